"""Issue 11, finding 2 (and issue 22, item 4): no sandbox larger than the host, no more
sandboxes than the host can hold by what they really use (paused ones hold none),
per-workspace maxima, and a process limit that a fork bomb inside meets with EAGAIN while the
sandbox lives on."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cpuos import InvalidArgument, LimitExceeded, Sandbox
from support.daemon import Daemon, e2e_unavailable, new_daemon, oserror_after, wait_until

pytestmark = pytest.mark.e2e


# the daemon's default task limit here (small: each task the fork bomb starts is a fork and
# an exec under gVisor)
PIDS = 64


@pytest.fixture(scope="module")
def small_host() -> Iterator[Daemon]:
    """A daemon that believes its host has 4 GiB and keeps 3.25 GiB of it free: what its
    sandboxes really hold fills the 768 MiB left after a few of them."""
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    d = new_daemon(CPUOS_POOL_SIZE="0", CPUOS_HOST_MEMORY_MIB="4096",
                   CPUOS_MEMORY_RESERVE_MIB="3328", CPUOS_DEFAULT_PIDS=str(PIDS))
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


def test_host_memory_counts_what_running_sandboxes_hold(small_host: Daemon) -> None:
    """Admitted by what the sandboxes really hold (not their 2 GiB sizes), refused with
    host_memory once that fills the host; a paused one holds no memory."""
    kw = small_host.sdk_kwargs()
    made: list[Sandbox] = []

    def create() -> Sandbox:
        s = Sandbox.create(template="python", **kw)
        made.append(s)
        return s

    try:
        with pytest.raises(LimitExceeded, match=r"the host is full \(memory\)") as e:
            for _ in range(60):
                create()
        # what is full, not the host's figures or what other workspaces hold
        assert e.value.details == {"limit": "host_memory"}
        assert made, "not even one sandbox was admitted"
        with pytest.raises(LimitExceeded):
            made[0].fork()  # a fork's clone needs room too
        paused = made.pop()
        paused.pause()  # its memory is freed: once the last creates' promises lapse, room

        def admitted() -> bool:
            try:
                create()
            except LimitExceeded:
                return False
            return True

        wait_until(admitted, "a create admitted once a sandbox is paused", 90)
        # the paused one may have held more than a new one is taken to need: fill what room
        # is left, then its resume is refused as a create is
        with pytest.raises(LimitExceeded):
            for _ in range(60):
                create()
        with pytest.raises(LimitExceeded):
            Sandbox.resume(paused.id, **kw)
        made.pop().kill()  # two, so that room for one shows whatever each held
        made.pop().kill()

        def resumed() -> bool:
            try:
                made.append(Sandbox.resume(paused.id, **kw))
            except LimitExceeded:
                return False
            return True

        wait_until(resumed, "the paused sandbox resumed once others are killed", 90)
        assert made[-1].exec("echo back").stdout == "back\n"
        with small_host.client() as cl:
            host = cl.get("/workspace").json()["host"]
        assert host["memory_total_mib"] == 4096 and host["memory_reserve_mib"] == 3328
        assert host["memory_available_mib"] < 4096 and host["sandbox_mib"] > 0
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
            assert int(pids_max.read_text()) == 4 * PIDS + 1024
        assert s.exec("ulimit -u").stdout == f"{PIDS}\n"
        # (a fork bomb in Python: bash waits 1+2+4+8 s before it reports a fork's EAGAIN)
        started, err = oserror_after(s, "subprocess.Popen(['sleep', '300'])", 2 * PIDS,
                                     setup="import subprocess")
        # EAGAIN below the limit (its other tasks: the shell, python, the agent's own)
        assert err == errno.EAGAIN and 0 < started < PIDS, (started, err)
        # the agent (exempt from the limit) still starts commands: one that need not fork
        assert s.exec(["pkill", "-u", "user", "sleep"]).exit_code == 0
        wait_until(lambda: s.exec("echo alive").stdout == "alive\n", "forks work again")
    finally:
        s.kill()


def test_a_hundred_idle_sandboxes_are_admitted_with_defaults() -> None:
    """Issue 22: with the daemon's defaults, 100 idle python sandboxes (2 vCPUs and 2 GiB
    each as caps: 200 vCPUs and 200 GiB on this host) are all admitted; the 101st meets the
    workspace's maximum, not the host."""
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    d = new_daemon()
    d.start()
    made: list[Sandbox] = []
    try:
        kw = d.sdk_kwargs()
        for _ in range(100):
            made.append(Sandbox.create(template="python", timeout="10m", **kw))
        assert made[-1].exec("echo up").stdout == "up\n"
        with pytest.raises(LimitExceeded) as e:
            Sandbox.create(template="python", **kw)
        assert e.value.details["limit"] == "max_sandboxes"
        with d.client() as c:
            ws = c.get("/workspace").json()
        assert ws["used"]["sandboxes"] == 100 and ws["used"]["vcpus"] == 200
    finally:
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(lambda s: s.kill(), made))
        assert not d.teardown(False)
