"""Per-sandbox network namespaces: ``cpuos-n<index>`` holding ``eth0`` (the sandbox's end of a
veth pair, 10.213.x.y/30 from the daemon's pool), its host end ``cvn<index>`` in the daemon's
namespace as the gateway. Made with `ip` (through cpuosd.procs: pyroute2 forks helper
children for namespaces, which the reaper of adopted orphans would take); a few are made
ahead of time (``NetnsPool``) so a create does not wait for them (about 10 ms each here;
removed by deleting the namespace, see ``remove_netns``). A namespace is used by one
sandbox once and then deleted: runsc's netstack takes the interface's addresses and routes
into the sandbox, so a used namespace is never clean again.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from .. import procs
from ..config import NetworkConfig

T = TypeVar("T")

log = logging.getLogger("cpuosd.network")

NETNS_DIR = "/var/run/netns"
# threads of the network's own for its blocking work (nft, ip): the default executor is
# shared with the daemon's reaper, which many concurrent kills keep busy
EXECUTOR = ThreadPoolExecutor(max_workers=4, thread_name_prefix="net")


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(EXECUTOR, fn, *args)


def netns_prefix(tag: str) -> str:
    return f"cpuos-{tag}-n" if tag else "cpuos-n"


def host_if_prefix(tag: str) -> str:
    return f"cv{tag}n"


@dataclass(frozen=True)
class Slot:
    """One /30 of the pool: index i -> host end .1+4i, sandbox end .2+4i."""

    index: int
    gateway: str
    address: str
    tag: str = ""

    @property
    def netns(self) -> str:
        return f"{netns_prefix(self.tag)}{self.index}"

    @property
    def netns_path(self) -> str:
        return f"{NETNS_DIR}/{self.netns}"

    @property
    def host_if(self) -> str:
        return f"{host_if_prefix(self.tag)}{self.index}"

    @property
    def gateway6(self) -> str:
        return v6_of(self.gateway)

    @property
    def address6(self) -> str:
        return v6_of(self.address)


# IPv6 on the veth, so that an IPv6 attempt leaves the sandbox's stack and meets the firewall,
# which refuses and records it (with no address or route gVisor's netstack fails it inside,
# unseen). A unique-local /126 per slot that mirrors its IPv4 /30 (the IPv4 address in the
# last 32 bits): unique on the host as the IPv4 slots are. Never routed anywhere.
V6_PREFIX = ipaddress.IPv6Address("fd63:7075:6f73::")


def v6_of(v4: str) -> str:
    return str(ipaddress.IPv6Address(int(V6_PREFIX) | int(ipaddress.IPv4Address(v4))))


class AddressPool:
    """The daemon's address pool (``CPUOS_NET_POOL``, default 10.213.0.0/16): /30 slots,
    reserved synchronously."""

    def __init__(self, cidr: str = NetworkConfig.pool, tag: str = "") -> None:
        self.tag = tag
        self.net = ipaddress.IPv4Network(cidr)
        self.size = self.net.num_addresses // 4
        self.used: set[int] = set()
        self._next = 0

    def slot(self, index: int) -> Slot:
        base = int(self.net.network_address) + 4 * index
        return Slot(index, str(ipaddress.IPv4Address(base + 1)),
                    str(ipaddress.IPv4Address(base + 2)), self.tag)

    def reserve(self) -> Slot:
        for _ in range(self.size):
            i = self._next
            self._next = (self._next + 1) % self.size
            if i not in self.used:
                self.used.add(i)
                return self.slot(i)
        raise RuntimeError(f"the address pool {self.net} is exhausted")

    def release(self, index: int) -> None:
        self.used.discard(index)

    def index_of(self, address: str) -> int | None:
        try:
            ip = ipaddress.IPv4Address(address)
        except ValueError:
            return None
        if ip not in self.net:
            return None
        off = int(ip) - int(self.net.network_address)
        return off // 4 if off % 4 == 2 else None


def _ip(*argv: str, batch: str | None = None, check: bool = True) -> None:
    """``ip`` through cpuosd.procs (pyroute2's namespace helpers fork children of their
    own, which the daemon's reaper of adopted orphans would collect from under them)."""
    rc, _, err = procs.run_sync(["ip", *argv, *(["-batch", "-"] if batch else [])],
                                input=batch.encode() if batch else None, timeout=30)
    if rc != 0 and check:
        raise RuntimeError(f"ip {' '.join(argv)}: {err.decode(errors='replace').strip()}")


def create(slot: Slot) -> None:
    """The namespace, the veth pair and their addresses; the sandbox end's default route
    goes to the host end. Blocking (run it in a thread)."""
    _ip("netns", "add", slot.netns)
    try:
        _ip(batch=f"link add {slot.host_if} type veth peer name eth0 netns {slot.netns}\n"
                  f"addr add {slot.gateway}/30 dev {slot.host_if}\n"
                  f"addr add {slot.gateway6}/126 dev {slot.host_if} nodad\n"
                  f"link set {slot.host_if} up\n")
        _ip("-n", slot.netns, batch=f"addr add {slot.address}/30 dev eth0\n"
                                    f"addr add {slot.address6}/126 dev eth0 nodad\n"
                                    "link set eth0 up\nlink set lo up\n"
                                    f"route add default via {slot.gateway}\n"
                                    f"route add default via {slot.gateway6}\n")
    except BaseException:
        destroy(slot)
        raise


# s the host end of a deleted namespace's pair may take to go with it before it is deleted
# by hand (a process still in the namespace keeps it, and so the pair, alive)
HOST_END_WAIT = 5.0
HOST_END_POLL = 0.01  # s


def remove_netns(slot: Slot) -> None:
    """The namespace's name (``ip netns del``: ~1 ms). The kernel then removes the
    namespace, its end of the veth pair and with it the host end, in a cleanup of its own
    that takes many namespaces in one batch: a removal by ``ip link del`` waits for a
    network-wide RCU grace period each (~40 ms here on a quiet host, 270 ms in a loaded
    test run: a kill of 100 sandboxes left 27 s of them behind it). Blocking."""
    if os.path.exists(slot.netns_path):
        _ip("netns", "del", slot.netns, check=False)


def host_end_present(slot: Slot) -> bool:
    return os.path.exists(f"/sys/class/net/{slot.host_if}")


def remove_host_end(slot: Slot) -> None:
    """The host end by hand (its namespace is gone, or outlived the wait). Blocking."""
    if host_end_present(slot):
        _ip("link", "del", slot.host_if, check=False)


def destroy(slot: Slot, wait: float = HOST_END_WAIT) -> None:
    """Remove the namespace and the host end (idempotent): the namespace first, then, when
    its pair has not gone with it within ``wait`` s, the host end by hand. Returns once
    the host end is gone (its name may be used again). Blocking (``destroy_async`` waits
    on the event loop instead of a thread)."""
    remove_netns(slot)
    deadline = time.monotonic() + wait
    while host_end_present(slot) and time.monotonic() < deadline:
        time.sleep(HOST_END_POLL)
    remove_host_end(slot)


async def destroy_async(slot: Slot, wait: float = HOST_END_WAIT) -> None:
    """``destroy`` whose wait for the kernel's cleanup holds no thread of ``EXECUTOR`` (a
    hundred sandboxes killed at once wait together)."""
    await in_thread(remove_netns, slot)
    deadline = time.monotonic() + wait
    while host_end_present(slot) and time.monotonic() < deadline:
        await asyncio.sleep(HOST_END_POLL)
    if host_end_present(slot):
        await in_thread(remove_host_end, slot)


def existing(tag: str) -> list[int]:
    """Indexes of our namespaces on the host (after a restart)."""
    try:
        names = os.listdir(NETNS_DIR)
    except FileNotFoundError:
        return []
    name_re = re.compile(rf"^{re.escape(netns_prefix(tag))}(\d+)$")
    return sorted(int(m.group(1)) for n in names if (m := name_re.fullmatch(n)))


class NetnsPool:
    """Namespaces made ahead of time (``CPUOS_NETNS_POOL``, default 4), refilled in the
    background; ``take`` makes one on the spot when the pool is empty."""

    def __init__(self, addresses: AddressPool, size: int = NetworkConfig.netns_pool) -> None:
        self.addresses = addresses
        self.size = size
        self.ready: list[Slot] = []
        self._filling: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._closing = False

    async def take(self) -> Slot:
        if self.ready:
            slot = self.ready.pop()
        else:
            slot = await self._make()
        self.refill()
        return slot

    async def _make(self) -> Slot:
        slot = self.addresses.reserve()
        made = asyncio.ensure_future(in_thread(create, slot))
        try:
            await asyncio.shield(made)
        except asyncio.CancelledError:
            # the thread goes on: what it makes is removed once it is done
            made.add_done_callback(lambda _: asyncio.ensure_future(self._undo(slot)))
            raise
        except BaseException:
            self.addresses.release(slot.index)
            raise
        return slot

    async def _undo(self, slot: Slot) -> None:
        try:
            await destroy_async(slot)
        finally:
            self.addresses.release(slot.index)

    def refill(self) -> None:
        if not self._closing and (self._filling is None or self._filling.done()):
            self._filling = asyncio.get_running_loop().create_task(self._fill())

    async def _fill(self) -> None:
        async with self._lock:
            while len(self.ready) < self.size and not self._closing:
                try:
                    self.ready.append(await self._make())
                except Exception:
                    log.exception("making a spare network namespace failed")
                    return

    async def close(self) -> None:
        # not cancelled: a namespace being made in a thread would be made after all, and
        # never removed; the fill stops after the one under way (about 50 ms)
        self._closing = True
        if self._filling is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(self._filling), 30)
        for slot in self.ready:
            await destroy_async(slot)
            self.addresses.release(slot.index)
        self.ready.clear()
