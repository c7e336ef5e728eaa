"""The agent dispatches each request kind to one handler, listed by the service module
that owns it (cpuos_agent.agent.HANDLERS)."""

from __future__ import annotations

from cpuos_agent import agent
from cpuos_agent.protocol import Kind

# what the host sends (the rest are answers, sent by the agent)
REQUESTS = {Kind.PING, Kind.IDENTITY, Kind.MEMORY, Kind.QUIESCE, Kind.CREDIT, Kind.KILL,
            Kind.EXEC, Kind.STDIN, Kind.BG_LIST, Kind.BG_INFO, Kind.BG_ATTACH,
            Kind.BG_RESIZE, Kind.BG_SIGNAL, Kind.BG_WAIT, Kind.BG_STDIN, Kind.WRITE,
            Kind.DATA, Kind.EOF, Kind.READ, Kind.STAT, Kind.LIST, Kind.REMOVE, Kind.MKDIR,
            Kind.TAR, Kind.UNTAR, Kind.WATCH, Kind.DIAL}


def test_every_request_has_one_handler_in_one_service() -> None:
    claimed: dict[str, str] = {}
    for svc in agent.SERVICES:
        for kind in svc.HANDLERS:
            assert isinstance(kind, Kind), (svc.__name__, kind)
            assert kind not in claimed, f"{kind} in {claimed[kind]} and {svc.__name__}"
            claimed[kind] = svc.__name__
    assert set(claimed) == {str(k) for k in REQUESTS}
    assert set(agent.HANDLERS) == set(claimed)


def test_a_kind_is_its_string_on_the_wire() -> None:
    from cpuos_agent import protocol as P

    h, _ = P.FrameDecoder().feed(P.encode({"t": Kind.BG_ATTACH, "id": 3}))[0]
    assert h == {"t": "bg_attach", "id": 3}
    assert agent.HANDLERS["bg_attach"] is agent.HANDLERS[Kind.BG_ATTACH]
