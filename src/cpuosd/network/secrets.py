"""Secrets that never enter a sandbox.

``Sandbox.create(..., secrets={"OPENAI_API_KEY": {"value": "sk-...", "hosts":
["api.openai.com"]}})``: the sandbox's environment gets a placeholder
(``cpuos-secret-<24 hex>``), the value stays on the host (``$CPUOS_HOME/secrets``, 0600,
root only), and the egress proxy puts the value in place of the placeholder in the *headers*
of HTTP requests to those hosts, and nowhere else. For HTTPS the proxy terminates TLS for
those hosts with a certificate from a CA of the sandbox's own (EC P-256, made with
``cryptography``), which the sandbox trusts through a CA bundle the daemon places at
/run/cpuos/ca-bundle.pem (the template's bundle plus that CA) and the usual variables
(SSL_CERT_FILE, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE, NODE_EXTRA_CA_CERTS, GIT_SSL_CAINFO,
PIP_CERT). The value is in no API answer, no record, no log line, no snapshot.

Where they are kept (``SecretStore``'s backend): on one host (SQLite) files under
``$CPUOS_HOME/secrets`` (``FileBackend``); with a shared database (Postgres, many hosts) its
``secrets`` table, every value and every CA's private key sealed with AES-256-GCM under the
cluster's secrets key (``CPUOS_SECRETS_KEY_FILE``, the same file on every node:
``SealedBackend``, ``Sealer``), so that a sandbox resumed or forked on another node has
them there. Each row carries the id of the key that sealed it (rotation: the file's first
key seals, the others still open; ``Sealer.rewrap``); the row's name is the cipher's
associated data, so a row copied under another name does not open.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import secrets
import ssl
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import ApiError, invalid

if TYPE_CHECKING:
    from ..store import Store

log = logging.getLogger("cpuosd.network.secrets")

TOKEN_RE = re.compile(r"^cpuos-secret-[0-9a-f]{24}$")
CA_RE = re.compile(r"^ca-[0-9a-f]{24}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
MAX_SECRETS = 32
MAX_VALUE = 16 * 1024
SANDBOX_CA_DIR = "/run/cpuos"
CA_ENV = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO", "PIP_CERT")


def stored_names(policy: dict[str, Any] | None) -> set[str]:
    """What a stored policy keeps in the secret store: its placeholders and its CA."""
    p = policy or {}
    out = {str(s.get("placeholder")) for s in (p.get("secrets") or {}).values()
           if isinstance(s, dict) and s.get("placeholder")}
    if p.get("ca"):
        out.add(str(p["ca"]))
    return out


class SecretKeyError(Exception):
    """A sealed secret that cannot be opened (a key this node does not hold, a tampered or
    misplaced row), or a secrets key file that is not one. The message names the row and
    the key id, never a value."""


KEY_BYTES = 32  # AES-256
NONCE_BYTES = 12


def key_id(key: bytes) -> str:
    """A key's public name (stored with each row it sealed): a hash of it, not the key."""
    return hashlib.sha256(b"cpuos secrets key id\0" + key).hexdigest()[:16]


def load_keys(path: Path) -> list[bytes]:
    """The secrets keys of ``path``: one key a line, 64 hex digits (32 random bytes:
    ``openssl rand -hex 32``), ``#`` comments and blank lines skipped; the first seals,
    every one opens (rotation)."""
    try:
        text = path.read_text()
    except OSError as e:
        raise SecretKeyError(f"the secrets key file {path} cannot be read: "
                             f"{e.strerror or e}") from None
    keys = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            k = bytes.fromhex(line)
        except ValueError:
            k = b""
        if len(k) != KEY_BYTES:
            raise SecretKeyError(f"the secrets key file {path}, line {n}: not a key "
                                 f"({2 * KEY_BYTES} hex digits)")
        keys.append(k)
    if not keys:
        raise SecretKeyError(f"the secrets key file {path} holds no key")
    return keys


class Sealer:
    """AES-256-GCM under the cluster's secrets keys: ``seal`` with the first, ``open`` with
    the one a row names; the row's name is the associated data."""

    def __init__(self, keys: list[bytes]) -> None:
        if not keys or any(len(k) != KEY_BYTES for k in keys):
            raise SecretKeyError(f"a secrets key is {KEY_BYTES} bytes")
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # (cluster only)

        self.keys = {key_id(k): AESGCM(k) for k in keys}
        self.current = key_id(keys[0])

    def seal(self, name: str, plain: bytes) -> tuple[str, str]:
        """(key id, base64 of nonce + ciphertext with its tag)."""
        nonce = os.urandom(NONCE_BYTES)
        ct = self.keys[self.current].encrypt(nonce, plain, name.encode())
        return self.current, base64.b64encode(nonce + ct).decode()

    def open(self, name: str, kid: str, data: str) -> bytes:
        from cryptography.exceptions import InvalidTag

        aead = self.keys.get(kid)
        if aead is None:
            raise SecretKeyError(f"secret {name} is sealed under key {kid}, which this node "
                                 f"does not hold (CPUOS_SECRETS_KEY_FILE: {sorted(self.keys)})")
        try:
            raw = base64.b64decode(data, validate=True)
            if len(raw) < NONCE_BYTES + 16:
                raise ValueError("short")
            return self.keys[kid].decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], name.encode())
        except (InvalidTag, ValueError):
            raise SecretKeyError(f"secret {name} does not open under key {kid}: the row "
                                 "was altered (or sealed under another key of that id)") \
                from None


class SealedRows(Protocol):
    """Where a ``SealedBackend`` keeps its rows (cpuosd.store.base.Store's secrets)."""

    def put_secret(self, name: str, key_id: str, data: str) -> None: ...
    def get_secret(self, name: str) -> tuple[str, str] | None: ...
    def delete_secrets(self, names: list[str]) -> None: ...
    def secret_names(self, *, not_key: str | None = None) -> list[str]: ...


class Backend(Protocol):
    def write(self, name: str, data: dict[str, Any]) -> None: ...
    def read(self, name: str) -> dict[str, Any] | None: ...
    def delete(self, name: str) -> None: ...
    def names(self) -> list[str]: ...


class FileBackend:
    """One host: a file each under the secrets directory (0600, root only)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def write(self, name: str, data: dict[str, Any]) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.root)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.root / f"{name}.json")

    def read(self, name: str) -> dict[str, Any] | None:
        try:
            d: dict[str, Any] = json.loads((self.root / f"{name}.json").read_text())
            return d
        except (OSError, ValueError):
            return None

    def delete(self, name: str) -> None:
        (self.root / f"{name}.json").unlink(missing_ok=True)

    def names(self) -> list[str]:
        return [p.stem for p in self.root.glob("*.json")]


class SealedBackend:
    """Many hosts: rows of the shared database, sealed (``Sealer``). Without a key
    (``sealer`` None) nothing can be written (a create with secrets is refused, naming
    CPUOS_SECRETS_KEY_FILE) and nothing read (logged: the placeholder goes out as it is)."""

    def __init__(self, rows: SealedRows, sealer: Sealer | None) -> None:
        self.rows, self.sealer = rows, sealer

    def write(self, name: str, data: dict[str, Any]) -> None:
        if self.sealer is None:
            raise ApiError("unavailable", "secrets need the cluster's secrets key on this "
                           "node (CPUOS_SECRETS_KEY_FILE), which it does not have",
                           {"field": "secrets"})
        kid, sealed = self.sealer.seal(name, json.dumps(data).encode())
        self.rows.put_secret(name, kid, sealed)

    def read(self, name: str) -> dict[str, Any] | None:
        row = self.rows.get_secret(name)
        if row is None:
            return None
        if self.sealer is None:
            log.error("secret %s: this node has no secrets key (CPUOS_SECRETS_KEY_FILE)", name)
            return None
        try:
            d: dict[str, Any] = json.loads(self.sealer.open(name, *row))
            return d
        except (SecretKeyError, ValueError) as e:
            log.error("%s", e)
            return None

    def delete(self, name: str) -> None:
        self.rows.delete_secrets([name])

    def names(self) -> list[str]:
        return self.rows.secret_names()

    def rewrap(self) -> int:
        """Seal again under the current key every row sealed under another key this node
        holds (after a rotation: a new first key in the file); rows under keys it does not
        hold are left (logged). Returns how many were sealed again."""
        if self.sealer is None:
            return 0
        n = 0
        for name in self.rows.secret_names(not_key=self.sealer.current):
            row = self.rows.get_secret(name)
            if row is None or row[0] == self.sealer.current:
                continue
            try:
                plain = self.sealer.open(name, *row)
            except SecretKeyError as e:
                log.warning("%s", e)
                continue
            self.rows.put_secret(name, *self.sealer.seal(name, plain))
            n += 1
        return n


def unused(store: Store, sids: list[str]) -> list[str]:
    """The stored names (placeholders, CAs) of the sandboxes ``sids`` that no live sandbox
    uses any more (a fork shares its parent's; on many hosts: any node's)."""
    from ..store.base import LIVE_STATES

    mine: set[str] = set()
    for sid in sids:
        row = store.get_sandbox(sid)
        mine |= stored_names(row.spec.network if row else None)
    if not mine:
        return []
    for other in store.list_sandboxes(None, LIVE_STATES):
        mine -= stored_names(other.spec.network)
    return sorted(mine)


class SecretStore:
    def __init__(self, root: Path, backend: Backend | None = None) -> None:
        self.root = root  # (also where the leaf certificates are written to load them)
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o700)
        self.backend: Backend = backend or FileBackend(root)
        self._leaf: dict[tuple[str, str], ssl.SSLContext] = {}

    def _write(self, name: str, data: dict[str, Any]) -> None:
        self.backend.write(name, data)

    def _read(self, name: str) -> dict[str, Any] | None:
        return self.backend.read(name)

    # -- values ------------------------------------------------------------------------
    def add(self, request: Any) -> tuple[dict[str, str], dict[str, dict[str, Any]], str]:
        """Store a create request's ``secrets``; returns (environment with placeholders,
        the policy's view {name: {placeholder, hosts}}, the sandbox's CA id)."""
        if not isinstance(request, dict) or len(request) > MAX_SECRETS:
            raise invalid(f"secrets must be an object of at most {MAX_SECRETS} entries",
                          field="secrets")
        env: dict[str, str] = {}
        view: dict[str, dict[str, Any]] = {}
        try:
            self._add(request, env, view)
            ca = self.new_ca()
        except BaseException:  # (what was written before a refusal goes again)
            self.forget([v["placeholder"] for v in view.values()])
            raise
        env.update(self.ca_env())
        return env, view, ca

    def _add(self, request: dict[Any, Any], env: dict[str, str],
             view: dict[str, dict[str, Any]]) -> None:
        for name, spec in request.items():
            if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
                raise invalid(f"secret name {str(name)[:60]!r} is not an environment "
                              "variable name", field="secrets")
            if not isinstance(spec, dict) or set(spec) - {"value", "hosts"}:
                raise invalid(f"secrets.{name} must be {{\"value\": ..., \"hosts\": [...]}}",
                              field="secrets")
            value, hosts = spec.get("value"), spec.get("hosts")
            if not isinstance(value, str) or not value or len(value) > MAX_VALUE \
                    or any(c in value for c in "\r\n\0"):
                raise invalid(f"secrets.{name}.value must be a one-line string of at most "
                              f"{MAX_VALUE} characters", field="secrets")
            from .policy import NAME_RE  # (names as in an allowlist)

            if not isinstance(hosts, list) or not hosts or len(hosts) > 32 or not all(
                    isinstance(h, str) and NAME_RE.fullmatch(h.lower()) for h in hosts):
                raise invalid(f"secrets.{name}.hosts must be a list of host names",
                              field="secrets")
            token = f"cpuos-secret-{secrets.token_hex(12)}"
            view[name] = {"placeholder": token, "hosts": [h.lower() for h in hosts]}
            self._write(token, {"value": value})
            env[name] = token

    def value(self, token: str) -> str | None:
        if not TOKEN_RE.fullmatch(token):
            return None
        d = self._read(token)
        v = d.get("value") if d else None
        return v if isinstance(v, str) else None

    def forget(self, names: list[str]) -> None:
        for n in names:
            if TOKEN_RE.fullmatch(n) or CA_RE.fullmatch(n):
                self.backend.delete(n)
                self._leaf = {k: v for k, v in self._leaf.items() if k[0] != n}

    def known(self) -> list[str]:
        return self.backend.names()

    # -- the sandbox's CA ---------------------------------------------------------------
    @staticmethod
    def ca_env() -> dict[str, str]:
        bundle = f"{SANDBOX_CA_DIR}/ca-bundle.pem"
        return {**{k: bundle for k in CA_ENV}, "NODE_EXTRA_CA_CERTS": f"{SANDBOX_CA_DIR}/ca.pem"}

    def new_ca(self) -> str:
        from .certs import new_ca

        key, cert = new_ca()
        ca_id = f"ca-{secrets.token_hex(12)}"
        self._write(ca_id, {"key": key, "cert": cert})
        return ca_id

    def ca_cert_pem(self, ca_id: str) -> str | None:
        d = self._read(ca_id) if CA_RE.fullmatch(ca_id) else None
        c = d.get("cert") if d else None
        return c if isinstance(c, str) else None

    def server_context(self, ca_id: str, host: str) -> ssl.SSLContext | None:
        """A TLS server context presenting a certificate for ``host`` from the sandbox's
        CA (cached)."""
        ctx = self._leaf.get((ca_id, host))
        if ctx is not None:
            return ctx
        d = self._read(ca_id) if CA_RE.fullmatch(ca_id) else None
        if not d:
            return None
        from .certs import leaf

        key, cert = leaf(d["key"], d["cert"], host)
        with tempfile.TemporaryDirectory(dir=self.root) as tmp:
            cp, kp = Path(tmp, "c.pem"), Path(tmp, "k.pem")
            cp.write_bytes(cert)
            kp.write_bytes(key)
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(cp, kp)
        ctx.set_alpn_protocols(["http/1.1"])
        if len(self._leaf) > 256:
            self._leaf.clear()
        self._leaf[(ca_id, host)] = ctx
        return ctx


# the headers a secret may be put into (credentials; never the request line, never a header
# a server is likely to echo back such as Origin, Referer or the Host)
CREDENTIAL_HEADERS = frozenset({b"authorization", b"proxy-authorization", b"x-api-key",
                                b"api-key", b"x-auth-token", b"x-goog-api-key"})


class Scrubber:
    """Server-to-client bytes with each secret value masked (the placeholder, cut or padded
    with '*' to the value's length: the answer's framing, its Content-Length, stays true),
    also across read boundaries (a tail that could begin a value waits for the next read).
    ``mask`` masks one whole piece (a header value)."""

    def __init__(self, replace: dict[bytes, bytes]) -> None:
        self.back = {v: (k + b"*" * len(v))[:len(v)] for k, v in replace.items() if v}
        self.buf = b""

    def mask(self, data: bytes) -> bytes:
        for value, ph in self.back.items():
            data = data.replace(value, ph)
        return data

    def feed(self, data: bytes) -> bytes:
        self.buf += data
        for value, ph in self.back.items():
            self.buf = self.buf.replace(value, ph)
        hold = self._partial()
        cut = len(self.buf) - hold
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out

    def _partial(self) -> int:
        """How many bytes at the end could begin a value (held back for the next read;
        nothing else is: an answer is never kept waiting)."""
        best = 0
        n = len(self.buf)
        for value in self.back:
            lo = max(0, n - len(value) + 1)
            i = self.buf.find(value[:1], lo)
            while i >= 0:
                if value.startswith(self.buf[i:]):
                    best = max(best, n - i)
                    break
                i = self.buf.find(value[:1], i + 1)
        return best

    def flush(self) -> bytes:
        out, self.buf = self.buf, b""
        return out
