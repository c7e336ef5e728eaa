"""What runs inside a gVisor sandbox without going through the API, recorded from outside
it: gVisor's runtime monitoring (seccheck trace points) with a ``remote`` sink in the daemon.

``Traced`` wraps the gVisor backend: before runsc starts or restores a sandbox, a listener
(a SOCK_SEQPACKET unix socket in the sandbox's host directory, never mounted inside) is
made for it and runsc is given ``--pod-init-config`` naming that socket. runsc (on the host)
connects, does the sink's handshake, and hands the connected socket to the Sentry, which
then sends one protobuf message per trace point: every ``execve`` (``sentry/execve``:
argv, binary, pid, uid, cwd) and every ``open``/``openat``/``creat`` (``syscall/*/exit``:
path, flags, result), which we keep when it opened a file for writing. The Sentry is the
sandbox's kernel: code inside cannot skip, forge or silence these points, and nothing of
the recording lives inside (killing or replacing the agent changes nothing).

The trace session is set up when the Sentry boots, so a restore (resume, fork, a create
from a template snapshot, the warm pool) passes the config again and the new Sentry
connects again; a daemon restarted while sandboxes run re-attaches with ``runsc trace
create --force``. Template boots are not traced (no one's sandbox).

Bounded: the Sentry never waits for us (its writes are non-blocking; what does not fit in
the socket's buffer it drops and counts, and the count comes in the header of the next
message that fits); a reader thread per sandbox reads at most RATE messages a second (a
burst of BURST) and otherwise does not read, so a flood inside costs the daemon at most
that; rows go to the audit's bounded queue. Every loss ends up in a counted ``dropped``
row (the Sentry's last count only once another message gets through).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import posixpath
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

from ..backends.base import Backend, Capabilities, SandboxSpec
from . import seccheck_pb2 as _pb
from .audit import AuditLog

log = logging.getLogger("cpuosd.trace")
# the generated module makes its classes at import (protoc's form): no static types
pb: Any = _pb

HEADER = struct.Struct("<HHI")  # header size, message type, dropped count (wire.Header)
MAX_MESSAGE = 256 << 10  # a bigger one (a huge argv) is cut by the socket: counted, not read
RATE = 5000.0  # messages parsed per second per sandbox (beyond: counted as dropped)
BURST = 20000.0
CONTEXT = ["time", "group_id", "parent_thread_group_id", "credentials", "cwd", "process_name"]
O_ACCMODE, O_WRONLY, O_RDWR = 0o3, 0o1, 0o2
O_CREAT, O_TRUNC, O_APPEND = 0o100, 0o1000, 0o2000
FLAG_NAMES = ((O_CREAT, "O_CREAT"), (O_TRUNC, "O_TRUNC"), (O_APPEND, "O_APPEND"),
              (0o200, "O_EXCL"), (0o20000000, "O_TMPFILE"))
MSG_EXEC = pb.MESSAGE_SENTRY_EXEC
MSG_OPEN = pb.MESSAGE_SYSCALL_OPEN


def session_config(endpoint: Path) -> dict[str, Any]:
    """runsc's --pod-init-config: the one trace session, its points and our sink."""
    opens = [{"name": f"syscall/{s}/exit", "context_fields": CONTEXT,
              **({"optional_fields": ["fd_path"]} if s != "open" else {})}
             for s in ("open", "openat", "creat")]
    return {"trace_session": {
        "name": "Default",
        "points": [{"name": "sentry/execve", "context_fields": CONTEXT}, *opens],
        "sinks": [{"name": "remote", "config": {"endpoint": str(endpoint), "retries": 0}}],
    }}


def flag_names(flags: int) -> list[str]:
    acc = flags & O_ACCMODE
    out = ["O_WRONLY" if acc == O_WRONLY else "O_RDWR" if acc == O_RDWR else "O_RDONLY"]
    return out + [n for bit, n in FLAG_NAMES if flags & bit == bit]


# opened for writing all the time and never a file's content: not kept
DEVICES = frozenset({"/dev/null", "/dev/tty", "/dev/urandom", "/dev/random", "/dev/zero",
                     "/dev/full"})


def is_write(flags: int) -> bool:
    return bool(flags & O_ACCMODE in (O_WRONLY, O_RDWR) or flags & (O_CREAT | O_TRUNC))


def _ctx(c: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"pid": c.thread_group_id, "ppid": c.parent_thread_group_id,
                           "uid": c.credentials.real_uid, "euid": c.credentials.effective_uid}
    if c.process_name:
        out["process"] = c.process_name
    return out


def decode(mtype: int, payload: bytes) -> tuple[str, dict[str, Any]] | None:
    """One trace message as (kind, detail), or None for one not kept (an open for reading
    or one that failed). Raises on a malformed message (the caller counts it)."""
    if mtype == MSG_EXEC:
        m = pb.ExecveInfo.FromString(payload)
        c = m.context_data
        return "command", {
            "source": "runtime", "argv": list(m.argv), "binary": m.binary_path or m.execfn,
            "cwd": c.cwd, "env": sorted({e.partition("=")[0] for e in m.env})[:256],
            **_ctx(c), "time_ns": c.time_ns}
    if mtype == MSG_OPEN:
        o = pb.Open.FromString(payload)
        if not is_write(o.flags) or (o.HasField("exit") and o.exit.result < 0):
            return None
        c = o.context_data
        path = o.pathname
        if path and not path.startswith("/"):
            base = o.fd_path if o.fd_path.startswith("/") else c.cwd
            path = posixpath.normpath(posixpath.join(base or "/", path))
        if path in DEVICES:
            return None
        return "file_write", {"source": "runtime", "path": path,
                              "flags": flag_names(o.flags), "fd": o.exit.result,
                              **_ctx(c), "time_ns": c.time_ns}
    return None


class Sink:
    """One sandbox's listener and reader (a thread of its own)."""

    def __init__(self, sid: str, path: Path, audit: AuditLog) -> None:
        self.sid, self.path, self.audit = sid, path, audit
        self.connections = 0  # Sentries that connected (a restore is a new one)
        self.messages = 0
        self._stop = threading.Event()
        self._conn: socket.socket | None = None
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self._lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._lsock.bind(str(path))
        os.chmod(path, 0o600)
        self._lsock.listen(4)
        self._lsock.settimeout(0.5)
        self._thread = threading.Thread(target=self._run, name=f"trace-{sid}", daemon=True)
        self._thread.start()

    def close(self, wait: float = 0.0) -> None:
        """Stop listening and reading (the thread ends by itself, promptly: the event loop
        never waits for it unless ``wait``)."""
        self._stop.set()
        for sock in (self._conn, self._lsock):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept or recv
        with contextlib.suppress(OSError):
            self.path.unlink()
        if wait:
            self._thread.join(wait)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    conn, _ = self._lsock.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                self._conn = conn
                try:
                    self._serve(conn)
                except Exception:
                    log.exception("trace sink of %s failed", self.sid)
                finally:
                    self._conn = None
                    conn.close()
        finally:
            self._lsock.close()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(10.0)
        hello = conn.recv(10240)  # runsc's Handshake (the version it speaks)
        theirs = pb.Handshake.FromString(hello)
        conn.sendall(pb.Handshake(version=1).SerializeToString())
        self.connections += 1
        log.info("trace session of %s connected (sink version %d)", self.sid, theirs.version)
        conn.settimeout(0.5)
        tokens, last = BURST, time.monotonic()
        seen_dropped = 0  # the Sentry's count in the last header read
        lost = malformed = 0  # not yet in a dropped row (one a second at most)
        noted = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if (lost or malformed) and now - noted >= 1.0:
                self._note(lost, malformed)
                lost = malformed = 0
                noted = now
            tokens = min(BURST, tokens + (now - last) * RATE)
            last = now
            if tokens < 1:
                # over the rate: stop reading for a while; the socket's buffer fills and the
                # Sentry drops (and counts) what does not fit, at no cost to the daemon
                self._stop.wait(min(0.2, (1 - tokens) / RATE))
                continue
            try:
                data, _, flags, _ = conn.recvmsg(MAX_MESSAGE)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break  # the Sentry is gone (sandbox stopped, checkpointed, killed)
            tokens -= 1
            self.messages += 1
            if len(data) < HEADER.size or flags & socket.MSG_TRUNC:
                malformed += 1
                continue
            hsize, mtype, dropped = HEADER.unpack_from(data)
            if dropped != seen_dropped:
                lost += (dropped - seen_dropped) % (1 << 32)
                seen_dropped = dropped
            try:
                got = decode(mtype, data[hsize:]) if hsize >= HEADER.size else None
            except Exception:
                malformed += 1
                continue
            if got is not None:
                self.audit.record(self.sid, got[0], got[1])
        self._note(lost, malformed)
        log.info("trace session of %s ended", self.sid)

    def _note(self, lost: int, malformed: int) -> None:
        self.audit.note_dropped(self.sid, lost, "gVisor's sink (the socket's buffer was full)")
        self.audit.note_dropped(self.sid, malformed, "malformed or too large")


class Traced:
    """Wraps a gVisor backend: every sandbox it starts or restores is traced into ``audit``
    (the lifecycle calls the same methods as before)."""

    def __init__(self, inner: Backend, audit: AuditLog, sandboxes_dir: Path) -> None:
        self.inner, self.audit, self.sandboxes_dir = inner, audit, sandboxes_dir
        self.capabilities: Capabilities = dataclasses.replace(inner.capabilities)
        self.image_kind = inner.image_kind
        self.sinks: dict[str, Sink] = {}
        self._adopted = False

    def __getattr__(self, name: str) -> Any:  # what the wrapper does not change
        return getattr(self.inner, name)

    def runtime(self) -> dict[str, str]:
        return {**self.inner.runtime(), "audit": "runtime monitoring (seccheck)"}

    def _config_path(self, sid: str) -> Path:
        return self.sandboxes_dir / sid / "trace.json"

    def _prepare(self, spec: SandboxSpec) -> None:
        if spec.template_boot:
            return
        spec.dir.mkdir(parents=True, exist_ok=True)
        old = self.sinks.pop(spec.id, None)
        if old is not None:
            old.close()
        sock = spec.dir / "trace.sock"
        self.sinks[spec.id] = Sink(spec.id, sock, self.audit)
        cfg = self._config_path(spec.id)
        cfg.write_text(json.dumps(session_config(sock)))
        spec.trace_config = cfg

    def _drop(self, sid: str) -> None:
        sink = self.sinks.pop(sid, None)
        if sink is not None:
            sink.close()

    async def start(self, spec: SandboxSpec) -> None:
        self._prepare(spec)
        try:
            await self.inner.start(spec)
        except BaseException:
            self._drop(spec.id)
            raise

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> None:
        self._prepare(spec)
        try:
            await self.inner.restore(spec, image_dir)
        except BaseException:
            self._drop(spec.id)
            raise

    async def checkpoint(self, sandbox_id: str, image_dir: Path) -> None:
        try:
            await self.inner.checkpoint(sandbox_id, image_dir)
        finally:  # the Sentry has stopped; a restore makes a new listener
            self._drop(sandbox_id)

    async def kill(self, sandbox_id: str) -> None:
        try:
            await self.inner.kill(sandbox_id)
        finally:
            self._drop(sandbox_id)

    async def running(self) -> dict[str, str]:
        live = await self.inner.running()
        if not self._adopted:  # a restarted daemon: sessions of running sandboxes re-attach
            self._adopted = True
            for sid, status in live.items():
                if status == "running" and self._config_path(sid).exists():
                    await self._reattach(sid)
        return live

    async def _reattach(self, sid: str) -> None:
        from .. import procs

        d = self.sandboxes_dir / sid
        sock = d / "trace.sock"
        self._drop(sid)
        self.sinks[sid] = Sink(sid, sock, self.audit)
        flags = getattr(self.inner, "_global_flags", None)
        if flags is None:
            return
        try:
            rc, _, err = await procs.run([*flags(), "trace", "create", "--force",
                                          f"--config={self._config_path(sid)}", sid],
                                         timeout=30)
        except TimeoutError:
            rc, err = -1, b"timed out"
        if rc != 0:
            log.warning("trace session of %s not re-attached: %s", sid,
                        err.decode(errors="replace")[-300:])
        else:
            log.info("trace session of %s re-attached", sid)

    async def close(self) -> None:
        for sid in list(self.sinks):
            self._drop(sid)
        await self.inner.close()
