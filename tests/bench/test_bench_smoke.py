"""Every benchmark case runs in smoke mode (tiny N) in the default test run, so it cannot
rot: each case module by itself (``bench/cases/<case>.py --smoke``), the runner's grouping
of cases by daemon (bench/run.py), and the runtimes case."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from support.browser import chromium_unavailable
from cpuosd.templates.builder import template_info
from support.daemon import TEMPLATES, e2e_unavailable

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / ".cache" / "bench"

class Case(NamedTuple):
    section: str  # bench/run.py --only
    key: str  # in the results
    title: str  # how its table's title starts (not the line printed before it runs)
    samples: list[str]  # sample lists it fills (N each)
    metrics: list[str]  # its rows of the summary


CASES = {
    "create": Case("create", "create", "1. create → first exec result",
                   ["ours_s", "floor_run_s", "floor_delete_s", "floor_run_delete_s"],
                   ["create → first exec, p50"]),
    "exec_roundtrip": Case(
        "exec", "exec", "2. exec round trip of `true`",
        ["ours_shell_s", "ours_argv_s", "floor_in_sandbox_s", "peer_runsc_exec_s"],
        ["exec 'true' round trip, p50", "exec ['/bin/true'] round trip, p50"]),
    "stream": Case("stream", "stream", "3. stdout streaming to the SDK",
                   ["ours_MBps", "floor_MBps", "ours_dd_MBps", "floor_dd_MBps"],
                   ["stdout streaming (head -c), median", "stdout streaming (dd bs=1M), median"]),
    "files": Case("files", "files", "4. files,",
                  ["ours_up_MBps", "ours_down_MBps", "floor_up_MBps", "floor_down_MBps"],
                  ["file upload, median", "file download, median"]),
    "snap_create": Case(
        "snap-create", "snap_create", "5. create from the template snapshot → first exec result",
        ["ours_s", "ours_create_s", "floor_restore_s", "floor_restore_exec_s"],
        ["create from snapshot → first exec, p50"]),
    "pool": Case("pool", "pool", "6. create from the warm pool (CPUOS_POOL_SIZE=",
                 ["ours_create_s", "ours_create_exec_s", "floor_http_s", "floor_runsc_exec_s"],
                 ["create from warm pool, p50", "create from warm pool + first exec, p50"]),
    "pause": Case("pause", "pause", "7. pause / resume with a 100 MiB heap (N=",
                  ["ours_pause_s", "ours_resume_s", "ours_resume_exec_s", "floor_checkpoint_s",
                   "floor_checkpoint_delete_s", "floor_restore_s", "floor_restore_exec_s"],
                  ["pause, 100 MiB heap, p50", "resume, 100 MiB heap, p50",
                   "resume + first exec, 100 MiB heap, p50"]),
    "size": Case("size", "size", "8. snapshot size on disk, one paused", [],
                 ["snapshot size on disk, idle sandbox", "snapshot size on disk, 100 MiB heap"]),
    "microvm": Case("microvm", "microvm", "9. microVM: QEMU -M microvm",
                    ["spawn_jailed_s", "spawn_bare_s"],
                    ["microVM spawn → QMP ready (jailed, -S), p50",
                     "microVM clone → agent ready, p50",
                     "microVM per-VM memory beyond guest RAM, p50"]),
    "network": Case("network", "network", "10. network: HTTP download of", [],
                    ["network download, mode on, median", "network download, allowlist, median",
                     "new connection + response, allowlist, p50",
                     "new connection + response, mode on, p50",
                     "create from snapshot → first exec, network on, p50"]),
    "run_code": Case("run-code", "run_code", "15. code interpreter",
                     ["ours_run_code_s", "floor_exec_s", "ours_create_run_code_s",
                      "ours_create_s", "floor_create_exec_s", "floor_create_s"],
                     ["run_code('1+1') round trip, warm, p50", "create → first run_code, p50"]),
    "ports": Case("ports", "ports", "11. ports: HTTP download of", [],
                  ["preview download, median", "preview GET, new connection, p50",
                   "preview GET, keep-alive, p50", "wake on request → response, p50"]),
    "audit": Case("audit", "audit", "12. audit trail: cost of recording",
                  ["on_exec_s", "off_exec_s"],
                  ["exec round trip, audit on vs off, p50",
                   "10 execs inside, monitored vs not, median", "audit store, rows/s"]),
    "browser": Case("browser", "browser", "13. browser: create → first screenshot",
                    ["ours_s", "ours_create_s", "floor_s", "floor_create_s", "warm_shot_s"],
                    ["browser create → first screenshot, p50",
                     "browser create from warm pool → first screenshot, p50"]),
    "limits": Case("limits", "limits", "14. noisy neighbour", ["idle_s"],
                   [f"neighbour exec p99 beside {x}" for x in
                    ("fork bomb", "memory balloon", "disk fill",
                     "empty files to the inode limit, removed, again", "CPU spin, 4 processes")]),
    "interactive": Case("interactive", "interactive", "16. interactive: keystroke echo",
                        ["ours_echo_s", "floor_exec_s", "ours_reattach_s",
                         "ours_pty_reattach_s", "ours_stdin_MBps", "floor_stdin_MBps"],
                        ["keystroke echo through a terminal, p50", "streamed stdin, median",
                         "reattach to a command → first byte, p50",
                         "reattach to a terminal → first byte, p50"]),
    "density": Case("density", "density", "17. density:", [],
                    ["host memory per idle sandbox", "host CPU per idle sandbox",
                     "exec 'true' with 2 idle, p50", "exec 'true' with 2 idle, p99",
                     "back-to-back create → first exec with 2 idle, p50",
                     "back-to-back create → first exec with 2 idle, p95",
                     "pause, idle sandbox, p50", "resume → first exec, idle sandbox, p50",
                     "paused snapshot on disk, idle sandbox"]),
    "inside": Case("inside", "inside", "19. code inside",
                   [], [f"{w}: {what}" for w in ("import", "fork100", "pass20", "pip", "git",
                                                 "pytest", "compute", "syscalls")
                        for what in ("cpuos audit on vs raw runsc", "audit on vs off")]
                   + ["inside: repo files / tests / wheels"]),
    "console": Case("console", "console", "20. console: first paint with N sandboxes",
                    ["ours_paint_s", "floor_api_s"],
                    ["console first paint of the sandboxes page, p50",
                     "console event → screen, p50"]),
    "e2b_sdk": Case("e2b", "e2b", "18. E2B SDK on cpuos",
                ["ours_run_s", "floor_exec_login_s", "floor_exec_s", "ours_create_s",
                 "ours_create_run_s", "floor_create_s", "floor_create_exec_s"],
                ["e2b commands.run('true') round trip, p50",
                 "e2b create → first command, p50"]),
}
# (sample lists, the key of their N) of the network case's parts
NETWORK = {"download": (["ours_on_MBps", "ours_allow_MBps", "floor_MBps"], "runs"),
           "connect": (["ours_allow_s", "ours_on_s", "floor_s"], "n"),
           "create": (["ours_net_s", "ours_net_create_s", "ours_off_s", "ours_off_create_s"], "n")}
# ... and of the ports case's
PORTS = {"download": (["ours_MBps", "floor_MBps"], "runs"),
         "latency": (["ours_new_s", "floor_new_s", "ours_keepalive_s", "floor_keepalive_s"], "n"),
         "wake": (["ours_wake_s", "floor_resume_s", "floor_resume_request_s"], "n")}
HEAP = 100 << 20  # the heap holder's bytes (pause, size)


def run(argv: list[str], out: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Run a bench script (root, real runsc); its results file ``out``, written anew."""
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    out.unlink(missing_ok=True)
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=600,
                       cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res: dict[str, Any] = json.loads(out.read_text())
    return r, res


def check_clean_run(res: dict[str, Any]) -> None:
    meta = res["meta"]
    assert meta["complete"] and not meta["failed"]
    cleanup = meta["cleanup"]
    assert cleanup["raw_containers_left"] == []
    assert all(left == [] for left in cleanup["daemon_containers_left"].values())
    assert cleanup["stray_runsc_processes"] == []


def check_figures(module: str, data: dict[str, Any]) -> None:
    """Every sample list the case fills has its N samples, all positive, and what its
    figures say about the sandboxes holds (a heap is in the images that should hold it)."""
    for k in CASES[module].samples:
        n = data["peer_n"] if k.startswith("peer_") else data["n_create"] if (
            module in ("run_code", "e2b_sdk") and "create" in k) else data["runs"] if (
            module == "interactive" and "MBps" in k) else data.get("n", data.get("runs"))
        assert len(data[k]) == n and all(x > 0 for x in data[k]), (k, data[k])
    if module == "snap_create":
        assert data["image_bytes"] > 0
    if module == "pause":  # every cycle, the warmup's too
        assert len(data["ours_snapshot_bytes"]) == data["n"] + 1
        assert all(x > HEAP for x in data["ours_snapshot_bytes"] + data["floor_image_bytes"])
    if module == "size":
        for name in ("idle", "heap"):
            assert all(v > 0 for v in data[name].values()), data[name]
        for k in ("du_apparent", "floor_du_apparent"):
            assert data["heap"][k] > data["idle"][k] + HEAP * 9 // 10, k
    if module == "ports":
        for part, (keys, n) in PORTS.items():
            for k in keys:
                xs = data[part][k]
                assert len(xs) == data[part][n] and all(x > 0 for x in xs), (part, k, xs)
        assert data["download"]["bytes"] > 0 and data["address"].startswith("10.")
    if module == "browser":
        p = data["pool"]
        assert len(p["ours_s"]) == p["n"] and all(x > 0 for x in p["ours_s"]), p
    if module == "network":
        for part, (keys, n) in NETWORK.items():
            for k in keys:
                xs = data[part][k]
                assert len(xs) == data[part][n] and all(x > 0 for x in xs), (part, k, xs)
        assert data["download"]["bytes"] > 0
        # the sandboxes had the modes asked for, and a plain create got the daemon's default
        assert [m["mode"] for m in data["modes"]] == ["on", "allowlist"], data["modes"]
        assert data["create"]["default_network"]["mode"] == "on"
        assert data["network_left"] == []
    if module == "audit":
        for k in ("on_fork100_s", "off_fork100_s"):
            assert len(data[k]) == data["runs"] and all(x > 0 for x in data[k]), (k, data[k])
        assert data["audit_runtime"][0] and data["audit_runtime"][1] is None  # on / off
        rr = data["runtime_rows"]  # every exec inside recorded or counted as dropped
        assert rr["recorded"] + rr["dropped"] >= rr["expected"], rr
        assert data["store"]["verified"] and data["store"]["ours_rows_per_s"] > 0
    if module == "inside":  # every workload in every place, its N; audit on and off
        for w, places in data["samples"].items():
            for place, xs in places.items():
                assert len(xs["wall"]) == len(xs["cpu"]) == data["reps"], (w, place)
                assert all(x > 0 for x in xs["wall"]), (w, place, xs)
                assert place == "native" or all(x > 0 for x in xs["cpu"]), (w, place, xs)
        assert set(data["samples"]["import"]) == {"native", "raw", "on", "off"}
        assert data["audit_runtime"] and data["audit_runtime_off"] is None
    if module == "limits":
        assert len(data["loads"]) == 5 and data["daemon_healthy"]
        for load in data["loads"]:
            assert len(load["samples_s"]) == data["n"] and load["noisy_alive"], load["name"]
    if module == "console":
        assert data["sandboxes"] == data["n_asked"] and data["events"] >= 4
        assert len(data["ours_event_s"]) >= 4 and all(x >= 0 for x in data["ours_event_s"])
        assert len(data["floor_event_s"]) == data["events"]
    if module == "density":
        n = data["n"]
        mem, cpu = data["memory"], data["cpu"]
        assert mem["ours_drop_bytes"] >= 0 and mem["floor_drop_bytes"] >= 0
        for k in ("ours_cgroup_bytes", "floor_cgroup_bytes", "ours_own_bytes",
                  "floor_own_bytes", "ours_host_tasks",
                  "floor_host_tasks"):
            assert len(mem[k]) == n and all(x > 0 for x in mem[k]), (k, mem[k])
        # the agent and its spawner were found inside
        assert mem["agent"].get("agent_rss_kib", 1) > 0, mem["agent"]
        assert len(cpu["ours_core_share"]) == n == len(cpu["floor_core_share"])
        assert all(x >= 0 for x in cpu["ours_core_share"] + cpu["floor_core_share"])
        for part, keys in (("exec", ["ours_s", "floor_s"]), ("creates", ["ours_s", "floor_s"]),
                           ("pause", ["ours_pause_s", "ours_resume_exec_s",
                                      "floor_checkpoint_s", "floor_restore_exec_s",
                                      "ours_du_allocated"])):
            for k in keys:
                xs = data[part][k]
                want = data[part]["n_floor"] if part == "exec" and k == "floor_s" \
                    else data[part]["n"]
                assert len(xs) == want and all(x > 0 for x in xs), (part, k, xs)
    if module == "microvm":
        assert set(data["probe"]) == {"ok", "reason", "seconds"}
        assert data["gvisor"]["ours_create_s"] and data["gvisor"]["floor_restore_s"]
        assert data["jails_left"] == []


@pytest.mark.e2e
@pytest.mark.parametrize("module", [  # the network case builds network namespaces
    pytest.param(m, marks=pytest.mark.net) if m in ("network", "ports") else m for m in CASES])
def test_case_smoke(module: str) -> None:
    """bench/cases/<module>.py --smoke by itself: its own daemon, its table, its summary
    rows and samples, and nothing left behind."""
    case = CASES[module]
    if module == "console" and chromium_unavailable():
        pytest.skip(f"the console benchmark drives a browser: {chromium_unavailable()}")
    for needs, template in (("browser", "browser"), ("run_code", "code-interpreter")):
        if module == needs and template_info(TEMPLATES, template) is None:
            pytest.skip(f"the {template} template is not built in {TEMPLATES} "
                        f"(`cpuosd template build {template}`; scripts/test.sh builds it)")
    r, res = run([f"bench/cases/{module}.py", "--smoke"], OUT / f"case-{case.section}-smoke.json")
    check_clean_run(res)
    assert res["meta"]["sections"] == [case.section]
    check_figures(module, res[case.key])
    assert [row["metric"] for row in res["summary"]] == case.metrics
    assert all(row["ours"] and row["floor"] for row in res["summary"]), res["summary"]
    assert r.stdout.index(case.title) < r.stdout.index("Summary")


@pytest.mark.e2e
def test_density_thousand_smoke() -> None:
    """density.py --thousand --smoke: 4 sandboxes with idle_timeout=5s (the workspace's
    max_sandboxes raised through the admin API), all paused by themselves before an exec
    in 2 of them resumes each."""
    r, res = run(["bench/cases/density.py", "--smoke", "--thousand"],
                 OUT / "case-density-smoke.json")
    check_clean_run(res)
    data = res["density"]
    assert data["mode"] == "thousand" and data["created"] == data["n"] == 4, data
    assert not data["refused"] and not data["failed"] and not data["stopped"], data
    assert data["max_sandboxes"] >= 4 and data["states_at_end"] == {"paused": 4}, data
    assert data["exec_states"] == ["paused", "paused"] and not data["exec_failed"], data
    assert len(data["exec_s"]) == 2 and all(x > 0 for x in data["exec_s"])
    assert [row["metric"] for row in res["summary"]] == [
        "sandboxes created with idle_timeout=5s", "exec in 2 picked at random, p50",
        "exec in 2 picked at random, p99"]
    assert "17. density --thousand" in r.stdout


@pytest.mark.e2e
def test_runner_groups_cases_by_daemon() -> None:
    """bench/run.py runs the selected cases, consecutive ones with the same daemon
    configuration on one daemon (exec and files share a cold-boot daemon and its sandbox;
    pool gets its own), and reports them in their order with one summary."""
    r, res = run(["bench/run.py", "--smoke", "--only", "pool,files,exec"],
                 OUT / "results-smoke.json")
    check_clean_run(res)
    assert res["meta"]["sections"] == ["exec", "files", "pool"]
    modules = ("exec_roundtrip", "files", "pool")
    for module in modules:
        check_figures(module, res[CASES[module].key])
    assert len(res["meta"]["cleanup"]["daemon_containers_left"]) == 2  # daemons started
    assert [row["metric"] for row in res["summary"]] == [
        m for module in modules for m in CASES[module].metrics]
    at = [r.stdout.index(t) for t in [*(CASES[m].title for m in modules), "Summary"]]
    assert at == sorted(at)


@pytest.mark.e2e
def test_runtimes_case_smoke() -> None:
    r, res = run(["bench/cases/runtimes.py", "--smoke", "--runtimes", "pinned"],
                 OUT / "runtimes-smoke.json")
    pinned = res["runtimes"]["pinned"]
    assert set(pinned["workloads"]) == {"import", "fork100", "pass20"}
    assert pinned["health"]["backend"] == "gvisor"
    for k in ("exec_s", "spawn_floor_s", "pause_s", "resume_s", "create_exec_s"):
        assert pinned[k] and all(x > 0 for x in pinned[k]), k
    assert "host memory per idle sandbox" in r.stdout
