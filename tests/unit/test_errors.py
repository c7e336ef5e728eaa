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
    from cpuos._errors import ERROR_CODES
    from cpuos_agent.protocol import ErrorCode
    from cpuosd.agentconn import AgentError, raise_for_agent_error
    from cpuosd.errors import STATUS, ApiError

    assert set(STATUS) == set(ERROR_CODES)
    for code, (status, cls) in ERROR_CODES.items():
        assert STATUS[code] == status == ApiError(code, "m").status
        assert type(error_from(status, code, "m")) is cls
        # what an agent may report is its own code; anything else (the codes only the
        # daemon gives: unauthorized, spending_cap...) becomes internal
        with pytest.raises(AgentError) as e:
            raise_for_agent_error({"t": "err", "code": code, "message": "m"})
        assert e.value.code == (code if code in set(ErrorCode) else "internal")
    # every code an agent reports is one of the API's, and every SDK class's own code too
    assert {str(c) for c in ErrorCode} <= set(ERROR_CODES)
    for sdk_cls in CpuosError.__subclasses__():
        assert sdk_cls.code in ERROR_CODES, sdk_cls


def test_the_transport_raises_transport_errors_that_the_api_maps() -> None:
    from cpuosd.agentconn import AgentGone, AgentTimeout, StdinClosed, TransportError
    from cpuosd.errors import ApiError, api_error

    # not API errors: the channel knows no HTTP status
    assert not issubclass(TransportError, ApiError)
    gone, late = api_error(AgentGone("went away")), api_error(AgentTimeout("no answer"))
    assert (gone.code, gone.status, gone.message) == ("unavailable", 503, "went away")
    assert (late.code, late.status, late.message) == ("timeout", 504, "no answer")
    own = StdinClosed("closed")  # the agent's own answer: an API error as it is
    assert api_error(own) is own and own.status == 422
    assert api_error(RuntimeError("x")).code == "internal"


def test_an_agent_error_code_that_is_not_a_string_is_internal() -> None:
    from cpuosd.agentconn import AgentError

    assert AgentError({"t": "err", "code": ["not_found"], "message": 7}).code == "internal"
    assert AgentError({"t": "err", "code": {"a": 1}}).message == "sandbox agent error"
