"""Where the daemon is and which key to use.

``CPUOS_API_URL`` / ``CPUOS_API_KEY``; with no key set, the local daemon's
``$CPUOS_HOME/admin.key`` (default /var/lib/cpuos/admin.key) when it is readable,
so the SDK just works on the machine that runs the daemon.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path

from ._errors import AuthError

DEFAULT_URL = "http://127.0.0.1:7770"


def resolve(api_url: str | None = None, api_key: str | None = None) -> tuple[str, str]:
    url = api_url or os.environ.get("CPUOS_API_URL") or DEFAULT_URL
    key = api_key or os.environ.get("CPUOS_API_KEY")
    if not key:
        p = Path(os.environ.get("CPUOS_HOME", "/var/lib/cpuos")) / "admin.key"
        try:
            key = p.read_text().strip()
        except OSError:
            raise AuthError(
                "no API key: set CPUOS_API_KEY (or run where the daemon's admin.key is readable)"
            ) from None
    return url.rstrip("/"), key


_TLS: ssl.SSLContext | None = None


def tls_context() -> ssl.SSLContext:
    """One verifying TLS context per process (making one costs ~20 ms). Plain http URLs
    (the local daemon) need none at all."""
    global _TLS
    if _TLS is None:
        _TLS = ssl.create_default_context()
    return _TLS
