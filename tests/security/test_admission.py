"""Issue 11, finding 2: no sandbox larger than the host, no more sandboxes than the host (times
its overcommit ratio) can hold, per-workspace maxima, and a process limit that a fork bomb
inside meets with EAGAIN while the sandbox lives on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cpuos import InvalidArgument, LimitExceeded, Sandbox
from cpuosd.testing import Daemon, e2e_unavailable, new_daemon, wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def small_host() -> Iterator[Daemon]:
    """A daemon that believes its host has 4 GiB (ratio 1): two default sandboxes fill it."""
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    d = new_daemon(CPUOS_POOL_SIZE="0", CPUOS_HOST_MEMORY_MIB="4096",
                   CPUOS_MEMORY_OVERCOMMIT="1", CPUOS_DEFAULT_PIDS="256")
    d.start()
    yield d
    assert not d.teardown(False)


def test_oversized_sandbox_is_refused(small_host: Daemon) -> None:
    with small_host.client() as c:
        r = c.post("/sandboxes", json={"memory_mib": 262144, "vcpus": 64})
        assert r.status_code == 422, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_argument" and err["details"]["field"] == "vcpus"
        r = c.post("/sandboxes", json={"memory_mib": 8192, "vcpus": 1})
        assert r.status_code == 422 and r.json()["error"]["details"]["field"] == "memory_mib"
        assert c.get("/sandboxes").json()["sandboxes"] == []  # nothing was made


def test_host_capacity_counts_running_not_paused(small_host: Daemon) -> None:
    kw = small_host.sdk_kwargs()
    a = Sandbox.create(template="python", **kw)
    b = Sandbox.create(template="python", **kw)
    made = [a, b]
    try:
        with pytest.raises(LimitExceeded, match="the host is full") as e:
            Sandbox.create(template="python", **kw)
        # (what the host holds and what other workspaces reserve is not in it)
        assert e.value.details == {"limit": "host_capacity"}
        with pytest.raises(LimitExceeded):
            a.fork()  # a fork's clone needs room too
        b.pause()  # a paused sandbox holds no memory: room for another
        c = Sandbox.create(template="python", **kw)
        made.append(c)
        with pytest.raises(LimitExceeded):
            Sandbox.resume(b.id, **kw)
        c.kill()
        b2 = Sandbox.resume(b.id, **kw)
        assert b2.exec("echo back").stdout == "back\n"
        with small_host.client() as cl:
            ws = cl.get("/workspace").json()
        assert ws["used"]["memory_mib"] == 4096 and ws["host"]["capacity"]["memory_mib"] == 4096
    finally:
        for s in made:
            s.kill()


def test_workspace_maxima(small_host: Daemon) -> None:
    with small_host.client() as c:
        r = c.post("/workspaces", json={"name": "tight", "limits": {"max_sandboxes": 1,
                                                                    "max_vcpus": 1}})
        assert r.status_code == 201, r.text
        key = r.json()["key"]
        assert r.json()["limits"]["max_sandboxes"] == 1
        bad = c.post("/workspaces", json={"name": "bad", "limits": {"nope": 1}})
        assert bad.status_code == 422 and "unknown limit" in bad.json()["error"]["message"]
    kw = small_host.sdk_kwargs(key)
    with pytest.raises(InvalidArgument, match="maximum of 1 per sandbox"):
        Sandbox.create(template="python", vcpus=2, **kw)
    s = Sandbox.create(template="python", vcpus=1, **kw)
    try:
        with pytest.raises(LimitExceeded, match="maximum is 1"):
            Sandbox.create(template="python", vcpus=1, **kw)
    finally:
        s.kill()


def test_fork_bomb_meets_the_process_limit(small_host: Daemon) -> None:
    s = Sandbox.create(template="python", **small_host.sdk_kwargs())
    try:
        pids_max = Path(f"/sys/fs/cgroup/pids/cpuos/{s.id}/pids.max")
        if pids_max.exists():  # cgroup v1 hosts; the backstop under the in-sandbox limit
            assert int(pids_max.read_text()) == 4 * 256 + 1024
        r = s.exec("ulimit -u; for i in $(seq 1 400); do sleep 300 & done; "
                   "echo spawned; ps -e --no-headers | wc -l", timeout="2m")
        lines = r.stdout.split()
        assert lines[0] == "256", r.stdout
        assert "fork: Resource temporarily unavailable" in r.stderr
        # the agent (exempt from the limit) still starts commands: one that need not fork
        assert s.exec(["pkill", "-u", "user", "sleep"]).exit_code == 0
        wait_until(lambda: s.exec("echo alive").stdout == "alive\n", "forks work again")
    finally:
        s.kill()
