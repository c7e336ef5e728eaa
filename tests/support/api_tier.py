"""An API process (``cpuosd.cluster.api``) in process, over a store the test made, whose
nodes answer as an ``httpx.MockTransport`` handler says (tests/unit: the forwarder's
routing, forks and route cache without node processes)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import httpx
from starlette.testclient import TestClient

from cpuosd.cluster.api import Forwarder, create_api_app
from cpuosd.cluster.preview import PreviewRelay
from cpuosd.config import Config
from cpuosd.store import Store
from cpuosd.wiring import ApiServices


@contextlib.contextmanager
def api_client(cfg: Config, store: Store, key: str,
               handler: Callable[[httpx.Request], httpx.Response],
               calls: list[httpx.Request]) -> Iterator[TestClient]:
    """A client of the API process's app, authorized with ``key``; every request a node is
    sent is appended to ``calls``, then answered by ``handler``. The forwarder is not
    started (no refresh loop: its view of the nodes is the store's at this moment)."""
    def record(r: httpx.Request) -> httpx.Response:
        calls.append(r)
        return handler(r)

    fwd = Forwarder(cfg, store)
    fwd.view.refresh()  # type: ignore[union-attr]
    fwd.transport = httpx.MockTransport(record)
    fwd.http = httpx.AsyncClient(transport=fwd.transport)
    svc = ApiServices(cfg=cfg, store=store, forwarder=fwd,
                      preview=PreviewRelay(fwd, 0, "127.0.0.1", cfg.preview),
                      _stack=contextlib.AsyncExitStack())
    with TestClient(create_api_app(cfg, svc)) as c:
        c.headers["Authorization"] = f"Bearer {key}"
        yield c
