"""What the E2B surface keeps of its own, beside cpuos's core: its per-sandbox access
tokens (derived, never stored: an HMAC of the sandbox id under a key only the daemon holds,
``$CPUOS_HOME/e2b.key``), the E2B-side facts of the sandboxes it created (the template name
asked for, whether their ports are public) in ``$CPUOS_HOME/e2b.db``, the template mapping,
the domain it hands out, and the target of a sandbox request (which sandbox, checked).

Everything else — lifecycle, limits, policy, audit, usage — is cpuos's, reached through the
Manager's public operations as the cpuos API reaches them."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..agentconn import TransportError
from ..errors import ApiError
from ..events import SandboxEvent
from ..paths import check_path
from ..store import SandboxRow, Store
from ..templates.builder import template_info
from ..lifecycle.states import ENDED, GONE, State

if TYPE_CHECKING:
    from ..config import Config
    from ..lifecycle.common import Live
    from ..lifecycle.manager import Manager

log = logging.getLogger("cpuosd.e2b")

ENVD_PORT = 49983
JUPYTER_PORT = 49999
# the envd version cpuos answers: the SDKs' modern behaviour (the server's default user,
# octet-stream uploads, close_stdin, entries in watch events); file metadata (0.6.2:
# xattrs) is refused by the server with a clear error
ENVD_VERSION = "0.6.4"
# s: a polled watcher asked this soon after a change made through this surface waits (at
# most this long) for that change's events
SETTLE = 1.0
HOME = "/home/user"
USER = "user"
KEY_RE = re.compile(r"^e2b_[0-9a-f]{40}$")
SID_RE = re.compile(r"^sbx-[a-z0-9]{12}$")


def new_e2b_key() -> str:
    """A key in E2B's format (the JS SDK checks ``^e2b_[0-9a-f]+$`` before any request)."""
    return "e2b_" + secrets.token_hex(20)


def parse_templates(spec: str) -> dict[str, list[str]]:
    """``CPUOS_E2B_TEMPLATES``: ``name=tpl[,fallback...];name2=...``."""
    out: dict[str, list[str]] = {}
    for part in spec.split(";"):
        name, _, targets = part.strip().partition("=")
        names = [t.strip() for t in targets.split(",") if t.strip()]
        if name.strip() and names:
            out[name.strip()] = names
    return out


class E2BError(Exception):
    """An answer of the E2B surface's own (control plane, plain envd routes):
    ``{"code": <status>, "message"}`` with that status."""

    def __init__(self, status: int, message: str, extra: dict[str, Any] | None = None
                 ) -> None:
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra or {}

    def body(self) -> dict[str, Any]:
        return {**self.extra, "code": self.status, "message": self.message}


def not_running(sid: str) -> E2BError:
    """What E2B's edge answers for an unknown or ended sandbox (the SDK reads the words
    'was not found' in it as SandboxNotRunningException)."""
    return E2BError(502, "The sandbox was not found", {"sandboxId": sid})


@dataclass
class Target:
    """The sandbox a request of the sandbox plane is for (token checked)."""
    e2b: E2B
    sid: str
    row: SandboxRow
    port: int

    @property
    def ws(self) -> str:
        return self.row.workspace_id

    async def ready(self) -> Live:
        """The running sandbox (cpuos's Manager.ready: the same checks as its own API)."""
        try:
            return await self.e2b.mgr.ready(self.ws, self.sid)
        except (ApiError, TransportError):
            row = self.e2b.store.get_sandbox(self.sid)
            if row is None or row.state in GONE:
                raise not_running(self.sid) from None
            raise

    def path(self, p: str, what: str = "path") -> str:
        """A path of the request: absolute, or relative to the user's home (E2B's rule)."""
        return check_path(p, what, cwd=HOME)


class E2B:
    """The E2B surface's state; attached to the daemon's core at start (``attach``)."""

    def __init__(self, cfg: Config, store: Store | None = None) -> None:
        """``store``: for an API process (many hosts), which finds the sandbox of a signed
        file URL (``signed_for``) and serves nothing else of the surface."""
        self.cfg = cfg
        self._key = self._load_key(cfg.e2b_key_path)
        self.templates = parse_templates(cfg.e2b.templates)
        self.domain_override = cfg.e2b.domain
        self._db_path = cfg.home / "e2b.db"
        self._db: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._mgr: Manager | None = None
        self._store: Store | None = store
        self.preview: Any = None
        # per sandbox: pid -> (cmd, args, envs, cwd, tag) of processes started here
        self.processes: dict[str, dict[int, dict[str, Any]]] = {}
        self._public: dict[str, bool] = {}
        # per sandbox: when a change went through this surface last (monotonic): a polled
        # watcher asked right after waits for its events (the agent coalesces for 50 ms)
        self.touched: dict[str, float] = {}
        self.on_end: list[Callable[[str], None]] = []
        self._unsubscribe: Callable[[], None] | None = None

    # -- wiring ---------------------------------------------------------------------------
    @staticmethod
    def _load_key(path: Path) -> bytes:
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            k = path.read_bytes().strip()
            if len(k) >= 64:
                return k
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        k = secrets.token_hex(32).encode()
        with os.fdopen(fd, "wb") as f:
            f.write(k + b"\n")
        return k

    def attach(self, mgr: Manager, store: Store, preview: Any) -> None:
        self._mgr, self._store, self.preview = mgr, store, preview
        self._db = sqlite3.connect(self._db_path, check_same_thread=False, isolation_level=None)
        os.chmod(self._db_path, 0o600)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS sandboxes (id TEXT PRIMARY KEY, "
                         "alias TEXT NOT NULL, public INTEGER NOT NULL, extra TEXT NOT NULL)")
        self._unsubscribe = mgr.events.subscribe(self._on_event)

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
        if self._db is not None:
            self._db.close()
            self._db = None

    @property
    def mgr(self) -> Manager:
        if self._mgr is None:
            raise ApiError("unavailable", "the daemon is starting")
        return self._mgr

    @property
    def store(self) -> Store:
        if self._store is None:
            raise ApiError("unavailable", "the daemon is starting")
        return self._store

    def _on_event(self, ev: SandboxEvent) -> None:
        if ev.kind not in ENDED:
            return
        self.processes.pop(ev.sandbox, None)
        self.touched.pop(ev.sandbox, None)
        self.forget(ev.sandbox)  # (an ended sandbox is a 404 on this surface)
        for fn in list(self.on_end):
            fn(ev.sandbox)

    # -- tokens ---------------------------------------------------------------------------
    def _token(self, kind: str, sid: str) -> str:
        return hmac.new(self._key, f"{kind}:{sid}".encode(), hashlib.sha256).hexdigest()

    def envd_token(self, sid: str) -> str:
        return self._token("envd", sid)

    def traffic_token(self, sid: str) -> str:
        return self._token("traffic", sid)

    def check_token(self, sid: str, given: str | None, kind: str = "envd") -> bool:
        return given is not None and hmac.compare_digest(
            given.encode("latin-1", "replace"), self._token(kind, sid).encode())

    def touch(self, sid: str) -> None:
        import time

        self.touched[sid] = time.monotonic()

    def signed(self, sid: str, path: str, op: str, user: str | None, signature: str,
               expiration: str | None) -> bool:
        """E2B's signed file URLs (``download_url``/``upload_url``): v1_ + the base64 of
        sha256("path:op:user:<envd token>[:expiration]"), unexpired."""
        import base64
        import time

        if expiration:
            if not expiration.isdigit() or int(expiration) < time.time():
                return False
        raw = f"{path}:{op}:{user or ''}:{self.envd_token(sid)}" + (
            f":{expiration}" if expiration else "")
        want = "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(
            b"=").decode()
        return hmac.compare_digest(signature.encode("latin-1", "replace"), want.encode())

    def signed_for(self, query_string: bytes, method: str, sid: str | None) -> str | None:
        """The sandbox a signed /files request (its query and method) is for (``sid``: the
        one its headers name), or None."""
        from urllib.parse import parse_qs

        q = parse_qs(query_string.decode("latin-1"))
        sig, path = (q.get("signature") or [""])[0], (q.get("path") or [""])[0]
        if not sig or not path:
            return None
        op = "write" if method == "POST" else "read"
        user = (q.get("username") or [""])[0] or None
        exp = (q.get("signature_expiration") or [""])[0] or None
        if sid is not None:
            return sid if self.signed(sid, path, op, user, sig, exp) else None
        return self.find_signed(path, op, user, sig, exp)

    def find_signed(self, path: str, op: str, user: str | None, signature: str,
                    expiration: str | None) -> str | None:
        """The sandbox a signed URL without routing headers is for (the SDK's signed URLs
        drop E2B_SANDBOX_URL's path and headers): each live sandbox's token is tried."""
        for row in self.store.list_sandboxes(None, (State.RUNNING, State.PAUSED, State.RESUMING,
                                                    State.PAUSING, State.CREATING)):
            if self.signed(row.id, path, op, user, signature, expiration):
                return row.id
        return None

    # -- the sandboxes it created ---------------------------------------------------------
    def remember(self, sid: str, alias: str, public: bool, extra: dict[str, Any]) -> None:
        """The E2B-side facts of a sandbox made here: in e2b.db, and in the sandbox's row
        (``spec["e2b"]``: a node that resumes it after a pause into the shared store, or
        answers for it, reads them there; many hosts, docs/DEPLOY.md)."""
        assert self._db is not None
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO sandboxes VALUES (?,?,?,?)",
                             (sid, alias, int(public), json.dumps(extra)))
        self._public[sid] = public
        row = self.store.get_sandbox(sid)
        if row is not None:
            facts = {**extra, "alias": alias, "public": public}
            row.spec = replace(row.spec, e2b=facts)
            self.store.update_sandbox(sid, spec=row.spec)
            lv = self.mgr.live.get(sid)
            if lv is not None:
                lv.row.spec = replace(lv.row.spec, e2b=facts)

    def facts(self, sid: str, row: SandboxRow | None = None) -> dict[str, Any] | None:
        if self._db is None:
            return None
        with self._lock:
            r = self._db.execute("SELECT alias, public, extra FROM sandboxes WHERE id=?",
                                 (sid,)).fetchone()
        if r is None:  # (made on another node: its row says)
            if row is None and self._store is not None:
                row = self.store.get_sandbox(sid)
            shared = row.spec.e2b if row is not None else None
            if not isinstance(shared, dict) or not isinstance(shared.get("alias"), str):
                return None
            return {**shared, "public": bool(shared.get("public", True))}
        return {"alias": r[0], "public": bool(r[1]), **json.loads(r[2])}

    def forget(self, sid: str) -> None:
        if self._db is not None:
            with self._lock:
                self._db.execute("DELETE FROM sandboxes WHERE id=?", (sid,))
        self._public.pop(sid, None)

    def public_ports(self, sid: str, row: SandboxRow | None = None) -> bool | None:
        """For a sandbox made on the E2B surface: are its ports open to anyone (E2B's
        default), or do they need its traffic token? None: not an E2B sandbox. ``row``: its
        row, read already (not read again)."""
        if sid not in self._public:
            f = self.facts(sid, row)
            if f is None:
                return None
            self._public[sid] = f["public"]
        return self._public[sid]

    # -- templates and domain -------------------------------------------------------------
    def template_for(self, name: str) -> str:
        candidates = self.templates.get(name, [name])
        for t in candidates:
            if template_info(self.cfg.templates_dir, t) is not None:
                return t
        return candidates[0]  # (the create then says it is not built)

    def domain(self) -> str:
        """The ``domain`` of create/connect answers: the SDK's get_host(port) is then
        ``<port>-<id>.<domain>``, which the preview proxy routes."""
        if self.domain_override:
            return self.domain_override
        port = (self.preview.public()[1] if hasattr(self.preview, "public")
                else getattr(self.preview, "port", None))
        return f"{self.cfg.preview.domain}:{port}" if port else self.cfg.preview.domain

    # -- a request of the sandbox plane ---------------------------------------------------
    def target(self, sid: str, port: int, token: str | None,
               traffic: str | None = None, signed: bool = False) -> Target:
        """Which sandbox: the id must be a sandbox's and the token its own (E2B's
        ``X-Access-Token``; for the code interpreter its traffic token is accepted too;
        ``signed``: a file URL whose signature was checked)."""
        if not SID_RE.fullmatch(sid):
            raise not_running(sid[:80])
        ok = signed or self.check_token(sid, token) or (
            port == JUPYTER_PORT and self.check_token(sid, traffic, "traffic"))
        if not ok:
            raise E2BError(401, "missing or wrong access token (X-Access-Token)")
        row = self.store.get_sandbox(sid)
        if row is None or row.state in GONE or row.state == State.POOLED:
            raise not_running(sid)
        return Target(self, sid, row, port)
