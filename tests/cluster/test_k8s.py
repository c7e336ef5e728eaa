"""Against a real kube-apiserver and etcd (built from the Go module proxy by
scripts/build-k8s.sh, started here on 127.0.0.1): deploy/kubernetes applies (server-side,
strict field validation: a dry run, then for real, then again without a change); RBAC lets
each role do what it needs with Leases and nothing else; Leases drive membership (a node
whose Lease stops being renewed is dead, a cordon label holds across heartbeats); leader
election between two processes, taken over when the leader stops or is killed. There is
no kubelet: nodes are processes (here, tasks and processes of the test)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.api_client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.dynamic import DynamicClient, ResourceInstance

from support import testbed
from support.daemon import wait_until
from cpuosd.cluster.membership import (CORDON_LABEL, LEADER_LEASE, LeaderElector, Membership,
                                       NodeFacts, NodeLease, connect, lease_name)

pytestmark = pytest.mark.cluster

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
NS = "cpuos"
NODE_USER = testbed.KubeUser("system:serviceaccount:cpuos:cpuos-node", "node-" + os.urandom(
    12).hex(), ("system:serviceaccounts", "system:serviceaccounts:cpuos"))
API_USER = testbed.KubeUser("system:serviceaccount:cpuos:cpuos-api", "api-" + os.urandom(
    12).hex(), ("system:serviceaccounts", "system:serviceaccounts:cpuos"))


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[testbed.KubeApiserver]:
    why = testbed.kube_unavailable()
    if why:
        pytest.skip(why)
    k = testbed.KubeApiserver(tmp_path_factory.mktemp("kube"), users=(NODE_USER, API_USER))
    try:
        k.start()
        yield k
    finally:
        k.stop()


def run(coro_fn: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return asyncio.run(coro_fn())


@contextlib.asynccontextmanager
async def api_as(kube: testbed.KubeApiserver, user: testbed.KubeUser | None = None
                 ) -> AsyncIterator[ApiClient]:
    api = await connect(str(kube.kubeconfig(user, NS)))
    try:
        yield api
    finally:
        await api.close()


def manifests() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for p in sorted(DEPLOY.glob("*.yaml")):
        if p.name == "kustomization.yaml":
            continue
        docs += [(p.name, d) for d in yaml.safe_load_all(p.read_text()) if d]
    return docs


async def apply(dyn: DynamicClient, doc: dict[str, Any], dry_run: bool) -> Any:
    """Server-side apply of one manifest; an error status raises ApiException.

    (kubernetes_asyncio's DynamicClient asks for the raw response and so never raises on an
    error status itself: a refused apply would read as a success. Checked here.)"""
    res = await dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
    resp = await dyn.server_side_apply(
        res, body=doc, field_manager="cpuos-deploy", force_conflicts=True,
        dry_run="All" if dry_run else None, query_params=[("fieldValidation", "Strict")],
        serialize=False)
    data = await resp.read()
    if not 200 <= resp.status <= 299:
        e = ApiException(status=resp.status, reason=resp.reason)
        e.body = data.decode(errors="replace")
        raise e
    return ResourceInstance(dyn, json.loads(data))  # type: ignore[no-untyped-call]


async def apply_all(kube: testbed.KubeApiserver, cache: Path) -> None:
    async with api_as(kube) as api:
        dyn = await DynamicClient(api, cache_file=str(cache))
        # the namespace first (a test run alone finds no namespace made by an earlier one)
        for _, doc in sorted(manifests(), key=lambda nd: nd[1]["kind"] != "Namespace"):
            await apply(dyn, doc, dry_run=False)


def test_kustomization_lists_every_manifest() -> None:
    k = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    files = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml",
                                                        "secret.example.yaml"}
    assert set(k["resources"]) == files
    images = {d["spec"]["template"]["spec"]["containers"][0]["image"] for _, d in manifests()
              if d["kind"] in ("DaemonSet", "Deployment")}
    assert images == {i["name"] for i in k["images"]}


def test_key_files_come_from_the_secret() -> None:
    """Every CPUOS_*_KEY_FILE a workload sets is a file of the Secret it mounts (an item of
    the example Secret): the audit and E2B keys on both roles, the secrets key (which seals
    sandboxes' secrets in the database) on the nodes, which alone open them."""
    secret = yaml.safe_load((DEPLOY / "secret.example.yaml").read_text())
    seen = {}
    for _, doc in manifests():
        if doc["kind"] not in ("DaemonSet", "Deployment"):
            continue
        pod = doc["spec"]["template"]["spec"]
        c = pod["containers"][0]
        mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
        files = {f"{mounts[v['name']]}/{i['path']}": i["key"] for v in pod["volumes"]
                 if "secret" in v and v["name"] in mounts for i in v["secret"]["items"]}
        env = {e["name"]: e.get("value") for e in c["env"]}
        keys = {n: files.get(str(v)) for n, v in env.items() if n.endswith("_KEY_FILE")}
        assert all(keys.values()), (doc["metadata"]["name"], keys, files)
        assert set(keys.values()) <= set(secret["stringData"]), keys
        seen[doc["kind"]] = set(keys)
    assert "CPUOS_SECRETS_KEY_FILE" in seen["DaemonSet"]
    assert "CPUOS_SECRETS_KEY_FILE" not in seen["Deployment"]  # (API processes never open one)


def test_manifests_apply(kube: testbed.KubeApiserver, tmp_path: Path) -> None:
    docs = manifests()
    kinds = {d["kind"] for _, d in docs}
    assert {"Namespace", "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Secret",
            "DaemonSet", "Deployment", "Service", "PodDisruptionBudget"} <= kinds

    async def go() -> None:
        async with api_as(kube) as api:
            dyn = await DynamicClient(api, cache_file=str(tmp_path / "discovery.json"))
            ns = next(d for _, d in docs if d["kind"] == "Namespace")
            await apply(dyn, ns, dry_run=False)  # (a dry run in a namespace needs it)
            for name, doc in docs:
                if doc["kind"] != "Namespace":
                    try:
                        await apply(dyn, doc, dry_run=True)
                    except ApiException as e:
                        raise AssertionError(f"{name}: {doc['kind']} "
                                             f"{doc['metadata']['name']}: {e.body!r}") from None
            apps = client.AppsV1Api(api)
            with pytest.raises(ApiException) as ei:  # a dry run made nothing
                await apps.read_namespaced_daemon_set("cpuos-node", NS)
            assert ei.value.status == 404
            versions = {}
            for _, doc in docs:
                r = await apply(dyn, doc, dry_run=False)
                versions[(doc["kind"], doc["metadata"]["name"])] = r.metadata.resourceVersion
            ds = await apps.read_namespaced_daemon_set("cpuos-node", NS)
            pod = ds.spec.template.spec
            assert pod.host_network and pod.containers[0].security_context.privileged
            assert pod.node_selector == {"cpuos.dev/pool": "sandbox"}
            assert {v.host_path.path for v in pod.volumes if v.host_path} >= {"/var/lib/cpuos",
                                                                            "/run/netns"}
            dep = await apps.read_namespaced_deployment("cpuos-api", NS)
            assert dep.spec.replicas == 2
            assert dep.spec.template.spec.containers[0].security_context.privileged is None
            svc = await client.CoreV1Api(api).read_namespaced_service("cpuos-api", NS)
            assert {p.port for p in svc.spec.ports} == {7770, 7771}
            for _, doc in docs:  # applying again changes nothing
                r = await apply(dyn, doc, dry_run=False)
                key = (doc["kind"], doc["metadata"]["name"])
                assert r.metadata.resourceVersion == versions[key], key
            # strict validation is on: a misspelt field is refused, not dropped
            bad = next(d for _, d in docs if d["kind"] == "DaemonSet")
            bad = {**bad, "spec": {**bad["spec"], "updateStrategyy": {}}}
            with pytest.raises(ApiException) as ei:
                await apply(dyn, bad, dry_run=True)
            assert "updateStrategyy" in str(ei.value.body)

    run(go)


def test_rbac_gives_each_role_leases_only(kube: testbed.KubeApiserver, tmp_path: Path) -> None:
    run(lambda: apply_all(kube, tmp_path / "d.json"))

    async def go() -> None:
        async with api_as(kube, NODE_USER) as node, api_as(kube, API_USER) as apip:
            lease = NodeLease(node, NS, NodeFacts("rbac-node", "10.0.0.9:7780"))
            await lease.register()
            await lease.heartbeat()
            states = await Membership(apip, NS).refresh()
            assert [s.node_id for s in states] == ["rbac-node"]
            for api, call in ((node, lambda a: client.CoreV1Api(a).list_namespaced_secret(NS)),
                              (apip, lambda a: client.CoreV1Api(a).list_namespaced_secret(NS)),
                              (node, lambda a: client.CoordinationV1Api(a)
                               .list_namespaced_lease("default")),
                              (apip, lambda a: client.AppsV1Api(a)
                               .list_namespaced_daemon_set(NS))):
                with pytest.raises(ApiException) as ei:
                    await call(api)
                assert ei.value.status == 403
            with pytest.raises(ApiException) as ei:  # a node cannot list the others
                await client.CoordinationV1Api(node).list_namespaced_lease(NS)
            assert ei.value.status == 403
            await lease.leave()

    run(go)


async def _wait(cond: Callable[[], Awaitable[bool]], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.2)


def test_leases_drive_membership(kube: testbed.KubeApiserver, tmp_path: Path) -> None:
    run(lambda: apply_all(kube, tmp_path / "d.json"))

    async def go() -> None:
        async with api_as(kube, NODE_USER) as node, api_as(kube, API_USER) as apip:
            facts_a = NodeFacts("node-a", "10.0.0.1:7780", capacity={"vcpus": 8},
                                runsc_version="r1", cpu_features=("avx2", "sse2"),
                                templates=("python-0cafb211",), snapshots=("sbx-1",))
            a = NodeLease(node, NS, facts_a, lease_seconds=3)
            b = NodeLease(node, NS, NodeFacts("node-b", "10.0.0.2:7780"), lease_seconds=3)
            await a.register()
            await b.register()
            beats = [asyncio.ensure_future(a.run()), asyncio.ensure_future(b.run())]
            members = Membership(apip, NS)

            async def state(node_id: str) -> Any:
                return next(s for s in await members.refresh() if s.node_id == node_id)

            try:
                sa, sb = await state("node-a"), await state("node-b")
                assert sa.alive and sb.alive and sa.placeable and not sa.cordoned
                assert sa.facts == facts_a and sa.holder == f"node-a/{facts_a.incarnation}"
                # node B stops renewing: dead once its Lease's duration has passed
                beats[1].cancel()
                await _wait(lambda: _not((state("node-b")), "alive"), "node-b to be dead")
                assert (await state("node-a")).alive  # (A heartbeats on)
                # cordon A: no new placements, and its own heartbeats keep the label
                await members.cordon("node-a")
                sa = await state("node-a")
                assert sa.cordoned and not sa.placeable and sa.alive
                renewed = sa.renewed
                await _wait(lambda: _changed(state("node-a"), renewed), "a heartbeat of A")
                assert (await state("node-a")).cordoned
                await members.cordon("node-a", on=False)
                assert (await state("node-a")).placeable
                # facts are published when they change
                await a.heartbeat(NodeFacts("node-a", "10.0.0.1:7780", facts_a.incarnation,
                                            capacity={"vcpus": 8}, snapshots=("sbx-1", "sbx-2")))
                assert (await state("node-a")).facts.snapshots == ("sbx-1", "sbx-2")
                # B restarts: a new incarnation takes its Lease over, alive again
                b2 = NodeLease(node, NS, NodeFacts("node-b", "10.0.0.2:7780"), lease_seconds=3)
                await b2.register()
                beats.append(asyncio.ensure_future(b2.run()))  # (it heartbeats on)
                sb = await state("node-b")
                assert sb.alive and sb.holder == b2.holder != b.holder
                # a fresh observer sees a long-dead node as dead at once (by its renewTime)
                beats[0].cancel()
                await asyncio.sleep(0)
                lease = await client.CoordinationV1Api(apip).read_namespaced_lease(
                    lease_name("node-a"), NS)
                stale = lease.spec.renew_time.timestamp() + 3.5
                await _wait(lambda: _after(stale), "node-a's Lease to expire")
                fresh = {s.node_id: s for s in await Membership(apip, NS).refresh()}
                assert not fresh["node-a"].alive and fresh["node-b"].alive
            finally:
                for t in beats:
                    t.cancel()
                await asyncio.gather(*beats, return_exceptions=True)
                await a.leave()
                await b.leave()
            assert [s.node_id for s in await members.refresh()] == []

    run(go)


async def _not(state: Awaitable[Any], attr: str) -> bool:
    return not getattr(await state, attr)


async def _changed(state: Awaitable[Any], before: float | None) -> bool:
    return bool((await state).renewed != before)


async def _after(t: float) -> bool:
    return time.time() > t


CANDIDATE = textwrap.dedent("""
    import asyncio, signal, sys
    from pathlib import Path
    from cpuosd.cluster.membership import LeaderElector, connect

    kubeconfig, me, status = sys.argv[1], sys.argv[2], Path(sys.argv[3])

    async def main() -> None:
        api = await connect(kubeconfig)
        el = LeaderElector(api, "cpuos", me, lease_seconds=4, renew_deadline=3,
                           retry_period=1)

        async def lead() -> None:
            status.write_text("leading")
            try:
                await asyncio.Event().wait()
            finally:
                status.write_text("stopped leading")

        task = asyncio.ensure_future(el.run(lead))
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        status.write_text("candidate")
        try:
            await task
        except asyncio.CancelledError:
            pass
        await api.close()
        status.write_text("exited")

    asyncio.run(main())
""")


def test_leader_election_between_two_processes(kube: testbed.KubeApiserver,
                                               tmp_path: Path) -> None:
    run(lambda: apply_all(kube, tmp_path / "d.json"))
    script = tmp_path / "candidate.py"
    script.write_text(CANDIDATE)
    kubeconfig = str(kube.kubeconfig(API_USER, NS))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    status = {n: tmp_path / f"{n}.status" for n in ("api-1", "api-2", "api-3")}

    def start(name: str) -> None:
        with open(tmp_path / f"{name}.log", "wb") as log:
            procs[name] = subprocess.Popen([sys.executable, str(script), kubeconfig, name,
                                            str(status[name])], stderr=log)

    def leading() -> list[str]:
        return sorted(n for n, p in status.items() if p.exists() and p.read_text() == "leading")

    async def holder() -> str | None:
        async with api_as(kube, API_USER) as api:
            return await LeaderElector(api, NS, "observer").holder()

    def wait_leader(others: set[str]) -> str:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = leading()
            assert len(now) <= 1, f"two leaders at once: {now}"
            if now and now[0] in others and run(holder) == now[0]:
                return now[0]
            time.sleep(0.1)
        raise TimeoutError(f"no leader among {others}; logs: " + " | ".join(
            (tmp_path / f"{n}.log").read_text()[-500:] for n in others))

    try:
        start("api-1")
        start("api-2")
        first = wait_leader({"api-1", "api-2"})
        other = ({"api-1", "api-2"} - {first}).pop()
        # (the other may write its status after the first leads: a loaded host)
        wait_until(lambda: status[other].exists()
                           and status[other].read_text() == "candidate", f"{other} a candidate")
        # the leader stops: it releases the Lease and the other takes over
        procs[first].send_signal(signal.SIGTERM)
        assert procs[first].wait(30) == 0
        assert status[first].read_text() == "exited"
        assert wait_leader({other}) == other
        # the new leader is killed: after the Lease's duration, a third one leads
        start("api-3")
        assert leading() == [other]
        procs[other].kill()
        procs[other].wait()
        status[other].unlink()
        assert wait_leader({"api-3"}) == "api-3"
    finally:
        for p in procs.values():
            testbed.stop_process(p, signal.SIGTERM, 15)
    assert run(holder) is None  # (the last one released it on its way out)


def test_lease_lookup_names() -> None:
    assert lease_name("node-1.example") == "cpuos-node-node-1.example"
    for bad in ("Node", "a/b", "-x", "x" * 60, ""):
        with pytest.raises(ValueError):
            lease_name(bad)
    assert LEADER_LEASE == "cpuos-api-leader" and CORDON_LABEL == "cpuos.dev/cordoned"
    f = NodeFacts("n", "a:1", snapshots=tuple(f"s{i}" for i in range(2500)))
    back = NodeFacts.from_annotation(f.to_annotation())
    assert back.truncated and len(back.snapshots) == 2000
