"""An API process (``cpuosd.cluster.api``) in process, over a store the test made, whose
nodes answer as an ``httpx.MockTransport`` handler says (tests/unit: the forwarder's
routing, forks and route cache without node processes)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import httpx
from starlette.testclient import TestClient

from cpuosd.cluster.api import Forwarder, create_api_app
from cpuosd.cluster.preview import PreviewRelay
from cpuosd.config import Config
from cpuosd.store import Store
from cpuosd.wiring import ApiServices


def api_services(cfg: Config, store: Store, node: Callable[[httpx.Request], Any]
                 ) -> ApiServices:
    """The API process's services over ``store``, its nodes answered by the
    ``httpx.MockTransport`` handler ``node`` (sync or async). The forwarder is not started
    (no refresh loop: its view of the nodes is the store's at this moment)."""
    fwd = Forwarder(cfg, store)
    fwd.view.refresh()  # type: ignore[union-attr]
    fwd.transport = httpx.MockTransport(node)
    fwd.http = httpx.AsyncClient(transport=fwd.transport)
    return ApiServices(cfg=cfg, store=store, forwarder=fwd,
                       preview=PreviewRelay(fwd, 0, "127.0.0.1", cfg.preview),
                       _stack=contextlib.AsyncExitStack())


@contextlib.contextmanager
def api_client(cfg: Config, store: Store, key: str,
               handler: Callable[[httpx.Request], httpx.Response],
               calls: list[httpx.Request]) -> Iterator[TestClient]:
    """A client of the API process's app, authorized with ``key``; every request a node is
    sent is appended to ``calls``, then answered by ``handler`` (``api_services``)."""
    def record(r: httpx.Request) -> httpx.Response:
        calls.append(r)
        return handler(r)

    with TestClient(create_api_app(cfg, api_services(cfg, store, record))) as c:
        c.headers["Authorization"] = f"Bearer {key}"
        yield c
