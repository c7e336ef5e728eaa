"""The sandbox states, the transitions between them, and which operations each state
accepts: one table, used by the Manager (the one writer of states) and the API.

    creating -> running <-> (pausing -> paused -> resuming) -> killing -> killed
    (pooled: restored ahead of time, handed out as running)     any live state -> error

An operation asked of a sandbox in a state that does not accept it is answered 409 with
the current state (``check``); DELETE is accepted in every state.
"""

from __future__ import annotations

from ..errors import ApiError

STATES = ("creating", "pooled", "running", "pausing", "paused", "resuming", "killing",
          "killed", "error")

_ENDING = {"killing", "error"}
TRANSITIONS: dict[str, frozenset[str]] = {
    "creating": frozenset({"running", *_ENDING}),
    "pooled": frozenset({"running", "killed", *_ENDING}),  # (killed: discarded unused)
    "running": frozenset({"pausing", *_ENDING}),
    # (resuming: a fork restores its source from the checkpoint it just made)
    "pausing": frozenset({"paused", "running", "resuming", *_ENDING}),
    "paused": frozenset({"resuming", *_ENDING}),
    # (paused: a failed resume leaves the snapshot as it was)
    "resuming": frozenset({"running", "paused", *_ENDING}),
    "killing": frozenset({"killed", "error"}),
    "killed": frozenset(),
    "error": frozenset({"killing"}),  # a sandbox in error still has things to tear down
}

LIVE = ("creating", "running", "pausing", "paused", "resuming", "killing", "pooled")
ENDED = ("killed", "error")

# operation -> states that accept it (anything else: 409 with the current state)
OPS: dict[str, frozenset[str]] = {
    "exec": frozenset({"running"}),
    "files": frozenset({"running"}),
    "pause": frozenset({"running"}),
    "resume": frozenset({"paused", "running"}),  # resuming a running sandbox: a no-op
    "fork": frozenset({"running"}),
    "set_timeout": frozenset({"running", "paused"}),
    "network": frozenset({"running", "paused"}),
    "info": frozenset(STATES),
    "delete": frozenset(STATES),
}


class InvalidTransition(RuntimeError):
    """A bug: the daemon tried a transition the table does not allow."""


def can(frm: str, to: str) -> bool:
    return to in TRANSITIONS.get(frm, frozenset())


def check_transition(frm: str, to: str) -> None:
    if not can(frm, to):
        raise InvalidTransition(f"{frm} -> {to} is not a sandbox transition")


def check(op: str, sid: str, state: str, reason: str | None = None) -> None:
    """409 unless ``state`` accepts ``op``."""
    if state not in OPS[op]:
        raise ApiError("conflict", f"sandbox {sid} is {state}" + (f" ({reason})" if reason
                                                                    else "")
                       + f"; {op} needs it {' or '.join(sorted(OPS[op]))}",
                       {"state": state, "reason": reason, "operation": op})
