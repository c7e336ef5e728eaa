"""The daemon's error type: every failure a client sees is one of these, as
``{"error": {"code", "message", "details"}}`` with the matching HTTP status."""

from __future__ import annotations

from typing import Any

STATUS = {
    "invalid_argument": 422,
    "unauthorized": 401,
    "permission_denied": 403,
    "not_found": 404,
    "conflict": 409,
    "already_exists": 409,
    "is_a_directory": 409,
    "not_a_directory": 409,
    "limit_exceeded": 429,
    "no_space": 507,
    "timeout": 504,
    "unavailable": 503,
    "internal": 500,
}


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
