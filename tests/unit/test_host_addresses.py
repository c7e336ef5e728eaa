"""The egress proxy refuses the daemon's own addresses: their list is refreshed while an
event loop runs (the listing once used pyroute2's IPRoute, which failed inside a running loop:
every check logged 'This event loop is already running' and refused nothing)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from cpuosd.network.service import Network


def _sink(sid: str, rec: dict[str, Any]) -> None:
    pass


def test_host_addresses_are_listed_from_inside_a_running_loop(tmp_path: Path) -> None:
    net = Network(_sink, tmp_path)

    async def check() -> bool:
        net.is_host_address("127.0.0.1")  # starts the listing (in a thread)
        deadline = time.monotonic() + 30
        while not net.is_host_address("127.0.0.1"):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    assert asyncio.run(check()), "127.0.0.1 never listed as the host's own address"
    assert not net.is_host_address("198.51.100.7")
