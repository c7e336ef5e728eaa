"""Tier 0: the real daemon in this process (uvicorn on a loopback port, in a thread) over
``LocalAgentBackend``: each sandbox is the real cpuos_agent as a local process. No root,
no runsc, no template; the public SDK drives it. See tests/support/local.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cpuos import Sandbox
from support.daemon import wait_until
from support.local import TEMPLATE, LocalDaemon, local_daemon, local_unavailable


@pytest.fixture(scope="module")
def local() -> Iterator[LocalDaemon]:
    """One per module: gone before the next directory's tests (its manager reaps this
    process's exited children that cpuosd.procs does not own, e.g. the e2e daemons)."""
    why = local_unavailable()
    if why:
        pytest.skip(why)
    with pytest.MonkeyPatch.context() as mp:
        # its own templates and snapshots, and no client default pointing elsewhere
        for name in ("CPUOS_TEMPLATES_DIR", "CPUOS_SNAPSHOTS_DIR", "CPUOS_API_URL",
                     "CPUOS_API_KEY"):
            mp.delenv(name, raising=False)
        with local_daemon() as d:
            yield d
            left = [s.id for s in Sandbox.list(**d.sdk_kwargs())]
            assert not left, f"sandboxes left running: {left}"


@pytest.fixture
def sbx(local: LocalDaemon) -> Iterator[Sandbox]:
    s = Sandbox.create(template=TEMPLATE, timeout="5m", **local.sdk_kwargs())
    yield s
    s.kill()
    s.close()
    # its agent, and everything in its namespace, is gone
    wait_until(lambda: s.id not in local.backend.agents, f"the agent of {s.id} ended", 10)
