"""A fork fanned out across nodes (issue 24: "fork fans out the same way"), the API
process's half.

``POST /sandboxes/<id>/fork {n}`` through an API process, when the parent's node has a
shared snapshot store (its heartbeat's ``snapshot_store`` fact): placement
(``nodes.place_children``) gives each child a node with room, the parent's node first, then
the others in turn (a parent with secrets: only nodes holding the secrets key its values
and CA are sealed under in the shared database). If every child lands on the parent's node,
the request is forwarded as any other (the node-local fork, as on one host). Else:

1. the parent's node checkpoints the parent once, restores it, puts the image into the
   shared store under ``fork-<id>-<hex>`` and restores its own share of the children
   (``POST /sandboxes/<id>/fork/publish``, cpuosd.api.forks);
2. each other chosen node fetches the image once (bounded like a resume's download, checked
   against its host) and restores its children, each a row of that node with its own
   network identity and the parent's egress policy (``.../fork/restore``), all at once;
3. the image is deleted from the store (``.../fork/release``; what a crash leaves there is
   the orphan sweep's).

A step that fails kills every child already made (through its node) and answers the failing
node's error (a JSON 4xx/5xx; 503 ``unavailable`` when a node did not answer): a fork gives
all its children or none. The work goes on to its end (or its clean-up) if the caller goes
away meanwhile. The caller's Authorization goes with every call: each node checks the key,
the workspace and its quotas itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import TYPE_CHECKING, Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import ApiError
from ..network.secrets import stored_names
from .nodes import TOKEN_HEADER, NodeInfo, place_children
from ..lifecycle.states import State

if TYPE_CHECKING:
    from .api import Forwarder

log = logging.getLogger("cpuosd.cluster")

MAX_BODY = 4096  # bytes of a fork's JSON body ({"n": 2})


def _error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _answer(r: httpx.Response) -> Response:
    return Response(r.content, status_code=r.status_code, media_type="application/json")


async def refuse_internal(request: Request) -> Response:
    """The nodes' internal fork routes are not the public's."""
    return _error(ApiError("not_found", f"no route {request.url.path}"))


def _n_of(body: bytes) -> int | None:
    """The fork's n (default 1), or None when the body is not what the node accepts (the
    node then says why)."""
    try:
        d = json.loads(body or b"{}")
    except ValueError:
        return None
    if not isinstance(d, dict) or set(d) - {"n"}:
        return None
    n = d.get("n", 1)
    return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 16 else None


async def fork(fwd: Forwarder, request: Request) -> Response:
    """POST /sandboxes/{sid}/fork through an API process."""
    sid = request.path_params["sid"]
    ok, found = await asyncio.to_thread(fwd._route, request.scope["headers"], request.url.path)
    if not ok:
        return _error(ApiError("unauthorized", "missing or invalid API key"))
    size = request.headers.get("content-length", "")
    if not size.isdigit() or int(size) > MAX_BODY:
        return await fwd.http_forward(request)  # (the node answers what it answers)
    n = _n_of(await request.body())
    parent = fwd.view.get(found[1]) if found is not None and found[1] is not None else None
    if n is None or parent is None or not parent.alive or not parent.facts.get(
            "snapshot_store"):
        return await fwd.http_forward(request)  # one node's fork (or its error)
    row = await asyncio.to_thread(fwd.store.get_sandbox, sid)
    if row is None or row.state != State.RUNNING:
        return await fwd.http_forward(request)  # (the node says 404/409, or wakes it)
    # (a parent with secrets: its children go to nodes holding the secrets key, which
    # opens its values and CA in the shared database)
    plan = place_children(fwd.view.nodes, parent, n, int(row.spec.memory_mib or 0),
                          row.spec.template_digest,
                          secrets=bool(stored_names(row.spec.network)))
    if plan is None:
        return _error(ApiError("unavailable", f"no room for {n} children of {sid} on the "
                               "nodes that can restore them"))
    if all(x.node_id == parent.node_id for x in plan):
        return await fwd.http_forward(request)
    auth = [(k, v) for k, v in request.headers.items() if k.lower() == "authorization"]
    job = asyncio.ensure_future(_fan_out(fwd, sid, parent, plan, dict(auth)))
    # (shielded: a caller who goes away does not cut the fork in half; it ends whole, or
    # its clean-up runs)
    return await asyncio.shield(job)


async def _fan_out(fwd: Forwarder, sid: str, parent: NodeInfo, plan: list[NodeInfo],
                   auth: dict[str, str]) -> Response:
    headers = {**auth, TOKEN_HEADER: fwd.token}
    # each node bounds its own transfers (CPUOS_SNAPSHOT_TRANSFER_TIMEOUT + 1 s per 20 MiB)
    # and restores; this is the backstop for a node that stops answering
    bound = httpx.Timeout(10.0, read=2 * fwd.cfg.cluster.snapshot_transfer_timeout + 300.0)
    n_local = sum(1 for x in plan if x.node_id == parent.node_id)
    groups: dict[str, tuple[NodeInfo, int]] = {}
    for x in plan:
        if x.node_id != parent.node_id:
            groups[x.node_id] = (x, groups.get(x.node_id, (x, 0))[1] + 1)
    try:
        r = await fwd.http.post(f"http://{parent.address}/sandboxes/{sid}/fork/publish",
                                json={"n": n_local, "remote": len(plan) - n_local},
                                headers=headers, timeout=bound)
    except httpx.HTTPError as e:
        log.warning("fork of %s: node %s did not answer the publish: %s", sid,
                    parent.node_id, e)
        return _error(ApiError("unavailable", f"node {parent.node_id} did not answer"))
    if r.status_code != 201:
        return _answer(r)
    try:
        pub = r.json()
        key, size = str(pub["image"]), int(pub.get("bytes") or 0)
        made: list[tuple[NodeInfo, dict[str, Any]]] = [(parent, s) for s in
                                                       _children(pub)]
    except (ValueError, KeyError, TypeError):  # (not this API's node: nothing to undo)
        return _error(ApiError("unavailable", f"node {parent.node_id} answered the fork "
                               "with something else than a fork's answer"))
    failure: Response | None = None
    try:
        async def restore(node: NodeInfo, k: int) -> httpx.Response:
            return await fwd.http.post(
                f"http://{node.address}/sandboxes/{sid}/fork/restore",
                json={"image": key, "bytes": size, "n": k}, headers=headers, timeout=bound)

        answers = await asyncio.gather(*(restore(node, k) for node, k in groups.values()),
                                       return_exceptions=True)
        for (node, _), a in zip(groups.values(), answers, strict=True):
            if isinstance(a, httpx.Response) and a.status_code == 201:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    made += [(node, s) for s in _children(a.json())]
                    continue
                a = ApiError("unavailable", f"node {node.node_id} answered the fork's "
                             "restore with something else than a fork's answer")
            if isinstance(a, httpx.Response):
                log.warning("fork of %s: node %s answered %d: %s", sid, node.node_id,
                            a.status_code, a.text[:300])
                answer = _answer(a)
            else:
                log.warning("fork of %s: node %s failed to restore: %r", sid, node.node_id, a)
                answer = _error(a if isinstance(a, ApiError) else ApiError(
                    "unavailable", f"node {node.node_id} did not answer the fork's restore"))
            failure = failure or answer
        if failure is not None:
            await _kill_all(fwd, made, headers)
            return failure
    finally:
        try:
            await fwd.http.post(f"http://{parent.address}/sandboxes/{sid}/fork/release",
                                json={"image": key}, headers=headers, timeout=60.0)
        except httpx.HTTPError as e:  # (the orphan sweep removes it later)
            log.warning("fork of %s: image %s stays in the store: %s", sid, key, e)
    log.info("fork of %s: %d children on %s", sid, len(made),
             ", ".join(sorted({x.node_id for x, _ in made})))
    return JSONResponse({"sandboxes": [s for _, s in made]}, status_code=201)


def _children(answer: Any) -> list[dict[str, Any]]:
    """The children in a node's fork answer (each a sandbox's JSON with its id)."""
    out = answer["sandboxes"]
    if not isinstance(out, list) or not all(
            isinstance(c, dict) and isinstance(c.get("id"), str) for c in out):
        raise TypeError("not a list of sandboxes")
    return out


async def _kill_all(fwd: Forwarder, made: list[tuple[NodeInfo, dict[str, Any]]],
                    headers: dict[str, str]) -> None:
    """Every child of a failed fork, killed through its node."""
    async def kill(node: NodeInfo, child: dict[str, Any]) -> None:
        try:
            r = await fwd.http.delete(f"http://{node.address}/sandboxes/{child['id']}",
                                      headers=headers, timeout=60.0)
            if r.status_code >= 300 and r.status_code != 404:
                log.error("failed fork: child %s on %s not killed: %s", child["id"],
                          node.node_id, r.text[:300])
        except httpx.HTTPError as e:
            log.error("failed fork: child %s on %s not killed: %s", child["id"],
                      node.node_id, e)

    await asyncio.gather(*(kill(node, c) for node, c in made))
