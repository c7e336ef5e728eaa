"""CPUOS_MEMBERSHIP=kubernetes: two real node processes heartbeat their Leases in a real
kube-apiserver (facts in the annotation), two API processes place and route by those
Leases and elect a leader: `cpuos node cordon` sets the Lease's label and steers placement,
a node whose Lease stops being renewed is dead (503 for its sandbox, creates elsewhere) and
the leader fences it; the leader stopping hands the lead over."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from kubernetes_asyncio import client

from cpuos import Sandbox
from support import testbed
from cpuosd.cluster.membership import Membership, connect
from support.daemon import e2e_unavailable, wait_until

pytestmark = pytest.mark.cluster
NS = "cpuos"


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[testbed.KubeApiserver]:
    why = testbed.kube_unavailable() or e2e_unavailable()
    if why:
        pytest.skip(why)
    k = testbed.KubeApiserver(tmp_path / "kube")
    try:
        k.start()

        async def namespace() -> None:
            api = await connect(str(k.kubeconfig(None, NS)))
            try:
                await client.CoreV1Api(api).create_namespace(
                    client.V1Namespace(metadata=client.V1ObjectMeta(name=NS)))
            finally:
                await api.close()

        asyncio.run(namespace())
        yield k
    finally:
        k.stop()


def lease_states(kubeconfig: str) -> dict[str, tuple[bool, bool, str]]:
    async def go() -> dict[str, tuple[bool, bool, str]]:
        api = await connect(kubeconfig)
        try:
            return {s.node_id: (s.alive, s.cordoned, s.facts.address if s.facts else "")
                    for s in await Membership(api, NS).refresh()}
        finally:
            await api.close()

    return asyncio.run(go())


def test_nodes_by_their_leases(kube: testbed.KubeApiserver, pg_url: str) -> None:
    kubeconfig = str(kube.kubeconfig(None, NS))
    env = {"CPUOS_MEMBERSHIP": "kubernetes", "KUBECONFIG": kubeconfig,
           "CPUOS_K8S_NAMESPACE": NS}
    with testbed.node_cluster(pg_url, env, {**env, "CPUOS_NODE_FENCE_AFTER": "2"}) as cl:
        api, key = cl.apis[0], cl.key
        # one leader among the API processes
        wait_until(lambda: sorted(str(a.health().get("leader")) for a in cl.apis)
                   == ["False", "True"], "one API process to lead", timeout=30)
        leases = lease_states(kubeconfig)
        assert set(leases) == {"node-a", "node-b"}
        assert all(alive and not cordoned and addr.startswith("127.0.0.1:")
                   for alive, cordoned, addr in leases.values()), leases
        cli_env = {**os.environ, "CPUOS_API_URL": api.url, "CPUOS_API_KEY": key}

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "cpuos.cli.main", *args],
                                  env=cli_env, capture_output=True, text=True, timeout=120)

        # cordon through the CLI: the Lease's label, which placement follows
        assert cli("node", "cordon", "node-a").returncode == 0
        assert lease_states(kubeconfig)["node-a"][1] is True
        wait_until(lambda: api.health().get("nodes_placeable") == 1, "node-a cordoned", 15)
        sbx = Sandbox.create(template="python", timeout="5m", api_url=api.url, api_key=key)
        store = testbed.open_test_store(pg_url)
        try:
            row = store.get_sandbox(sbx.id)
            assert row is not None and row.node_id == "node-b"
        finally:
            store.close()
        assert sbx.exec("echo via-lease").stdout == "via-lease\n"
        assert cli("node", "uncordon", "node-a").returncode == 0
        assert lease_states(kubeconfig)["node-a"][1] is False

        # node-b dies: its Lease is not renewed, the API process counts it dead
        cl.nodes[1].kill9()
        wait_until(lambda: api.health().get("nodes_alive") == 1, "node-b's Lease to lapse",
                   timeout=30)
        assert lease_states(kubeconfig)["node-b"][0] is False
        r = httpx.post(f"{api.url}/sandboxes/{sbx.id}/exec", json={"cmd": "true"},
                       headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 503, r.text
        other = Sandbox.create(template="python", timeout="5m", api_url=api.url, api_key=key)
        assert other.exec("echo " + (word := secrets.token_hex(4))).stdout == word + "\n"
        other.kill()
        # the leader fences it (CPUOS_NODE_FENCE_AFTER=2 s past its Lease)
        store = testbed.open_test_store(pg_url)
        try:
            wait_until(lambda: getattr(store.get_sandbox(sbx.id), "reason", "") == "node_lost",
                       "node-b's sandbox to be fenced", timeout=30)
        finally:
            store.close()
        # back: it takes its Lease over; the fenced sandbox stays lost (killed at reconcile)
        cl.nodes[1].start()
        wait_until(lambda: api.health().get("nodes_alive") == 2, "node-b back", timeout=30)
        assert sbx.id not in cl.nodes[1].runsc_containers()
        r = httpx.post(f"{api.url}/sandboxes/{sbx.id}/exec", json={"cmd": "true"},
                       headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 409, r.text
        # the leader stops: the other API process takes the lead over
        leader = next(a for a in cl.apis if a.health().get("leader"))
        follower = next(a for a in cl.apis if a is not leader)
        leader.stop()
        wait_until(lambda: follower.health().get("leader") is True, "the lead handed over",
                   timeout=30)
