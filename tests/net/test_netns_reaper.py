"""Namespaces are made and removed only through children the daemon owns (cpuosd.procs):
the daemon reaps every child it did not register (adopted orphans), and a helper that forks
and waits for its own children (pyroute2's namespace functions did) lost them to that
reaper: a create failed with ChildProcessError under load (seen in CI)."""

from __future__ import annotations

import os
import threading

import pytest

from cpuosd import procs
from cpuosd.network import netns

pytestmark = [pytest.mark.net]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)")
def test_namespaces_survive_a_busy_reaper() -> None:
    stop = threading.Event()

    def reap() -> None:
        while not stop.is_set():
            procs.reap_orphans()

    t = threading.Thread(target=reap, daemon=True)
    t.start()
    pool = netns.AddressPool("10.252.0.0/26", "rp")
    made: list[netns.Slot] = []
    try:
        for _ in range(10):
            slot = pool.reserve()
            made.append(slot)
            netns.create(slot)
            assert os.path.exists(slot.netns_path)
            netns.destroy(slot)
            assert not os.path.exists(slot.netns_path)
    finally:
        stop.set()
        t.join(10)
        for slot in made:
            netns.destroy(slot)
