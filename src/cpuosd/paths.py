"""Validation of everything that names a thing: sandbox ids and paths inside a sandbox."""

from __future__ import annotations

import posixpath
import re
from urllib.parse import unquote

from .errors import invalid

ID_RE = re.compile(r"^[a-z0-9-]{1,64}$")
MAX_PATH = 4096
MAX_NAME = 255
DEFAULT_CWD = "/work"


def check_id(value: str, what: str = "sandbox id") -> str:
    if not isinstance(value, str) or not ID_RE.fullmatch(value):
        raise invalid(f"bad {what} {str(value)[:80]!r}: must match ^[a-z0-9-]{{1,64}}$",
                      field=what)
    return value


def check_path(path: object, field: str = "path", cwd: str = DEFAULT_CWD) -> str:
    """A path inside the sandbox: absolute or relative to /work, normalised.

    Refused: non-strings, empty, NUL bytes, over-long paths or names, and any
    ``..`` component, including percent-encoded forms (``%2e%2e``, ``%252e%252e``).
    """
    if not isinstance(path, str) or not path:
        raise invalid(f"{field} must be a non-empty string", field=field)
    if "\x00" in path:
        raise invalid(f"{field} contains a NUL byte", field=field)
    if len(path.encode("utf-8", "surrogatepass")) > MAX_PATH:
        raise invalid(f"{field} is longer than {MAX_PATH} bytes", field=field)
    for part in path.split("/"):
        decoded = part
        for _ in range(4):  # undo up to four layers of percent-encoding
            nxt = unquote(decoded)
            if nxt == decoded:
                break
            decoded = nxt
        if "\x00" in decoded:
            raise invalid(f"{field} contains an encoded NUL byte", field=field)
        if decoded == ".." or ".." in decoded.replace("\\", "/").split("/"):
            raise invalid(f"{field} {path[:200]!r} contains '..': paths may not climb",
                          field=field)
        if len(part.encode("utf-8", "surrogatepass")) > MAX_NAME:
            raise invalid(f"{field} has a name longer than {MAX_NAME} bytes", field=field)
    full = path if path.startswith("/") else posixpath.join(cwd, path)
    return posixpath.normpath(full).replace("//", "/")
