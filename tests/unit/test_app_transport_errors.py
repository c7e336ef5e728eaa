"""A failure of the agent channel raised by a route before its answer starts (the agent
gone, or not answering) reaches the client as 503 ``unavailable`` / 504 ``timeout``, not
as a 500 ``internal`` (``create_app``'s TransportError handler)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from cpuosd.agentconn import AgentGone, AgentTimeout, TransportError
from cpuosd.api.app import create_app
from cpuosd.config import Config
from cpuosd.store import SqliteStore


@pytest.mark.parametrize("exc, status, code", [
    (AgentGone("sandbox agent is not connected"), 503, "unavailable"),
    (AgentTimeout("sandbox agent did not answer 'stat'"), 504, "timeout"),
])
def test_transport_errors_map_to_their_status(tmp_path: Path, exc: TransportError,
                                              status: int, code: str) -> None:
    store = SqliteStore(tmp_path / "cpuos.db")
    key = store.add_key(store.create_workspace("default"), "admin")
    app = create_app(Config(home=tmp_path))
    app.state.services = SimpleNamespace(store=store)  # (the Guard's key lookup only)

    async def failing() -> None:
        raise exc

    app.add_api_route("/test-transport-error", failing)

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as c:
            return await c.get("/test-transport-error",
                               headers={"Authorization": f"Bearer {key}"})

    r = asyncio.run(go())
    store.close()
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert r.json()["error"]["message"] == exc.message
