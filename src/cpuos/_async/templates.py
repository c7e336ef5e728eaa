"""AsyncTemplates: templates on the daemon's host, over its API (building one needs the
admin key). Written once; ``cpuos._sync.templates`` is generated from this file."""

from __future__ import annotations

import builtins
import io
import json
import os
import stat
import tarfile
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from .._errors import InvalidArgument, ServerError, error_from
from .._models import TemplateInfo
from .sandbox import _AsyncHTTP

LogCallback = Callable[[str], Any]
SKIP_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", ".venv", "node_modules"})


def is_local_source(source: str | Path) -> bool:
    """A spec or Dockerfile path (uploaded with its directory), not a built-in name."""
    s = str(source)
    p = Path(s)
    return (isinstance(source, Path) or "/" in s or p.suffix != "" or p.name == "Dockerfile"
            or p.name.endswith(".Dockerfile") or p.is_file())


def context_tar(spec_file: Path) -> IO[bytes]:
    """The spec's directory as a gzip tar (a temporary file): what COPY can read. Version
    control, virtualenv and cache directories are left out. Directories and regular files
    only: the daemon refuses a context with a link (or a device...), so one here is an
    InvalidArgument naming it, before anything is uploaded."""
    base = spec_file.resolve().parent
    out = tempfile.TemporaryFile()
    try:
        with tarfile.open(fileobj=out, mode="w:gz", compresslevel=3) as tf:
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
                rel = Path(dirpath).relative_to(base)
                for n in [*dirnames, *sorted(filenames)]:
                    full = os.path.join(dirpath, n)
                    mode = os.lstat(full).st_mode
                    if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                        kind = "a symlink" if stat.S_ISLNK(mode) else "not a regular file"
                        raise InvalidArgument(f"{full} is {kind}: a template's build context "
                                              "holds directories and regular files only")
                    tf.add(full, arcname=str(rel / n), recursive=False)
    except BaseException:
        out.close()
        raise
    out.seek(0)
    return out


class AsyncTemplates:
    """``AsyncTemplates().list()``, ``.build("python", on_log=print)``,
    ``.build("./Dockerfile")``, ``.build_oci("image.tar", name="app")``, ``.remove(name)``."""

    def __init__(self, api_url: str | None = None, api_key: str | None = None) -> None:
        self._http = _AsyncHTTP(api_url, api_key, request_timeout=120.0)

    async def close(self) -> None:
        await self._http.close()

    async def __aenter__(self) -> AsyncTemplates:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def list(self) -> builtins.list[TemplateInfo]:
        d = await self._http.request("GET", "/templates")
        return [TemplateInfo.from_json(x) for x in d["templates"]]

    async def get(self, name: str) -> TemplateInfo:
        return TemplateInfo.from_json(await self._http.request("GET", f"/templates/{name}"))

    async def remove(self, name: str, *, force: bool = False) -> dict[str, Any]:
        """Delete a template's builds and snapshot images; refused (Conflict) while
        sandboxes of it are alive, unless ``force``."""
        d: dict[str, Any] = await self._http.request(
            "DELETE", f"/templates/{name}", params={"force": str(force).lower()})
        return d

    async def build(self, source: str | Path, *, name: str | None = None, force: bool = False,
                    on_log: LogCallback | None = None) -> TemplateInfo:
        """Build a built-in template (``"python"``) or a local TOML spec or Dockerfile (its
        directory is uploaded as the build context); ``on_log`` gets each line of the build
        log as it happens. Cached builds return at once."""
        params: dict[str, str] = {"force": str(force).lower()}
        if name:
            params["name"] = name
        if not is_local_source(source):
            params["builtin"] = str(source)
            return await self._build(params, None, on_log)
        p = Path(source)
        if not p.is_file():
            raise InvalidArgument(f"{p}: no such file")
        params["file"] = p.name
        with context_tar(p) as body:
            return await self._build(params, body, on_log)

    async def build_oci(self, tarball: str | Path, *, name: str, force: bool = False,
                        on_log: LogCallback | None = None) -> TemplateInfo:
        """A template from an image tarball (``docker save``, or an OCI layout tar)."""
        p = Path(tarball)
        if not p.is_file():
            raise InvalidArgument(f"{p}: no such file")
        with open(p, "rb") as body:
            return await self._build({"oci": "true", "name": name,
                                      "force": str(force).lower()}, body, on_log)

    async def _build(self, params: dict[str, str], body: IO[bytes] | None,
                     on_log: LogCallback | None) -> TemplateInfo:
        async def chunks() -> AsyncIterator[bytes]:
            assert body is not None
            while True:
                b = body.read(1 << 20)
                if not b:
                    return
                yield b

        buf = io.BytesIO()
        result: dict[str, Any] | None = None
        async for chunk in self._http.stream("POST", "/templates/build", params=params,
                                             content=chunks() if body is not None else b""):
            buf.write(chunk)
            *lines, rest = buf.getvalue().split(b"\n")
            buf = io.BytesIO()
            buf.write(rest)
            for line in lines:
                result = _event(line, on_log) or result
        if buf.getvalue().strip():
            result = _event(buf.getvalue(), on_log) or result
        if result is None:
            raise ServerError("the template build's stream ended without a result (the "
                              "connection was cut, or the daemon stopped)")
        return TemplateInfo.from_json(result)


def _event(line: bytes, on_log: LogCallback | None) -> dict[str, Any] | None:
    """One line of the build stream: logs go to on_log; the result is returned; an error
    is raised."""
    if not line.strip():
        return None
    try:
        ev = json.loads(line)
    except ValueError:
        raise ServerError(f"bad line in the template build stream: {line[:200]!r}") from None
    if "log" in ev and on_log is not None:
        on_log(str(ev["log"]))
    elif "error" in ev:
        e = ev["error"]
        raise error_from(None, e.get("code"), str(e.get("message")), e.get("details"))
    elif "result" in ev:
        result: dict[str, Any] = ev["result"]
        return result
    return None
