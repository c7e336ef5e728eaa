"""The guest agent's transports, with the real agent main loop in a subprocess (its reaper
waits for every child of its process, so it never runs inside pytest's own process):

* a unix socket the test listens on (the gVisor path);
* a pty standing in for the virtio-serial character device: the slave side is the
  "device" (behind a symlink, like /dev/virtio-ports/<name>), the master is the host.
  Closing the master is a host hang-up; a new pty behind the same symlink is the host
  coming back (the agent reopens a device that stays hung up).

Plus ``DeviceLink`` over a socketpair (a hang-up is the peer closing) and the transport
selection. No root, no guest.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import time
import tty
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import cpuos_agent
from cpuos_agent import conn as C
from cpuos_agent import transport as A
from cpuos_agent import protocol as P

SRC = str(Path(cpuos_agent.__file__).resolve().parent.parent)
TIMEOUT = 20.0


# ---- a host end over any fd -------------------------------------------------------------

class Host:
    """The host end of one session: frames over an fd (a socket or a pty master)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.dec = P.FrameDecoder()
        self.frames: list[tuple[P.Header, bytes]] = []

    def send(self, header: P.Header, payload: bytes = b"") -> None:
        data = P.encode(header, payload)
        while data:
            n = os.write(self.fd, data)
            data = data[n:]

    def recv(self, timeout: float = TIMEOUT) -> tuple[P.Header, bytes]:
        deadline = time.monotonic() + timeout
        while not self.frames:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("no frame from the agent in time")
            r, _, _ = select.select([self.fd], [], [], left)
            if not r:
                continue
            try:
                data = os.read(self.fd, 1 << 16)
            except OSError as e:
                raise AssertionError(f"host end: {e}") from None
            if not data:
                raise AssertionError("agent closed the connection")
            self.frames += self.dec.feed(data)
        return self.frames.pop(0)

    def expect_hello(self) -> P.Header:
        h, _ = self.recv()
        assert h["t"] == "hello", h
        assert h["version"] == P.PROTOCOL_VERSION
        assert isinstance(h["pid"], int)
        return h

    def ping(self, sid: int) -> None:
        self.send({"t": "ping", "id": sid})
        h, _ = self.recv()
        assert h["t"] == "pong" and h["id"] == sid, h

    def exec_echo(self, sid: int, cwd: Path) -> None:
        self.send({"t": "exec", "id": sid, "argv": ["echo", "hi"], "cwd": str(cwd)})
        h, _ = self.recv()
        assert h["t"] == "started" and h["id"] == sid, h
        out = b""
        while True:
            h, payload = self.recv()
            assert h["id"] == sid, h
            if h["t"] == "out":
                assert h["fd"] == 1
                out += payload
            else:
                break
        assert h["t"] == "exit", h
        assert h["exit_code"] == 0 and h["signal"] is None and not h["timed_out"], h
        assert out == b"hi\n"


@pytest.fixture
def run_agent(tmp_path: Path) -> Iterator[Callable[[str], subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []

    def start(path: str) -> subprocess.Popen[bytes]:
        log = tmp_path / f"agent-{len(procs)}.log"
        logs.append(log)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": SRC,
               "CPUOS_AGENT_SOCKET": path, "PYTHONDONTWRITEBYTECODE": "1"}
        with open(log, "wb") as f:
            p = subprocess.Popen([sys.executable, "-m", "cpuos_agent"], env=env,
                                 stdin=subprocess.DEVNULL, stdout=f, stderr=f,
                                 start_new_session=True)
        procs.append(p)
        return p

    yield start
    for p in procs:
        alive = p.poll() is None
        if alive:
            p.kill()
        p.wait()
        assert alive, f"the agent exited ({p.returncode}): " + " ".join(
            log.read_text(errors="replace")[-1500:] for log in logs)


# ---- (a) unix socket ----------------------------------------------------------------------

def test_unix_socket_hello_ping_exec_and_reconnect(
        tmp_path: Path, run_agent: Callable[[str], subprocess.Popen[bytes]]) -> None:
    path = tmp_path / "agent.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(2)
    srv.settimeout(TIMEOUT)
    proc = run_agent(str(path))
    try:
        for round_ in range(2):  # the second time: the agent reconnected after our close
            conn, _ = srv.accept()
            try:
                host = Host(conn.fileno())
                assert host.expect_hello()["pid"] == proc.pid
                host.ping(1)
                host.exec_echo(2 + round_, tmp_path)
                host.ping(9)
            finally:
                conn.close()
    finally:
        srv.close()


def test_unix_socket_quiesce_then_reconnect(
        tmp_path: Path, run_agent: Callable[[str], subprocess.Popen[bytes]]) -> None:
    path = tmp_path / "agent.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(2)
    srv.settimeout(TIMEOUT)
    run_agent(str(path))
    conn, _ = srv.accept()
    host = Host(conn.fileno())
    host.expect_hello()
    host.send({"t": "quiesce", "id": 1})
    h, _ = host.recv()
    assert h == {"t": "ok", "id": 1}
    conn.settimeout(TIMEOUT)
    assert conn.recv(1) == b""  # the agent dropped the connection itself
    conn.close()
    conn, _ = srv.accept()
    with conn:
        host = Host(conn.fileno())
        host.expect_hello()
        host.ping(2)
    srv.close()


# ---- (b) a pty as the character device -----------------------------------------------------

class FakePort:
    """A pty pair; the slave is reached through ``link`` (a symlink, like
    /dev/virtio-ports/cpuos.agent). ``hangup`` closes the master, ``plug`` makes a new pair
    and points the symlink at its slave."""

    def __init__(self, link: Path) -> None:
        self.link = link
        self.master = -1
        self.slave = -1
        self.plug()

    def plug(self) -> None:
        m, s = os.openpty()
        tty.setraw(s)  # bytes pass unchanged, no echo
        tmp = self.link.with_name(self.link.name + ".new")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(os.ttyname(s))
        os.replace(tmp, self.link)
        self.master, self.slave = m, s  # the slave stays open: no EIO on our master

    def hangup(self) -> None:
        os.close(self.master)
        os.close(self.slave)
        self.master = self.slave = -1

    def close(self) -> None:
        if self.master >= 0:
            self.hangup()


@pytest.fixture
def port(tmp_path: Path) -> Iterator[FakePort]:
    p = FakePort(tmp_path / "cpuos.agent")
    yield p
    p.close()


def test_char_device_selected_for_a_pty(port: FakePort) -> None:
    assert isinstance(A.transport_for(str(port.link)), A.CharDeviceTransport)


def test_char_device_hello_ping_exec_and_host_reconnect(
        tmp_path: Path, port: FakePort,
        run_agent: Callable[[str], subprocess.Popen[bytes]]) -> None:
    proc = run_agent(str(port.link))
    host = Host(port.master)
    assert host.expect_hello()["pid"] == proc.pid
    host.ping(1)
    host.exec_echo(2, tmp_path)
    # half a frame, then the host goes away: the next session must start from a clean
    # decoder with a fresh hello
    host.send({"t": "ping", "id": 3})
    os.write(port.master, P.encode({"t": "ping", "id": 4})[:6])
    time.sleep(0.3)
    port.hangup()
    time.sleep(0.3)
    port.plug()
    host = Host(port.master)
    assert host.expect_hello()["pid"] == proc.pid
    host.ping(5)
    host.exec_echo(6, tmp_path)


def test_char_device_long_running_exec_killed_on_hangup(
        tmp_path: Path, port: FakePort,
        run_agent: Callable[[str], subprocess.Popen[bytes]]) -> None:
    run_agent(str(port.link))
    host = Host(port.master)
    host.expect_hello()
    marker = tmp_path / "still-running"
    host.send({"t": "exec", "id": 1, "cwd": str(tmp_path),
               "argv": ["sh", "-c", f"sleep 0.5; while :; do touch {marker}; sleep 0.1; done"]})
    h, _ = host.recv()
    assert h["t"] == "started"
    pid = h["pid"]
    port.hangup()
    deadline = time.monotonic() + TIMEOUT
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}"), "exec survived the host hang-up"
    port.plug()
    host = Host(port.master)
    host.expect_hello()
    host.ping(2)


def test_char_device_quiesce_waits_for_the_host_to_hang_up(
        tmp_path: Path, port: FakePort,
        run_agent: Callable[[str], subprocess.Popen[bytes]]) -> None:
    run_agent(str(port.link))
    host = Host(port.master)
    host.expect_hello()
    host.send({"t": "quiesce", "id": 1})
    h, _ = host.recv()
    assert h == {"t": "ok", "id": 1}
    port.hangup()  # what the host does after a quiesce (QEMU's socket closes)
    port.plug()
    host = Host(port.master)
    host.expect_hello()
    host.ping(2)


# ---- DeviceLink semantics over a socketpair ------------------------------------------------

def _pair() -> tuple[socket.socket, A.DeviceLink]:
    a, b = socket.socketpair()
    b.setblocking(False)
    return a, A.DeviceLink(b.detach())


def test_device_link_reads_frames_and_ends_on_hangup() -> None:
    host, link = _pair()
    try:
        frames = [({"t": "ping", "id": i}, os.urandom(i * 1000)) for i in range(1, 20)]
        blob = b"".join(P.encode(h, p) for h, p in frames)

        def feed() -> None:
            for i in range(0, len(blob), 777):
                host.sendall(blob[i:i + 777])

        t = threading.Thread(target=feed)
        t.start()
        got = [P.read_frame_sync(link.rfile) for _ in frames]
        t.join()
        assert got == frames
        link.sendall(P.encode({"t": "pong"}))
        assert host.recv(100) == P.encode({"t": "pong"})
        host.close()  # the host hangs up
        assert P.read_frame_sync(link.rfile) is None
        assert link.hungup
        with pytest.raises(OSError):
            link.sendall(b"x")
    finally:
        link.close()
        link.close()  # idempotent


def test_device_link_close_stops_a_blocked_writer() -> None:
    """A writer blocked on a full device gives up once the session is closed: nothing of an
    old session can be written after the next one began."""
    host, link = _pair()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            link.sendall(b"x" * (16 << 20))  # far more than the socket buffers hold
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=write)
    t.start()
    time.sleep(0.3)
    assert t.is_alive()
    t0 = time.monotonic()
    link.close()
    t.join(5)
    assert not t.is_alive()
    assert time.monotonic() - t0 < 2
    assert errors and isinstance(errors[0], OSError)
    assert link.fd == -1
    host.close()


def test_conn_send_raises_closed_after_hangup() -> None:
    host, link = _pair()
    conn = C.Conn(link)
    conn.send({"t": "hello"})
    assert host.recv(100) == P.encode({"t": "hello"})
    host.close()
    assert P.read_frame_sync(conn.rfile) is None
    with pytest.raises(A.Closed):
        conn.send({"t": "pong"})
    conn.shutdown()


def test_transport_selection(tmp_path: Path) -> None:
    assert isinstance(A.transport_for(str(tmp_path / "agent.sock")), A.UnixSocketTransport)
    assert isinstance(A.transport_for("/run/cpuos/agent.sock"), A.UnixSocketTransport)
    assert isinstance(A.transport_for("/dev/vport0p1"), A.CharDeviceTransport)
    assert isinstance(A.transport_for("/dev/virtio-ports/cpuos.agent"),
                      A.CharDeviceTransport)
    assert isinstance(A.transport_for("/dev/null"), A.CharDeviceTransport)


# ---- CharDeviceTransport over a fake device ------------------------------------------------

class FakeDevice(A.CharDeviceTransport):
    """A device whose every open() yields one end of a socketpair; the test holds the other
    end (the host). A closed host end is a device that opens but reports POLLHUP, like a
    virtio-serial port while QEMU is not connected."""

    POLL = 0.01
    REOPEN = 0.2
    HANGUP_WAIT = 0.5

    def __init__(self) -> None:
        super().__init__("/dev/fake-port")
        self.host_up = False
        self.hosts: list[socket.socket] = []
        self.opens = 0

    def _try_open(self) -> int | None:
        self.opens += 1
        guest, host = socket.socketpair()
        guest.setblocking(False)
        if not self.host_up:
            host.close()
        else:
            self.hosts.append(host)
        return guest.detach()


def test_char_device_connect_waits_for_the_host() -> None:
    dev = FakeDevice()
    got: list[A.Link] = []
    t = threading.Thread(target=lambda: got.append(dev.connect()))
    t.start()
    time.sleep(0.5)
    assert t.is_alive() and not got  # no session while the host is away
    assert 2 <= dev.opens <= 10  # reopened about every REOPEN, no busy loop
    dev.host_up = True
    t.join(5)
    assert got
    link = got[0]
    assert isinstance(link, A.DeviceLink)
    link.sendall(P.encode({"t": "hello"}))
    assert dev.hosts[-1].recv(100) == P.encode({"t": "hello"})
    link.close()
    for h in dev.hosts:
        h.close()


def test_char_device_after_quiesce_waits_for_the_hangup() -> None:
    dev = FakeDevice()
    dev.host_up = True
    link = dev.connect()
    link.close()
    # the host stays connected: the agent waits HANGUP_WAIT, then goes on
    t0 = time.monotonic()
    dev.after_session(link, quiesced=True)
    assert dev.HANGUP_WAIT <= time.monotonic() - t0 < dev.HANGUP_WAIT + 1
    # the host hangs up: no waiting
    dev.host_up = False
    t0 = time.monotonic()
    dev.after_session(link, quiesced=True)
    assert time.monotonic() - t0 < 0.2
    # a session that ended with a hang-up: nothing to wait for
    hung = A.DeviceLink(os.open("/dev/null", os.O_RDWR))
    hung.hungup = True
    hung.close()
    t0 = time.monotonic()
    dev.host_up = True
    dev.after_session(hung, quiesced=True)
    assert time.monotonic() - t0 < 0.1
    for h in dev.hosts:
        h.close()
