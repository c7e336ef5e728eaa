"""The code interpreter's driver (``sbx.run_code``): one IPython kernel per sandbox, driven
with jupyter_client.

It runs inside the sandbox as the sandbox user, started by the ``code-interpreter``
template's start command (``python3 -m cpuos_agent.interp_driver``), so the kernel is up
and warm (pandas and matplotlib's inline backend imported) in the template snapshot (at a
cold boot it starts the kernel in the background and listens at once: a create does not
wait for it; on an emulated CPU it waits for the first request). In a template without it
(the plain ``python``) the daemon starts it on the first run_code
(cpuosd.lifecycle.interpreter).
The kernel is its child (jupyter_client's ``KernelManager``): a timeout interrupts the
running cell with SIGINT and the kernel's state stays. The kernel's ZMQ channels are unix
sockets in a directory of the sandbox user's (mode 0700), not TCP ports: nothing outside
this sandbox reaches them.

The host reaches the driver through the agent (``dial``: a byte stream to ``SOCK``). One
request per connection, a JSON line in::

    {"op": "run", "code": "...", "language": "python", "timeout": 30}
    {"op": "restart", "language": "python"}

and JSON lines out, as the cell runs::

    {"t": "stream", "name": "stdout"|"stderr", "text": "..."}
    {"t": "cut", "name": "stdout"|"stderr", "dropped": n}   (then the stream's tail)
    {"t": "display", "main": bool, "data": {"text/plain": ..., "image/png": base64, ...}}
    {"t": "error", "ename": ..., "evalue": ..., "traceback": "..."}
    {"t": "done", "status": "ok"|"error"|"timeout"|"died"|"busy"|"invalid",
     "execution_count": n, "timed_out": bool, "restarted": bool, "dropped_items": n}

A connection closed by the host while its cell runs interrupts the cell. What this sends is
bounded (stream head and tail, display items and their sizes); the host bounds it again
and trusts none of it (code in the sandbox can replace this program).

Unlike the rest of ``cpuos_agent`` this module is not stdlib-only: it needs jupyter_client
and ipykernel (the ``python`` and ``code-interpreter`` templates have them); nothing else
imports it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import select
import socket
import sys
import threading
import time
from collections import deque
from typing import Any

SOCK_DIR = "/tmp/.cpuos-kernel"
SOCK = SOCK_DIR + "/driver.sock"
MAX_REQUEST = 4 << 20  # bytes of one request line
STREAM_HEAD = 1 << 20  # chars of a stream sent as they come; then only the tail is kept
STREAM_TAIL = 1 << 20
MAX_ITEMS = 32  # display items (figures, results) per cell
MAX_FORMAT = 4 << 20  # bytes of one item's format (a PNG, an HTML table); bigger: left out
INTERRUPT_GRACE = 5.0  # s an interrupted cell gets to stop before the kernel is restarted
KEEP_FORMATS = ("text/plain", "text/html", "text/markdown", "text/latex", "image/png",
                "image/jpeg", "image/svg+xml", "application/json")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# Run before the snapshot (and after a restart): what a first plot or DataFrame would load.
WARM = """
def __cpuos_warm():
    import io
    try:
        import matplotlib.pyplot as plt
        fig = plt.figure()
        plt.plot([1, 2])
        fig.savefig(io.BytesIO(), format="png")
        plt.close(fig)
    except Exception:
        pass
    try:
        import pandas
        pandas.DataFrame({"a": [1]})._repr_html_()
    except Exception:
        pass
__cpuos_warm()
del __cpuos_warm
"""
KERNEL_ARGS = ["--HistoryManager.enabled=False", "--InteractiveShell.colors=NoColor"]


class Kernel:
    """One kernel of one language, one cell at a time. jupyter_client's KernelManager
    starts, interrupts and restarts it and signs its messages; the shell and iopub
    channels are plain (synchronous) ZMQ sockets polled here: jupyter_client's blocking
    client runs an asyncio loop per call, which cost more than the cell under gVisor."""

    def __init__(self, language: str, spec_name: str) -> None:
        self.language, self.spec_name = language, spec_name
        self.lock = threading.Lock()
        self.km: Any = None
        self.zmq: Any = None
        self.shell: Any = None
        self.iopub: Any = None
        self.poller: Any = None

    def start(self) -> None:
        jc = importlib.import_module("jupyter_client")
        self.zmq = importlib.import_module("zmq")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MPLBACKEND")}
        env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
        # ZMQ over unix sockets in our 0700 directory: no TCP port at all, and no look-up of
        # "localhost" addresses (jupyter_client resolves the hostname for its tcp default,
        # which waits 20 s for a resolver when the sandbox has no network)
        self.km = jc.KernelManager(kernel_name=self.spec_name, transport="ipc",
                                   ip=f"{SOCK_DIR}/{self.language}")
        self.km.start_kernel(extra_arguments=KERNEL_ARGS, env=env, cwd=os.getcwd())
        self._connect()

    def _connect(self) -> None:
        for sock in (self.shell, self.iopub):
            if sock is not None:
                sock.close(linger=0)
        self.shell = self.km.connect_shell()
        self.iopub = self.km.connect_iopub()
        self.poller = self.zmq.Poller()
        self.poller.register(self.shell, self.zmq.POLLIN)
        self.poller.register(self.iopub, self.zmq.POLLIN)
        self._wait_ready(120)
        if self.language == "python":
            self._quiet(WARM, 120)

    def _send(self, kind: str, content: dict[str, Any]) -> str:
        msg = self.km.session.send(self.shell, kind, content)
        return str(msg["header"]["msg_id"])

    def _recv(self, timeout: float) -> list[tuple[str, dict[str, Any]]]:
        """What arrived within ``timeout`` s: (channel, message), iopub's first."""
        ready = dict(self.poller.poll(max(0, int(timeout * 1000))))
        out = []
        for name, sock in (("iopub", self.iopub), ("shell", self.shell)):
            if sock not in ready:
                continue
            while True:
                try:
                    _, msg = self.km.session.recv(sock, mode=self.zmq.NOBLOCK)
                except (ValueError, KeyError):  # a message that does not verify
                    continue
                if msg is None:
                    break
                out.append((name, msg))
        return out

    def _wait_ready(self, timeout: float) -> None:
        """Until the kernel answers on shell and its iopub reaches us (a SUB socket
        connects late: what is published before is lost)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            mid = self._send("kernel_info_request", {})
            replied = heard = False
            end = time.monotonic() + 1.0
            while time.monotonic() < end and not (replied and heard):
                for name, m in self._recv(end - time.monotonic()):
                    heard = heard or name == "iopub"
                    replied = replied or (name == "shell" and _parent(m) == mid)
            if replied and heard:
                self._recv(0.05)  # the rest of that request's status messages
                return
        raise RuntimeError("the kernel did not become ready")

    def _quiet(self, code: str, timeout: float) -> None:
        """Run code without history or output; wait for its reply."""
        mid = self._send("execute_request", {"code": code, "silent": True,
                                             "store_history": False, "user_expressions": {},
                                             "allow_stdin": False, "stop_on_error": False})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(n == "shell" and _parent(m) == mid
                   for n, m in self._recv(deadline - time.monotonic())):
                break
        self._recv(0.05)

    def restart(self) -> None:
        self.km.restart_kernel(now=True)
        self._connect()

    def run(self, code: str, timeout: float, send: Any, gone: Any) -> None:
        """Run one cell; ``send(dict)`` each message; ``gone()``: the host left."""
        out = Output(send)
        timed_out = restarted = False
        status = "ok"
        count: int | None = None
        self._recv(0)  # anything stale
        mid = self._send("execute_request", {"code": code, "silent": False,
                                             "store_history": True, "user_expressions": {},
                                             "allow_stdin": False, "stop_on_error": False})
        deadline = time.monotonic() + timeout
        interrupted_at: float | None = None
        idle = replied = False
        next_check = time.monotonic() + 0.5
        while not (idle and replied):
            now = time.monotonic()
            if interrupted_at is None and (now >= deadline or gone()):
                timed_out = now >= deadline
                self.km.interrupt_kernel()
                interrupted_at = now
            if interrupted_at is not None and now - interrupted_at > INTERRUPT_GRACE:
                self.restart()  # the cell ignored SIGINT: its state is lost
                restarted = True
                break
            if now >= next_check:
                next_check = now + 0.5
                if not self.km.is_alive():
                    status = "died"
                    self.restart()
                    restarted = True
                    break
            wait = 0.1 if interrupted_at is not None else min(0.25, deadline - now)
            for chan, m in self._recv(max(0.005, wait)):
                if _parent(m) != mid:
                    continue
                kind, c = m.get("msg_type"), m.get("content") or {}
                if chan == "shell":
                    replied = True
                    count = c.get("execution_count", count)
                    if c.get("status") == "error" and status == "ok":
                        status = "error"
                elif kind == "stream":
                    out.stream(str(c.get("name")), str(c.get("text", "")))
                elif kind in ("display_data", "execute_result", "update_display_data"):
                    out.display(c.get("data") or {}, kind == "execute_result")
                elif kind == "error":
                    status = "error"
                    out.error(c)
                elif kind == "execute_input":
                    count = c.get("execution_count", count)
                elif kind == "status" and c.get("execution_state") == "idle":
                    idle = True
        if timed_out:
            status = "timeout"
        out.finish()
        send({"t": "done", "status": status, "execution_count": count,
              "timed_out": timed_out, "restarted": restarted,
              "dropped_items": out.dropped_items})


def _parent(m: dict[str, Any]) -> Any:
    return (m.get("parent_header") or {}).get("msg_id")


class Output:
    """A cell's output as it goes out: each stream's head as it comes, then its tail."""

    def __init__(self, send: Any) -> None:
        self.send = send
        self.sent = {"stdout": 0, "stderr": 0}
        self.tail: dict[str, deque[str]] = {"stdout": deque(), "stderr": deque()}
        self.tail_len = {"stdout": 0, "stderr": 0}
        self.dropped = {"stdout": 0, "stderr": 0}
        self.items = 0
        self.dropped_items = 0

    def stream(self, name: str, text: str) -> None:
        if name not in self.sent:
            name = "stdout"
        room = STREAM_HEAD - self.sent[name]
        if room > 0:
            head, text = text[:room], text[room:]
            self.sent[name] += len(head)
            self.send({"t": "stream", "name": name, "text": head})
        if not text:
            return
        t = self.tail[name]
        t.append(text)
        self.tail_len[name] += len(text)
        while self.tail_len[name] - len(t[0]) >= STREAM_TAIL:
            self.dropped[name] += len(t[0])
            self.tail_len[name] -= len(t.popleft())

    def finish(self) -> None:
        for name in ("stdout", "stderr"):
            text = "".join(self.tail[name])
            if len(text) > STREAM_TAIL:
                self.dropped[name] += len(text) - STREAM_TAIL
                text = text[-STREAM_TAIL:]
            if self.dropped[name]:
                self.send({"t": "cut", "name": name, "dropped": self.dropped[name]})
            for i in range(0, len(text), 256 * 1024):
                self.send({"t": "stream", "name": name, "text": text[i:i + 256 * 1024]})

    def display(self, data: dict[str, Any], main: bool) -> None:
        if self.items >= MAX_ITEMS:
            self.dropped_items += 1
            return
        keep = {k: v for k, v in data.items() if k in KEEP_FORMATS and isinstance(v, str)
                and len(v) <= MAX_FORMAT * 4 // 3 + 4}
        if "application/json" in data and not isinstance(data["application/json"], str):
            js = json.dumps(data["application/json"])
            if len(js) <= MAX_FORMAT:
                keep["application/json"] = js
        if not keep:
            self.dropped_items += 1
            return
        self.items += 1
        self.send({"t": "display", "main": main, "data": keep})

    def error(self, c: dict[str, Any]) -> None:
        tb = "\n".join(str(x) for x in c.get("traceback") or [])
        self.send({"t": "error", "ename": str(c.get("ename"))[:1000],
                   "evalue": str(c.get("evalue"))[:10000],
                   "traceback": ANSI.sub("", tb)[-200000:]})


class Driver:
    def __init__(self) -> None:
        self.kernels: dict[str, Kernel] = {}
        self.start_lock = threading.Lock()

    def kernel(self, language: str) -> Kernel | None:
        with self.start_lock:
            k = self.kernels.get(language)
            if k is not None:
                return k
            spec = _spec_for(language)
            if spec is None:
                return None
            k = Kernel(language, spec)
            k.start()
            self.kernels[language] = k
            return k

    def serve(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SOCK)
        tmp = SOCK + ".new"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(tmp)
        srv.listen(64)
        os.rename(tmp, SOCK)  # it appears only once it is served (the template's ready check)
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()

    def handle(self, conn: socket.socket) -> None:
        lock = threading.Lock()

        def send(msg: dict[str, Any]) -> None:
            data = (json.dumps(msg, separators=(",", ":")) + "\n").encode()
            with lock:
                conn.sendall(data)

        def gone() -> bool:
            try:
                r, _, _ = select.select([conn], [], [], 0)
                return bool(r) and not conn.recv(1, socket.MSG_PEEK)
            except OSError:
                return True

        try:
            conn.settimeout(30)
            req = _read_line(conn)
            conn.settimeout(None)
            op = req.get("op")
            language = str(req.get("language") or "python")
            try:
                k = self.kernel(language)
            except Exception as e:  # (the kernel's own failure, e.g. a broken install)
                send({"t": "done", "status": "died",
                      "message": f"the {language} kernel did not start: {e}"[:500]})
                return
            if k is None:
                send({"t": "done", "status": "invalid",
                      "message": f"no {language} kernel in this sandbox"})
                return
            timeout = float(req.get("timeout") or 300)
            if not k.lock.acquire(timeout=timeout):
                send({"t": "done", "status": "busy",
                      "message": "the kernel was busy with another cell until the timeout"})
                return
            try:
                if op == "restart":
                    k.restart()
                    send({"t": "done", "status": "ok", "restarted": True})
                elif op == "run":
                    k.run(str(req.get("code", "")), timeout, send, gone)
                elif op == "ping":
                    send({"t": "done", "status": "ok", "pid": os.getpid()})
                else:
                    send({"t": "done", "status": "invalid", "message": f"unknown op {op!r}"})
            finally:
                k.lock.release()
        except (OSError, ValueError) as e:
            with contextlib.suppress(OSError):
                send({"t": "done", "status": "invalid", "message": str(e)[:500]})
        finally:
            conn.close()


def _read_line(conn: socket.socket) -> dict[str, Any]:
    buf = bytearray()
    while b"\n" not in buf:
        b = conn.recv(65536)
        if not b:
            break
        buf += b
        if len(buf) > MAX_REQUEST:
            raise ValueError("request too large")
    req = json.loads(bytes(buf).split(b"\n", 1)[0] or b"{}")
    if not isinstance(req, dict):
        raise ValueError("request must be a JSON object")
    return req


def _spec_for(language: str) -> str | None:
    """The kernelspec of a language: python's own kernel, else an installed kernelspec of
    that language (e.g. a Node kernel's ``javascript``)."""
    if language == "python":
        return "python3"
    try:
        ksm = importlib.import_module("jupyter_client.kernelspec").KernelSpecManager()
        for name, d in ksm.get_all_specs().items():
            if (d.get("spec") or {}).get("language", "").lower() == language.lower():
                return str(name)
    except Exception:
        return None
    return None


def _lazy() -> bool:
    """Start the kernel on the first request instead: when asked (CPUOS_KERNEL_LAZY=1), or
    on an emulated CPU (a microVM under QEMU's TCG, for tests only), where warming a kernel
    takes minutes."""
    if os.environ.get("CPUOS_KERNEL_LAZY") == "1":
        return True
    try:
        with open("/proc/cpuinfo") as f:
            return "QEMU TCG" in f.read(65536)
    except OSError:
        return False


def main() -> None:
    os.makedirs(SOCK_DIR, mode=0o700, exist_ok=True)
    os.chmod(SOCK_DIR, 0o700)
    with contextlib.suppress(OSError):
        os.chdir("/work")
    d = Driver()
    if _lazy():
        pass  # the first request starts it
    elif os.environ.get("CPUOS_TEMPLATE_SNAPSHOT") == "1":
        d.kernel("python")  # started and warmed before we listen: in the template snapshot
    else:  # a cold boot (no snapshot): its create does not wait for the kernel
        threading.Thread(target=d.kernel, args=("python",), daemon=True).start()
    print("cpuos kernel driver: ready", file=sys.stderr, flush=True)
    d.serve()


if __name__ == "__main__":
    main()
