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


def test_one_table_for_agent_daemon_and_sdk() -> None:
    import cpuos._errors as sdk_errors
    from cpuos_agent import protocol as P
    from cpuosd.agentconn import raise_for_agent_error
    from cpuosd.errors import STATUS, ApiError

    for code, (status, cls_name, agent_may) in P.ERROR_CODES.items():
        assert STATUS[code] == status == ApiError(code, "m").status
        cls = getattr(sdk_errors, cls_name)
        assert type(error_from(status, code, "m")) is cls
        try:
            raise_for_agent_error({"t": "err", "code": code, "message": "m"})
        except ApiError as e:
            assert e.code == (code if agent_may else "internal")
    # every SDK class's own code is in the table
    for cls in CpuosError.__subclasses__():
        assert cls.code in P.ERROR_CODES, cls
