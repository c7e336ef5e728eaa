"""AsyncWorkspace: the caller's workspace (its limits, what it holds, its usage and cost).
Written once; ``cpuos._sync.workspace`` is generated from this file."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from .sandbox import _AsyncHTTP


class AsyncWorkspace:
    """``AsyncWorkspace().usage()`` (this month), ``.usage(since="2026-12-01")``,
    ``.info()`` (limits, what its sandboxes hold, the host's room)."""

    def __init__(self, api_url: str | None = None, api_key: str | None = None) -> None:
        self._http = _AsyncHTTP(api_url, api_key)

    async def close(self) -> None:
        await self._http.close()

    async def __aenter__(self) -> AsyncWorkspace:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def info(self) -> dict[str, Any]:
        d: dict[str, Any] = await self._http.request("GET", "/workspace")
        return d

    async def usage(self, *, since: str | float | None = None, until: str | float | None = None,
                    sandbox: str | None = None) -> dict[str, Any]:
        """Usage between since and until (epoch seconds or ISO 8601; default this month):
        ``total`` and per-sandbox ``sandboxes`` (running_seconds, vcpu_seconds,
        memory_gib_seconds, paused_seconds, snapshot_gib_seconds, cost), the ``prices``
        and the ``spending_cap`` (cap, month_spent, reached)."""
        params = {k: str(v) for k, v in (("since", since), ("until", until),
                                          ("sandbox", sandbox)) if v is not None}
        d: dict[str, Any] = await self._http.request("GET", "/usage", params=params)
        return d

    async def metrics(self) -> list[dict[str, Any]]:
        """``Sandbox.metrics()`` of each running and paused sandbox, in one request."""
        d = await self._http.request("GET", "/metrics")
        return list(d["sandboxes"])
