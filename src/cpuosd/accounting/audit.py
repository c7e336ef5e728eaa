"""The audit trail: append-only rows in the daemon's SQLite, in one hash chain.

Rows live in ``$CPUOS_HOME/audit.db`` (SQLite, WAL; a database of its own beside the
daemon's state so that the audit's writer and the lifecycle's writes never wait for each
other's lock). A row is (seq, time, workspace, sandbox, kind, detail JSON, prev_hash, hash) with
``kind`` one of KINDS. ``hash`` is an HMAC-SHA256, under a key only the daemon holds
(``$CPUOS_HOME/audit.key``, 0600), of the previous row's hash and this row's fields: a row
edited, inserted or deleted in the database breaks the chain at that row, and whoever
edits the database without the key cannot forge a new chain. The newest row's (seq, hash)
is also written to ``$CPUOS_HOME/audit.head`` after each batch, so that deleting the newest
rows is found too (``verify`` compares; keep a copy of the head elsewhere for more).

Producers never wait: ``record`` puts the row on a bounded queue (per sandbox at most
``MAX_PENDING_PER_SANDBOX`` rows waiting, all together ``MAX_PENDING``); beyond that rows are
counted, and a ``dropped`` row with the count is written once the writer catches up. One
writer thread computes the chain and writes batches in one transaction on a connection of
its own (the lifecycle's Store is not held while it writes).

Rows come from the lifecycle's event bus (``on_event``: lifecycle changes, API commands and
file writes, connections, ports, limits) and from gVisor's runtime monitoring
(cpuosd.accounting.trace: commands and file writes made inside, recorded outside it).

Growth is bounded (issue 25, finding 6):

- coalescing: a row that repeats one written less than ``COALESCE_WINDOW`` ago (the same
  sandbox, kind and detail, less times, pids and fds: a command run again and again, one
  file written again and again, connections to a preview port from one peer, denied
  connection attempts) is counted, not written; when the window ends one row with the last
  one's detail and ``count`` (how many it stands for) is written. The first is always
  written at once. (gVisor's sink coalesces runtime points the same way before they leave
  the Sentry: cpuosd.accounting.trace.)
- a row budget per sandbox and per workspace (token buckets, ``CPUOS_AUDIT_SANDBOX_ROWS``
  and ``CPUOS_AUDIT_WORKSPACE_ROWS`` rows an hour, each bucket holding an hour's worth):
  past it, rows are counted and every ``DROP_EVERY`` seconds a ``dropped`` row says how many
  of each kind, and for file writes in which directories; lifecycle, limit and dropped rows
  are never held back;
- a free-space floor (``CPUOS_AUDIT_MIN_FREE``, default 1 GiB, checked every few seconds):
  below it only lifecycle, limit and dropped rows are written, the rest counted;
- retention (``CPUOS_AUDIT_RETENTION``, a duration; default 30 days; ``forever`` keeps
  everything): older rows are deleted from the front of the chain; the last deleted row's
  (seq, hash) is kept as the chain's anchor (itself under the key), so a verified chain
  still starts where retention says it does.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import json
import logging
import os
import posixpath
import secrets
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import homedir
from ..config import AuditConfig
from ..events import NOT_TRANSITIONS, SandboxEvent
from ..lifecycle.states import ENDED, State

if TYPE_CHECKING:
    from ..store.audit_chain import PgAuditChain

log = logging.getLogger("cpuosd.audit")

# The audit's own SQLite database beside the daemon's state (cpuos.db): its writer never
# holds the lock the lifecycle's writes (on the event loop) wait for, and a flood of rows
# never slows a create or an exec.
DB_NAME = "audit.db"
KINDS = ("command", "file_write", "connection", "lifecycle", "limit", "port", "dropped")
GENESIS = "0" * 64
MAX_PENDING = 100_000
MAX_PENDING_PER_SANDBOX = 20_000
BATCH = 500  # rows per transaction (the write lock is held ~10 ms)
GATHER = 0.01  # s the writer waits for more rows before writing a batch (unless flushed)
RETRY_FIRST, RETRY_MAX = 0.5, 30.0  # s: a failed write is tried again after these (doubling)
HEAD_SIZE = 128  # bytes of audit.head (its JSON padded with spaces), rewritten in place
MAX_DETAIL = 16_384  # bytes of a row's detail JSON (longer strings are cut)
COALESCE_WINDOW = 5.0  # s: repeats of a row within this are one row with a count
MAX_COALESCING = 20_000  # rows being coalesced at once (beyond: written as they come)
DROP_EVERY = 10.0  # s: at most one dropped row per sandbox and cause in this time
EXEMPT = frozenset({"lifecycle", "limit", "dropped"})  # never held back by budget or space
NET_KINDS = frozenset({"connection", "port"})  # budgets of their own (see _within_budget)
SPACE_CHECK = 5.0  # s
# fields that differ between repeats of "the same" row
VOLATILE = frozenset({"time_ns", "pid", "ppid", "fd", "count", "time", "first_time"})

SCHEMA = """
CREATE TABLE IF NOT EXISTS audit (
    seq INTEGER PRIMARY KEY, time REAL NOT NULL, workspace TEXT NOT NULL,
    sandbox TEXT NOT NULL, kind TEXT NOT NULL, detail TEXT NOT NULL,
    prev_hash TEXT NOT NULL, hash TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS audit_sbx ON audit(sandbox, seq);
CREATE INDEX IF NOT EXISTS audit_time ON audit(time);
CREATE TABLE IF NOT EXISTS audit_anchor (
    id INTEGER PRIMARY KEY CHECK (id = 1), seq INTEGER NOT NULL, hash TEXT NOT NULL,
    mac TEXT NOT NULL
);
"""
COLS = "seq, time, workspace, sandbox, kind, detail, prev_hash, hash"


@dataclass(frozen=True)
class Limits:
    """What bounds the audit's growth (None: no bound)."""

    sandbox_rows: float | None = None  # rows an hour per sandbox
    workspace_rows: float | None = None  # rows an hour per workspace
    min_free: int | None = None  # bytes free on the database's filesystem
    coalesce: float = 0.0  # s (0: no coalescing)

    @classmethod
    def of(cls, cfg: AuditConfig) -> Limits:
        """The bounds the daemon's configuration sets (CPUOS_AUDIT_*)."""
        return cls(cfg.sandbox_rows, cfg.workspace_rows, cfg.min_free, COALESCE_WINDOW)


class Bucket:
    """A token bucket: ``per_hour`` tokens an hour, holding at most an hour's worth."""

    __slots__ = ("cap", "last", "rate", "tokens")

    def __init__(self, per_hour: float, now: float) -> None:
        self.cap, self.rate = per_hour, per_hour / 3600.0
        self.tokens, self.last = per_hour, now

    def take(self, now: float) -> bool:
        self.tokens = min(self.cap, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False

    def give_back(self) -> None:
        self.tokens = min(self.cap, self.tokens + 1)


CoalesceKey = tuple[Any, ...]


def coalesce_key(sandbox: str, kind: str, detail: dict[str, Any]) -> CoalesceKey | None:
    """What makes two rows "the same" for coalescing, or None for a row never coalesced:
    runtime commands and file changes, preview connections, refused connection attempts.
    A tuple of the detail's items but the volatile ones, in their order (rows of one kind
    come from one place, so in one order; lists as tuples): thousands of runtime points a
    second each make one, and a JSON text of the sorted items cost ~3x as much."""
    if kind in ("command", "file_write"):
        if detail.get("source") != "runtime":
            return None
    elif kind == "port":
        if detail.get("action") != "connect":
            return None
    elif kind == "connection":
        if detail.get("verdict") == "allowed":
            return None
    else:
        return None
    key = (sandbox, kind, *[(k, tuple(v) if type(v) is list else v)
                            for k, v in detail.items() if k not in VOLATILE])
    try:
        hash(key)
    except TypeError:  # a nested dict, a list in a list: as text
        rest = {k: v for k, v in detail.items() if k not in VOLATILE}
        return (sandbox, kind, json.dumps(rest, sort_keys=True, default=str))
    return key


@dataclass
class Coalescing:
    since: float  # monotonic: the window's start (the row written at once)
    count: int = 0  # rows counted since
    first: float = 0.0  # time of the first counted
    last: Pending | None = None  # the last counted


@dataclass
class Held:
    """Rows of one sandbox held back for one cause, not yet in a dropped row."""

    count: int = 0
    kinds: collections.Counter[str] = field(default_factory=collections.Counter)
    dirs: collections.Counter[str] = field(default_factory=collections.Counter)
    since: float = 0.0  # monotonic: the first held


def load_key(path: Path) -> bytes:
    """The chain's key: made once (0600), kept beside the database."""
    try:
        return bytes.fromhex(path.read_text().strip())
    except FileNotFoundError:
        pass
    key = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    return key


def _cut(v: Any, room: int = 4096) -> Any:
    if isinstance(v, str):
        return v if len(v) <= room else v[:room] + f"...[{len(v) - room} more]"
    if isinstance(v, list):
        return [_cut(x, room) for x in v[:256]] + ([f"...[{len(v) - 256} more]"]
                                                   if len(v) > 256 else [])
    if isinstance(v, dict):
        return {str(k)[:128]: _cut(x, room) for k, x in list(v.items())[:128]}
    if v is None or isinstance(v, (bool, int, float)):
        return v
    return _cut(str(v), room)


def encode_detail(detail: dict[str, Any]) -> str:
    text = json.dumps(detail, sort_keys=True, separators=(",", ":"), default=str)
    if len(text) <= MAX_DETAIL:
        return text
    text = json.dumps(_cut(detail), sort_keys=True, separators=(",", ":"), default=str)
    if len(text) > MAX_DETAIL:
        text = json.dumps(_cut(detail, 256), sort_keys=True, separators=(",", ":"), default=str)
    if len(text) > MAX_DETAIL:
        text = json.dumps({"truncated": True, "bytes": len(text)})
    return text


def row_hash(key: bytes, prev: str, seq: int, t: float, ws: str, sbx: str, kind: str,
             detail: str) -> str:
    msg = "\x1f".join((prev, str(seq), repr(float(t)), ws, sbx, kind, detail)).encode()
    return hmac.digest(key, msg, "sha256").hex()  # (one call: what hmac.new(...).hexdigest() is)


def _anchor_mac(key: bytes, seq: int, h: str) -> str:
    return hmac.new(key, f"anchor\x1f{seq}\x1f{h}".encode(), hashlib.sha256).hexdigest()


@dataclass
class Pending:
    time: float
    workspace: str
    sandbox: str
    kind: str
    detail: dict[str, Any]


class AuditLog:
    def __init__(self, db_path: Path, key_path: Path, head_path: Path | None = None,
                 retention: float | None = None,
                 workspace_lookup: Callable[[str], str | None] | None = None,
                 limits: Limits | None = None, chain: PgAuditChain | None = None) -> None:
        self.db_path, self.head_path = db_path, head_path
        # many hosts (the state store in Postgres): rows go to the one chain every node
        # appends to (cpuosd.store.audit_chain) instead of this host's SQLite; the
        # queue, coalescing, budgets and the free-space floor work as on one host
        self.chain = chain
        self.limits = limits or Limits()
        # a sandbox's workspace before its first event names it (from the daemon's Store)
        self.workspace_lookup = workspace_lookup
        self.key = load_key(key_path)
        self.retention = retention
        homedir.create_private(db_path)  # 0600 before SQLite: its -wal/-shm get the same
        self._db = sqlite3.connect(str(db_path), check_same_thread=False, isolation_level=None,
                                   timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        homedir.private_db_files(db_path)
        self._dblock = threading.Lock()  # the connection: the writer's, readers'
        self._headlock = threading.Lock()  # audit.head: its rewrite, readers
        self._head_fd: int | None = None  # audit.head, open for its rewrites
        self._cv = threading.Condition()
        self._queue: collections.deque[Pending] = collections.deque()
        self._per_sbx: collections.Counter[str] = collections.Counter()
        self._enqueued = 0  # tickets: rows put (or dropped) so far
        self._written = 0  # ... and handled by the writer
        self._closed = False
        self._ws: dict[str, str] = {}  # sandbox -> workspace (from its lifecycle events)
        # in the order their windows started (so end): the writer looks only at the front
        # (with thousands of distinct rows in a window, a scan of all of them at each batch
        # was most of the writer's work)
        self._coalescing: collections.OrderedDict[CoalesceKey, Coalescing] = \
            collections.OrderedDict()
        self._flushing = 0  # flush() calls waiting: the writer gathers no more rows
        # ("s"|"w", sandbox or workspace id, "run"|"net") -> bucket
        self._buckets: dict[tuple[str, str, str], Bucket] = {}
        # rows held back, by (workspace, sandbox, cause): counted into dropped rows
        self._held: dict[tuple[str, str, str], Held] = {}
        self._low_space = False
        self._space_checked = 0.0
        self._failures = 0  # writes failed in a row (the writer backs off, then tries again)
        self.held_total = 0  # rows held back so far (budget, space, queue), all sandboxes
        r = self._db.execute("SELECT seq, hash FROM audit ORDER BY seq DESC LIMIT 1").fetchone()
        if r is None:
            a = self._db.execute("SELECT seq, hash FROM audit_anchor").fetchone()
            r = a if a is not None else (0, GENESIS)
        self._seq, self._head = int(r[0]), str(r[1])
        self._last_prune = 0.0
        # the runtime monitoring's (cpuosd.accounting.trace.Traced.drain): what it has read
        # or can read now, parsed into rows (catch_up)
        self.drain: Callable[[float], bool] | None = None
        self._thread = threading.Thread(target=self._writer, name="audit-writer", daemon=True)
        self._thread.start()

    # ---- producers ----------------------------------------------------------------------
    def workspace_of(self, sandbox: str) -> str:
        ws = self._ws.get(sandbox)
        if ws is None:
            ws = (self.workspace_lookup(sandbox) if self.workspace_lookup else None) or ""
            if len(self._ws) > 100_000:
                self._ws.clear()
            self._ws[sandbox] = ws
        return ws

    def record(self, sandbox: str, kind: str, detail: dict[str, Any],
               workspace: str | None = None, t: float | None = None) -> bool:
        """Queue a row (from any thread); False: held back (counted), by a full queue, the
        row budget or low disk space. A repeat being coalesced counts as queued."""
        ws = workspace if workspace is not None else self.workspace_of(sandbox)
        key = coalesce_key(sandbox, kind, detail) if self.limits.coalesce else None
        when = time.time() if t is None else t
        with self._cv:
            now = time.monotonic()  # (under the lock: windows start in the dict's order)
            if self._closed:
                return False
            if key is not None:
                c = self._coalescing.get(key)
                # within its window, or past it with repeats the writer has not made into
                # their row yet (replacing it would lose their count)
                if c is not None and (now - c.since < self.limits.coalesce or c.count):
                    c.count += int(detail.get("count") or 1)
                    c.first = c.first or when
                    c.last = Pending(when, ws, sandbox, kind, detail)
                    return True
                if c is not None:
                    del self._coalescing[key]  # (a new window: at the end of the order)
                if len(self._coalescing) < MAX_COALESCING:
                    self._coalescing[key] = Coalescing(now)
            return self._admit(Pending(when, ws, sandbox, kind, detail), now)

    def _admit(self, p: Pending, now: float) -> bool:
        """Budget, space and queue bound for one row; queue it. Holds ``_cv``."""
        if p.kind not in EXEMPT:
            cause = None
            if self._low_space:
                cause = "the disk is almost full (CPUOS_AUDIT_MIN_FREE)"
            elif not self._within_budget(p.workspace, p.sandbox, now, p.kind):
                cause = self._last_cause
            if cause is not None:
                self._hold(p, cause, now)
                return False
        if (len(self._queue) >= MAX_PENDING
                or self._per_sbx[p.sandbox] >= MAX_PENDING_PER_SANDBOX):
            self._hold(p, "audit queue full", now)
            return False
        self._queue.append(p)
        self._per_sbx[p.sandbox] += 1
        self._enqueued += 1
        if len(self._queue) in (1, BATCH):  # (the writer waits for the first, or gathers)
            self._cv.notify_all()
        return True

    _last_cause = ""

    def _within_budget(self, ws: str, sandbox: str, now: float, kind: str = "") -> bool:
        """Takes a token of the sandbox's and the workspace's budget for ``kind``'s class:
        network rows (connections, preview ports: what others can cause from outside) have
        buckets of their own, so a flood of them never uses up the budget of what runs
        inside."""
        taken: list[Bucket] = []
        cls = "net" if kind in NET_KINDS else "run"
        for scope, ident, per_hour, what in (
                ("s", sandbox, self.limits.sandbox_rows, "the sandbox's row budget "
                 "(CPUOS_AUDIT_SANDBOX_ROWS)"),
                ("w", ws, self.limits.workspace_rows, "the workspace's row budget "
                 "(CPUOS_AUDIT_WORKSPACE_ROWS)")):
            if per_hour is None:
                continue
            b = self._buckets.get((scope, ident, cls))
            if b is None:
                if len(self._buckets) > 100_000:
                    self._buckets.clear()
                b = self._buckets[(scope, ident, cls)] = Bucket(per_hour, now)
            if not b.take(now):
                for t in taken:  # a row the workspace refuses costs the sandbox nothing
                    t.give_back()
                self._last_cause = what
                return False
            taken.append(b)
        return True

    def _hold(self, p: Pending, cause: str, now: float) -> None:
        n = int(p.detail.get("count") or 1) if p.kind != "dropped" else 1
        h = self._held.get((p.workspace, p.sandbox, cause))
        if h is None:
            h = self._held[(p.workspace, p.sandbox, cause)] = Held(since=now)
        h.count += n
        self.held_total += n
        h.kinds[p.kind] += n
        path = p.detail.get("path")
        if p.kind == "file_write" and isinstance(path, str):
            d = posixpath.dirname(path) or "/"
            if d in h.dirs or len(h.dirs) < 32:
                h.dirs[d] += n
            else:
                h.dirs["(other directories)"] += n

    def _due(self, now: float, final: bool = False) -> list[Pending]:
        """Rows the writer owes: coalesced repeats whose window ended, dropped rows for what
        was held back (each cause of each sandbox at most every DROP_EVERY s). Holds
        ``_cv``."""
        out: list[Pending] = []
        while self._coalescing:
            key, c = next(iter(self._coalescing.items()))
            if not final and now - c.since < self.limits.coalesce:
                break  # (the rest started later)
            del self._coalescing[key]
            if c.count and c.last is not None:
                last = c.last
                row = Pending(last.time, last.workspace, last.sandbox, last.kind,
                              {**last.detail, "count": c.count, "first_time": c.first})
                if last.kind in EXEMPT or (not self._low_space and self._within_budget(
                        last.workspace, last.sandbox, now, last.kind)):
                    out.append(row)
                else:
                    self._hold(row, "the disk is almost full (CPUOS_AUDIT_MIN_FREE)"
                               if self._low_space else self._last_cause, now)
        for (ws, sbx, cause), h in list(self._held.items()):
            if final or now - h.since >= DROP_EVERY:
                del self._held[(ws, sbx, cause)]
                detail: dict[str, Any] = {"count": h.count, "source": cause,
                                          "kinds": dict(h.kinds)}
                if h.dirs:
                    detail["directories"] = dict(h.dirs.most_common(32))
                out.append(Pending(time.time(), ws, sbx, "dropped", detail))
        return out

    def _check_space(self, now: float) -> None:
        if self.limits.min_free is None or now - self._space_checked < SPACE_CHECK:
            return
        self._space_checked = now
        try:
            free = shutil.disk_usage(self.db_path.parent).free
        except OSError:
            return
        low = free < self.limits.min_free
        if low != self._low_space:
            (log.warning if low else log.info)(
                "audit: %d MiB free under %s: %s", free >> 20, self.db_path.parent,
                "rows other than lifecycle, limit and dropped are counted, not written"
                if low else "writing rows again")
        self._low_space = low

    def note_dropped(self, sandbox: str, count: int, source: str) -> None:
        """Points lost before they reached us (gVisor's sink counts them): a row saying so."""
        if count > 0:
            self.record(sandbox, "dropped", {"count": count, "source": source})

    def pending_repeats(self) -> int:
        """Rows being coalesced (their repeats not written yet)."""
        with self._cv:
            return sum(1 for c in self._coalescing.values() if c.count)

    def on_event(self, ev: SandboxEvent) -> None:
        """The event bus subscriber."""
        if ev.workspace:
            self._ws[ev.sandbox] = ev.workspace
        if ev.kind in ("command", "file_write", "limit", "port", "connection"):
            self.record(ev.sandbox, ev.kind, dict(ev.fields), ev.workspace, ev.time)
        elif ev.kind == "oom":
            self.record(ev.sandbox, "limit", {"limit": "memory", **ev.fields}, ev.workspace,
                        ev.time)
        elif ev.kind == "idle":  # (the pause that follows is a transition, reason idle)
            self.record(ev.sandbox, "lifecycle", {"event": "idle", **ev.fields}, ev.workspace,
                        ev.time)
        elif ev.kind == "network":
            pol = dict(ev.fields.get("network") or {})
            pol.pop("secrets", None)  # names and hosts only, never values
            pol.pop("ca", None)
            self.record(ev.sandbox, "lifecycle", {"event": "network", "network": pol},
                        ev.workspace, ev.time)
        elif ev.kind not in NOT_TRANSITIONS:
            if ev.kind == State.POOLED or (ev.previous == State.POOLED and ev.kind == State.KILLED):
                return  # the warm pool's own sandboxes: no one's yet
            self.record(ev.sandbox, "lifecycle", {"from": ev.previous, "to": ev.kind,
                                                  **ev.fields}, ev.workspace, ev.time)
        if ev.kind in ENDED:
            self._ws.pop(ev.sandbox, None)

    # ---- the writer ---------------------------------------------------------------------
    def _writer(self) -> None:
        while True:
            with self._cv:
                while (not self._queue and not self._closed
                       and not self._owed(time.monotonic())):
                    self._cv.wait(1.0)
                    self._check_space(time.monotonic())
                    if self.retention is not None and time.time() - self._last_prune > 60:
                        break
                # group commit: rows that come in a burst (runtime points, thousands a
                # second) share a transaction and a head write, not one each per wakeup
                # (a full batch or a flush ends the wait early)
                if 0 < len(self._queue) < BATCH and not self._closed and not self._flushing:
                    self._cv.wait(GATHER)
                now = time.monotonic()
                self._check_space(now)
                if self._closed and not self._queue:
                    final = self._due(now, final=True)
                    if not final:
                        return
                    self._queue.extend(final)
                    self._enqueued += len(final)
                    for p in final:
                        self._per_sbx[p.sandbox] += 1
                batch = [self._queue.popleft() for _ in range(min(BATCH, len(self._queue)))]
                for p in batch:
                    self._per_sbx[p.sandbox] -= 1
                    if self._per_sbx[p.sandbox] <= 0:
                        del self._per_sbx[p.sandbox]
                owed = self._due(now)
            batch.extend(owed)
            failed: Exception | None = None
            try:
                if batch:
                    self._write(batch)
            except Exception as e:
                failed = e
            if failed is None:
                try:
                    if self.retention is not None and time.time() - self._last_prune > 60:
                        self._last_prune = time.time()
                        self.prune(time.time() - self.retention)
                except Exception:
                    log.exception("audit: pruning rows past the retention failed")
            with self._cv:
                if failed is not None and not self._closed:
                    # a database that did not answer (Postgres restarting, a lock or pool
                    # timeout): the rows go back to the queue's front, in order, and are
                    # written when it answers again; meanwhile the queue's bound holds
                    self._failures += 1
                    self._queue.extendleft(reversed(batch))
                    self._enqueued += len(owed)  # (owed rows now queued, as in flush)
                    for p in batch:
                        self._per_sbx[p.sandbox] += 1
                    delay = min(RETRY_MAX, RETRY_FIRST * 2 ** (self._failures - 1))
                    log.warning("audit: writing %d rows failed (%s); trying again in %.1f s",
                                len(batch), failed, delay,
                                exc_info=failed if self._failures == 1 else None)
                    end = time.monotonic() + delay
                    while not self._closed and (left := end - time.monotonic()) > 0:
                        self._cv.wait(left)
                    continue
                if failed is not None:  # (closing: one try each, then what is left is lost)
                    log.error("audit: %d rows lost: writing them failed while closing (%s)",
                              len(batch), failed)
                elif self._failures:
                    log.warning("audit: writing rows again after %d failed tries",
                                self._failures)
                self._failures = 0
                self._written += len(batch) - len(owed)
                self._cv.notify_all()

    def _owed(self, now: float) -> bool:
        """Has the writer rows to make (a window or a drop interval ended)? Holds ``_cv``."""
        oldest = next(iter(self._coalescing.values()), None)
        # (an ended window without repeats only has its entry removed)
        return (oldest is not None and now - oldest.since >= self.limits.coalesce) or any(
            now - h.since >= DROP_EVERY for h in self._held.values())

    def _write(self, batch: list[Pending]) -> None:
        if self.chain is not None:
            seq, head = self.chain.append([(p.time, p.workspace, p.sandbox, p.kind, p.detail)
                                           for p in batch])
            self._seq, self._head = seq, head
            self._keep_head(seq, head)
            return
        rows = []
        seq, head = self._seq, self._head
        for p in batch:
            seq += 1
            detail = encode_detail(p.detail)
            h = row_hash(self.key, head, seq, p.time, p.workspace, p.sandbox, p.kind, detail)
            rows.append((seq, p.time, p.workspace, p.sandbox, p.kind, detail, head, h))
            head = h
        with self._dblock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany(f"INSERT INTO audit ({COLS}) VALUES (?,?,?,?,?,?,?,?)",
                                     rows)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        self._seq, self._head = seq, head
        self._keep_head(seq, head)

    def _keep_head(self, seq: int, head: str) -> None:
        """The head file after a committed batch: a failure to write it is logged, never
        raised (the batch must not be written twice); the next batch writes it again."""
        try:
            self._write_head(seq, head)
        except OSError as e:
            log.warning("audit: the head file %s was not written: %s", self.head_path, e)

    def _write_head(self, seq: int, head: str) -> None:
        """The head file: written whole once (a new file renamed into place), then rewritten
        in place, one write of HEAD_SIZE bytes (a file made and renamed costs ~0.3 ms of
        CPU here, and there is one per batch: per exec, or a hundred a second while a
        sandbox writes files); made anew if the path no longer names the file written."""
        if self.head_path is None:
            return
        data = json.dumps({"seq": seq, "hash": head}).encode()
        data = data.ljust(HEAD_SIZE - 1) + b"\n" if len(data) < HEAD_SIZE else data
        with self._headlock:
            fd = self._head_fd
            if fd is not None and len(data) == HEAD_SIZE:
                try:
                    same = os.path.samestat(os.fstat(fd), os.stat(self.head_path))
                except OSError:
                    same = False
                if same:
                    os.pwrite(fd, data, 0)
                    return
            if fd is not None:
                os.close(fd)
                self._head_fd = None
            tmp = self.head_path.with_suffix(".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, self.head_path)
            if len(data) == HEAD_SIZE:
                self._head_fd = os.open(self.head_path, os.O_WRONLY | os.O_CLOEXEC)

    def flush(self, timeout: float = 10.0, owed: bool = False) -> bool:
        """Wait (a thread's wait: call it off the event loop) until every row queued before
        the call is written; ``owed``: also the rows not due yet (repeats being coalesced,
        counts of rows held back), made now."""
        with self._cv:
            if owed and not self._closed:
                for p in self._due(time.monotonic(), final=True):
                    self._queue.append(p)
                    self._per_sbx[p.sandbox] += 1
                    self._enqueued += 1
            self._flushing += 1  # (the writer stops gathering)
            self._cv.notify_all()
            target = self._enqueued
            try:
                return self._cv.wait_for(lambda: self._written >= target or self._closed,
                                         timeout)
            finally:
                self._flushing -= 1

    def catch_up(self, timeout: float = 10.0) -> bool:
        """``flush`` after what runs inside up to now is queued (the runtime monitoring's
        drain: it parses a busy sandbox's points once it quiets down). A thread's wait."""
        if self.drain is not None:
            self.drain(min(timeout, 2.0))
        return self.flush(timeout)

    def close(self) -> None:
        self.flush(10.0, owed=True)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(10.0)
        with self._dblock:
            self._db.close()
        with self._headlock:
            if self._head_fd is not None:
                os.close(self._head_fd)
                self._head_fd = None
        if self.chain is not None:
            self.chain.close()

    # ---- readers ------------------------------------------------------------------------
    def query(self, sandbox: str | None = None, kinds: tuple[str, ...] = (),
              since: float | None = None, until: float | None = None, after: int = 0,
              limit: int = 1000, workspace: str | None = None) -> list[dict[str, Any]]:
        if self.chain is not None:
            return self.chain.query(sandbox, kinds, after, limit, workspace, since, until)
        sql = f"SELECT {COLS} FROM audit WHERE seq > ?"
        args: list[Any] = [after]
        for col, val in (("sandbox", sandbox), ("workspace", workspace)):
            if val is not None:
                sql += f" AND {col} = ?"
                args.append(val)
        if kinds:
            sql += f" AND kind IN ({','.join('?' * len(kinds))})"
            args.extend(kinds)
        if since is not None:
            sql += " AND time >= ?"
            args.append(since)
        if until is not None:
            sql += " AND time < ?"
            args.append(until)
        sql += " ORDER BY seq LIMIT ?"
        args.append(limit)
        with self._dblock:
            rows = self._db.execute(sql, args).fetchall()
        return [row_json(r) for r in rows]

    def iter_rows(self, after: int = 0, chunk: int = 5000) -> Iterator[tuple[Any, ...]]:
        if self.chain is not None:
            yield from self.chain.iter_rows(after, chunk)
            return
        while True:
            with self._dblock:
                rows = self._db.execute(f"SELECT {COLS} FROM audit WHERE seq > ? ORDER BY seq "
                                        "LIMIT ?", (after, chunk)).fetchall()
            if not rows:
                return
            yield from rows
            after = rows[-1][0]

    def anchor(self) -> tuple[int, str, str] | None:
        if self.chain is not None:
            return self.chain.anchor()
        with self._dblock:
            r = self._db.execute("SELECT seq, hash, mac FROM audit_anchor").fetchone()
        return None if r is None else (int(r[0]), str(r[1]), str(r[2]))

    def verify(self) -> dict[str, Any]:
        """Walk the whole chain (a thread's work: call it off the event loop)."""
        if self.chain is not None:  # (the shared chain, and this node's last row in it)
            return verify_shared(self.chain, self._head_file())
        return verify_chain(self.iter_rows(), self.key, self.anchor(), self._head_file())

    def _head_file(self) -> dict[str, Any] | None:
        with self._headlock:  # (never half of a rewrite)
            return read_head(self.head_path)

    def prune(self, before: float) -> int:
        """Delete rows older than ``before`` from the front of the chain; the last one
        deleted becomes the anchor."""
        if self.chain is not None:
            return self.chain.prune(before)
        with self._dblock:
            r = self._db.execute("SELECT seq, hash FROM audit WHERE time < ? ORDER BY seq DESC "
                                 "LIMIT 1", (before,)).fetchone()
            if r is None:
                return 0
            seq, h = int(r[0]), str(r[1])
            self._db.execute("BEGIN IMMEDIATE")
            try:
                n = self._db.execute("DELETE FROM audit WHERE seq <= ?", (seq,)).rowcount
                self._db.execute("INSERT OR REPLACE INTO audit_anchor (id, seq, hash, mac) "
                                 "VALUES (1, ?, ?, ?)", (seq, h, _anchor_mac(self.key, seq, h)))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        log.info("audit: %d rows older than retention removed (up to seq %d)", n, seq)
        return int(n)


def row_json(r: tuple[Any, ...]) -> dict[str, Any]:
    try:
        detail = json.loads(r[5])
    except ValueError:
        detail = {"unparsable": r[5][:200]}
    return {"seq": r[0], "time": r[1], "workspace": r[2], "sandbox": r[3], "kind": r[4],
            "detail": detail, "prev_hash": r[6], "hash": r[7]}


def verify_chain(rows: Iterator[tuple[Any, ...]], key: bytes,
                 anchor: tuple[int, str, str] | None, head: dict[str, Any] | None,
                 max_problems: int = 100) -> dict[str, Any]:
    """Check every row's hash and its link to the one before; the chain's start against the
    anchor (or genesis) and its end against the head file. Problems name the seq and, where
    the row is there, its sandbox."""
    problems: list[dict[str, Any]] = []
    n_problems = 0

    def bad(seq: int, sandbox: str | None, what: str) -> None:
        nonlocal n_problems
        n_problems += 1
        if len(problems) < max_problems:
            problems.append({"seq": seq, "sandbox": sandbox, "problem": what})

    if anchor is not None and not hmac.compare_digest(anchor[2],
                                                      _anchor_mac(key, anchor[0], anchor[1])):
        bad(anchor[0], None, "the retention anchor was altered")
    prev_seq, prev_hash = (anchor[0], anchor[1]) if anchor else (0, GENESIS)
    n = 0
    for seq, t, ws, sbx, kind, detail, ph, h in rows:
        n += 1
        if seq != prev_seq + 1:
            bad(prev_seq + 1, None, f"rows {prev_seq + 1}..{seq - 1} are missing")
        if ph != prev_hash:
            bad(seq, sbx, "its prev_hash is not the hash of the row before it")
        if not hmac.compare_digest(str(h), row_hash(key, str(ph), int(seq), float(t), str(ws),
                                                    str(sbx), str(kind), str(detail))):
            bad(seq, sbx, "its content does not match its hash (edited)")
        prev_seq, prev_hash = seq, h
    if head is not None:
        hs, hh = head.get("seq"), head.get("hash")
        if isinstance(hs, int) and hs > prev_seq:
            bad(prev_seq + 1, None, f"rows {prev_seq + 1}..{hs} (the newest) are missing")
        elif isinstance(hs, int) and hs == prev_seq and hh != prev_hash:
            bad(hs, None, "the newest row is not the one last written")
    return {"ok": n_problems == 0, "rows": n, "problems": problems,
            "problem_count": n_problems, "head": {"seq": prev_seq, "hash": prev_hash}}


def read_head(path: Path | None) -> dict[str, Any] | None:
    """The head a writer last recorded (``audit.head``: its seq and hash), if any."""
    if path is None:
        return None
    try:
        d = json.loads(path.read_text())
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


def verify_shared(chain: PgAuditChain, head: dict[str, Any] | None) -> dict[str, Any]:
    """The chain every node appends to (many hosts: cpuosd.store.audit_chain), and the row
    this node last wrote (``head``, its ``audit.head``): ``GET /audit/verify`` on a node
    and ``cpuosd audit verify`` with CPUOS_DATABASE_URL."""
    return chain.verify([(int(head["seq"]), str(head["hash"]))] if head else [])


def verify_database(url: str, key: bytes, head: dict[str, Any] | None) -> dict[str, Any]:
    """The host-side check of the shared chain in Postgres at ``url``, without a daemon."""
    from ..store.audit_chain import PgAuditChain

    chain = PgAuditChain(url, key, max_size=1)
    try:
        return verify_shared(chain, head)
    finally:
        chain.close()


def verify_file(home: Path, key_path: Path | None = None) -> dict[str, Any]:
    """The host-side check, without the daemon: the database under ``home``, the key at
    ``key_path`` (default ``home/audit.key``)."""
    db = sqlite3.connect(f"file:{home / DB_NAME}?mode=ro", uri=True)
    with contextlib.closing(db):
        key = bytes.fromhex((key_path or home / "audit.key").read_text().strip())
        try:
            a = db.execute("SELECT seq, hash, mac FROM audit_anchor").fetchone()
        except sqlite3.OperationalError:
            return {"ok": True, "rows": 0, "problems": [], "problem_count": 0,
                    "head": {"seq": 0, "hash": GENESIS}}
        head = read_head(home / "audit.head")

        def rows() -> Iterator[tuple[Any, ...]]:
            yield from db.execute(f"SELECT {COLS} FROM audit ORDER BY seq")

        return verify_chain(rows(), key, (int(a[0]), str(a[1]), str(a[2])) if a else None,
                            head)
