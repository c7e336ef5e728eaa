"""The daemon's error type: every failure a client sees is one of these, as
``{"error": {"code", "message", "details"}}`` with the matching HTTP status."""

from __future__ import annotations

from typing import Any

from cpuos._errors import ERROR_CODES

# code -> the HTTP status it is answered with, from the API's one table of error codes (the
# SDK's: cpuos._errors.ERROR_CODES, which maps each to the exception a client gets)
STATUS = {code: status for code, (status, _) in ERROR_CODES.items()}


class ApiError(Exception):
    def __init__(self, code: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code if code in STATUS else "internal"
        self.message = message
        self.details = details or {}

    @property
    def status(self) -> int:
        return STATUS[self.code]

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "details": self.details}}


def not_found(what: str, ident: str) -> ApiError:
    return ApiError("not_found", f"{what} {ident!r} not found", {what: ident})


def invalid(message: str, **details: Any) -> ApiError:
    return ApiError("invalid_argument", message, details)


def api_error(e: Exception) -> ApiError:
    """What a client is told of a failure: an ApiError as it is; a failure of the agent
    channel (``cpuosd.agentconn.TransportError``) as ``unavailable`` (the agent is gone) or
    ``timeout`` (it did not answer); anything else is ``internal``."""
    from .agentconn import AgentTimeout, TransportError  # (agentconn imports this module)

    if isinstance(e, ApiError):
        return e
    if isinstance(e, TransportError):
        return ApiError("timeout" if isinstance(e, AgentTimeout) else "unavailable",
                        e.message)
    return ApiError("internal", f"internal error: {type(e).__name__}")
