"""The sandbox states, the transitions between them, and which operations each state
accepts: one table, used by the Manager (the one writer of states) and the API.

    creating -> running <-> (pausing -> paused -> resuming) -> killing -> killed
    (pooled: restored ahead of time, handed out as running)     any live state -> error

An operation asked of a sandbox in a state that does not accept it is answered 409 with
the current state (``check``); DELETE is accepted in every state.
"""

from __future__ import annotations

from enum import StrEnum

from ..errors import ApiError


class State(StrEnum):
    """A sandbox's state. A ``StrEnum``: each member is equal to its string, which is what
    the API answers, the events carry and the store holds."""

    CREATING = "creating"
    POOLED = "pooled"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    RESUMING = "resuming"
    KILLING = "killing"
    KILLED = "killed"
    ERROR = "error"


S = State
STATES = tuple(State)

_ENDING = {S.KILLING, S.ERROR}
TRANSITIONS: dict[State, frozenset[State]] = {
    S.CREATING: frozenset({S.RUNNING, *_ENDING}),
    S.POOLED: frozenset({S.RUNNING, S.KILLED, *_ENDING}),  # (killed: discarded unused)
    S.RUNNING: frozenset({S.PAUSING, *_ENDING}),
    # (resuming: a fork restores its source from the checkpoint it just made)
    S.PAUSING: frozenset({S.PAUSED, S.RUNNING, S.RESUMING, *_ENDING}),
    S.PAUSED: frozenset({S.RESUMING, *_ENDING}),
    # (paused: a failed resume leaves the snapshot as it was)
    S.RESUMING: frozenset({S.RUNNING, S.PAUSED, *_ENDING}),
    S.KILLING: frozenset({S.KILLED, S.ERROR}),
    S.KILLED: frozenset(),
    S.ERROR: frozenset({S.KILLING}),  # a sandbox in error still has things to tear down
}

# States with something on the host (a runsc sandbox, a snapshot, or both in flux);
# ACTIVE: the same but pooled (a workspace's sandboxes); ENDED: nothing is left
LIVE = (S.CREATING, S.RUNNING, S.PAUSING, S.PAUSED, S.RESUMING, S.KILLING, S.POOLED)
ACTIVE = (S.CREATING, S.RUNNING, S.PAUSING, S.PAUSED, S.RESUMING, S.KILLING)
ENDED = (S.KILLED, S.ERROR)
# states in which a sandbox is over or being ended
GONE = (S.KILLING, S.KILLED, S.ERROR)
# the states a workspace sees (a pooled sandbox belongs to none yet)
SHOWN = tuple(s for s in State if s is not S.POOLED)

# operation -> states that accept it (anything else: 409 with the current state)
OPS: dict[str, frozenset[State]] = {
    "exec": frozenset({S.RUNNING}),
    "files": frozenset({S.RUNNING}),
    "pause": frozenset({S.RUNNING}),
    "resume": frozenset({S.PAUSED, S.RUNNING}),  # resuming a running sandbox: a no-op
    "fork": frozenset({S.RUNNING}),
    "set_timeout": frozenset({S.RUNNING, S.PAUSED}),
    "network": frozenset({S.RUNNING, S.PAUSED}),
    "info": frozenset(STATES),
    "delete": frozenset(STATES),
}


class InvalidTransition(RuntimeError):
    """A bug: the daemon tried a transition the table does not allow."""


def can(frm: str, to: str) -> bool:
    return frm in TRANSITIONS and to in TRANSITIONS[State(frm)]


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
