"""``sbx.audit``: the sandbox's audit trail (what was run, written, connected to, and what
happened to it), read from the daemon. Written once; ``cpuos._sync.audit`` is generated."""

from __future__ import annotations

import builtins
import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .sandbox import AsyncSandbox


def _params(kind: str | builtins.list[str] | None, since: float | None, until: float | None,
            after: int) -> dict[str, Any]:
    p: dict[str, Any] = {"after": after}
    if kind:
        p["kind"] = [kind] if isinstance(kind, str) else builtins.list(kind)
    if since is not None:
        p["since"] = since
    if until is not None:
        p["until"] = until
    return p


class AsyncAudit:
    """Rows are dicts: ``seq``, ``time``, ``kind`` (command | file_write | connection |
    lifecycle | limit | port | dropped), ``detail``, ``prev_hash``, ``hash``."""

    def __init__(self, sbx: AsyncSandbox) -> None:
        self._sbx = sbx

    async def list(self, *, kind: str | builtins.list[str] | None = None,
                   since: float | None = None, until: float | None = None, after: int = 0,
                   limit: int = 1000, wait: float = 0) -> builtins.list[dict[str, Any]]:
        """Rows oldest first; ``after``: only those after this seq; ``wait``: with none yet,
        wait up to this many seconds for one."""
        p = {**_params(kind, since, until, after), "limit": limit, "wait": wait}
        r = await self._sbx._http.request("GET", f"/sandboxes/{self._sbx.id}/audit", params=p)
        rows: builtins.list[dict[str, Any]] = r["rows"]
        return rows

    async def follow(self, *, kind: str | builtins.list[str] | None = None, after: int = 0,
                     timeout: float | None = None) -> AsyncIterator[dict[str, Any]]:
        """Rows as they are recorded (long polls), for ``timeout`` seconds or for ever."""
        end = None if timeout is None else time.monotonic() + timeout
        while end is None or time.monotonic() < end:
            wait = 10.0 if end is None else max(0.0, min(10.0, end - time.monotonic()))
            for row in await self.list(kind=kind, after=after, wait=wait):
                after = row["seq"]
                yield row

    async def export(self, *, kind: str | builtins.list[str] | None = None,
                     since: float | None = None, until: float | None = None
                     ) -> AsyncIterator[dict[str, Any]]:
        """Every row (the daemon's JSON-lines export, streamed)."""
        buf = b""
        async for chunk in self._sbx._http.stream(
                "GET", f"/sandboxes/{self._sbx.id}/audit/export",
                params=_params(kind, since, until, 0)):
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if line.strip():
                    yield json.loads(line)
        if buf.strip():
            yield json.loads(buf)

    async def verify(self) -> dict[str, Any]:
        """The daemon's check of the whole chain: ``ok``, ``rows``, ``problems`` (seq,
        sandbox, what is wrong), ``head`` (the newest row's seq and hash: keep it to find
        later deletions of the newest rows). With a key that is not the admin's, only
        ``ok``, ``problems`` and ``problem_count`` for this workspace's sandboxes (and the
        chain's own breaks), ``scope: "workspace"``."""
        out: dict[str, Any] = await self._sbx._http.request("GET", "/audit/verify")
        return out
