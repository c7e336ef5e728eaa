"""Bad input gets a clear 4xx JSON error and changes nothing (real daemon, raw HTTP)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import httpx
import pytest

from cpuos import AuthError, NotFound, Sandbox

pytestmark = pytest.mark.e2e


def _err(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()["error"]
    assert body["code"] == code and body["message"], body
    return str(body["message"])


@pytest.fixture
def box(daemon) -> Iterator[tuple[httpx.Client, str]]:  # type: ignore[no-untyped-def]
    c = daemon.client()
    r = c.post("/sandboxes", json={"template": "python", "timeout": "5m"})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    yield c, sid
    c.delete(f"/sandboxes/{sid}")
    c.close()


def _host_sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.mark.parametrize("raw_path", [
    "../../etc/passwd",
    "/work/../../etc/passwd",
    "%2e%2e/%2e%2e/etc/passwd",
    "%252e%252e%252fetc%252fpasswd",
    "..%2f..%2fetc%2fpasswd",
    "/work/a%00b",
])
def test_path_traversal_and_nul_refused(box, raw_path: str) -> None:  # type: ignore[no-untyped-def]
    c, sid = box
    before = c.get(f"/sandboxes/{sid}/files/list", params={"path": "/work"}).json()
    url = f"/sandboxes/{sid}/files?path={raw_path}"  # sent as given: encoded forms stay encoded
    msg = _err(c.put(url, content=b"pwned"), 422, "invalid_argument")
    assert "path" in msg
    _err(c.get(url), 422, "invalid_argument")
    _err(c.delete(url), 422, "invalid_argument")
    after = c.get(f"/sandboxes/{sid}/files/list", params={"path": "/work"}).json()
    assert before == after


def test_over_long_path_refused(box) -> None:  # type: ignore[no-untyped-def]
    c, sid = box
    _err(c.put(f"/sandboxes/{sid}/files", params={"path": "/work/" + "a" * 5000},
               content=b"x"), 422, "invalid_argument")
    _err(c.put(f"/sandboxes/{sid}/files", params={"path": "/work/" + "b" * 300},
               content=b"x"), 422, "invalid_argument")


def test_symlink_to_etc_stays_inside_sandbox(daemon, box) -> None:  # type: ignore[no-untyped-def]
    c, sid = box
    host_passwd = _host_sha("/etc/passwd")
    sbx = Sandbox.connect(sid, **daemon.sdk_kwargs())
    try:
        assert sbx.exec("ln -s /etc /work/etc-link && ln -s /tmp /work/tmp-link").exit_code == 0
        # the sandbox user cannot write the sandbox's /etc through the link ...
        r = c.put(f"/sandboxes/{sid}/files", params={"path": "/work/etc-link/passwd"},
                  content=b"root::0:0::/root:/bin/sh\n")
        _err(r, 403, "permission_denied")
        # ... and a write through a link to a writable place lands inside the sandbox only
        marker = "/tmp/cpuos-symlink-test-marker"
        r = c.put(f"/sandboxes/{sid}/files", params={"path": "/work/tmp-link/"
                  + marker.rsplit("/", 1)[1]}, content=b"inside")
        assert r.status_code == 200, r.text
        assert sbx.exec(f"cat {marker}").stdout == "inside"
        import os
        assert not os.path.exists(marker)
        assert _host_sha("/etc/passwd") == host_passwd
        assert "root:x:0:0" in sbx.files.read_text("/etc/passwd")
    finally:
        sbx.close()


def test_unknown_and_malformed_ids(daemon) -> None:  # type: ignore[no-untyped-def]
    with daemon.client() as c:
        _err(c.get("/sandboxes/sbx-doesnotexist"), 404, "not_found")
        _err(c.post("/sandboxes/sbx-doesnotexist/exec", json={"cmd": "true"}), 404, "not_found")
        _err(c.get("/sandboxes/BAD_ID!"), 422, "invalid_argument")
    with pytest.raises(NotFound):
        Sandbox.connect("sbx-doesnotexist", **daemon.sdk_kwargs())


def test_auth(daemon, box) -> None:  # type: ignore[no-untyped-def]
    _, sid = box
    with httpx.Client(base_url=daemon.url) as anon:
        _err(anon.get("/sandboxes"), 401, "unauthorized")
        _err(anon.get(f"/sandboxes/{sid}"), 401, "unauthorized")
        _err(anon.get("/sandboxes", headers={"Authorization": "Bearer wrong"}), 401,
             "unauthorized")
        assert anon.get("/health").status_code == 200
    with pytest.raises(AuthError):
        Sandbox.list(api_url=daemon.url, api_key="cpk_wrong")


def test_other_workspace_sees_404(daemon, box) -> None:  # type: ignore[no-untyped-def]
    c, sid = box
    r = c.post("/workspaces", json={"name": f"team-{sid[-6:]}"})
    assert r.status_code == 201, r.text
    other_key = r.json()["key"]
    with daemon.client(other_key) as o:
        _err(o.get(f"/sandboxes/{sid}"), 404, "not_found")
        _err(o.delete(f"/sandboxes/{sid}"), 404, "not_found")
        _err(o.post(f"/sandboxes/{sid}/exec", json={"cmd": "true"}), 404, "not_found")
        _err(o.get(f"/sandboxes/{sid}/files", params={"path": "/etc/hostname"}), 404,
             "not_found")
        assert sid not in [s["id"] for s in o.get("/sandboxes").json()["sandboxes"]]
        # and it cannot mint workspaces
        _err(o.post("/workspaces", json={"name": "x"}), 403, "permission_denied")
    assert c.get(f"/sandboxes/{sid}").json()["state"] == "running"


def test_bad_duration_and_body(daemon, box) -> None:  # type: ignore[no-untyped-def]
    c, sid = box
    n_before = len(c.get("/sandboxes", params={"all": "true"}).json()["sandboxes"])
    msg = _err(c.post("/sandboxes", json={"template": "python", "timeout": "soon"}), 422,
               "invalid_argument")
    assert "timeout" in msg
    _err(c.post("/sandboxes", json={"template": "python", "timeout": -1}), 422,
         "invalid_argument")
    _err(c.post("/sandboxes", json={"template": "python", "bogus": 1}), 422, "invalid_argument")
    _err(c.post("/sandboxes", json={"template": "no-such-template"}), 404, "not_found")
    _err(c.post("/sandboxes", json={"template": "../etc"}), 422, "invalid_argument")
    assert len(c.get("/sandboxes", params={"all": "true"}).json()["sandboxes"]) == n_before
    _err(c.post(f"/sandboxes/{sid}/timeout", json={"timeout": "1x"}), 422, "invalid_argument")
    _err(c.post(f"/sandboxes/{sid}/exec", json={"cmd": "true", "timeout": "forever"}), 422,
         "invalid_argument")
    _err(c.post(f"/sandboxes/{sid}/exec", json={"cmd": ""}), 422, "invalid_argument")
    _err(c.post(f"/sandboxes/{sid}/exec", json={"cmd": "true", "cwd": "../.."}), 422,
         "invalid_argument")
    _err(c.post(f"/sandboxes/{sid}/exec", json={"cmd": "true", "env": {"A=B": "x"}}), 422,
         "invalid_argument")
    _err(c.post(f"/sandboxes/{sid}/exec", content=b"{not json",
                headers={"Content-Type": "application/json"}), 422, "invalid_argument")
    assert c.get(f"/sandboxes/{sid}").json()["state"] == "running"


def test_exec_on_killed_sandbox_is_409(box) -> None:  # type: ignore[no-untyped-def]
    c, sid = box
    assert c.delete(f"/sandboxes/{sid}").json()["state"] == "killed"
    msg = _err(c.post(f"/sandboxes/{sid}/exec", json={"cmd": "true"}), 409, "conflict")
    assert "killed" in msg
    _err(c.put(f"/sandboxes/{sid}/files", params={"path": "x"}, content=b"x"), 409, "conflict")
    # killing again is harmless
    assert c.delete(f"/sandboxes/{sid}").status_code == 200


def test_missing_program_and_cwd(box) -> None:  # type: ignore[no-untyped-def]
    c, sid = box
    r = c.post(f"/sandboxes/{sid}/exec", json={"cmd": ["/no/such/program"]})
    _err(r, 404, "not_found")
    r = c.post(f"/sandboxes/{sid}/exec", json={"cmd": "true", "cwd": "/work/nope"})
    _err(r, 404, "not_found")
    # a shell line naming a missing program behaves like bash: exit 127
    from cpuos_agent.protocol import FrameDecoder
    r = c.post(f"/sandboxes/{sid}/exec", json={"cmd": "no-such-command-xyz"})
    frames = FrameDecoder().feed(r.content)
    exit_h = next(h for h, _ in frames if h["t"] == "exit")
    assert exit_h["exit_code"] == 127
