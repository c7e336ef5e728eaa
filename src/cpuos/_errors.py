"""The SDK's error tree. Every failure is a ``CpuosError``::

    CpuosError
    ├── AuthError            401: missing or wrong API key
    ├── PermissionDenied     403: the key or the sandbox user may not do this
    ├── NotFound             404: no such sandbox / template / file (for this key)
    ├── Conflict             409: wrong state (e.g. exec on a killed sandbox), exists, is a dir
    ├── InvalidArgument      422: bad input (path, duration, command...)
    ├── LimitExceeded        429 (a quota), 402 (the workspace's spending cap)
    ├── NoSpace              507: the sandbox's disk is full
    ├── Timeout              504 / client-side timeout
    ├── Unavailable          503: daemon or sandbox agent unreachable
    └── ServerError          5xx / malformed answers
"""

from __future__ import annotations

from typing import Any


class CpuosError(Exception):
    code = "internal"
    status: int | None = None

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.details = details or {}


class AuthError(CpuosError):
    code = "unauthorized"


class PermissionDenied(CpuosError):
    code = "permission_denied"


class NotFound(CpuosError):
    code = "not_found"


class Conflict(CpuosError):
    code = "conflict"


class InvalidArgument(CpuosError, ValueError):
    code = "invalid_argument"


class LimitExceeded(CpuosError):
    code = "limit_exceeded"


class NoSpace(CpuosError):
    code = "no_space"


class Timeout(CpuosError, TimeoutError):
    code = "timeout"


class Unavailable(CpuosError):
    code = "unavailable"


class ServerError(CpuosError):
    code = "internal"


# The API's error codes, the one table: code -> (the HTTP status the daemon answers with,
# the exception this SDK raises). The daemon takes its statuses from here
# (cpuosd.errors.STATUS), the JS SDK's table is generated from it (sdk/js/scripts/
# gen-types.mjs, via openapi.py --error-codes), and the codes an agent may report
# (cpuos_agent.protocol.ErrorCode) are among them (tests/unit/test_errors.py).
ERROR_CODES: dict[str, tuple[int, type[CpuosError]]] = {
    "invalid_argument": (422, InvalidArgument),
    "unauthorized": (401, AuthError),
    "permission_denied": (403, PermissionDenied),
    "not_found": (404, NotFound),
    "conflict": (409, Conflict),
    "already_exists": (409, Conflict),
    "is_a_directory": (409, Conflict),
    "not_a_directory": (409, Conflict),
    "too_large": (413, InvalidArgument),
    "limit_exceeded": (429, LimitExceeded),
    "spending_cap": (402, LimitExceeded),
    "no_space": (507, NoSpace),
    "timeout": (504, Timeout),
    "unavailable": (503, Unavailable),
    "internal": (500, ServerError),
}
_BY_CODE: dict[str, type[CpuosError]] = {code: cls for code, (_, cls) in ERROR_CODES.items()}
_BY_STATUS: dict[int, type[CpuosError]] = {
    status: cls for status, cls in ERROR_CODES.values() if status != 500}


def error_from(status: int | None, code: str | None, message: str,
               details: dict[str, Any] | None = None) -> CpuosError:
    cls = _BY_CODE.get(code or "") or _BY_STATUS.get(status or 0) or ServerError
    return cls(message, code=code, status=status, details=details)
