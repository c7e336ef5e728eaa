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
"""

from __future__ import annotations

import datetime
import json
import os
import re
import secrets
import ssl
import tempfile
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ..errors import invalid

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


class SecretStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o700)
        self._leaf: dict[tuple[str, str], ssl.SSLContext] = {}

    def _write(self, name: str, data: dict[str, Any]) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.root)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.root / f"{name}.json")

    def _read(self, name: str) -> dict[str, Any] | None:
        try:
            d: dict[str, Any] = json.loads((self.root / f"{name}.json").read_text())
            return d
        except (OSError, ValueError):
            return None

    # -- values ------------------------------------------------------------------------
    def add(self, request: Any) -> tuple[dict[str, str], dict[str, dict[str, Any]], str]:
        """Store a create request's ``secrets``; returns (environment with placeholders,
        the policy's view {name: {placeholder, hosts}}, the sandbox's CA id)."""
        if not isinstance(request, dict) or len(request) > MAX_SECRETS:
            raise invalid(f"secrets must be an object of at most {MAX_SECRETS} entries",
                          field="secrets")
        env: dict[str, str] = {}
        view: dict[str, dict[str, Any]] = {}
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
            self._write(token, {"value": value})
            env[name] = token
            view[name] = {"placeholder": token, "hosts": [h.lower() for h in hosts]}
        ca = self.new_ca()
        env.update(self.ca_env())
        return env, view, ca

    def value(self, token: str) -> str | None:
        if not TOKEN_RE.fullmatch(token):
            return None
        d = self._read(token)
        v = d.get("value") if d else None
        return v if isinstance(v, str) else None

    def forget(self, names: list[str]) -> None:
        for n in names:
            if TOKEN_RE.fullmatch(n) or CA_RE.fullmatch(n):
                (self.root / f"{n}.json").unlink(missing_ok=True)
                self._leaf = {k: v for k, v in self._leaf.items() if k[0] != n}

    def known(self) -> list[str]:
        return [p.stem for p in self.root.glob("*.json")]

    # -- the sandbox's CA ---------------------------------------------------------------
    @staticmethod
    def ca_env() -> dict[str, str]:
        bundle = f"{SANDBOX_CA_DIR}/ca-bundle.pem"
        return {**{k: bundle for k in CA_ENV}, "NODE_EXTRA_CA_CERTS": f"{SANDBOX_CA_DIR}/ca.pem"}

    def new_ca(self) -> str:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cpuos sandbox egress CA")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=30))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(False, False, False, False, False, True, True,
                                             False, False), critical=True)
                .sign(key, hashes.SHA256()))
        ca_id = f"ca-{secrets.token_hex(12)}"
        self._write(ca_id, {
            "key": key.private_bytes(serialization.Encoding.PEM,
                                     serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()).decode(),
            "cert": cert.public_bytes(serialization.Encoding.PEM).decode()})
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
        ca_key = serialization.load_pem_private_key(d["key"].encode(), None)
        ca_cert = x509.load_pem_x509_certificate(d["cert"].encode())
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
                .issuer_name(ca_cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=7))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        with tempfile.TemporaryDirectory(dir=self.root) as tmp:
            cp, kp = Path(tmp, "c.pem"), Path(tmp, "k.pem")
            cp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
            kp.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                             serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption()))
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
