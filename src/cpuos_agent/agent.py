"""cpuos-agent: the process inside every sandbox (PID 1, unprivileged).

Stdlib only. It reaches the host through ``CPUOS_AGENT_SOCKET``: a unix socket it
connects out to (gVisor: a host directory bind-mounted at /run/cpuos), or a character
device (microVM: the guest side of a virtio-serial port). On each host connection it says
hello, then serves requests multiplexed on that one connection: exec (streamed output,
exit status, timeout, kill of the whole process tree) and file operations. If the
connection drops it kills the commands it was running for it and reconnects.

The host never trusts anything this program sends.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import stat as stat_mod
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from . import privs, watch
from . import protocol as P
from .bg import Background, Reader
from .cgroups import Cgroups
from .conn import Conn
from .dial import Dial
from .exec import MAX_BG_KEPT, Exec, set_winsize
from .files import _errcode, _list, _remove, _stat, _unlink_quiet, create_beside, open_regular
from .identity import apply_identity, drop_inheritable_caps, not_dumpable, read_key
from .memguard import MemGuard
from .reaper import Reaper
from .spawner import Spawner
from .transport import Closed, Quiesce, Transport, transport_for

SOCKET_PATH = os.environ.get("CPUOS_AGENT_SOCKET", "/run/cpuos/agent.sock")


class Agent:
    """``spawner`` and ``cgroups``: root mode's (see ``main``); None: commands are started
    by the agent itself and tracked by a process-tree scan."""

    def __init__(self, key: str | None = None, spawner: Spawner | None = None,
                 cgroups: Cgroups | None = None) -> None:
        self.key = key if key is not None else read_key()
        self.reaper = Reaper()
        self.spawner, self.cgroups = spawner, cgroups
        if spawner is not None:
            spawner.attach(self.reaper, cgroups, lambda: bool(self.execs) or any(
                b.result is None for b in list(self.bg.values())))
        self.execs: dict[int, Exec] = {}
        self.writes: dict[int, tuple[int, str, str]] = {}
        self.dials: dict[int, Dial] = {}
        # background commands by pid (they outlive connections); on the current connection:
        # the streams reading one's output, and those writing to one's stdin
        self.bg: dict[int, Background] = {}
        self.readers: dict[int, Reader] = {}
        self.stdin_to: dict[int, Exec] = {}
        self.watches: dict[int, watch.Watch] = {}
        # gVisor: the sandbox's OOM killer (memguard.py); the host sends the limit
        self.memguard = MemGuard(cgroups, self._running, lambda: any(
            not e.background for e in list(self.execs.values()))) if (
            cgroups is not None and cgroups.kind != "v2" and cgroups.mem_root) else None

    def add_bg(self, bg: Background) -> None:
        self.bg[bg.pid] = bg  # an ended one whose pid was reused is forgotten
        ended = sorted((b.ended_at or 0.0, pid) for pid, b in self.bg.items()
                       if b.result is not None)
        for _, pid in ended[: max(0, len(ended) - MAX_BG_KEPT)]:
            self.bg.pop(pid, None)

    def _running(self) -> list[Exec]:
        """Every command running: foreground execs and background processes."""
        out = {id(e): e for e in list(self.execs.values())}
        for b in list(self.bg.values()):
            if b.result is None:
                out[id(b.ex)] = b.ex
        return list(out.values())

    # ---- connection lifecycle -------------------------------------------------------
    def serve_forever(self, transport: Transport | None = None) -> None:
        transport = transport or transport_for(SOCKET_PATH)
        while True:
            conn = Conn(transport.connect())
            quiesced = False
            try:
                # uid: the one it acts as (the commands'); ruid 0 in root mode (privs.py)
                # tracking: how an exec's processes are found for a timeout or a kill
                conn.send({"t": "hello", "version": P.PROTOCOL_VERSION, "pid": os.getpid(),
                           "uid": os.geteuid(), "ruid": os.getuid(),
                           "transport": transport.kind, "key": self.key,
                           "tracking": f"cgroup-{self.cgroups.kind}" if self.cgroups
                           else "tree-scan"})
                self._serve(conn)
            except Quiesce:
                quiesced = True
            except (Closed, P.ProtocolError, OSError):
                pass
            finally:
                conn.shutdown()
                if self.memguard is not None:  # the host's watch was this session's
                    self.memguard.host(False, False)
                for ex in list(self.execs.values()):
                    if not ex.background:
                        ex.kill("disconnected")
                for d in list(self.dials.values()):
                    d.close()
                for rd in list(self.readers.values()):
                    rd.cancel()
                self.readers.clear()
                for w in list(self.watches.values()):
                    w.cancel()
                self.watches.clear()
                for ssid, ex in list(self.stdin_to.items()):
                    ex.drop_stdin(ssid)
                self.stdin_to.clear()
                for fd, tmp, _ in self.writes.values():
                    os.close(fd)
                    _unlink_quiet(tmp)
                self.writes.clear()
            transport.after_session(conn.link, quiesced)

    def _serve(self, conn: Conn) -> None:
        while True:
            fr = P.read_frame_sync(conn.rfile)
            if fr is None:
                return
            h, payload = fr
            t = h["t"]
            sid = h.get("id")
            if not isinstance(sid, int):
                sid = 0
            try:
                self._dispatch(conn, t, sid, h, payload)
            except (Closed, Quiesce):
                raise
            except OSError as e:
                conn.send({"t": "err", "id": sid, "code": _errcode(e),
                           "message": f"{e.strerror or e}"})
            except Exception as e:  # a bad request must never take the agent down
                conn.send({"t": "err", "id": sid, "code": P.E_INTERNAL,
                           "message": f"{type(e).__name__}: {e}"})

    def _dispatch(self, conn: Conn, t: str, sid: int, h: P.Header, payload: bytes) -> None:
        if t == "ping":
            conn.send({"t": "pong", "id": sid, "time": time.time()})
        elif t == "identity":
            applied = apply_identity(h)
            limit = h.get("memory_limit")
            if self.memguard is not None and isinstance(limit, int):
                self.memguard.set_limit(limit)
                applied.append("memory_limit")
            idle_exit = h.get("spawner_idle_exit")
            if (self.spawner is not None and isinstance(idle_exit, (int, float))
                    and 0 <= idle_exit <= 86400):
                self.spawner.set_idle_exit(float(idle_exit))
                applied.append("spawner_idle_exit")
            conn.send({"t": "identity_ok", "id": sid, "applied": applied})
        elif t == "memory":  # the host's watch on the sandbox's memory (memguard.py)
            if self.memguard is not None:
                self.memguard.host(h.get("watched") is True, h.get("high") is True)
        elif t == "quiesce":
            if self.execs or self.writes or self.dials:
                conn.send({"t": "err", "id": sid, "code": P.E_EXISTS,
                           "message": "commands or file transfers are still running"})
                return
            conn.send({"t": "ok", "id": sid})
            raise Quiesce()
        elif t == "exec":
            Exec(self, conn, sid, h).start()
        elif t == "stdin":
            ex = self.execs.get(sid) or self.stdin_to.get(sid)
            if ex is not None:
                ack = h.get("ack") is True
                ex.feed_stdin(conn, sid, payload, close=h.get("close") is True, ack=ack)
                if ack:
                    self.stdin_to.pop(sid, None)
        elif t == "kill":
            ex = self.execs.get(sid)
            if ex is not None:
                ex.kill(str(h.get("reason") or "killed"))
            elif sid in self.readers:
                self.readers.pop(sid).cancel()
            elif sid in self.watches:
                self.watches.pop(sid).cancel()
            elif sid in self.stdin_to:
                self.stdin_to.pop(sid).drop_stdin(sid)
            else:  # a file read or a dial the host gave up on: its sender stops
                d = self.dials.get(sid)
                if d is not None:
                    d.close()
                conn.close_stream(sid)
        elif t.startswith("bg_"):
            self._bg(conn, t, sid, h)
        elif t == "credit":
            conn.add_credit(sid, int(h.get("n", 0)))
        elif t == "dial":
            Dial(self, conn, sid, h, payload).start()
        elif t == "write":
            self._write_open(conn, sid, h)
        elif t == "data":
            w = self.writes.get(sid)
            if w is not None:
                try:
                    view = memoryview(payload)
                    while view:  # a regular file of ours (O_EXCL): never blocks
                        view = view[os.write(w[0], view):]
                except OSError as e:
                    self.writes.pop(sid)
                    os.close(w[0])
                    _unlink_quiet(w[1])
                    conn.send({"t": "err", "id": sid, "code": _errcode(e),
                               "message": f"writing {w[2]}: {e.strerror}"})
        elif t == "eof":
            self._write_close(conn, sid, abort=bool(h.get("abort")))
        elif t == "read":
            threading.Thread(target=self._read, args=(conn, sid, h["path"]), daemon=True).start()
        elif t == "stat":
            conn.send({"t": "ok", "id": sid, "stat": _stat(h["path"])})
        elif t == "list":
            path = h["path"]
            self._in_thread(conn, sid, lambda: _listing(path))
        elif t == "remove":
            path, recursive = h["path"], bool(h.get("recursive", True))
            self._in_thread(conn, sid, lambda: _remove(path, recursive))
        elif t == "watch":
            watch.start(conn, sid, h, self.watches)
        elif t == "untar":
            archive, dest = h["archive"], h["path"]
            self._in_thread(conn, sid, lambda: _untar(archive, dest))
        elif t == "tar":
            threading.Thread(target=self._tar, args=(conn, sid, h["path"]), daemon=True).start()
        elif t == "mkdir":
            os.makedirs(h["path"], mode=0o755, exist_ok=True)
            conn.send({"t": "ok", "id": sid, "stat": _stat(h["path"])})
        else:
            conn.send({"t": "err", "id": sid, "code": P.E_INVALID, "message": f"unknown {t!r}"})

    # ---- background commands --------------------------------------------------------
    def _bg(self, conn: Conn, t: str, sid: int, h: P.Header) -> None:
        if t == "bg_list":
            infos = [b.info() for b in self.bg.values()]
            conn.send({"t": "ok", "id": sid, "n": len(infos)},
                      json.dumps(infos, separators=(",", ":")).encode())
            return
        pid = h.get("pid")
        bg = self.bg.get(pid) if isinstance(pid, int) else None
        if bg is None:
            conn.send({"t": "err", "id": sid, "code": P.E_NOT_FOUND,
                       "message": f"no background command with pid {pid!r}"})
        elif t == "bg_info":
            conn.send({"t": "ok", "id": sid, "info": bg.info()})
        elif t == "bg_attach":
            off = h.get("offset")
            rd = Reader(bg, conn, sid, off if isinstance(off, int) else 0,
                        h.get("follow") is True, self.readers)
            threading.Thread(target=rd.run, name=f"bg-read-{sid}", daemon=True).start()
        elif t == "bg_resize":
            fd = bg.ex.pty_fd
            if fd is None or bg.result is not None:
                conn.send({"t": "err", "id": sid, "code": P.E_INVALID,
                           "message": f"{pid} is not a running terminal"})
            else:
                set_winsize(fd, h.get("cols"), h.get("rows"))
                conn.send({"t": "ok", "id": sid})
        elif t == "bg_signal":
            self._bg_signal(conn, sid, bg, h.get("signal"))
        elif t == "bg_wait":
            timeout = h.get("timeout")
            limit = float(timeout) if isinstance(timeout, (int, float)) else 60.0
            limit = min(max(limit, 0.0), 600.0)
            self._in_thread(conn, sid, lambda: {"ended": bg.wait(limit), "info": bg.info()})
        elif t == "bg_stdin":
            ex = bg.ex
            if not ex.stdin_open:
                conn.send({"t": "err", "id": sid, "code": P.E_INVALID,
                           "message": f"the stdin of {pid} is closed"})
            else:
                self.stdin_to[sid] = ex
                conn.send({"t": "ok", "id": sid})
        else:
            conn.send({"t": "err", "id": sid, "code": P.E_INVALID, "message": f"unknown {t!r}"})

    @staticmethod
    def _bg_signal(conn: Conn, sid: int, bg: Background, sig: object) -> None:
        if not isinstance(sig, int) or not 0 < sig < 65:
            conn.send({"t": "err", "id": sid, "code": P.E_INVALID,
                       "message": f"bad signal {sig!r}"})
            return
        if bg.result is None:  # not reaped, so the pid is still this command's
            if sig == signal.SIGKILL:
                bg.ex.kill("killed")  # its whole cgroup (or tree)
            else:
                try:
                    os.killpg(bg.pid, sig)  # its process group (it leads one)
                except OSError:
                    with contextlib.suppress(OSError):
                        os.kill(bg.pid, sig)
        conn.send({"t": "ok", "id": sid, "running": bg.result is None})

    def _in_thread(self, conn: Conn, sid: int, fn: Callable[[], Any]) -> None:
        """Answer a request from a thread of its own (it may take long: a big tree)."""
        def run() -> None:
            try:
                out = fn()
                fields, payload = out if isinstance(out, tuple) else (out or {}, b"")
                conn.send({"t": "ok", "id": sid, **fields}, payload)
            except Closed:
                pass
            except OSError as e:
                with contextlib.suppress(Closed):
                    conn.send({"t": "err", "id": sid, "code": _errcode(e),
                               "message": f"{e.strerror or e}"})
            except Exception as e:
                with contextlib.suppress(Closed):
                    conn.send({"t": "err", "id": sid, "code": P.E_INTERNAL,
                               "message": f"{type(e).__name__}: {e}"})
        threading.Thread(target=run, daemon=True).start()

    # ---- files ----------------------------------------------------------------------
    def _write_open(self, conn: Conn, sid: int, h: P.Header) -> None:
        path: str = h["path"]
        parent = os.path.dirname(path) or "/"
        os.makedirs(parent, exist_ok=True)
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        fd, tmp = create_beside(path)
        self.writes[sid] = (fd, tmp, path)

    def _write_close(self, conn: Conn, sid: int, abort: bool) -> None:
        w = self.writes.pop(sid, None)
        if w is None:
            return
        fd, tmp, path = w
        try:
            try:
                if abort:
                    _unlink_quiet(tmp)
                    return
                try:  # a replaced file keeps its mode
                    os.fchmod(fd, stat_mod.S_IMODE(os.stat(path).st_mode))
                except OSError:
                    pass
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            _unlink_quiet(tmp)
            conn.send({"t": "err", "id": sid, "code": _errcode(e), "message": f"{e.strerror}"})
            return
        conn.send({"t": "ok", "id": sid, "stat": _stat(path)})

    def _tar(self, conn: Conn, sid: int, path: str) -> None:
        """Stream a tar of the directory at path: ``ok`` (length unknown), ``data``...,
        ``eof`` or ``err`` (as a file read; the host ends one early with ``kill``)."""
        def send(b: bytes) -> None:
            for i in range(0, len(b), P.CHUNK):
                conn.send_data(sid, {"t": "data", "id": sid}, b[i:i + P.CHUNK])
        from . import tarx  # (only when asked)
        try:
            try:
                if not stat_mod.S_ISDIR(os.stat(path).st_mode):
                    raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
            except OSError as e:
                conn.send({"t": "err", "id": sid, "code": _errcode(e),
                           "message": f"{path}: {e.strerror}"})
                return
            conn.open_stream(sid)
            try:
                conn.send({"t": "ok", "id": sid, "size": 0, "exact": False})
                tarx.pack(path, send)
                conn.send({"t": "eof", "id": sid})
            finally:
                conn.close_stream(sid)
        except Closed:
            pass
        except OSError as e:
            with contextlib.suppress(Closed):
                conn.send({"t": "err", "id": sid, "code": _errcode(e),
                           "message": f"{path}: {e.strerror or e}"})

    def _read(self, conn: Conn, sid: int, path: str) -> None:
        """Stream a regular file. ``exact`` in the answer: the file has real blocks, so its
        size is its length, and exactly ``size`` bytes follow (a file that grows is cut
        there; one that shrank is an error). Otherwise (procfs, sysfs: size 0 or made up)
        the length is known only at ``eof``."""
        try:
            try:
                fd, st = open_regular(path)
            except OSError as e:
                conn.send({"t": "err", "id": sid, "code": _errcode(e),
                           "message": f"{path}: {e.strerror}"})
                return
            try:
                exact = st.st_size > 0 and st.st_blocks > 0
                left = st.st_size if exact else -1
                conn.open_stream(sid)
                conn.send({"t": "ok", "id": sid, "size": st.st_size, "exact": exact})
                try:
                    while left != 0:
                        data = os.read(fd, P.CHUNK if left < 0 else min(P.CHUNK, left))
                        if not data:
                            if left > 0:
                                raise OSError(errno.EIO, f"{path} shrank while being read")
                            break
                        if left > 0:
                            left -= len(data)
                        conn.send_data(sid, {"t": "data", "id": sid}, data)
                    conn.send({"t": "eof", "id": sid})
                finally:
                    conn.close_stream(sid)
            finally:
                os.close(fd)
        except Closed:
            pass
        except OSError as e:
            with contextlib.suppress(Closed):
                conn.send({"t": "err", "id": sid, "code": _errcode(e),
                           "message": f"{path}: {e.strerror or e}"})


def _untar(archive: str, dest: str) -> dict[str, Any]:
    """Extract the uploaded archive into dest (every entry checked first: a refused
    archive writes nothing); the archive is removed either way."""
    import tarfile  # (tarfile and tarx: only when asked; not resident in every agent)

    from . import tarx
    try:
        return {"extracted": tarx.extract(archive, dest)}
    except tarx.Refused as e:
        raise OSError(errno.EINVAL, f"archive refused, nothing written: {e}") from None
    except tarfile.TarError as e:
        raise OSError(errno.EINVAL, f"not a readable tar archive: {e}") from None
    finally:
        _unlink_quiet(archive)


def _listing(path: str) -> tuple[dict[str, Any], bytes]:
    """A directory's entries, as JSON in the payload (a header holds at most 64 KiB: a few
    hundred entries); as many as fit in one frame."""
    entries = _list(path)
    while True:
        data = json.dumps(entries, separators=(",", ":")).encode()
        if len(data) <= P.MAX_PAYLOAD or not entries:
            return {"n": len(entries)}, data
        entries = entries[: len(entries) // 2]


def main(spawner: Spawner | None = None) -> None:
    """Start-up, in this order: signals shielded; in root mode (``privs``) the spawner is
    forked (before any thread, before the key is read: ``__main__`` does it before
    importing this module, else it is done here), the cgroup tree mounted, and the agent
    drops to the user's effective ids; then it reads its key and becomes non-dumpable."""
    privs.shield_signals()
    not_dumpable()
    os.umask(0o022)
    sys.stdout = sys.stderr  # nothing of ours goes to a guest-visible stdout
    cgroups: Cgroups | None = None
    if privs.root_mode():
        if spawner is None:
            spawner = Spawner()
            spawner.fork()
        cgroups = Cgroups.setup()
        key = read_key()
        privs.drop_to_user()
    else:
        key = read_key()
    not_dumpable()
    drop_inheritable_caps()
    Agent(key, spawner, cgroups).serve_forever()
