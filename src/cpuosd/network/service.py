"""The daemon's network: address pool, namespaces, the nftables table, the resolver and the
egress proxy, and the record of every outbound attempt. The backend wrapper
(network.backend) attaches a sandbox here when it starts or restores and detaches it when it
stops; the lifecycle never branches on networking.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import psutil

from ..config import NetworkConfig
from . import firewall
from . import netns as ns
from .dns import Resolver, Upstream, default_upstream
from .secrets import SecretStore
from .nflog import Dropped, NflogReader
from .policy import Deny, Policy
from .relay import CHUNK
from .proxy import EgressProxy
from .uplink import Uplink

log = logging.getLogger("cpuosd.network")

# (sandbox id, the record's fields) -> stored and published by the daemon
RecordSink = Callable[[str, dict[str, Any]], None]


class RecordWriter:
    """Connection records to SQLite in batches, off the event loop (one write per connection
    on the loop was about 30% of a proxied connection's cost), and to the event bus at
    once. Bounded: beyond MAX_PENDING unwritten records new ones are counted, not kept."""

    MAX_PENDING = 10_000
    INTERVAL = 0.05

    def __init__(self, store: Any, events: Any) -> None:
        self.store, self.events = store, events
        self.pending: list[tuple[str, dict[str, Any]]] = []
        self.dropped = 0
        self._ws: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    def put(self, sid: str, rec: dict[str, Any]) -> None:
        from ..events import SandboxEvent

        if len(self.pending) >= self.MAX_PENDING:
            self.dropped += 1
        else:
            self.pending.append((sid, rec))
        ws = self._ws.get(sid)
        if ws is None:
            row = self.store.get_sandbox(sid)
            ws = row.workspace_id if row else ""
            if len(self._ws) > 10_000:
                self._ws.clear()
            self._ws[sid] = ws
        self.events.emit(SandboxEvent("connection", sid, ws, None, fields=rec))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._later())

    async def _later(self) -> None:
        await asyncio.sleep(self.INTERVAL)
        await self.flush()

    async def flush(self) -> None:
        async with self._lock:
            batch, self.pending = self.pending, []
            if self.dropped:
                log.warning("connection records: %d dropped (writer behind)", self.dropped)
                self.dropped = 0
            if batch:
                await asyncio.to_thread(self.store.add_connections, batch)


@dataclass
class Attached:
    sid: str
    slot: ns.Slot
    policy: Policy


class Network:
    def __init__(self, sink: RecordSink, secrets_dir: Path,
                 cfg: NetworkConfig | None = None, secrets: SecretStore | None = None
                 ) -> None:
        self.cfg = cfg = cfg or NetworkConfig()
        self.tag = cfg.net_id  # this daemon's tag in the names it gives (CPUOS_NET_ID)
        self.names = firewall.Names(self.tag, cfg.nflog_group)
        self.nflog = NflogReader(self.names.log_group)
        self._nflog_task: asyncio.Task[None] | None = None
        self._drops: dict[tuple[str, str, str, int | None], list[float]] = {}
        self.addresses = ns.AddressPool(cfg.pool, tag=self.tag)
        self.pool = ns.NetnsPool(self.addresses, cfg.netns_pool)
        self.uplink = Uplink(cfg.uplink_netns)
        self.upstream = Upstream(self.uplink, default_upstream(cfg.dns_upstream))
        self.deny = Deny(cfg)
        self.sink = sink
        # where the records of an attachment that is not a sandbox go (a template build's)
        self.taps: dict[str, RecordSink] = {}
        self.records: RecordWriter | None = None  # (set by the daemon: flushed on reads)
        self.secrets = secrets or SecretStore(secrets_dir)
        self.by_sid: dict[str, Attached] = {}
        self._detaching: set[asyncio.Task[None]] = set()
        self.by_addr: dict[str, Attached] = {}
        self.proxy = EgressProxy(self.uplink, self.upstream, self.lookup, self.record,
                                 self.is_host_address, self.secrets, self.deny,
                                 cfg.upstream_ca_file)
        self._host_addrs: set[str] = set()
        self._host_addrs_at = 0.0
        self._server: asyncio.Server | None = None
        self._dns: asyncio.BaseTransport | None = None
        self.proxy_port = cfg.egress_port
        self.dns_port = cfg.dns_port

    # -- start and stop ------------------------------------------------------------------
    async def start(self) -> None:
        self._server = await asyncio.start_server(self.proxy.handle, host="0.0.0.0",
                                                  port=self.proxy_port, limit=CHUNK,
                                                  reuse_address=True)
        self.proxy_port = self._server.sockets[0].getsockname()[1]
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: Resolver(self.upstream, self.lookup, self.record, self.deny),
            local_addr=("0.0.0.0", self.dns_port))
        self._dns = transport
        self.dns_port = transport.get_extra_info("sockname")[1]
        await asyncio.to_thread(self.nflog.open)
        self._nflog_task = loop.create_task(self.nflog.run(self._dropped))
        await ns.in_thread(firewall.install, self.names, self.proxy_port, self.dns_port)
        self._host_addrs_at = time.monotonic()
        await asyncio.to_thread(self._list_host_addrs)
        log.info("network: table %s, egress proxy :%d, resolver :%d, upstream DNS %s:%d%s",
                 self.names.table, self.proxy_port, self.dns_port, *self.upstream.server,
                 f", uplink netns {self.uplink.netns}" if self.uplink.netns else "")
        self.pool.refill()

    async def close(self) -> None:
        """The daemon stops: the proxy and resolver stop, spare namespaces go, the table
        goes; namespaces of live sandboxes stay (a restarted daemon adopts them)."""
        if self._server is not None:
            self._server.close()
        for t in list(self.proxy.conns):
            t.cancel()
        if self._dns is not None:
            self._dns.close()
        if self._detaching:
            await asyncio.wait(list(self._detaching), timeout=30)
        await self.pool.close()
        if not self.by_sid:  # (sandboxes still running stay filtered until the next start,
            with contextlib.suppress(Exception):  # which rebuilds the table in one go)
                await ns.in_thread(firewall.remove, self.names)
        self.nflog.close()
        if self._nflog_task is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self._nflog_task, 5)
        self.uplink.close()
        if self.records is not None:
            await self.records.flush()

    def is_host_address(self, address: str) -> bool:
        """One of the daemon's own namespace's addresses (listed at start, refreshed in the
        background at most every 10 s: with a sandbox's veth each, a host's list is long)."""
        now = time.monotonic()
        if now - self._host_addrs_at > 10:
            self._host_addrs_at = now
            threading.Thread(target=self._list_host_addrs, name="host-addrs",
                             daemon=True).start()
        return address in self._host_addrs

    def _list_host_addrs(self) -> None:
        # getifaddrs(3) through psutil (a link-local IPv6 address comes as "fe80::1%eth0")
        try:
            self._host_addrs = {a.address.partition("%")[0]
                                for addrs in psutil.net_if_addrs().values() for a in addrs
                                if a.family in (socket.AF_INET, socket.AF_INET6)}
        except Exception:
            log.exception("listing the host's addresses failed")

    # -- sandboxes -----------------------------------------------------------------------
    def lookup(self, address: str) -> tuple[str, Policy] | None:
        a = self.by_addr.get(address)
        return (a.sid, a.policy) if a is not None else None

    async def attach(self, sid: str, policy: Policy) -> ns.Slot:
        slot = await self.pool.take()
        try:
            await ns.in_thread(firewall.add_interface, self.names, slot.host_if,
                                    slot.address, policy.mode != "off")
        except BaseException:
            await ns.destroy_async(slot)
            self.addresses.release(slot.index)
            raise
        self._register(Attached(sid, slot, policy))
        return slot

    async def adopt(self, sid: str, index: int, policy: Policy) -> bool:
        """A live sandbox's namespace after a daemon restart: back into the table."""
        slot = self.addresses.slot(index)
        if not os.path.exists(slot.netns_path):
            return False
        self.addresses.used.add(index)
        await ns.in_thread(firewall.add_interface, self.names, slot.host_if,
                                slot.address, policy.mode != "off")
        self._register(Attached(sid, slot, policy))
        return True

    def _register(self, a: Attached) -> None:
        self.by_sid[a.sid] = a
        self.by_addr[a.slot.address] = a

    def detach_later(self, sid: str) -> None:
        """Detach now (the sandbox is out of the proxy's and resolver's tables, its
        connections end), remove its namespace in the background: a kill's bound covers the
        sandbox, not the namespace's removal, which contends for the kernel's rtnl lock with
        every other. (A restore right after attaches a new namespace meanwhile.)"""
        a = self.by_sid.pop(sid, None)
        if a is None:
            return
        self.by_addr.pop(a.slot.address, None)
        self.proxy.close_sandbox(sid)
        t = asyncio.get_running_loop().create_task(self._teardown(a.slot))
        self._detaching.add(t)
        t.add_done_callback(self._detaching.discard)

    async def detach(self, sid: str) -> None:
        a = self.by_sid.pop(sid, None)
        if a is None:
            return
        self.by_addr.pop(a.slot.address, None)
        self.proxy.close_sandbox(sid)
        # to the end even if our caller is cancelled: half a teardown leaks a namespace
        await asyncio.shield(self._teardown(a.slot))

    async def _teardown(self, slot: ns.Slot) -> None:
        try:
            await ns.in_thread(firewall.remove_interface, self.names, slot.host_if,
                                    slot.address)
            await ns.destroy_async(slot)  # (its name free again before the slot is)
        finally:
            self.addresses.release(slot.index)

    async def update(self, sid: str, policy: Policy) -> None:
        a = self.by_sid.get(sid)
        if a is None:
            return
        if (a.policy.mode == "off") != (policy.mode == "off"):
            await ns.in_thread(firewall.set_egress, self.names, a.slot.host_if,
                                    policy.mode != "off")
        a.policy = policy

    async def remove_strays(self) -> int:
        """Namespaces of ours that no sandbox holds (a daemon that died before it could
        remove them); after reconcile has adopted the live ones."""
        held = ({a.slot.index for a in self.by_sid.values()}
                | {s.index for s in self.pool.ready} | set(self.addresses.used))
        n = 0
        for index in ns.existing(self.tag):
            if index not in held:
                await ns.destroy_async(self.addresses.slot(index))
                n += 1
        return n

    def _dropped(self, d: Dropped) -> None:
        """A packet the firewall refused (NFLOG): recorded against the sandbox whose
        interface it came in on; repeats of one (sandbox, protocol, destination, port)
        within a second are counted into the next record, not each written."""
        a = None
        pre = ns.host_if_prefix(self.tag)
        if d.indev_name and d.indev_name.startswith(pre) and d.indev_name[len(pre):].isdigit():
            slot = self.addresses.slot(int(d.indev_name[len(pre):]))
            a = self.by_addr.get(slot.address)
        if a is None:
            a = self.by_addr.get(d.src)
        if a is None:
            return
        key = (a.sid, d.protocol, d.dst, d.dport)
        now = time.monotonic()
        st = self._drops.get(key)
        if st is not None and now - st[0] < 1.0:
            st[1] += 1
            return
        repeats = int(st[1]) if st else 0
        if len(self._drops) > 4096:
            self._drops.clear()
        self._drops[key] = [now, 0]
        why = {"cpuos in": "refused by the firewall (only the proxy and resolver serve "
                          "sandboxes)", "cpuos fwd": "refused by the firewall (no routing)",
               "cpuos v6": "IPv6 is not routed", "cpuos spoof": "spoofed source address"}
        rec: dict[str, Any] = {"proto": d.protocol, "dst": d.dst, "port": d.dport,
                               "verdict": "denied",
                               "rule": why.get(d.prefix.strip(), d.prefix.strip())}
        if repeats:
            rec["repeats_before"] = repeats
        self.record(a.sid, **rec)

    def record(self, sid: str, **fields: Any) -> None:
        fields.setdefault("time", time.time())
        try:
            self.taps.get(sid, self.sink)(sid, fields)
        except Exception:
            log.exception("recording a connection of %s failed", sid)
