"""AsyncSandbox: the SDK, written once. ``cpuos._sync`` is generated from this file by
``scripts/gen_sync.py`` (unasync); edit here, then regenerate."""

from __future__ import annotations

import builtins
import functools
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, overload

import httpx

from cpuos_agent.protocol import CONTENT_TYPE, FrameDecoder, ProtocolError

from .._config import resolve, tls_context
from .._durations import parse_duration, parse_size_mib
from .._errors import (Conflict, CpuosError, InvalidArgument, NotFound, ServerError, Timeout,
                       Unavailable, error_from)
from .audit import AsyncAudit
from .._code import CodeResult
from .._models import (DEFAULT_MAX_OUTPUT, DOWNLOAD_MAX_BYTES, READ_MAX_BYTES, ExecResult,
                      FileEntry, SandboxInfo)
from .._pumps import AsyncBeside
from .browser import AsyncBrowser
from .pty import AsyncPty
from .watch import AsyncWatchHandle, EventCallback
from .commands import AsyncCommandHandle, AsyncCommands, OutputSink, StdinSource, stdin_chunks
from .interp import AsyncInterpreter, OutputCallback as _Out, ResultCallback

OutputCallback = Callable[[str], Any]


def _dur(value: str | float | int | None, what: str) -> float | None:
    if value is None:
        return None
    try:
        return parse_duration(value, what)
    except ValueError as e:
        raise InvalidArgument(str(e)) from None


def _size(value: str | int, what: str) -> int:
    try:
        return parse_size_mib(value, what)
    except ValueError as e:
        raise InvalidArgument(str(e)) from None


class _AsyncHTTP:
    """The one I/O boundary: HTTP to the daemon, errors mapped to the CpuosError tree."""

    def __init__(self, api_url: str | None, api_key: str | None,
                 request_timeout: float = 60.0) -> None:
        self.url, key = resolve(api_url, api_key)
        self.key = key
        self.client = httpx.AsyncClient(
            base_url=self.url, headers={"Authorization": f"Bearer {key}"},
            timeout=httpx.Timeout(request_timeout, read=None), follow_redirects=False,
            verify=tls_context() if self.url.startswith("https:") else False)

    async def close(self) -> None:
        await self.client.aclose()

    @staticmethod
    def _raise(r: httpx.Response, body: bytes) -> None:
        if r.status_code < 400:
            return
        try:
            err = httpx.Response(r.status_code, content=body).json()["error"]
            code, message, details = err.get("code"), err.get("message"), err.get("details")
        except Exception:
            code, message, details = None, body[:500].decode(errors="replace"), None
        raise error_from(r.status_code, code, str(message or f"HTTP {r.status_code}"), details)

    async def request(self, method: str, path: str, **kw: Any) -> Any:
        try:
            r = await self.client.request(method, path, **kw)
        except httpx.TimeoutException as e:
            raise Timeout(f"{method} {path}: {e}") from None
        except httpx.TransportError as e:
            raise Unavailable(f"cannot reach cpuosd at {self.url}: {e}") from None
        self._raise(r, r.content)
        return r.json()

    async def stream(self, method: str, path: str, meta: dict[str, str] | None = None,
                     **kw: Any) -> AsyncIterator[bytes]:
        """The response body as it arrives; ``meta`` (if given) gets its content type
        before the first chunk. A body cut short (its Content-Length or its chunked end
        never reached) raises Unavailable."""
        try:
            async with self.client.stream(method, path, **kw) as r:
                if r.status_code >= 400:
                    self._raise(r, await r.aread())
                if meta is not None:
                    meta["content_type"] = r.headers.get("content-type", "")
                async for chunk in r.aiter_raw():
                    yield chunk
        except httpx.TimeoutException as e:
            raise Timeout(f"{method} {path}: {e}") from None
        except httpx.TransportError as e:
            raise Unavailable(f"connection to cpuosd at {self.url} failed: {e}") from None


def _too_large(path: str, limit: int, why: str = "") -> CpuosError:
    return error_from(413, "too_large", f"{path}: {why or f'more than {limit} bytes'}; pass "
                      "max_bytes= to accept more (None: no limit)",
                      {"path": path, "limit": limit})


class AsyncFiles:
    """``sbx.files``: files inside the sandbox. Relative paths are relative to /work."""

    def __init__(self, sbx: AsyncSandbox) -> None:
        self._sbx = sbx

    @property
    def _base(self) -> str:
        return f"/sandboxes/{self._sbx.id}/files"

    async def write(self, path: str, data: str | bytes) -> FileEntry:
        """Create or replace a file (parents are created); atomic inside the sandbox."""
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgument("data must be str or bytes")
        d = await self._sbx._http.request("PUT", self._base, params={"path": path},
                                          content=bytes(data))
        return FileEntry.from_json(d)

    async def upload(self, local_path: str | Path, path: str) -> FileEntry:
        """Stream a local file into the sandbox without holding it in memory."""
        async def chunks() -> AsyncIterator[bytes]:
            with open(local_path, "rb") as f:
                while True:
                    b = f.read(1 << 20)
                    if not b:
                        return
                    yield b

        d = await self._sbx._http.request("PUT", self._base, params={"path": path},
                                          content=chunks())
        return FileEntry.from_json(d)

    async def _chunks(self, path: str, sub: str = "", max_bytes: int | None = None
                      ) -> AsyncIterator[bytes]:
        """The file's bytes as they arrive. A read that fails part-way (the sandbox could
        not read on, its agent went away, the connection broke) raises a CpuosError: the
        daemon ends the stream with an ``error`` frame (or without its ``eof``), never with
        a body that merely looks short. More than ``max_bytes`` (None: no bound here) is
        refused: by the daemon up front when the file's size says so, else as it arrives
        (InvalidArgument, code ``too_large``)."""
        meta: dict[str, str] = {}
        dec = FrameDecoder()
        got = 0
        ended = False
        params: dict[str, Any] = {"path": path}
        if max_bytes is not None:
            if max_bytes < 0:
                raise InvalidArgument("max_bytes must be >= 0 (or None: no limit)")
            params["max_bytes"] = max_bytes
        try:
            async for chunk in self._sbx._http.stream(
                    "GET", self._base + sub, meta, params=params,
                    headers={"Accept": CONTENT_TYPE}):
                if not meta.get("content_type", "").startswith(CONTENT_TYPE):
                    got += len(chunk)  # raw bytes (a daemon without framed reads)
                    if max_bytes is not None and got > max_bytes:
                        raise _too_large(path, max_bytes)
                    yield chunk
                    continue
                for h, payload in dec.feed(chunk):
                    if ended:
                        raise ServerError(f"reading {path}: data after the end of the stream")
                    t = h.get("t")
                    if t == "data":
                        got += len(payload)
                        if max_bytes is not None and got > max_bytes:
                            raise _too_large(path, max_bytes)
                        yield payload
                    elif t == "eof":
                        if h.get("size") != got:
                            raise ServerError(f"reading {path}: {got} bytes received, the "
                                              f"stream says {h.get('size')!r}")
                        ended = True
                    elif t == "error":
                        raise error_from(None, h.get("code"),
                                         f"reading {path} failed after {got} bytes: "
                                         f"{h.get('message')}",
                                         {"path": path, "received": got})
        except ProtocolError as e:
            raise ServerError(f"reading {path}: malformed stream: {e}") from None
        if meta.get("content_type", "").startswith(CONTENT_TYPE) and not ended:
            raise Unavailable(f"reading {path}: the stream ended after {got} bytes without "
                              "its end", details={"path": path, "received": got})

    async def read(self, path: str, *, max_bytes: int | None = READ_MAX_BYTES) -> bytes:
        """The file's bytes. Raises (a CpuosError) if the read fails, also part-way, and
        InvalidArgument (code ``too_large``) for a file over ``max_bytes`` (default 1 GiB;
        None: no limit), before holding more than that."""
        parts = []
        async for chunk in self._chunks(path, max_bytes=max_bytes):
            parts.append(chunk)
        return b"".join(parts)

    async def read_text(self, path: str, encoding: str = "utf-8", *,
                        max_bytes: int | None = READ_MAX_BYTES) -> str:
        return (await self.read(path, max_bytes=max_bytes)).decode(encoding)

    async def download(self, path: str, local_path: str | Path, *,
                       max_bytes: int | None = DOWNLOAD_MAX_BYTES) -> int:
        """Stream a sandbox file to a local file; returns the byte count. A read that
        fails part-way raises, and the partial local file is removed; so does a file over
        ``max_bytes`` (default 8 GiB; None: no limit: InvalidArgument, code ``too_large``,
        at once if its size says so)."""
        n = 0
        try:
            with open(local_path, "wb") as f:
                async for chunk in self._chunks(path, max_bytes=max_bytes):
                    f.write(chunk)
                    n += len(chunk)
        except BaseException:
            Path(local_path).unlink(missing_ok=True)
            raise
        return n

    async def upload_dir(self, local_dir: str | Path, path: str) -> dict[str, Any]:
        """Copy a local directory tree into the sandbox directory ``path`` (created) as
        one tar stream: files, directories and symlinks, with their modes. The daemon
        refuses the whole archive (writing nothing) if an entry would land outside
        ``path`` or a symlink's target is absolute or has '..' (``cpuos_agent.tarx``);
        nothing already in ``path`` is written through. Returns the counts: files, dirs,
        links, bytes."""
        import tarfile
        import tempfile

        if not Path(local_dir).is_dir():
            raise InvalidArgument(f"{local_dir} is not a directory")
        with tempfile.TemporaryFile() as tmp:
            with tarfile.open(fileobj=tmp, mode="w", format=tarfile.PAX_FORMAT) as tf:
                tf.add(str(local_dir), arcname=".", recursive=True)
            tmp.seek(0)

            async def chunks() -> AsyncIterator[bytes]:
                while True:
                    b = tmp.read(1 << 20)
                    if not b:
                        return
                    yield b

            d: dict[str, Any] = await self._sbx._http.request(
                "PUT", self._base + "/tar", params={"path": path}, content=chunks())
        return d

    async def download_dir(self, path: str, local_dir: str | Path, *,
                           max_bytes: int | None = DOWNLOAD_MAX_BYTES) -> int:
        """Copy the sandbox directory ``path`` into ``local_dir`` (created) as one tar
        stream; returns the archive's size in bytes.

        The archive is checked as it arrives and kept in a temporary file: at most
        ``max_bytes`` of it (default 8 GiB; None: no limit), and an entry declaring more
        ends the download at its header (InvalidArgument, code ``too_large``). Then it is
        checked whole and only then written: an absolute name, ``..``, a device, a
        symlink whose target is absolute or has ``..``, an entry or target through a link
        of the archive refuse it all (ServerError; nothing written). Writing resolves
        every path beneath ``local_dir`` without following a symlink already there (what
        an earlier download left, or anything else): such a path fails (OSError) instead
        of being written through. Nothing is chowned; files get the archive's permission
        bits (no setuid)."""
        import tarfile
        import tempfile

        from cpuos_agent import tarx

        scan = tarx.TarScanner(max_bytes=max_bytes)
        n = 0
        with tempfile.TemporaryFile() as tmp:
            try:
                async for chunk in self._chunks(path, "/tar", max_bytes):
                    scan.feed(chunk)
                    tmp.write(chunk)
                    n += len(chunk)
                scan.close()
                tmp.seek(0)
                with tarfile.open(fileobj=tmp, mode="r:") as tf:
                    members = tarx.check_members(tf, max_bytes=max_bytes)
                    tarx.extract_members(tf, members, str(local_dir))
            except tarx.TooBig as e:
                raise _too_large(path, e.limit, str(e)) from None
            except (tarx.Refused, tarfile.TarError) as e:
                raise ServerError(f"the archive of {path} was refused: {e}") from None
        return n

    async def watch(self, path: str, on_event: EventCallback, *, recursive: bool = True
                    ) -> AsyncWatchHandle:
        """Changes under the directory ``path`` (the file API's path rules), to
        ``on_event`` as they happen (``FileEvent``: create, modify, delete, rename; one
        per path per 50 ms; type ``overflow``: some were lost, rescan), until ``stop()``
        on the handle. Returns once the watch is in place."""
        http = _AsyncHTTP(self._sbx._http.url, self._sbx._http.key)
        handle = AsyncWatchHandle(http, path, on_event)
        try:
            await handle._start(self._sbx.id, recursive)
        except BaseException:
            await http.close()
            raise
        return handle

    async def list(self, path: str = "/work") -> builtins.list[FileEntry]:
        d = await self._sbx._http.request("GET", self._base + "/list", params={"path": path})
        return [FileEntry.from_json(e) for e in d["entries"]]

    async def stat(self, path: str) -> FileEntry:
        d = await self._sbx._http.request("GET", self._base + "/stat", params={"path": path})
        return FileEntry.from_json(d)

    async def exists(self, path: str) -> bool:
        try:
            await self.stat(path)
        except CpuosError as e:
            if e.code == "not_found":
                return False
            raise
        return True

    async def remove(self, path: str) -> None:
        """Remove a file, or a directory with everything in it."""
        await self._sbx._http.request("DELETE", self._base, params={"path": path})

    async def mkdir(self, path: str) -> FileEntry:
        d = await self._sbx._http.request("POST", self._base + "/mkdir", params={"path": path})
        return FileEntry.from_json(d)


Network = str | dict[str, Any]  # "off" | "on" | "allowlist" | {"allow": [names]}


class AsyncNetwork:
    """``sbx.network``: the sandbox's egress policy and the record of its connections."""

    def __init__(self, sbx: AsyncSandbox) -> None:
        self._sbx = sbx

    @property
    def policy(self) -> dict[str, Any] | None:
        """The policy as of the last answer about the sandbox (``sbx.info()`` refreshes)."""
        return self._sbx._info.network

    async def update(self, network: Network) -> dict[str, Any] | None:
        """A new policy; the sandbox's new connections follow it at once."""
        d = await self._sbx._http.request("POST", f"/sandboxes/{self._sbx.id}/network",
                                          json={"network": network})
        self._sbx._info = SandboxInfo.from_json(d)
        return self._sbx._info.network

    async def connections(self, limit: int = 100) -> list[dict[str, Any]]:
        """Outbound attempts, newest first: time, proto, dst, port, name, verdict (allowed,
        denied, error), rule, bytes_out/bytes_in."""
        d = await self._sbx._http.request("GET", f"/sandboxes/{self._sbx.id}/connections",
                                          params={"limit": limit})
        out: list[dict[str, Any]] = d["connections"]
        return out


class AsyncPorts:
    """``sbx.ports``: preview URLs for servers inside the sandbox (the daemon's preview
    proxy; a request to a paused sandbox resumes it)."""

    def __init__(self, sbx: AsyncSandbox) -> None:
        self._sbx = sbx

    async def expose(self, port: int, *, public: bool | None = None) -> str:
        """The URL at which ``port`` inside is served (the path form), its token in the
        query (none for a ``public`` port). A program uses it as it is (or sends the
        token as ``X-Cpuos-Token``); a browser that opens it is sent on to the port's own
        origin, ``<port>-<id>.<domain>`` (``get_host``), where the token becomes a cookie
        of that origin only: no two sandboxes or ports share an origin or a cookie."""
        p = await self.info(port, public=public)
        return str(p["url"]) if p["public"] else f"{p['url']}?cpuos_token={p['token']}"

    async def info(self, port: int, *, public: bool | None = None) -> dict[str, Any]:
        """Expose ``port`` (``public`` None keeps what it was): {port, url, host_url,
        token, public}."""
        body: dict[str, Any] = {"port": port}
        if public is not None:
            body["public"] = public
        d: dict[str, Any] = await self._sbx._http.request(
            "POST", f"/sandboxes/{self._sbx.id}/ports", json=body)
        return d

    async def list(self) -> builtins.list[dict[str, Any]]:
        d = await self._sbx._http.request("GET", f"/sandboxes/{self._sbx.id}/ports")
        out: builtins.list[dict[str, Any]] = d["ports"]
        return out

    async def unexpose(self, port: int) -> None:
        await self._sbx._http.request("DELETE", f"/sandboxes/{self._sbx.id}/ports/{port}")


class AsyncSandbox:
    """A disposable, isolated Linux machine.

    >>> sbx = await AsyncSandbox.create(template="python", timeout="15m")
    >>> run = await sbx.exec("python -c 'print(1)'")
    """

    def __init__(self, info: SandboxInfo, http: _AsyncHTTP) -> None:
        self.id = info.id
        self._info = info
        self._http = http
        self.files = AsyncFiles(self)
        self.network = AsyncNetwork(self)
        self.ports = AsyncPorts(self)
        self.audit = AsyncAudit(self)
        self.commands = AsyncCommands(self)
        self.pty = AsyncPty(self)
        self.browser = AsyncBrowser(self)
        self.interpreter = AsyncInterpreter(self)

    # ---- construction -----------------------------------------------------------------
    @classmethod
    async def create(cls, template: str = "python", timeout: str | float = "5m", *,
                     metadata: dict[str, str] | None = None, env: dict[str, str] | None = None,
                     vcpus: int | None = None, memory_mib: int | None = None,
                     cpus: int | None = None, memory: str | int | None = None,
                     disk: str | int | None = None, pids: int | None = None,
                     on_timeout: str = "kill", network: Network | None = None,
                     secrets: dict[str, dict[str, Any]] | None = None,
                     idle_timeout: str | float | None = None,
                     api_url: str | None = None, api_key: str | None = None) -> AsyncSandbox:
        """A new sandbox. ``on_timeout="pause"`` pauses it at its deadline instead of
        killing it. ``idle_timeout`` (``"5m"``; ``0``: never; default: the workspace's,
        10 minutes unless set): paused after that long with no call needing the machine,
        no open stream or preview connection and no CPU use inside; any such call (exec,
        files, commands, ...) or a preview request resumes it transparently.
        ``network``: ``"off"``, ``"on"``, ``"allowlist"`` or ``{"allow": ["pypi.org",
        "*.github.com"]}`` (default: the daemon's). ``secrets``: ``{"NAME":
        {"value": "...", "hosts": ["api.example.com"]}}``: NAME inside is a placeholder,
        the value goes only into request headers to those hosts. Limits: ``cpus`` (vCPUs),
        ``memory`` and ``disk`` (``"1GiB"``, ``"512MiB"`` or MiB: past ``disk`` a write
        inside gets ENOSPC), ``pids`` (processes and threads); unset ones take the
        workspace's defaults."""
        if cpus is not None:
            vcpus = cpus
        if memory is not None:
            memory_mib = _size(memory, "memory")
        body: dict[str, Any] = {"template": template, "timeout": timeout,
                                "metadata": metadata or {}, "env": env or {},
                                "on_timeout": on_timeout}
        if vcpus is not None:
            body["vcpus"] = vcpus
        if memory_mib is not None:
            body["memory_mib"] = memory_mib
        if disk is not None:
            body["disk_mib"] = _size(disk, "disk")
        if pids is not None:
            body["pids"] = pids
        if idle_timeout is not None:
            body["idle_timeout"] = idle_timeout
        if network is not None:
            body["network"] = network
        if secrets:
            body["secrets"] = secrets
        return await cls._open(api_url, api_key, "POST", "/sandboxes", json=body)

    @classmethod
    async def _open(cls, api_url: str | None, api_key: str | None, method: str, path: str,
                    **kw: Any) -> AsyncSandbox:
        """A sandbox object from one request's answer; its client is closed if that fails."""
        http = _AsyncHTTP(api_url, api_key)
        try:
            d = await http.request(method, path, **kw)
        except BaseException:
            await http.close()
            raise
        return cls(SandboxInfo.from_json(d), http)

    @classmethod
    async def connect(cls, sandbox_id: str, *, auto_resume: bool = True,
                      api_url: str | None = None, api_key: str | None = None) -> AsyncSandbox:
        """Attach to an existing sandbox; a paused one is resumed unless auto_resume=False."""
        sbx = await cls._open(api_url, api_key, "GET", f"/sandboxes/{sandbox_id}")
        if auto_resume and sbx._info.state == "paused":
            try:
                d = await sbx._http.request("POST", f"/sandboxes/{sandbox_id}/resume")
            except BaseException:
                await sbx.close()
                raise
            sbx._info = SandboxInfo.from_json(d)
        return sbx

    @classmethod
    async def resume(cls, sandbox_id: str, *, api_url: str | None = None,
                     api_key: str | None = None) -> AsyncSandbox:
        """Restore a paused sandbox: its processes, memory and files as they were."""
        return await cls._open(api_url, api_key, "POST", f"/sandboxes/{sandbox_id}/resume")

    @classmethod
    async def list(cls, *, all: bool = False, api_url: str | None = None,
                   api_key: str | None = None) -> builtins.list[SandboxInfo]:
        http = _AsyncHTTP(api_url, api_key)
        try:
            d = await http.request("GET", "/sandboxes", params={"all": str(all).lower()})
        finally:
            await http.close()
        return [SandboxInfo.from_json(x) for x in d["sandboxes"]]

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        try:
            await self.kill()
        finally:
            await self.close()

    async def close(self) -> None:
        """Close this client's connection (the sandbox keeps running)."""
        await self._http.close()

    # ---- lifecycle --------------------------------------------------------------------
    async def info(self) -> SandboxInfo:
        self._info = SandboxInfo.from_json(await self._http.request("GET", f"/sandboxes/{self.id}"))
        return self._info

    async def metrics(self) -> dict[str, Any]:
        """What the host measures of the sandbox now: cpu_seconds, cpu_percent_avg,
        memory_bytes, memory_limit_bytes, pids, pids_limit, net_tx_bytes, net_rx_bytes (those
        its backend can)."""
        d: dict[str, Any] = await self._http.request("GET", f"/sandboxes/{self.id}/metrics")
        return d

    async def usage(self) -> dict[str, Any]:
        """What this sandbox has used this month: running_seconds, vcpu_seconds,
        memory_gib_seconds, paused_seconds, snapshot_gib_seconds and cost (USD)."""
        d = await self._http.request("GET", "/usage", params={"sandbox": self.id})
        rows = d.get("sandboxes") or []
        return dict(rows[0]) if rows else {"id": self.id, **d["total"]}

    async def get_host(self, port: int) -> str:
        """The host-form preview URL of ``port`` (``http://<port>-<id>.localhost:...``),
        exposing it if needed: the port's own origin, the form browsers are served; send
        its token as ``X-Cpuos-Token``, or once as ``?cpuos_token=`` from a browser (a
        cookie of that host from then on)."""
        p = await self.ports.info(port)
        return str(p["host_url"])

    async def set_timeout(self, timeout: str | float) -> SandboxInfo:
        """Kill the sandbox ``timeout`` from now (extends or shortens its life)."""
        d = await self._http.request("POST", f"/sandboxes/{self.id}/timeout",
                                     json={"timeout": timeout})
        self._info = SandboxInfo.from_json(d)
        return self._info

    async def set_idle_timeout(self, idle_timeout: str | float) -> SandboxInfo:
        """Pause the sandbox after ``idle_timeout`` idle (counted from now; ``0``: never)."""
        d = await self._http.request("POST", f"/sandboxes/{self.id}/timeout",
                                     json={"idle_timeout": idle_timeout})
        self._info = SandboxInfo.from_json(d)
        return self._info

    async def pause(self) -> str:
        """Checkpoint the sandbox to disk and stop it (CPU and memory are freed); returns
        its id for ``Sandbox.resume(id)``."""
        d = await self._http.request("POST", f"/sandboxes/{self.id}/pause")
        self._info = SandboxInfo.from_json(d)
        return self.id

    async def fork(self, n: int = 1) -> builtins.list[AsyncSandbox]:
        """n new sandboxes with this one's memory, processes and files."""
        d = await self._http.request("POST", f"/sandboxes/{self.id}/fork", json={"n": n})
        out = []
        for x in d["sandboxes"]:
            http = _AsyncHTTP(self._http.url, self._http.key)
            out.append(type(self)(SandboxInfo.from_json(x), http))
        return out

    async def kill(self) -> None:
        try:
            await self._http.request("DELETE", f"/sandboxes/{self.id}")
        except CpuosError as e:
            if e.code != "not_found":
                raise

    # ---- exec -------------------------------------------------------------------------
    @overload
    async def exec(self, cmd: str | builtins.list[str], *, timeout: str | float | None = None,
                   env: dict[str, str] | None = None, cwd: str | None = None,
                   stdin: StdinSource | None = None,
                   on_stdout: OutputCallback | None = None,
                   on_stderr: OutputCallback | None = None,
                   max_output: int = DEFAULT_MAX_OUTPUT,
                   background: Literal[False] = False, buffer: int | None = None
                   ) -> ExecResult: ...

    @overload
    async def exec(self, cmd: str | builtins.list[str], *, timeout: str | float | None = None,
                   env: dict[str, str] | None = None, cwd: str | None = None,
                   stdin: StdinSource | None = None,
                   on_stdout: OutputCallback | None = None,
                   on_stderr: OutputCallback | None = None,
                   max_output: int = DEFAULT_MAX_OUTPUT,
                   background: Literal[True], buffer: int | None = None
                   ) -> AsyncCommandHandle: ...

    async def exec(self, cmd: str | builtins.list[str], *, timeout: str | float | None = None,
                   env: dict[str, str] | None = None, cwd: str | None = None,
                   stdin: StdinSource | None = None,
                   on_stdout: OutputCallback | None = None,
                   on_stderr: OutputCallback | None = None,
                   max_output: int = DEFAULT_MAX_OUTPUT,
                   background: bool = False, buffer: int | None = None
                   ) -> ExecResult | AsyncCommandHandle:
        """Run ``cmd`` (a shell line for bash, or an argv list) and wait for it.

        Output streams to ``on_stdout``/``on_stderr`` as it arrives (text decoded
        as UTF-8, invalid bytes replaced); the result keeps raw bytes, at most
        ``max_output`` per stream (head and tail, ``truncated`` set if cut).
        A timeout kills the command's whole process tree and sets ``timed_out``.

        ``background=True``: start it and return at once with a handle (``pid``,
        ``wait``, ``kill``, ``send_stdin``, ``close_stdin``); it runs on after this
        client is gone (see ``sbx.commands``); ``buffer``: bytes of its output kept.
        """
        if background:
            handle = await self.commands.run(
                cmd, env=env, cwd=cwd, timeout=_dur(timeout, "timeout"), buffer=buffer,
                on_stdout=on_stdout, on_stderr=on_stderr)
            handle.max_output = max_output
            if stdin is not None:
                await handle.send_stdin(stdin)
            return handle
        body: dict[str, Any] = {"cmd": cmd, "env": env or {}, "cwd": cwd,
                                "timeout": _dur(timeout, "timeout")}
        streamed = stdin is not None and not isinstance(
            stdin, (str, bytes, bytearray, memoryview))
        if isinstance(stdin, str):
            body["stdin"] = stdin
        elif streamed:
            body["stdin_stream"] = True
        elif stdin is not None:
            import base64

            body["stdin_b64"] = base64.b64encode(stdin).decode()  # type: ignore[arg-type]
        sink = OutputSink(on_stdout, on_stderr, max_output)
        dec = FrameDecoder()
        exit_h: dict[str, Any] | None = None
        exec_id = None
        pump: AsyncBeside | None = None
        try:
            async for chunk in self._http.stream("POST", f"/sandboxes/{self.id}/exec", json=body,
                                                 headers={"Accept": CONTENT_TYPE}):
                for h, payload in dec.feed(chunk):
                    t = h["t"]
                    if t == "out" and h.get("fd") in (1, 2):
                        await sink.out(h["fd"], payload)
                    elif t == "started":
                        exec_id = h.get("exec_id")
                        if streamed and pump is None and isinstance(exec_id, str):
                            pump = AsyncBeside(functools.partial(
                                self._send_exec_stdin, exec_id, stdin))
                    elif t == "exit":
                        exit_h = h
                    elif t == "error":
                        raise error_from(None, h.get("code"), str(h.get("message")))
        except ProtocolError as e:
            raise ServerError(f"malformed exec stream: {e}") from None
        finally:
            if pump is not None:
                await pump.cancel()  # done by now, unless the exec failed
        if exit_h is None:
            raise Unavailable("exec stream ended without an exit status")
        await sink.flush()
        return sink.result(exit_h, exec_id)

    async def _send_exec_stdin(self, exec_id: str, src: Any) -> None:
        """A streamed stdin, as fast as the command reads it; then closed. The command may
        stop reading (it exited, closed its stdin): the rest is not sent, and that is no
        error of the exec's."""
        try:
            await self._http.request("POST", f"/sandboxes/{self.id}/execs/{exec_id}/stdin",
                                     params={"close": "true"}, content=stdin_chunks(src))
        except (InvalidArgument, NotFound, Conflict):
            pass

    # ---- code interpreter (cpuos._async.interp) -----------------------------------------
    async def run_code(self, code: str, language: str = "python", *,
                       timeout: str | float | None = None, on_stdout: _Out | None = None,
                       on_stderr: _Out | None = None, on_result: ResultCallback | None = None
                       ) -> CodeResult:
        """Run a cell on the sandbox's persistent kernel (see ``AsyncInterpreter``)."""
        return await self.interpreter.run_code(code, language, timeout=timeout,
                                               on_stdout=on_stdout, on_stderr=on_stderr,
                                               on_result=on_result)

    async def restart_kernel(self, language: str = "python") -> None:
        """A fresh kernel: every variable and import of the old one is gone."""
        await self.interpreter.restart(language)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} template={self._info.template}>"
