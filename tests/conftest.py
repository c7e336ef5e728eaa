"""Test fixtures: a real cpuosd (real runsc, real SQLite, real HTTP) per test session.
The daemon harness lives in support.daemon (shared with bench/)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.daemon import (SHARED_IMAGES_ENV, Daemon, busybox_root, busybox_unavailable,
                            e2e_unavailable, new_daemon)


def pytest_configure(config: pytest.Config) -> None:
    """One template image directory for every daemon of the session (support.daemon:
    SHARED_IMAGES_ENV), made by the process that starts the session (xdist's controller,
    before its workers, which inherit the variable) unless the caller set one."""
    if hasattr(config, "workerinput") or os.environ.get(SHARED_IMAGES_ENV):
        return
    d = tempfile.mkdtemp(prefix="cpuos-timages-", dir="/tmp")
    os.environ[SHARED_IMAGES_ENV] = d
    config._cpuos_images = d  # type: ignore[attr-defined]


def pytest_unconfigure(config: pytest.Config) -> None:
    d = getattr(config, "_cpuos_images", None)
    if d:
        shutil.rmtree(d, ignore_errors=True)
        os.environ.pop(SHARED_IMAGES_ENV, None)


# the only skips CI accepts: KVM guests where this host's /dev/kvm cannot run them (their
# TCG twins run instead)
ALLOWED_CI_SKIPS = ("KVM boot probe failed",)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    if rep.skipped and os.environ.get("CI") and not any(
            ok in str(rep.longrepr) for ok in ALLOWED_CI_SKIPS):
        # in CI a test that cannot run fails, saying why: no silent skip
        rep.outcome = "failed"
        rep.longrepr = f"skipped in CI, which must run it: {rep.longrepr}"
    if rep.failed:
        item.session.config._cpuos_failed = True  # type: ignore[attr-defined]


# tier 2 (marker ``tier2``): heavy suites, still in the default run (scripts/test.sh): the
# bench smokes, microVM guests under TCG, the browser. Tier 0 is tests/unit and
# tests/component (``scripts/test.sh --fast``); tier 1 everything else.
TIER2 = ("tests/bench/", "tests/cluster/test_bench_cluster.py", "tests/e2e/test_microvm.py",
         "tests/net/test_microvm_net.py", "tests/e2e/test_browser.py")


# the modules that take longest (minutes of a worker: each its own daemons, clusters or
# suites), handed to the workers first (scripts/test.sh runs xdist with
# --no-loadscope-reorder, which keeps this order; xdist's own puts the modules with most
# tests first, and these came last, one worker busy with them while the others idled)
LONGEST_FIRST = ("tests/bench/test_bench_smoke.py", "tests/cluster/test_two_nodes.py",
                 "tests/e2b/test_e2b_upstream.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(__file__).resolve().parent.parent
    rank: dict[str, int] = {}
    for item in items:
        rel = Path(item.fspath).resolve().relative_to(root).as_posix()
        if rel.startswith(TIER2):
            item.add_marker(pytest.mark.tier2)
        rank[item.nodeid] = (LONGEST_FIRST.index(rel) if rel in LONGEST_FIRST
                             else len(LONGEST_FIRST))
    items.sort(key=lambda item: rank[item.nodeid])  # (stable: the rest keep their order)


@pytest.fixture(scope="session")
def daemon(request: pytest.FixtureRequest) -> Iterator[Daemon]:
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    d = new_daemon()
    d.start()
    yield d
    left = d.teardown(getattr(request.config, "_cpuos_failed", False))
    assert not left, f"runsc containers left behind: {left}"


@pytest.fixture
def fresh_daemon(request: pytest.FixtureRequest) -> Iterator[Daemon]:
    """A daemon of the test's own (for restart/kill tests), warm pool off unless the test
    is parametrized indirectly with an environment dict."""
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    env = {"CPUOS_POOL_SIZE": "0", **getattr(request, "param", {})}
    d = new_daemon(**env)
    d.start()
    yield d
    left = d.teardown(getattr(request.config, "_cpuos_failed", False))
    assert not left, f"runsc containers left behind: {left}"


@pytest.fixture
def sbx(daemon: Daemon) -> Iterator[object]:
    from cpuos import Sandbox

    s = Sandbox.create(template="python", timeout="10m", **daemon.sdk_kwargs())
    yield s
    s.kill()
    s.close()


@pytest.fixture
def busybox_tree(tmp_path: Path) -> Path:
    """A tiny root (busybox-static as /bin/sh, its applets, /tmp, /work) for template build
    steps (real runsc)."""
    why = busybox_unavailable()
    if why:
        pytest.skip(why)
    return busybox_root(tmp_path)
