"""Many hosts on one host (issue 24): two node processes (``cpuosd --role=node``, real runsc,
own homes, network slots and ports) and two API processes (``--role=api``) over one real
Postgres. Through the unchanged Python SDK: create through one API process, exec, files and
a terminal (WebSocket) through the other; a node refuses whoever lacks the node token;
cordon steers placement; a node that dies is skipped by placement and its sandboxes answer
503 until it is back."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cpuos import Sandbox
from cpuosd.store.audit_chain import PgAuditChain
from support import testbed
from support.testbed import ApiProcess, node_of, open_test_store
from support.fakenet import FakeInternet
from support.daemon import Daemon, e2e_unavailable, wait_until

pytestmark = pytest.mark.cluster

@pytest.fixture
def cluster(pg_url: str) -> Iterator[Cluster]:
    yield from _cluster(pg_url, {})


@pytest.fixture
def cluster_s3(pg_url: str, s3_server: testbed.S3Server) -> Iterator[Cluster]:
    bucket = "snap-" + secrets.token_hex(4)
    s3_server.create_bucket(bucket)
    yield from _cluster(pg_url, s3_server.env(bucket))


@pytest.fixture
def cluster_s3_inet(pg_url: str, s3_server: testbed.S3Server, tmp_path: Path
                    ) -> Iterator[tuple[Cluster, FakeInternet]]:
    """Both nodes' uplinks lead into one fake internet (support.fakenet): no route out."""
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    bucket = "snap-" + secrets.token_hex(4)
    s3_server.create_bucket(bucket)
    (tmp_path / "inet").mkdir()
    inet = FakeInternet(tmp_path / "inet").start()
    try:
        for c in _cluster(pg_url, {**s3_server.env(bucket), **inet.env()}):
            yield c, inet
    finally:
        inet.stop()


@pytest.fixture
def cluster_fencing(pg_url: str) -> Iterator[Cluster]:
    yield from _cluster(pg_url, {}, {"CPUOS_NODE_FENCE_AFTER": "2"})


Cluster = tuple[list[Daemon], list[ApiProcess], str]
TOKEN = ""  # (the running cluster's node token, set by _cluster)


def _cluster(pg_url: str, extra: dict[str, str], api_extra: dict[str, str] | None = None
             ) -> Iterator[Cluster]:
    global TOKEN
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    with testbed.node_cluster(pg_url, extra, api_extra) as c:
        TOKEN = c.token
        yield c.nodes, c.apis, c.key


def test_two_nodes_two_apis(cluster: Cluster, pg_url: str) -> None:
    nodes, (api1, api2), key = cluster
    # a node answers only with the node token (health aside)
    r = httpx.get(nodes[0].url + "/sandboxes", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    assert httpx.get(nodes[0].url + "/health").status_code == 200
    # an API process checks the key itself
    r = httpx.get(api1.url + "/sandboxes", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    # placement by memory: no node has 256 GiB free
    r = httpx.post(api1.url + "/sandboxes", headers={"Authorization": f"Bearer {key}"},
                   json={"template": "python", "memory_mib": 262144})
    assert r.status_code == 503 and "no node" in r.json()["error"]["message"], r.text

    # cordon node-b: the create lands on node-a; then the other way round
    store = open_test_store(pg_url)
    try:
        placed = {}
        for here, away in (("node-a", "node-b"), ("node-b", "node-a")):
            for n in (here, away):
                store.set_node_cordoned(n, True)
            wait_until(lambda: api1.health().get("nodes_placeable") == 0,
                       "the API process to see both cordoned", timeout=10)
            r = httpx.post(api1.url + "/sandboxes", json={"template": "python"},
                           headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 503 and "no node" in r.json()["error"]["message"]
            store.set_node_cordoned(here, False)
            wait_until(lambda: api1.health().get("nodes_placeable") == 1,
                       "the API process to see the cordon lifted", timeout=10)
            sbx = Sandbox.create(template="python", timeout="5m", api_url=api1.url,
                                 api_key=key)
            placed[here] = sbx
            assert node_of(pg_url, sbx.id) == here
        store.set_node_cordoned("node-a", False)
    finally:
        store.close()

    for here, sbx in placed.items():
        # through the other API process: exec, files, a terminal (WebSocket)
        other = Sandbox.connect(sbx.id, api_url=api2.url, api_key=key)
        run = other.exec(f"echo hello from {here}; echo err >&2; exit 3")
        assert (run.exit_code, run.stdout, run.stderr) == (3, f"hello from {here}\n", "err\n")
        other.files.write("/work/x.txt", f"on {here}")
        assert sbx.files.read("/work/x.txt") == f"on {here}".encode()
        seen: list[bytes] = []
        t = other.pty.create(cmd=["bash", "-c", "echo pty-$((6*7))"], on_data=seen.append)
        assert t.wait().exit_code == 0
        assert b"pty-42" in b"".join(seen)
        listed = {s["id"] for s in httpx.get(api2.url + "/sandboxes", headers={
            "Authorization": f"Bearer {key}"}).json()["sandboxes"]}
        assert set(s.id for s in placed.values()) <= listed

    # node-b dies: its sandbox answers 503 through either API process, and placement
    # skips it (every create lands on node-a)
    nodes[1].kill9()
    for a in (api1, api2):
        wait_until(lambda a=a: a.health().get("nodes_alive") == 1,  # type: ignore[misc]
                   "node-b to be counted dead", timeout=30)
    r = httpx.post(f"{api2.url}/sandboxes/{placed['node-b'].id}/exec",
                   json={"cmd": "true"}, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable", r.text
    again = Sandbox.create(template="python", timeout="5m", api_url=api2.url, api_key=key)
    assert node_of(pg_url, again.id) == "node-a"
    assert again.exec("echo ok").stdout == "ok\n"
    again.kill()
    placed["node-a"].kill()

    # node-b comes back (same home): its sandbox is reattached and reachable again
    nodes[1].start()
    wait_until(lambda: api1.health().get("nodes_alive") == 2, "node-b to be alive again",
               timeout=30)
    back = Sandbox.connect(placed["node-b"].id, api_url=api1.url, api_key=key)
    assert back.files.read("/work/x.txt") == b"on node-b"
    back.kill()


def _cordon_all_but(pg_url: str, api: ApiProcess, here: str) -> None:
    store = open_test_store(pg_url)
    try:
        for n in ("node-a", "node-b"):
            store.set_node_cordoned(n, True)
        wait_until(lambda: api.health().get("nodes_placeable") == 0, "both cordoned",
                   timeout=10)
        store.set_node_cordoned(here, False)
        wait_until(lambda: api.health().get("nodes_placeable") == 1, "one placeable",
                   timeout=10)
    finally:
        store.close()


def test_pause_on_one_node_resume_on_the_other(cluster_s3: Cluster, pg_url: str) -> None:
    """Pause uploads to the S3 store and leaves the row on no node; node A is SIGKILLed;
    the resume lands on node B with the sandbox's files, processes and Python variables (the
    interpreter's kernel); two nodes racing
    to resume one id: one restore."""
    nodes, (api1, api2), key = cluster_s3
    _cordon_all_but(pg_url, api1, "node-a")
    sbx = Sandbox.create(template="python", timeout="5m", api_url=api1.url, api_key=key)
    assert node_of(pg_url, sbx.id) == "node-a"
    sbx.files.write("/work/state.txt", "made on node-a")
    pid = sbx.exec("sleep 1000 >/dev/null 2>&1 & echo $!").stdout.strip()
    assert pid.isdigit()
    made = sbx.run_code("answer = 6 * 7")  # (a Python variable, in the kernel's memory)
    assert made.ok and made.error is None, made

    Sandbox.connect(sbx.id, api_url=api2.url, api_key=key).pause()
    store = open_test_store(pg_url)
    try:
        row = store.get_sandbox(sbx.id)
        assert row is not None and row.state == "paused" and row.node_id is None
        assert not (nodes[0].snapshots_dir / sbx.id).exists()  # (only in the store)
        # what the pause did is in the shared chain when it answers (the node dies next)
        chain = PgAuditChain(pg_url, b"")
        try:
            on_record = chain.query(sbx.id, ("lifecycle",))
        finally:
            chain.close()
        assert [r["detail"].get("to") for r in on_record][-2:] == ["pausing", "paused"], on_record

        nodes[0].kill9()
        _cordon_all_but(pg_url, api1, "node-b")
        wait_until(lambda: api1.health().get("nodes_alive") == 1, "node-a dead", timeout=30)
        back = Sandbox.connect(sbx.id, api_url=api1.url, api_key=key)  # (resumes it)
        assert node_of(pg_url, sbx.id) == "node-b"
        assert back.files.read("/work/state.txt") == b"made on node-a"
        assert back.exec(f"kill -0 {pid} && cat /proc/{pid}/cmdline | tr '\\0' ' '"
                         ).stdout == "sleep 1000 "
        assert back.exec("echo resumed").stdout == "resumed\n"
        assert back.run_code("answer").text == "42"  # (its Python variables came along)

        # again: paused into the store, then both nodes asked to resume it at once
        back.pause()
        nodes[0].start()
        wait_until(lambda: api1.health().get("nodes_alive") == 2, "node-a back", timeout=30)
        before = store.get_sandbox(sbx.id)
        assert before is not None and before.node_id is None

        async def both() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120, headers={
                    "Authorization": f"Bearer {key}", "X-Cpuos-Node-Token": TOKEN}) as c:
                return list(await asyncio.gather(*(
                    c.post(f"{d.url}/sandboxes/{sbx.id}/resume") for d in nodes)))

        answers = asyncio.run(both())
        codes = sorted(r.status_code for r in answers)
        assert codes in ([200, 200], [200, 409]), [r.text for r in answers]
        after = store.get_sandbox(sbx.id)
        assert after is not None and after.state == "running"
        assert after.node_id in ("node-a", "node-b") and after.epoch > before.epoch
        winner = nodes[0] if after.node_id == "node-a" else nodes[1]
        loser = nodes[1] if winner is nodes[0] else nodes[0]
        assert sbx.id in winner.runsc_containers()
        assert sbx.id not in loser.runsc_containers()  # (one restore)
        final = Sandbox.connect(sbx.id, api_url=api2.url, api_key=key)
        assert final.files.read("/work/state.txt") == b"made on node-a"
        final.kill()

        # the audit rows of both nodes: one chain in Postgres, verified through either
        # API process (each lands on some node) and on each node
        auth = {"Authorization": f"Bearer {key}"}
        rows = httpx.get(f"{api1.url}/sandboxes/{sbx.id}/audit", headers=auth,
                         params={"kind": "lifecycle"}).json()["rows"]
        seqs = [r["seq"] for r in rows]
        assert seqs == sorted(seqs) and len(seqs) >= 8, rows
        states = [r["detail"].get("to") for r in rows]
        assert states.count("paused") == 2 and states.count("resuming") == 2, states
        assert states.count("running") >= 3 and states[-1] == "killed", states
        total = None
        for url, extra_h in ((api1.url, {}), (api2.url, {}),
                             (nodes[0].url, {"X-Cpuos-Node-Token": TOKEN}),
                             (nodes[1].url, {"X-Cpuos-Node-Token": TOKEN})):
            v = httpx.get(f"{url}/audit/verify", headers={**auth, **extra_h},
                          timeout=60).json()
            assert v["ok"], v
            total = total or v["rows"]
            assert v["rows"] >= total  # (the same chain, possibly grown meanwhile)
    finally:
        store.close()


def _cli(api: ApiProcess, key: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CPUOS_API_URL": api.url, "CPUOS_API_KEY": key}
    return subprocess.run([sys.executable, "-m", "cpuos.cli.main", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_node_cordon_and_drain_from_the_cli(cluster_s3: Cluster, pg_url: str) -> None:
    """``cpuos node ls|cordon|uncordon|drain`` through an API process (admin only); a drain
    pauses the node's sandboxes into the store, and they resume on another node."""
    nodes, (api1, api2), key = cluster_s3
    r = _cli(api1, key, "node", "ls", "--json")
    assert r.returncode == 0, r.stderr
    listed = {n["id"]: n for n in json.loads(r.stdout)}
    assert set(listed) == {"node-a", "node-b"}
    assert all(n["alive"] and not n["cordoned"] and n["runsc_version"] for n in listed.values())
    # only the admin workspace
    other = httpx.post(api1.url + "/workspaces", json={"name": "tenant"},
                       headers={"Authorization": f"Bearer {key}"}).json()["key"]
    r = _cli(api1, other, "node", "cordon", "node-a")
    assert r.returncode == 1 and "permission_denied" in r.stderr
    r = _cli(api1, key, "node", "cordon", "nope")
    assert r.returncode == 1 and "not_found" in r.stderr

    assert _cli(api1, key, "node", "cordon", "node-b").returncode == 0
    wait_until(lambda: api2.health().get("nodes_placeable") == 1, "node-b cordoned", 10)
    sbx = Sandbox.create(template="python", timeout="5m", api_url=api2.url, api_key=key)
    assert node_of(pg_url, sbx.id) == "node-a"
    sbx.files.write("/work/f", "drained")

    r = _cli(api2, key, "node", "drain", "node-a")
    assert r.returncode == 0 and "1 paused, 0 failed" in r.stdout, (r.stdout, r.stderr)
    store = open_test_store(pg_url)
    try:
        row = store.get_sandbox(sbx.id)
        assert row is not None and row.state == "paused" and row.node_id is None
        assert row.reason == "drain"
        assert {n["id"]: n["cordoned"] for n in store.list_nodes()} == {"node-a": True,
                                                                         "node-b": True}
    finally:
        store.close()
    assert _cli(api1, key, "node", "uncordon", "node-b").returncode == 0
    wait_until(lambda: api1.health().get("nodes_placeable") == 1, "node-b uncordoned", 10)
    back = Sandbox.connect(sbx.id, api_url=api1.url, api_key=key)
    assert node_of(pg_url, sbx.id) == "node-b"
    assert back.files.read("/work/f") == b"drained"

    # the node's own preStop hook: `cpuosd drain` on node-b (its port and token)
    env = {**os.environ, "CPUOS_PORT": str(nodes[1].port), "CPUOS_NODE_TOKEN": TOKEN,
           "CPUOS_HOST": "127.0.0.1"}
    r2 = subprocess.run([sys.executable, "-m", "cpuosd.main", "drain"], env=env,
                        capture_output=True, text=True, timeout=300)
    assert r2.returncode == 0 and r2.stdout.strip() == "node-b: 1 paused, 0 failed", r2
    store = open_test_store(pg_url)
    try:
        row = store.get_sandbox(sbx.id)
        assert row is not None and row.state == "paused" and row.node_id is None
        assert all(n["cordoned"] for n in store.list_nodes())
    finally:
        store.close()
    env["CPUOS_NODE_TOKEN"] = "x" * 32  # (a wrong token: refused)
    r2 = subprocess.run([sys.executable, "-m", "cpuosd.main", "drain"], env=env,
                        capture_output=True, text=True, timeout=60)
    assert r2.returncode == 1 and "403" in r2.stderr
    Sandbox.connect(sbx.id, auto_resume=False, api_url=api1.url, api_key=key).kill()


def test_a_dead_node_is_fenced(cluster_fencing: Cluster, pg_url: str) -> None:
    """A node silent past the lease and CPUOS_NODE_FENCE_AFTER: its sandboxes are marked
    error/node_lost (new epoch); when it wakes up (SIGSTOP, SIGCONT: a partition, not a
    restart) it stops them itself; a paused one stays for its return."""
    nodes, (api1, _), key = cluster_fencing
    _cordon_all_but(pg_url, api1, "node-b")
    sbx = Sandbox.create(template="python", timeout="5m", api_url=api1.url, api_key=key)
    kept = Sandbox.create(template="python", timeout="5m", api_url=api1.url, api_key=key)
    kept.pause()  # (no snapshot store: paused on node-b's disk)
    assert {node_of(pg_url, s.id) for s in (sbx, kept)} == {"node-b"}
    assert sbx.id in nodes[1].runsc_containers()
    store = open_test_store(pg_url)
    try:
        epoch = store.get_sandbox(sbx.id).epoch  # type: ignore[union-attr]
        assert nodes[1].proc is not None
        os.kill(nodes[1].proc.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: getattr(store.get_sandbox(sbx.id), "state", "") == "error",
                       "node-b's sandbox to be fenced", timeout=60)
        finally:
            os.kill(nodes[1].proc.pid, signal.SIGCONT)
        row = store.get_sandbox(sbx.id)
        assert row is not None and row.reason == "node_lost" and row.epoch == epoch + 1
        still = store.get_sandbox(kept.id)
        assert still is not None and still.state == "paused" and still.node_id == "node-b"
        # node-b beats again and stops what it still ran for the fenced row
        wait_until(lambda: sbx.id not in nodes[1].runsc_containers(),
                   "node-b to stop its fenced sandbox", timeout=60)
        wait_until(lambda: api1.health().get("nodes_alive") == 2, "node-b alive", timeout=30)
        r = httpx.post(f"{api1.url}/sandboxes/{sbx.id}/exec", json={"cmd": "true"},
                       headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 409, r.text
        back = Sandbox.connect(kept.id, api_url=api1.url, api_key=key)
        assert back.exec("echo kept").stdout == "kept\n"
        back.kill()
    finally:
        store.close()


def _curl(s: Sandbox, url: str) -> bool:
    r = s.exec(["curl", "-sS", "-m", "5", "-o", "/dev/null", url], timeout="1m")
    return r.exit_code == 0


def test_egress_policy_follows_the_sandbox(cluster_s3_inet: tuple[Cluster, FakeInternet],
                                           pg_url: str) -> None:
    """An allowlist sandbox paused on node A and resumed on node B (A SIGKILLed) keeps its
    policy: the allowed name answers, another name, a private address and the metadata
    address do not (nor did they reach the fake internet's listeners)."""
    (nodes, (api1, api2), key), inet = cluster_s3_inet
    _cordon_all_but(pg_url, api1, "node-a")
    r = httpx.post(api1.url + "/sandboxes", headers={"Authorization": f"Bearer {key}"},
                   json={"template": "python", "timeout": "10m",
                         "network": {"mode": "allowlist", "allow": ["allowed.test"]}})
    assert r.status_code == 201, r.text
    s = Sandbox.connect(r.json()["id"], api_url=api1.url, api_key=key)
    assert node_of(pg_url, s.id) == "node-a"
    assert _curl(s, "http://allowed.test/") and not _curl(s, "http://other.test/")
    s.pause()
    nodes[0].kill9()
    _cordon_all_but(pg_url, api1, "node-b")
    wait_until(lambda: api2.health().get("nodes_alive") == 1, "node-a dead", timeout=30)
    moved = Sandbox.connect(s.id, api_url=api2.url, api_key=key)
    assert node_of(pg_url, s.id) == "node-b"
    assert moved.info().network == {"mode": "allowlist", "allow": ["allowed.test"]}
    assert _curl(moved, "http://allowed.test/")
    for url in ("http://other.test/", "http://10.9.9.9/", "http://169.254.169.254/"):
        assert not _curl(moved, url), url
    bad = [e for e in inet.seen() if e["listener"].startswith(("10.9.9.9", "169.254"))]
    assert not bad, bad
    moved.kill()
    nodes[0].start()  # (its network is set up again and torn down cleanly at the end)


SECRET = "sk-cluster-" + secrets.token_hex(16)
AUTH = 'Authorization: Bearer $API_KEY'


def _sent(s: Sandbox, inet: FakeInternet, url: str) -> list[str]:
    """What the fake internet's server got of a request from inside ``s`` carrying the
    secret's placeholder in its Authorization header (the answer is not kept)."""
    n = len(inet.seen())
    r = s.exec(f'curl -sS -m 10 -o /dev/null -H "{AUTH}" {url}', timeout="1m")
    assert r.exit_code == 0, r.stderr
    return [e["data"] for e in inet.seen()[n:] if "Authorization" in e.get("data", "")]


def _inside(s: Sandbox) -> str:
    """Every string inside that starts like the secret: environments of all processes, and
    the files under /run /tmp /etc /home /work (the prefix only is handed in)."""
    r = s.exec("grep -rhaoE 'sk-cluster-[0-9a-f]*' /proc/[0-9]*/environ /run /tmp /etc "
               "/home /work 2>/dev/null; true", timeout="1m")
    return r.stdout


def _tables(pg_url: str) -> str:
    """The raw rows of the tables that could hold a secret, as text."""
    import psycopg

    out = []
    with psycopg.connect(pg_url) as c:
        for t in ("secrets", "sandboxes", "connections", "audit", "nodes", "execs"):
            out.append(repr(c.execute(f"SELECT * FROM {t}").fetchall()))
    return "\n".join(out)


def test_secrets_follow_the_sandbox(cluster_s3_inet: tuple[Cluster, FakeInternet],
                                    pg_url: str) -> None:
    """A sandbox with a secret for allowed.test (HTTPS: the proxy ends TLS with the
    sandbox's own CA) on node A, paused into the store, A SIGKILLed, resumed on node B: the
    server still gets the real value, with the same CA (the sandbox's trust bundle unchanged),
    while inside there is only the placeholder; the database holds the value and the CA's
    key sealed only; A back, a fork fans out to both nodes and each child's request carries
    the value; deleting them all removes the rows; no value in any answer or log."""
    import psycopg

    (nodes, (api1, api2), key), inet = cluster_s3_inet
    _cordon_all_but(pg_url, api1, "node-a")
    r = httpx.post(api1.url + "/sandboxes", headers={"Authorization": f"Bearer {key}"},
                   json={"template": "python", "timeout": "10m",
                         "network": {"mode": "allowlist", "allow": ["other.test"]},
                         "secrets": {"API_KEY": {"value": SECRET, "hosts": ["allowed.test"]}}})
    assert r.status_code == 201, r.text
    assert SECRET not in r.text
    s = Sandbox.connect(r.json()["id"], api_url=api1.url, api_key=key)
    assert node_of(pg_url, s.id) == "node-a"
    placeholder = s.exec('printf %s "$API_KEY"').stdout
    assert placeholder.startswith("cpuos-secret-")
    ca_pem = s.files.read("/run/cpuos/ca.pem")
    got = _sent(s, inet, "https://allowed.test:8443/bytes/10")
    assert got and SECRET in got[0] and "Host: allowed.test" in got[0]
    assert SECRET not in _inside(s)
    # sealed in the database, nothing on the node's disk
    with psycopg.connect(pg_url) as c:
        rows = c.execute("SELECT name, key_id, data FROM secrets").fetchall()
    names = {n for n, _, _ in rows}
    assert placeholder in names and any(n.startswith("ca-") for n in names)
    raw = _tables(pg_url)
    assert SECRET not in raw and "PRIVATE KEY" not in raw
    assert not list((nodes[0].home / "secrets").glob("*.json"))

    s.pause()
    nodes[0].kill9()
    _cordon_all_but(pg_url, api1, "node-b")
    wait_until(lambda: api2.health().get("nodes_alive") == 1, "node-a dead", timeout=30)
    moved = Sandbox.connect(s.id, api_url=api2.url, api_key=key)
    assert node_of(pg_url, s.id) == "node-b"
    assert moved.exec('printf %s "$API_KEY"').stdout == placeholder
    assert moved.files.read("/run/cpuos/ca.pem") == ca_pem  # (the same CA: the bundle holds)
    got = _sent(moved, inet, "https://allowed.test:8443/bytes/10")
    assert got and SECRET in got[0]
    # plain HTTP (the sandbox picks where it goes) and other hosts: the placeholder
    got = _sent(moved, inet, "http://allowed.test/bytes/10")
    assert got and SECRET not in got[0] and placeholder in got[0]
    assert SECRET not in _inside(moved)
    assert SECRET not in moved.exec("env").stdout

    # node A back; a fork fans out to both nodes, each child substitutes
    nodes[0].start()
    store = open_test_store(pg_url)
    try:
        store.set_node_cordoned("node-a", False)
    finally:
        store.close()
    wait_until(lambda: api2.health().get("nodes_placeable") == 2, "both placeable",
               timeout=30)
    children = moved.fork(n=2)
    where = sorted(str(node_of(pg_url, x.id)) for x in children)
    assert where == ["node-a", "node-b"], where
    for child in children:
        assert child.exec('printf %s "$API_KEY"').stdout == placeholder
        got = _sent(child, inet, "https://allowed.test:8443/bytes/10")
        assert got and SECRET in got[0], (node_of(pg_url, child.id), got)
    r = httpx.get(api1.url + f"/sandboxes/{children[0].id}",
                  headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200 and SECRET not in r.text

    # deleted everywhere: the rows go with the last sandbox that uses them
    for x in (*children, moved):
        x.kill()

    def gone() -> bool:
        with psycopg.connect(pg_url) as c:
            left = {n for (n,) in c.execute("SELECT name FROM secrets").fetchall()}
        return not (left & names)
    wait_until(gone, "the secrets' rows removed", timeout=30)
    for d in nodes:
        assert SECRET not in d.log.read_text()
    for a in (api1, api2):
        assert SECRET not in a.log.read_text()
    assert SECRET not in _tables(pg_url)


class StallingServer:
    """A TCP server on 127.0.0.1 that accepts connections and never answers (an S3
    endpoint that hangs): an upload to it stays under way until the node dies."""

    def __init__(self) -> None:
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.accepted:
            c.close()


@pytest.fixture(params=["600", "3"], ids=["no-timeout", "timeout-3s"])
def cluster_stalled_s3(pg_url: str, request: pytest.FixtureRequest
                       ) -> Iterator[tuple[Cluster, StallingServer]]:
    stall = StallingServer()
    try:
        env = {"CPUOS_SNAPSHOT_TRANSFER_TIMEOUT": str(request.param),
               "CPUOS_SNAPSHOT_STORE": "s3://never/p",
               "CPUOS_S3_ENDPOINT": f"http://127.0.0.1:{stall.port}",
               "CPUOS_S3_ACCESS_KEY_ID": "x", "CPUOS_S3_SECRET_ACCESS_KEY": "y"}
        for c in _cluster(pg_url, env):
            yield c, stall
    finally:
        stall.close()


@pytest.mark.parametrize("cluster_stalled_s3", ["600"], indirect=True)
def test_a_node_killed_mid_upload_never_says_paused(
        cluster_stalled_s3: tuple[Cluster, StallingServer], pg_url: str) -> None:
    """The S3 endpoint hangs: the pause's upload is under way (row: pausing) when node A is
    SIGKILLed. The row never says paused; restarted, A finds its local image and the
    sandbox is paused on A (not in the store), and resumes there with its file."""
    import threading

    (nodes, (api1, _), key), stall = cluster_stalled_s3
    _cordon_all_but(pg_url, api1, "node-a")
    sbx = Sandbox.create(template="python", timeout="5m", api_url=api1.url, api_key=key)
    sbx.files.write("/work/f", "kept")
    answer: list[int] = []
    t = threading.Thread(target=lambda: answer.append(httpx.post(
        f"{api1.url}/sandboxes/{sbx.id}/pause", headers={"Authorization": f"Bearer {key}"},
        timeout=120).status_code), daemon=True)
    t.start()
    store = open_test_store(pg_url)
    try:
        wait_until(lambda: bool(stall.accepted) and getattr(
            store.get_sandbox(sbx.id), "state", "") == "pausing",
            "the upload to be under way", timeout=60)
        nodes[0].kill9()
        t.join(60)
        assert answer and answer[0] >= 500, answer  # (the pause did not answer ok)
        row = store.get_sandbox(sbx.id)
        assert row is not None and row.state == "pausing" and row.node_id == "node-a"
        nodes[0].start()
        wait_until(lambda: getattr(store.get_sandbox(sbx.id), "state", "") == "paused",
                   "node-a's reconcile", timeout=30)
        row = store.get_sandbox(sbx.id)
        assert row is not None and row.node_id == "node-a"  # (on A's disk, not the store)
        wait_until(lambda: api1.health().get("nodes_alive") == 2, "node-a back", timeout=30)
        back = Sandbox.connect(sbx.id, api_url=api1.url, api_key=key)
        assert back.files.read("/work/f") == b"kept"
        assert store.get_sandbox(sbx.id).node_id == "node-a"  # type: ignore[union-attr]
        back.kill()
    finally:
        store.close()


@pytest.mark.parametrize("cluster_stalled_s3", ["3"], indirect=True)
def test_a_hanging_store_bounds_the_pause(
        cluster_stalled_s3: tuple[Cluster, StallingServer], pg_url: str) -> None:
    """CPUOS_SNAPSHOT_TRANSFER_TIMEOUT=3: the upload to a store that never answers is given
    up; the pause answers, the sandbox paused on its node's disk, and resumes there."""
    (_, (api1, _), key), stall = cluster_stalled_s3
    _cordon_all_but(pg_url, api1, "node-a")
    sbx = Sandbox.create(template="python", timeout="5m", api_url=api1.url, api_key=key)
    sbx.files.write("/work/f", "here")
    r = httpx.post(f"{api1.url}/sandboxes/{sbx.id}/pause",
                   headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert r.status_code == 200 and r.json()["state"] == "paused", r.text
    assert stall.accepted  # (it did try)
    assert node_of(pg_url, sbx.id) == "node-a"
    back = Sandbox.connect(sbx.id, api_url=api1.url, api_key=key)
    assert back.files.read("/work/f") == b"here"
    back.kill()


@pytest.fixture
def cluster_s3_bucket(pg_url: str, s3_server: testbed.S3Server
                      ) -> Iterator[tuple[Cluster, testbed.S3Server, str]]:
    bucket = "snap-" + secrets.token_hex(4)
    s3_server.create_bucket(bucket)
    for c in _cluster(pg_url, s3_server.env(bucket)):
        yield c, s3_server, bucket


def _store_keys(s3: testbed.S3Server, bucket: str) -> list[str]:
    import boto3

    c = boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1",
                     aws_access_key_id=s3.access_key, aws_secret_access_key=s3.secret_key)
    return [o["Key"] for o in c.list_objects_v2(Bucket=bucket).get("Contents", [])]


def test_fork_fans_out_across_nodes(
        cluster_s3_bucket: tuple[Cluster, testbed.S3Server, str], pg_url: str) -> None:
    """fork n=2 through an API process, both nodes placeable: one child on the parent's
    node, one on the other (restored from the fork's image in the S3 store), each with the
    parent's files and processes, its own identity, independent of the other; exec works
    on both through either API process; the image leaves the store; the internal routes
    are not the public's; with the other node cordoned the fork stays on the parent's
    node (the node-local fork)."""
    (nodes, (api1, api2), key), s3, bucket = cluster_s3_bucket
    _cordon_all_but(pg_url, api1, "node-a")
    parent = Sandbox.create(template="python", timeout="5m", api_url=api1.url, api_key=key)
    assert node_of(pg_url, parent.id) == "node-a"
    parent.files.write("/work/state.txt", "written before the fork")
    pid = parent.exec("sleep 1000 >/dev/null 2>&1 & echo $!").stdout.strip()
    assert pid.isdigit()
    store = open_test_store(pg_url)
    try:
        store.set_node_cordoned("node-b", False)
    finally:
        store.close()
    wait_until(lambda: api2.health().get("nodes_placeable") == 2, "both placeable",
               timeout=10)

    children = Sandbox.connect(parent.id, api_url=api2.url, api_key=key).fork(n=2)
    assert len(children) == 2
    where = {c.id: node_of(pg_url, c.id) for c in children}
    assert sorted(str(w) for w in where.values()) == ["node-a", "node-b"], where
    for c in children:
        assert c.id in (nodes[0] if where[c.id] == "node-a" else nodes[1]).runsc_containers()
        for api in (api1, api2):  # exec through either API process
            s = Sandbox.connect(c.id, api_url=api.url, api_key=key)
            assert s.files.read("/work/state.txt") == b"written before the fork"
            assert s.exec(f"kill -0 {pid} && cat /proc/{pid}/cmdline | tr '\\0' ' '"
                          ).stdout == "sleep 1000 "
        assert c.exec("hostname").stdout.strip() == c.id  # (its own identity)
        assert c.info().state == "running"
    # independent: a write in one is seen neither in the other nor in the parent
    a, b = children
    a.files.write("/work/only-a.txt", "a")
    for other in (b, parent):
        assert other.exec("test -e /work/only-a.txt").exit_code == 1
    assert parent.exec("cat /work/state.txt").stdout == "written before the fork"
    # the fork's image is gone from the store
    assert not [k for k in _store_keys(s3, bucket) if "/fork-" in k]
    # the nodes' internal routes are refused by an API process
    r = httpx.post(f"{api1.url}/sandboxes/{parent.id}/fork/publish", json={"remote": 1},
                   headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text

    # node-b cordoned: the fork is node-a's own (the node-local fork, no image stored)
    _cordon_all_but(pg_url, api1, "node-a")
    local = parent.fork(n=1)
    assert [node_of(pg_url, c.id) for c in local] == ["node-a"]
    assert local[0].files.read("/work/state.txt") == b"written before the fork"
    for s in (*children, *local):
        s.kill()

    # node-b misconfigured (its store's endpoint refuses connections): the fork fails as a
    # whole: a JSON error, node-a's child killed, the image released, the parent running
    nodes[1].stop()
    nodes[1].extra_env["CPUOS_S3_ENDPOINT"] = f"http://127.0.0.1:{testbed.free_port()}"
    nodes[1].start()
    store = open_test_store(pg_url)
    try:
        store.set_node_cordoned("node-b", False)
    finally:
        store.close()
    wait_until(lambda: api1.health().get("nodes_placeable") == 2, "node-b back", timeout=30)
    r = httpx.post(f"{api1.url}/sandboxes/{parent.id}/fork", json={"n": 2}, timeout=300,
                   headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable", r.text
    assert "fork image" in r.json()["error"]["message"], r.text
    listed = httpx.get(f"{api1.url}/sandboxes", headers={"Authorization": f"Bearer {key}"}
                       ).json()["sandboxes"]
    assert [x["id"] for x in listed] == [parent.id], listed
    assert nodes[0].runsc_containers() == [parent.id]
    assert not nodes[1].runsc_containers()
    assert not [k for k in _store_keys(s3, bucket) if "/fork-" in k]
    assert parent.exec("cat /work/state.txt").stdout == "written before the fork"
    parent.kill()
