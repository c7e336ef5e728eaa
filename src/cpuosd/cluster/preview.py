"""``--role=api``'s preview listener: preview URLs of every node at one address
(docs/DEPLOY.md).

An API process listens on its preview port (``CPUOS_PREVIEW_PORT``, default its API port
+ 1, the same variables as a node's or one host's preview listener) and relays each
request to the preview listener of the node holding the sandbox, which serves it as one
host would: the preview token (query, header or cookie), the path form's rules, a paused
sandbox woken, the E2B surface's port rules. Nothing is decided here that the node would
decide: the request reaches the node with its Host, path, query, token and cookies as the
client sent them (only hop-by-hop headers, the node token header a client might send and
nothing else dropped; ``X-Forwarded-For`` extended with the client's address).

Routing, per request (also the second and later ones on a kept-alive connection, issue
25): the sandbox id and port from the Host (``<port>-<id>.<CPUOS_PREVIEW_DOMAIN>``) or the
path (``/sandboxes/<id>/ports/<port>/``), parsed exactly as the node parses them
(``cpuosd.network.preview``); its row in the store names the node (the forwarder's
``_target``): a sandbox paused into the snapshot store (on no node) goes to the node
placement picks, which resumes it as the request wakes it. Unknown sandbox: 404; the
node not alive, or not answering: 503. The node's preview address is in its registration
facts (``preview_address``: the host of CPUOS_NODE_ADDRESS and the node's preview port).

The connection handling (bounds on connections, heads, time; h11 per request; answers and
upgrades relayed as they come) is the node's own proxy's (``Preview``), which this class
extends: it has no manager and no sandboxes, and overrides only the routing of a request
(``_exchange``), the one place the proxy touches them.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import h11

from ..config import PreviewConfig
from ..errors import ApiError
from ..network.preview import HOP_HEADERS, Head, Preview, _Client, _reply, parse_head
from .nodes import TOKEN_HEADER

if TYPE_CHECKING:
    from .api import Forwarder

# what a client's request never carries on to the node (besides hop-by-hop headers)
RELAY_DROP = frozenset({TOKEN_HEADER.encode(), b"proxy-authorization"})


class PreviewRelay(Preview):
    """The API tier's preview proxy (see the module's doc)."""

    def __init__(self, fwd: Forwarder, port: int, host: str = "127.0.0.1",
                 cfg: PreviewConfig | None = None) -> None:
        # (Preview.__init__ wants a manager: this relay has none; see the module's doc)
        self._listener(port, host, cfg)
        self.fwd = fwd

    def urls(self, sid: str, port: int) -> dict[str, str]:  # (no sandboxes here)
        raise NotImplementedError

    def _node_for(self, sid: str) -> tuple[str, int] | tuple[int, str]:
        """The preview listener (host, port) of the node for sid, or an answer (status,
        message): 404 unknown, 503 its node not alive or serving no previews."""
        fwd = self.fwd
        row = fwd.store.get_sandbox(sid)
        if row is None:
            return 404, f"no sandbox {sid}"
        try:
            node = fwd._target("GET", f"/sandboxes/{sid}", (row.id, row.node_id))
        except ApiError as e:
            return e.status, e.message
        addr = str(node.facts.get("preview_address") or "")
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            return 503, f"node {node.node_id} serves no previews (no preview address)"
        return host.strip("[]"), int(port)

    async def _exchange(self, c: _Client, req: h11.Request) -> bool:
        head = parse_head(req, self.domain)  # (exactly as the node will parse it)
        if not isinstance(head, Head):
            return await _reply(c.writer, *head)
        headers, lower, sid, port = head.headers, head.lower, head.sid, head.port
        found = await asyncio.to_thread(self._node_for, sid)
        if isinstance(found[0], int):
            status, msg = found
            assert isinstance(msg, str)
            return await _reply(c.writer, status, msg)
        addr, to_port = found
        assert isinstance(addr, str) and isinstance(to_port, int)
        conn_tokens = {t.strip() for k, v in lower if k == b"connection"
                       for t in v.lower().split(b",")}
        upgrade_to = next((v for k, v in lower if k == b"upgrade"), None)
        upgrade = b"upgrade" in conn_tokens and upgrade_to is not None
        up = c.up
        if up is None or (up.sid, up.port, up.addr) != (sid, port, addr):
            up = await self._upstream(c, sid, port, addr, to_port,
                                      (503, f"the node holding {sid} did not answer"))
            if up is None:
                return False
        out: list[tuple[bytes, bytes]] = []
        xff = b""
        for k, v in headers:
            lk = k.lower()
            if lk in HOP_HEADERS or lk in conn_tokens or lk in RELAY_DROP:
                continue
            if lk == b"x-forwarded-for":
                xff = v + b", "
                continue
            out.append((k, v))
        if upgrade and upgrade_to is not None:
            out += [(b"Connection", b"upgrade"), (b"Upgrade", upgrade_to)]
        out.append((b"X-Forwarded-For", xff + c.ip.encode()))
        # (form "relay": the node's answer as it is, its headers already made for the
        # client: Set-Cookie host-only, the path form's CSP)
        return await self._send(c, up, req.method, req.target, out, "relay", upgrade)
