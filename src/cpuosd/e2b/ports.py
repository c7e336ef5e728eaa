"""The preview proxy's rule for sandboxes made on the E2B surface (``Preview.route``).

E2B's semantics: ``get_host(port)`` is ``<port>-<id>.<domain>`` and every port of a sandbox
is reachable there without a token, unless the sandbox was created with
``network.allowPublicTraffic: false`` (then the ``e2b-traffic-access-token`` header must carry
its traffic token). cpuos's own token rules stay for every other sandbox and for cpuos's
API. envd (49983) and the code interpreter (49999) in the host form (``E2B_DOMAIN``) are
handed to the daemon's listener with the routing headers the header form uses, so both
forms reach the same code and the same access-token check."""

from __future__ import annotations

from typing import Any

from ..network.preview import Route
from .state import E2B, ENVD_PORT, JUPYTER_PORT

ROUTING = frozenset({b"e2b-sandbox-id", b"e2b-sandbox-port", b"x-cpuos-node-token"})


def router(e2b: E2B, api: tuple[str, int], api_headers: tuple[tuple[bytes, bytes], ...] = ()
           ) -> Any:
    """``api_headers``: what a request handed to the daemon's listener also carries (a
    node's token, --role=node)."""
    def route(row: Any, port: int, hdr: dict[bytes, bytes]) -> Route | tuple[int, str] | None:
        public = e2b.public_ports(row.id, row)
        if public is None and port not in (ENVD_PORT, JUPYTER_PORT):
            return None  # not an E2B sandbox: cpuos's rules
        if port in (ENVD_PORT, JUPYTER_PORT):
            # (the listener checks the sandbox's access token)
            return Route(upstream=api, drop=ROUTING,
                         add=((b"E2b-Sandbox-Id", row.id.encode()),
                              (b"E2b-Sandbox-Port", str(port).encode()), *api_headers))
        if not public:
            given = hdr.get(b"e2b-traffic-access-token", b"").decode("latin-1")
            if not e2b.check_token(row.id, given, "traffic"):
                return 403, ("this sandbox's ports need its traffic token "
                             "(e2b-traffic-access-token)")
        return Route(drop=frozenset({b"e2b-traffic-access-token"}))
    return route
