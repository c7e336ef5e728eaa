"""exec through the real daemon and the real agent: output and exit status, argv, env and
cwd, streaming callbacks, timeouts, stdin (text, bytes, streamed)."""

from __future__ import annotations

import hashlib

import httpx
import pytest

from cpuos import Sandbox
from support.local import LocalDaemon

pytestmark = pytest.mark.component

MIB = 1 << 20


def test_shell_exec_output_and_status(sbx: Sandbox) -> None:
    r = sbx.exec("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n"), r
    assert not r.ok and not r.timed_out


def test_argv_env_and_cwd(sbx: Sandbox, local: LocalDaemon) -> None:
    r = sbx.exec(["printf", "%s|", "a b", "c"])
    assert r.stdout == "a b|c|", r
    sub = local.work / f"{sbx.id}-cwd"
    sbx.files.mkdir(str(sub))
    r = sbx.exec("echo $FOO; pwd", env={"FOO": "bar baz"}, cwd=str(sub))
    assert r.stdout == f"bar baz\n{sub}\n", r
    # the template's workdir by default
    assert sbx.exec("pwd").stdout == f"{local.work}\n"


def test_output_streams_in_order(sbx: Sandbox) -> None:
    seen: list[str] = []
    r = sbx.exec("for i in 1 2 3; do echo $i; sleep 0.05; done", on_stdout=seen.append)
    assert r.ok and "".join(seen) == "1\n2\n3\n" == r.stdout, (seen, r)
    big = sbx.exec("head -c 3000000 /dev/zero | tr '\\0' a")
    assert big.ok and big.stdout == "a" * 3_000_000


def test_timeout_kills_the_command(sbx: Sandbox) -> None:
    r = sbx.exec("echo started; sleep 60", timeout="1s")
    assert r.timed_out and r.stdout == "started\n", r
    assert sbx.exec("pgrep -x sleep || echo none").stdout == "none\n"


def test_stdin_text_bytes_and_streamed(sbx: Sandbox) -> None:
    assert sbx.exec("cat", stdin="hello\n").stdout == "hello\n"
    data = bytes(range(256)) * 40
    assert sbx.exec("wc -c", stdin=data).stdout.strip() == str(len(data))
    chunks = [bytes([i]) * MIB for i in range(8)]  # 8 MiB, streamed as it is read
    want = hashlib.sha256(b"".join(chunks)).hexdigest()
    r = sbx.exec("sha256sum", stdin=iter(chunks))
    assert r.ok and r.stdout.split()[0] == want, r


def test_stdin_given_twice_is_refused(sbx: Sandbox, local: LocalDaemon) -> None:
    with httpx.Client(base_url=local.url, headers={"Authorization": f"Bearer {local.key}"}
                      ) as c:
        r = c.post(f"/sandboxes/{sbx.id}/exec", json={"cmd": "cat", "stdin": "a",
                                                      "stdin_b64": "YQ=="})
        assert r.status_code == 422 and r.json()["error"]["details"]["field"] == "stdin", r.text
        r = c.post(f"/sandboxes/{sbx.id}/exec", json={"cmd": "cat", "stdin_b64": "!!"})
        assert r.status_code == 422 and "base64" in r.json()["error"]["message"], r.text


def test_one_host_names_no_node(sbx: Sandbox, local: LocalDaemon) -> None:
    """--role=all: the sandbox's JSON has node_id null (many hosts: the node's id)."""
    r = httpx.get(f"{local.url}/sandboxes/{sbx.id}",
                  headers={"Authorization": f"Bearer {local.key}"})
    assert r.status_code == 200 and "node_id" in r.json() and r.json()["node_id"] is None
    assert sbx.info().node_id is None
