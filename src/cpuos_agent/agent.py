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

import errno
import os
import signal
import stat as stat_mod
import sys
import threading
import time
from typing import BinaryIO

from . import protocol as P
from .conn import Conn
from .exec import Exec
from .files import _errcode, _list, _remove, _stat, _unlink_quiet
from .identity import apply_identity, drop_inheritable_caps, not_dumpable, read_key
from .reaper import Reaper
from .transport import Closed, Quiesce, Transport, transport_for

SOCKET_PATH = os.environ.get("CPUOS_AGENT_SOCKET", "/run/cpuos/agent.sock")


class Agent:
    def __init__(self, key: str | None = None) -> None:
        self.key = key if key is not None else read_key()
        self.reaper = Reaper()
        self.execs: dict[int, Exec] = {}
        self.writes: dict[int, tuple[BinaryIO, str, str]] = {}

    # ---- connection lifecycle -------------------------------------------------------
    def serve_forever(self, transport: Transport | None = None) -> None:
        transport = transport or transport_for(SOCKET_PATH)
        while True:
            conn = Conn(transport.connect())
            quiesced = False
            try:
                conn.send({"t": "hello", "version": P.PROTOCOL_VERSION, "pid": os.getpid(),
                           "uid": os.getuid(), "transport": transport.kind,
                           "key": self.key})
                self._serve(conn)
            except Quiesce:
                quiesced = True
            except (Closed, P.ProtocolError, OSError):
                pass
            finally:
                conn.shutdown()
                for ex in list(self.execs.values()):
                    ex.kill("disconnected")
                for f, tmp, _ in self.writes.values():
                    f.close()
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
            conn.send({"t": "identity_ok", "id": sid, "applied": apply_identity(h)})
        elif t == "quiesce":
            if self.execs or self.writes:
                conn.send({"t": "err", "id": sid, "code": P.E_EXISTS,
                           "message": "commands or file transfers are still running"})
                return
            conn.send({"t": "ok", "id": sid})
            raise Quiesce()
        elif t == "exec":
            Exec(self, conn, sid, h).start()
        elif t == "stdin":
            ex = self.execs.get(sid)
            if ex is not None:
                ex.feed_stdin(payload if payload else None)
        elif t == "kill":
            ex = self.execs.get(sid)
            if ex is not None:
                ex.kill(str(h.get("reason") or "killed"))
        elif t == "credit":
            conn.add_credit(sid, int(h.get("n", 0)))
        elif t == "write":
            self._write_open(conn, sid, h)
        elif t == "data":
            w = self.writes.get(sid)
            if w is not None:
                try:
                    w[0].write(payload)
                except OSError as e:
                    self.writes.pop(sid)
                    w[0].close()
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
            conn.send({"t": "ok", "id": sid, "entries": _list(h["path"])})
        elif t == "remove":
            _remove(h["path"], bool(h.get("recursive", True)))
            conn.send({"t": "ok", "id": sid})
        elif t == "mkdir":
            os.makedirs(h["path"], mode=0o755, exist_ok=True)
            conn.send({"t": "ok", "id": sid, "stat": _stat(h["path"])})
        else:
            conn.send({"t": "err", "id": sid, "code": P.E_INVALID, "message": f"unknown {t!r}"})

    # ---- files ----------------------------------------------------------------------
    def _write_open(self, conn: Conn, sid: int, h: P.Header) -> None:
        path: str = h["path"]
        parent = os.path.dirname(path) or "/"
        os.makedirs(parent, exist_ok=True)
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        tmp = os.path.join(parent, f".{os.path.basename(path)}.cpuos-{sid}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        self.writes[sid] = (os.fdopen(fd, "wb", buffering=1 << 20), tmp, path)

    def _write_close(self, conn: Conn, sid: int, abort: bool) -> None:
        w = self.writes.pop(sid, None)
        if w is None:
            return
        f, tmp, path = w
        try:
            f.close()
            if abort:
                _unlink_quiet(tmp)
                return
            mode = None
            try:
                mode = stat_mod.S_IMODE(os.stat(path).st_mode)
            except OSError:
                pass
            if mode is not None:
                os.chmod(tmp, mode)
            os.replace(tmp, path)
        except OSError as e:
            _unlink_quiet(tmp)
            conn.send({"t": "err", "id": sid, "code": _errcode(e), "message": f"{e.strerror}"})
            return
        conn.send({"t": "ok", "id": sid, "stat": _stat(path)})

    def _read(self, conn: Conn, sid: int, path: str) -> None:
        try:
            try:
                f = open(path, "rb", buffering=0)
            except OSError as e:
                conn.send({"t": "err", "id": sid, "code": _errcode(e),
                           "message": f"{path}: {e.strerror}"})
                return
            with f:
                st = os.fstat(f.fileno())
                if stat_mod.S_ISDIR(st.st_mode):
                    conn.send({"t": "err", "id": sid, "code": P.E_IS_DIR,
                               "message": f"{path}: is a directory"})
                    return
                conn.open_stream(sid)
                conn.send({"t": "ok", "id": sid, "size": st.st_size})
                try:
                    while True:
                        data = f.read(P.CHUNK)
                        if not data:
                            break
                        conn.send_data(sid, {"t": "data", "id": sid}, data)
                    conn.send({"t": "eof", "id": sid})
                finally:
                    conn.close_stream(sid)
        except Closed:
            pass
        except OSError as e:
            try:
                conn.send({"t": "err", "id": sid, "code": _errcode(e), "message": str(e)})
            except Closed:
                pass


def main() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    os.umask(0o022)
    sys.stdout = sys.stderr  # nothing of ours goes to a guest-visible stdout
    not_dumpable()
    drop_inheritable_caps()
    Agent().serve_forever()


if __name__ == "__main__":
    main()
