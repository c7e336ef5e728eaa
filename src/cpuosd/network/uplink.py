"""Where sandbox traffic leaves the host: the sockets the egress proxy and the resolver open
towards the world. By default the daemon's own network namespace; ``CPUOS_UPLINK_NETNS``
names another one (tests lead it into a fake internet with no route off the machine). A
socket belongs to the namespace it was created in, so one thread, switched into the uplink
namespace once, creates them all.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import socket
from concurrent.futures import ThreadPoolExecutor

CLONE_NEWNET = 0x40000000


def _enter(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


class Uplink:
    def __init__(self, netns: str | None = None) -> None:
        self.netns = netns
        self._pool: ThreadPoolExecutor | None = None
        if self.netns:
            path = self.netns if "/" in self.netns else f"/var/run/netns/{self.netns}"
            if not os.path.exists(path):
                raise RuntimeError(f"CPUOS_UPLINK_NETNS: no network namespace {path}")
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="uplink",
                                            initializer=_enter, initargs=(path,))

    async def new_socket(self, family: int, type_: int) -> socket.socket:
        if self._pool is None:
            s = socket.socket(family, type_)
        else:
            s = await asyncio.get_running_loop().run_in_executor(
                self._pool, socket.socket, family, type_)
        s.setblocking(False)
        return s

    async def connect(self, host: str, port: int, timeout: float = 10.0) -> socket.socket:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        s = await self.new_socket(family, socket.SOCK_STREAM)
        try:
            async with asyncio.timeout(timeout):
                await asyncio.get_running_loop().sock_connect(s, (host, port))
        except BaseException:
            s.close()
            raise
        return s

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
