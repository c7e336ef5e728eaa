"""End to end on real runsc: the SDK over real HTTP to a real cpuosd."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time

import pytest

from cpuos import AsyncSandbox, Conflict, InvalidArgument, NotFound, Sandbox

pytestmark = pytest.mark.e2e

QUICKSTART_CODE = """
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
xs = np.linspace(0, 6.28, 100)
plt.plot(xs, np.sin(xs))
plt.title("model-written chart")
plt.savefig("/work/chart.png")
print("mean of sin:", round(float(np.sin(xs).mean()), 3))
"""


def test_quickstart_flow(sbx: Sandbox) -> None:
    sbx.files.write("/work/main.py", QUICKSTART_CODE)
    seen: list[str] = []
    run = sbx.exec("python /work/main.py", timeout="2m", on_stdout=seen.append)
    assert run.exit_code == 0, run.stderr
    assert "mean of sin:" in run.stdout
    assert "".join(seen) == run.stdout
    chart = sbx.files.read("/work/chart.png")
    assert chart[:8] == b"\x89PNG\r\n\x1a\n" and len(chart) > 1000
    info = sbx.info()
    assert info.state == "running" and info.template == "python"


def test_exit_codes(sbx: Sandbox) -> None:
    assert sbx.exec("true").exit_code == 0
    assert sbx.exec("false").exit_code == 1
    r = sbx.exec("kill -9 $$")
    assert (r.exit_code, r.signal, r.timed_out) == (137, 9, False)
    assert sbx.exec(["python3", "-c", "import sys; sys.exit(42)"]).exit_code == 42


def test_runs_unprivileged_in_work(sbx: Sandbox) -> None:
    r = sbx.exec("id -u; id -g; pwd; grep -E '^Cap(Inh|Prm|Eff|Amb)' /proc/self/status")
    uid, gid, cwd, *caps = r.stdout.splitlines()
    assert (uid, gid, cwd) == ("1000", "1000", "/work")
    # the agent holds CAP_SYS_ADMIN (ambient, to survive its own execve); a command has none
    assert len(caps) == 4 and all(c.split()[1] == "0000000000000000" for c in caps), caps
    # the template's root filesystem is shared and must stay untouched
    assert sbx.exec("touch /usr/bin/x").exit_code != 0


def test_stdout_stderr_ordered_separate_and_streamed(sbx: Sandbox) -> None:
    events: list[tuple[float, str, str]] = []
    script = (
        "import sys, time\n"
        "for i in range(5):\n"
        "    print(f'out{i}', flush=True); print(f'err{i}', file=sys.stderr, flush=True)\n"
        "time.sleep(2)\n"
        "print('last', flush=True)\n"
    )
    t0 = time.monotonic()
    r = sbx.exec(["python3", "-c", script],
                 on_stdout=lambda s: events.append((time.monotonic() - t0, "out", s)),
                 on_stderr=lambda s: events.append((time.monotonic() - t0, "err", s)))
    total = time.monotonic() - t0
    assert r.stdout == "".join(f"out{i}\n" for i in range(5)) + "last\n"
    assert r.stderr == "".join(f"err{i}\n" for i in range(5))
    first_out = next(t for t, kind, _ in events if kind == "out")
    assert first_out < total - 1.5, f"first line came at {first_out:.2f}s of {total:.2f}s"


def test_timeout_kills_whole_tree_including_setsid_grandchild(sbx: Sandbox) -> None:
    cmd = ("(setsid bash -c 'trap \"\" TERM; exec -a cpuos-orphan sleep 1000' &); "
           "(trap '' TERM; sleep 1000) & sleep 1000")
    t0 = time.monotonic()
    r = sbx.exec(cmd, timeout=2)
    took = time.monotonic() - t0
    assert r.timed_out and r.exit_code == 137 and r.signal == 9
    assert 1.9 < took < 8, took
    ps = sbx.exec("ps -eo pid,ppid,sid,args")
    assert ps.exit_code == 0
    assert "sleep" not in ps.stdout and "cpuos-orphan" not in ps.stdout, ps.stdout
    assert sbx.exec("echo still-usable").stdout == "still-usable\n"


def test_background_process_does_not_hold_exec(sbx: Sandbox) -> None:
    t0 = time.monotonic()
    r = sbx.exec("nohup sleep 30 >/dev/null 2>&1 & echo started")
    assert r.stdout == "started\n" and time.monotonic() - t0 < 5
    assert "sleep 30" in sbx.exec("ps -eo args").stdout


def test_binary_and_invalid_utf8_output_byte_exact(sbx: Sandbox) -> None:
    blob = os.urandom(3 * 1024 * 1024) + b"\xff\xfe\x00\xc3("
    sbx.files.write("/work/blob.bin", blob)
    r = sbx.exec("cat /work/blob.bin; printf '\\xff\\x00' >&2")
    assert r.stdout_bytes == blob
    assert r.stderr_bytes == b"\xff\x00"
    assert "\ufffd" in r.stderr  # the text view replaces, the bytes stay exact


def test_stdin(sbx: Sandbox) -> None:
    assert sbx.exec("tr a-z A-Z", stdin="hello\n").stdout == "HELLO\n"
    data = os.urandom(600_000)
    r = sbx.exec("sha256sum", stdin=data)
    assert r.stdout.split()[0] == hashlib.sha256(data).hexdigest()


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_large_output_bounded_memory_head_and_tail(daemon, sbx: Sandbox) -> None:  # type: ignore[no-untyped-def]
    sbx.exec("true")
    before = _rss_kib(daemon.proc.pid)
    cap = 1 << 20
    script = ("import sys; w = sys.stdout.buffer.write; w(b'HEAD'); "
              "[w(b'x' * 1048576) for _ in range(50)]; w(b'TAIL')")
    r = sbx.exec(["python3", "-c", script], max_output=cap)
    after = _rss_kib(daemon.proc.pid)
    assert r.exit_code == 0
    assert r.stdout_total == 50 * 1048576 + 8
    assert r.truncated and len(r.stdout_bytes) == cap
    assert r.stdout_bytes.startswith(b"HEADxxx") and r.stdout_bytes.endswith(b"xxxTAIL")
    assert after - before < 40 * 1024, f"daemon RSS grew {after - before} KiB"


def test_100mib_file_round_trip(sbx: Sandbox, tmp_path) -> None:  # type: ignore[no-untyped-def]
    src = tmp_path / "big.bin"
    h = hashlib.sha256()
    with open(src, "wb") as f:
        for _ in range(100):
            chunk = os.urandom(1 << 20)
            h.update(chunk)
            f.write(chunk)
    entry = sbx.files.upload(src, "/work/big.bin")
    assert entry.size == 100 << 20
    inside = sbx.exec("sha256sum /work/big.bin").stdout.split()[0]
    assert inside == h.hexdigest()
    dst = tmp_path / "back.bin"
    assert sbx.files.download("/work/big.bin", dst) == 100 << 20
    assert hashlib.sha256(dst.read_bytes()).hexdigest() == h.hexdigest()


def test_files_api(sbx: Sandbox) -> None:
    sbx.files.write("notes/a.txt", "alpha")  # relative to /work; parents created
    sbx.files.write("/work/notes/b.bin", b"\x00\x01")
    names = [(e.name, e.type, e.size) for e in sbx.files.list("/work/notes")]
    assert names == [("a.txt", "file", 5), ("b.bin", "file", 2)]
    assert sbx.files.read_text("/work/notes/a.txt") == "alpha"
    assert sbx.files.exists("/work/notes/a.txt")
    sbx.files.write("/work/notes/a.txt", "replaced")
    assert sbx.files.read("/work/notes/a.txt") == b"replaced"
    sbx.files.remove("/work/notes/a.txt")
    assert not sbx.files.exists("/work/notes/a.txt")
    assert sbx.files.mkdir("/work/d1/d2").type == "dir"
    with pytest.raises(NotFound):
        sbx.files.read("/work/missing.txt")
    with pytest.raises(Conflict):
        sbx.files.read("/work/notes")
    sbx.files.remove("/work/notes")
    assert not sbx.files.exists("/work/notes")
    # a file written through the API is the user's, visible to commands
    assert sbx.exec("stat -c %u /work/d1").stdout.strip() == "1000"


def test_concurrent_execs(sbx: Sandbox) -> None:
    results: dict[int, str] = {}

    def run(i: int) -> None:
        results[i] = sbx.exec(f"sleep 0.5; echo {i}").stdout

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: f"{i}\n" for i in range(6)}
    assert time.monotonic() - t0 < 3


def test_async_sdk(daemon) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with await AsyncSandbox.create(template="python", timeout="2m",
                                             **daemon.sdk_kwargs()) as sbx:
            await sbx.files.write("/work/x.py", "print(6 * 7)")
            got: list[str] = []

            async def on_out(s: str) -> None:
                got.append(s)

            r = await sbx.exec("python /work/x.py", on_stdout=on_out)
            assert r.stdout == "42\n" and got == ["42\n"]
            sid = sbx.id
        info = (await AsyncSandbox.list(all=True, **daemon.sdk_kwargs()))
        assert [i.state for i in info if i.id == sid] == ["killed"]

    asyncio.run(main())


def test_context_manager_connect_list(daemon) -> None:  # type: ignore[no-untyped-def]
    with Sandbox.create(template="python", timeout="2m", **daemon.sdk_kwargs()) as sbx:
        other = Sandbox.connect(sbx.id, **daemon.sdk_kwargs())
        assert other.exec("echo via-connect").stdout == "via-connect\n"
        other.close()
        assert sbx.id in [s.id for s in Sandbox.list(**daemon.sdk_kwargs())]
    assert sbx.id not in [s.id for s in Sandbox.list(**daemon.sdk_kwargs())]
    with pytest.raises(Conflict):
        sbx2 = Sandbox.connect(sbx.id, **daemon.sdk_kwargs())
        try:
            sbx2.exec("true")
        finally:
            sbx2.close()


def test_deadline_reaper_and_set_timeout(daemon) -> None:  # type: ignore[no-untyped-def]
    short = Sandbox.create(template="python", timeout=2, **daemon.sdk_kwargs())
    extended = Sandbox.create(template="python", timeout=2, **daemon.sdk_kwargs())
    try:
        extended.set_timeout("1m")
        time.sleep(4)
        info = short.info()
        assert (info.state, info.reason) == ("killed", "timeout")
        assert extended.info().state == "running"
        assert extended.exec("echo alive").stdout == "alive\n"
        with pytest.raises(Conflict):
            short.exec("true")
    finally:
        for s in (short, extended):
            s.kill()
            s.close()
    assert short.id not in daemon.runsc_containers()


def test_sdk_rejects_bad_duration(sbx: Sandbox) -> None:
    with pytest.raises(InvalidArgument):
        sbx.exec("true", timeout="soon")
    with pytest.raises(InvalidArgument):
        sbx.set_timeout("-5")
