"""Issue 23: E2B's own Python SDKs (``e2b``, ``e2b-code-interpreter``, unchanged, from PyPI)
against a real cpuosd, configured only through E2B's environment variables: the control
plane, commands, files, watches, ports, the code interpreter, pause/resume, and that it is
cpuos underneath (audit rows, the access token, the sandbox's end ending its streams)."""

from __future__ import annotations

import base64
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.daemon import Daemon, wait_until

pytestmark = [pytest.mark.e2e]

e2b = pytest.importorskip("e2b")
from e2b import CommandExitException, Sandbox, SandboxQuery  # noqa: E402
from e2b.exceptions import NotFoundException, SandboxException  # noqa: E402
from e2b.sandbox.commands.command_handle import PtySize  # noqa: E402
from e2b.sandbox.filesystem.filesystem import WriteEntry  # noqa: E402
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType  # noqa: E402


@pytest.fixture(scope="module")
def env(daemon: Daemon) -> Iterator[dict[str, str]]:
    """The SDKs' configuration, as a user would set it (nothing else is passed to them)."""
    mp = pytest.MonkeyPatch()
    vals = {"E2B_API_URL": daemon.url + "/e2b", "E2B_SANDBOX_URL": daemon.url + "/e2b",
            "E2B_API_KEY": daemon.key}
    for k, v in vals.items():
        mp.setenv(k, v)
    yield vals
    mp.undo()


@pytest.fixture(scope="module")
def sbx(env: dict[str, str]) -> Iterator[Sandbox]:
    s = Sandbox.create(timeout=600, envs={"GREETING": "hello"}, metadata={"suite": "e2b"})
    yield s
    s.kill()


def test_create_info_list_timeout_kill(env: dict[str, str], daemon: Daemon) -> None:
    s = Sandbox.create(timeout=120, metadata={"who": "lifecycle"})
    try:
        info = s.get_info()
        assert info.sandbox_id == s.sandbox_id and info.template_id == "base"
        assert info.metadata == {"who": "lifecycle"} and info.state.value == "running"
        assert s.is_running()
        # listed, filtered by metadata; another query does not list it
        ids = [x.sandbox_id for x in Sandbox.list(
            query=SandboxQuery(metadata={"who": "lifecycle"})).next_items()]
        assert ids == [s.sandbox_id]
        assert not Sandbox.list(query=SandboxQuery(metadata={"who": "nobody"})).next_items()
        # the same sandbox in cpuos's own API
        with daemon.client() as c:
            row = c.get(f"/sandboxes/{s.sandbox_id}").json()
        assert row["state"] == "running" and row["metadata"] == {"who": "lifecycle"}
        end0 = info.end_at
        s.set_timeout(600)
        assert s.get_info().end_at > end0
        same = Sandbox.connect(s.sandbox_id)
        assert same.commands.run("echo $((6 * 7))").stdout == "42\n"
    finally:
        assert s.kill() is True
    assert Sandbox.kill(s.sandbox_id) is False  # (E2B: a second kill says False)
    assert not s.is_running()
    with pytest.raises(NotFoundException):
        Sandbox.get_info(s.sandbox_id)


def test_paging_newest_first(env: dict[str, str]) -> None:
    a = Sandbox.create(timeout=120, metadata={"page": "x"})
    b = Sandbox.create(timeout=120, metadata={"page": "x"})
    try:
        pager = Sandbox.list(query=SandboxQuery(metadata={"page": "x"}), limit=1)
        first = pager.next_items()
        assert [x.sandbox_id for x in first] == [b.sandbox_id] and pager.has_next
        assert [x.sandbox_id for x in pager.next_items()] == [a.sandbox_id]
        assert not pager.has_next
    finally:
        a.kill()
        b.kill()


def test_commands(sbx: Sandbox) -> None:
    out: list[str] = []
    err: list[str] = []
    r = sbx.commands.run("echo $GREETING; echo oops >&2; echo $X; pwd", envs={"X": "y"},
                         on_stdout=out.append, on_stderr=err.append)
    assert r.exit_code == 0
    assert r.stdout == "hello\ny\n/home/user\n" and r.stderr == "oops\n"
    assert "".join(out) == r.stdout and "".join(err) == r.stderr
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("echo before; exit 3")
    assert ei.value.exit_code == 3 and ei.value.stdout == "before\n"
    # a login shell as E2B's user
    assert sbx.commands.run("id -un; echo $HOME").stdout == "user\n/home/user\n"


def test_streaming_arrives_while_running(sbx: Sandbox) -> None:
    seen: list[tuple[float, str]] = []
    sbx.commands.run("for i in 1 2 3; do echo $i; sleep 0.5; done",
                     on_stdout=lambda s: seen.append((time.monotonic(), s)))
    assert "".join(s for _, s in seen) == "1\n2\n3\n"
    assert seen[-1][0] - seen[0][0] > 0.5  # the first line came before the command ended


def test_background_list_kill_stdin(sbx: Sandbox) -> None:
    h = sbx.commands.run("sleep 60", background=True)
    assert h.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException):
        h.wait()
    assert h.pid not in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(999999) is False
    # stdin
    cat = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(cat.pid, "line one\n")
    sbx.commands.send_stdin(cat.pid, "line two\n")
    sbx.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "line one\nline two\n"
    # reattached from another handle
    bg = sbx.commands.run("sleep 1; echo late", background=True)
    again = sbx.commands.connect(bg.pid)
    assert again.wait().stdout.endswith("late\n")


def test_pty(sbx: Sandbox) -> None:
    got = bytearray()
    done = threading.Event()

    def on_data(b: bytes) -> None:
        got.extend(b)
        if b"pty-ok-42" in got:
            done.set()

    t = sbx.pty.create(PtySize(rows=24, cols=80))
    try:
        sbx.pty.send_stdin(t.pid, b"echo pty-ok-$((40 + 2)); tty\n")
        def follow() -> None:
            with contextlib.suppress(CommandExitException):  # (killed at the end)
                t.wait(on_pty=on_data)

        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        assert done.wait(30), bytes(got)[-500:]
        sbx.pty.resize(t.pid, PtySize(rows=30, cols=100))
    finally:
        sbx.pty.kill(t.pid)


def test_files(sbx: Sandbox) -> None:
    sbx.files.write("notes/a.txt", "text ü")
    assert sbx.files.read("notes/a.txt") == "text ü"
    blob = bytes(range(256)) * 1000
    sbx.files.write("/tmp/blob.bin", blob)
    assert bytes(sbx.files.read("/tmp/blob.bin", format="bytes")) == blob
    assert sbx.files.exists("/home/user/notes/a.txt") and not sbx.files.exists("nope")
    entries = {e.name: e for e in sbx.files.list("notes")}
    assert entries["a.txt"].size == len("text ü".encode())
    assert entries["a.txt"].owner == "user"
    assert sbx.files.make_dir("d1/d2") is True and sbx.files.make_dir("d1/d2") is False
    info = sbx.files.write_files([WriteEntry(path=f"many/f{i}", data=f"n{i}")
                                  for i in range(20)])
    assert len(info) == 20
    assert sorted(e.name for e in sbx.files.list("many")) == sorted(f"f{i}" for i in range(20))
    assert sbx.commands.run("cat ~/many/f7").stdout == "n7"
    sbx.files.rename("many/f0", "many/g0")
    assert sbx.files.exists("many/g0") and not sbx.files.exists("many/f0")
    deep = [e.path for e in sbx.files.list("d1", depth=2)]
    assert deep == ["/home/user/d1/d2"]
    sbx.files.remove("many")
    assert not sbx.files.exists("many")
    with pytest.raises(NotFoundException):
        sbx.files.read("does-not-exist")
    with pytest.raises(SandboxException):  # cpuos runs everything as the sandbox's user
        sbx.commands.run("id", user="root")


def test_watch(sbx: Sandbox) -> None:
    sbx.files.make_dir("watched")
    w = sbx.files.watch_dir("watched")
    try:
        sbx.files.write("watched/new.txt", "x")
        sbx.commands.run("rm ~/watched/new.txt")
        seen: list[tuple[str, FilesystemEventType]] = []

        def got_both() -> bool:
            seen.extend((e.name, e.type) for e in w.get_new_events())
            return ("new.txt", FilesystemEventType.REMOVE) in seen

        wait_until(got_both, "the watch's events", 30)
        assert seen[0] == ("new.txt", FilesystemEventType.CREATE)
    finally:
        w.stop()


def test_get_host_reaches_a_server_inside(sbx: Sandbox, daemon: Daemon) -> None:
    sbx.files.write("site/index.html", "served from inside")
    srv = sbx.commands.run("cd ~/site && exec python3 -m http.server 8000", background=True,
                           timeout=0)
    try:
        host = sbx.get_host(8000)
        assert host.startswith(f"8000-{sbx.sandbox_id}.localhost:")
        port = int(host.rsplit(":", 1)[1])
        # (*.localhost is loopback; glibc does not resolve it: connect by address)

        def fetch() -> httpx.Response | None:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/index.html", headers={"Host": host},
                              timeout=5)
            except httpx.TransportError:
                return None
            return r if r.status_code == 200 else None

        wait_until(lambda: fetch() is not None, "the server inside", 60)
        r = fetch()
        assert r is not None and r.text == "served from inside"  # no token: E2B's rule
        # a cpuos sandbox's port (not made on the E2B surface) still needs its token
        with daemon.client() as c:
            other = c.post("/sandboxes", json={"template": "python", "timeout": 60}).json()
            try:
                r2 = httpx.get(f"http://127.0.0.1:{port}/", timeout=5,
                               headers={"Host": f"8000-{other['id']}.localhost:{port}"})
                assert r2.status_code == 404  # not exposed
            finally:
                c.delete(f"/sandboxes/{other['id']}")
    finally:
        srv.kill()


def test_access_token_required(sbx: Sandbox, daemon: Daemon) -> None:
    url = daemon.url + "/e2b/filesystem.Filesystem/Stat"
    hdr = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983",
           "Content-Type": "application/json"}
    assert httpx.post(url, headers=hdr, json={"path": "/"}).status_code == 401
    bad = {**hdr, "X-Access-Token": "0" * 64}
    assert httpx.post(url, headers=bad, json={"path": "/"}).status_code == 401
    r = httpx.get(daemon.url + "/e2b/v2/sandboxes", headers={"X-API-Key": "e2b_" + "0" * 40})
    assert r.status_code == 401 and set(r.json()) >= {"code", "message"}


def test_audit_and_events_are_cpuos(sbx: Sandbox, daemon: Daemon) -> None:
    sbx.commands.run("echo audited-e2b-command")
    sbx.files.write("/tmp/audited.txt", "x")
    with daemon.client() as c:
        rows = c.get(f"/sandboxes/{sbx.sandbox_id}/audit", params={"limit": 1000}).json()
    details = [str(r.get("detail")) for r in rows["rows"]]
    assert any("audited-e2b-command" in d and "'source': 'e2b'" in d for d in details)
    assert any("/tmp/audited.txt" in d for d in details)


def test_pause_resume(env: dict[str, str]) -> None:
    s = Sandbox.create(timeout=300)
    try:
        s.commands.run("echo kept > ~/state.txt")
        assert s.pause() is True
        assert Sandbox.get_info(s.sandbox_id).state.value == "paused"
        assert not s.is_running()
        again = Sandbox.connect(s.sandbox_id)  # resumes it
        assert again.get_info().state.value == "running"
        assert again.files.read("state.txt") == "kept\n"
    finally:
        s.kill()


def test_kill_ends_a_running_command(env: dict[str, str]) -> None:
    from e2b.exceptions import SandboxNotRunningException

    s = Sandbox.create(timeout=120)
    errors: list[BaseException] = []
    started = threading.Event()

    def run() -> None:
        try:
            s.commands.run("echo up; sleep 100", on_stdout=lambda _: started.set(),
                           timeout=0)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(30)
    t0 = time.monotonic()
    s.kill()
    t.join(60)
    assert not t.is_alive() and time.monotonic() - t0 < 30
    assert errors and isinstance(errors[0], SandboxNotRunningException), errors


def test_e2b_format_key(daemon: Daemon) -> None:
    r = httpx.post(daemon.url + "/e2b/keys", headers={"X-API-Key": daemon.key})
    assert r.status_code == 201
    key = r.json()["key"]
    assert key.startswith("e2b_") and all(c in "0123456789abcdef" for c in key[4:])
    listed = httpx.get(daemon.url + "/e2b/v2/sandboxes", headers={"X-API-Key": key})
    assert listed.status_code == 200
    # the same workspace through cpuos's own API
    assert httpx.get(daemon.url + "/sandboxes",
                     headers={"Authorization": f"Bearer {key}"}).status_code == 200


# ---- the code interpreter (e2b-code-interpreter) ---------------------------------------
ci = pytest.importorskip("e2b_code_interpreter")


@pytest.fixture(scope="module")
def cbx(env: dict[str, str]) -> Iterator[Any]:
    s = ci.Sandbox.create(timeout=600)
    yield s
    s.kill()


def test_code_state_and_streaming(cbx: Any) -> None:
    cbx.run_code("x = 41")
    out: list[str] = []
    ex = cbx.run_code("print('side'); x + 1", on_stdout=lambda m: out.append(m.line))
    assert ex.text == "42" and ex.logs.stdout == ["side\n"] and out == ["side\n"]
    assert ex.error is None


def test_code_error(cbx: Any) -> None:
    errs: list[Any] = []
    ex = cbx.run_code("1 / 0", on_error=errs.append)
    assert ex.error is not None and ex.error.name == "ZeroDivisionError"
    assert "division by zero" in ex.error.value and "ZeroDivisionError" in ex.error.traceback
    assert errs and errs[0].name == "ZeroDivisionError"


def test_code_matplotlib_png(cbx: Any) -> None:
    ex = cbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()")
    pngs = [r.png for r in ex.results if r.png]
    assert pngs and base64.b64decode(pngs[0])[:8] == b"\x89PNG\r\n\x1a\n"


def test_code_contexts(cbx: Any) -> None:
    ctx = cbx.create_code_context(language="python")
    assert ctx.language == "python"
    assert any(c.id == ctx.id for c in cbx.list_code_contexts())
    cbx.run_code("y = 5", context=ctx)
    assert cbx.run_code("y", context=ctx).text == "5"
    cbx.restart_code_context(ctx)
    assert cbx.run_code("'y' in dir()", context=ctx).text == "False"


def test_host_form_reaches_envd_and_private_ports(env: dict[str, str]) -> None:
    """The E2B_DOMAIN form: ``<port>-<id>.<domain>`` through the preview proxy, for envd
    (49983: handed to the listener, the same token check) and for a sandbox created with
    ``allowPublicTraffic: false`` (its ports need its traffic token)."""
    s = Sandbox.create(timeout=120, network={"allow_public_traffic": False})
    try:
        preview = int(s.get_host(1).rsplit(":", 1)[1])
        envd = f"49983-{s.sandbox_id}.localhost:{preview}"
        url = f"http://127.0.0.1:{preview}/filesystem.Filesystem/Stat"
        body = {"path": "/home/user"}
        r = httpx.post(url, json=body, headers={"Host": envd})
        assert r.status_code == 401
        r = httpx.post(url, json=body, headers={"Host": envd, "X-Access-Token":
                                                s._envd_access_token or ""})
        assert r.status_code == 200 and r.json()["entry"]["type"] == "FILE_TYPE_DIRECTORY"
        # a routing header of the client's own cannot point the request elsewhere
        r = httpx.post(url, json=body, headers={"Host": envd, "E2b-Sandbox-Id": "sbx-" + "z" * 12,
                                                "X-Access-Token": s._envd_access_token or ""})
        assert r.status_code == 200
        srv = s.commands.run("cd /tmp && exec python3 -m http.server 8002", background=True,
                             timeout=0)
        host = s.get_host(8002)

        def status(headers: dict[str, str]) -> int:
            try:
                return httpx.get(f"http://127.0.0.1:{preview}/", timeout=5,
                                 headers={"Host": host, **headers}).status_code
            except httpx.TransportError:
                return 0

        token = s.traffic_access_token or ""
        wait_until(lambda: status({"e2b-traffic-access-token": token}) == 200,
                   "the private server", 60)
        assert status({}) == 403
        assert status({"e2b-traffic-access-token": "wrong"}) == 403
        srv.kill()
    finally:
        s.kill()


def test_bad_input_gets_e2b_errors(sbx: Sandbox, daemon: Daemon) -> None:
    hdr = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983",
           "X-Access-Token": sbx._envd_access_token or ""}
    files = daemon.url + "/e2b/files"
    r = httpx.post(files, headers={**hdr, "Content-Type": "multipart/form-data; boundary=xx"},
                   content=b"--xx\r\nContent-Disposition: form-data; name=\"file\"; "
                           b"filename=\"/tmp/cut.txt\"\r\n\r\nno end")
    assert r.status_code == 400 and set(r.json()) == {"code", "message"}
    r = httpx.get(files, headers=hdr, params={"path": "/home/user/../../etc/passwd"})
    assert r.status_code == 400 and "'..'" in r.json()["message"]
    r = httpx.get(files, headers=hdr, params={"path": "/tmp"})
    assert r.status_code == 400  # a directory
    r = httpx.post(daemon.url + "/e2b/v2/sandboxes", headers={"X-API-Key": daemon.key},
                   json={"templateID": "no-such-template"})
    assert r.status_code == 404 and set(r.json()) == {"code", "message"}
    r = httpx.post(daemon.url + "/e2b/v2/sandboxes", headers={"X-API-Key": daemon.key},
                   json={"timeout": "soon"})
    assert r.status_code == 400 and r.json()["code"] == 400
    r = httpx.post(daemon.url + "/e2b/process.Process/Start",
                   headers={**hdr, "Content-Type": "application/json"},
                   json={"process": {"cmd": "true"}})
    assert r.status_code >= 400  # a server stream asked for as unary: refused, not run


def test_e2b_key_revoked_like_any(daemon: Daemon) -> None:
    made = httpx.post(daemon.url + "/e2b/keys", headers={"X-API-Key": daemon.key}).json()
    hdr = {"X-API-Key": made["key"]}
    assert httpx.get(daemon.url + "/e2b/v2/sandboxes", headers=hdr).status_code == 200
    with daemon.client() as c:
        listed = {k["id"]: k for k in c.get("/workspace/keys").json()["keys"]}
        assert listed[made["id"]]["label"] == "e2b"
        assert c.delete(f"/workspace/keys/{made['id']}").status_code == 200
    r = httpx.get(daemon.url + "/e2b/v2/sandboxes", headers=hdr)
    assert r.status_code == 401 and r.json()["code"] == 401
