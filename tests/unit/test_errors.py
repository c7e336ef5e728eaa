import pytest

from cpuos import (AuthError, Conflict, CpuosError, InvalidArgument, NotFound, ServerError,
                   Timeout, Unavailable)
from cpuos._errors import error_from


@pytest.mark.parametrize("status,code,cls", [
    (404, "not_found", NotFound), (409, "conflict", Conflict), (401, "unauthorized", AuthError),
    (422, "invalid_argument", InvalidArgument), (504, "timeout", Timeout),
    (503, "unavailable", Unavailable), (500, "internal", ServerError), (418, None, ServerError),
    (409, "is_a_directory", Conflict), (None, "timeout", Timeout),
])
def test_mapping(status: int | None, code: str | None, cls: type) -> None:
    e = error_from(status, code, "msg", {"k": "v"})
    assert type(e) is cls and isinstance(e, CpuosError)
    assert e.message == "msg" and e.details == {"k": "v"}
