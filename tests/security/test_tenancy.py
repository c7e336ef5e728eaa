"""Issue 25, finding 12: API keys could not be revoked nor workspaces deleted, and any
workspace read global information (template host paths, the audit chain's row count and
head, the host's capacity and every tenant's reservations). A real daemon, two tenants.

- keys: listed without the key, made, revoked; a revoked key is 401 on its next request and
  its open exec stream and terminal are ended; a workspace cannot revoke its own last key,
  nor touch another's keys (404); the admin may.
- deletion (admin): the workspace's sandboxes are gone (running and paused: runsc
  containers, snapshot), its keys 401, its audit rows kept; the other tenant unaffected.
- a tenant's answers hold no host path, no chain head or row count, no host capacity.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cpuos import (
    AuthError,
    Conflict,
    CpuosError,
    NotFound,
    PermissionDenied,
    Sandbox,
    Templates,
    Workspace,
)
from cpuosd.accounting.audit import DB_NAME
from cpuosd.api.schemas import ApiKey, ApiKeyList, WorkspaceDeleted, WorkspaceRecord
from support.daemon import Daemon, e2e_unavailable, new_daemon

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tenancy() -> Iterator[Daemon]:
    why = e2e_unavailable()
    if why:
        pytest.skip(why)
    d = new_daemon(CPUOS_POOL_SIZE="0")
    d.start()
    yield d
    assert not d.teardown(False)


def admin(d: Daemon) -> Workspace:
    return Workspace(**d.sdk_kwargs())


def tenant(d: Daemon, name: str) -> dict[str, Any]:
    with admin(d) as a:
        return a.create_workspace(name)


def test_keys_listed_made_and_revoked(tenancy: Daemon) -> None:
    a, b = tenant(tenancy, "keys-a"), tenant(tenancy, "keys-b")
    with Workspace(**tenancy.sdk_kwargs(a["key"])) as wa:
        first = wa.keys()
        assert len(first) == 1 and first[0].current and first[0].key is None
        ci = wa.create_key("ci")
        assert ci.key and ci.key.startswith("cpk_") and ci.label == "ci" and not ci.current
        listed = wa.keys()
        assert [k.id for k in listed] == [first[0].id, ci.id]
        assert all(k.key is None for k in listed)
        raw = httpx.get(tenancy.url + "/workspace/keys", timeout=30,
                        headers={"Authorization": f"Bearer {a['key']}"})
        assert ci.key not in raw.text and "hash" not in raw.text  # never a key nor its hash
        ApiKeyList.model_validate(raw.json(), strict=True)  # as /openapi.json says
        Sandbox.list(**tenancy.sdk_kwargs(ci.key))  # it works...
        gone = wa.revoke_key(ci.id)
        assert gone.revoked
        with pytest.raises(AuthError, match="revoked"):  # ...and at once no more
            Sandbox.list(**tenancy.sdk_kwargs(ci.key))
        assert wa.revoke_key(ci.id).revoked  # again: no change, no error
        # the workspace's last live key: refused (nobody but the admin could get it back in)
        with pytest.raises(Conflict, match="last live key"):
            wa.revoke_key(first[0].id)
        # another workspace's keys: not found, whatever the route
        b_keys = Workspace(**tenancy.sdk_kwargs(b["key"])).keys()
        with pytest.raises(NotFound):
            wa.keys(workspace=b["id"])
        with pytest.raises(NotFound):
            wa.revoke_key(b_keys[0].id)
        with pytest.raises(NotFound):
            wa.revoke_key(b_keys[0].id, workspace=b["id"])
        with pytest.raises(NotFound):
            wa.create_key("x", workspace=b["id"])
        with pytest.raises(PermissionDenied):
            wa.list_workspaces()
    Sandbox.list(**tenancy.sdk_kwargs(b["key"]))  # b's key untouched
    with admin(tenancy) as ad:
        # the admin may leave another workspace keyless, never itself
        ad.revoke_key(first[0].id, workspace=a["id"])
        with pytest.raises(AuthError):
            Sandbox.list(**tenancy.sdk_kwargs(a["key"]))
        mine = [k for k in ad.keys() if not k.revoked]
        assert len(mine) == 1 and mine[0].current
        with pytest.raises(Conflict):
            ad.revoke_key(mine[0].id)
        new = ad.create_key("again", workspace=a["id"])
        assert new.key is not None
    Sandbox.list(**tenancy.sdk_kwargs(new.key))


def test_revoking_a_key_ends_its_open_streams(tenancy: Daemon) -> None:
    t = tenant(tenancy, "streams")
    with Workspace(**tenancy.sdk_kwargs(t["key"])) as w:
        spare = w.create_key("spare")
        assert spare.key is not None
        key_id = next(k.id for k in w.keys() if k.current)
    sbx = Sandbox.create(template="python", timeout="5m", **tenancy.sdk_kwargs(t["key"]))
    try:
        term = sbx.pty.create(on_data=lambda _b: None)
        lines: list[str] = []
        first = threading.Event()
        outcome: dict[str, Any] = {}

        def on_line(line: str) -> None:
            lines.append(line)
            first.set()

        def stream() -> None:
            try:
                outcome["result"] = sbx.exec("for i in $(seq 600); do echo $i; sleep 0.1; done",
                                             on_stdout=on_line, timeout="2m")
            except CpuosError as e:
                outcome["error"] = e

        th = threading.Thread(target=stream)
        th.start()
        assert first.wait(120), "the exec stream never started"
        with tenancy.client(spare.key) as c:
            r = c.delete(f"/workspace/keys/{key_id}")
        assert r.status_code == 200, r.text
        revoked = r.json()
        ApiKey.model_validate(revoked, strict=True)
        assert revoked["requests_ended"] >= 2  # the exec stream and the terminal
        th.join(120)
        assert not th.is_alive()
        # the stream was cut (not run to its end), the terminal closed with 4401
        assert "error" in outcome and "result" not in outcome, outcome  # Unavailable: cut
        assert len(lines) < 600
        with pytest.raises(AuthError, match="revoked"):
            term.wait()
        assert revoked["revoked_at"] is not None
        with pytest.raises(AuthError):
            sbx.info()  # this client's key: refused from now on
        # the sandbox itself lives on for the workspace's other key
        other = Sandbox.connect(sbx.id, **tenancy.sdk_kwargs(spare.key))
        assert other.exec("echo still").stdout == "still\n"
        other.kill()
    finally:
        sbx.close()


def test_deleting_a_workspace_kills_its_sandboxes_only(tenancy: Daemon) -> None:
    doomed, other = tenant(tenancy, "doomed"), tenant(tenancy, "bystander")
    kd, ko = tenancy.sdk_kwargs(doomed["key"]), tenancy.sdk_kwargs(other["key"])
    running = Sandbox.create(template="python", timeout="5m", **kd)
    paused = Sandbox.create(template="python", timeout="5m", **kd)
    paused.exec("echo hi > /work/f")
    paused.pause()
    snap = tenancy.snapshots_dir / paused.id
    assert snap.exists()
    neighbour = Sandbox.create(template="python", timeout="5m", **ko)
    try:
        with Workspace(**ko) as wo:
            with pytest.raises(PermissionDenied):
                wo.delete_workspace(doomed["id"])
        with admin(tenancy) as ad:
            default = next(w for w in ad.list_workspaces() if w["name"] == "default")
            with pytest.raises(Conflict):
                ad.delete_workspace(default["id"])
            d = ad.delete_workspace(doomed["id"])
            WorkspaceDeleted.model_validate(d, strict=True)
            assert d["keys_revoked"] == 1
            assert sorted(d["sandboxes_killed"]) == sorted([running.id, paused.id])
            with pytest.raises(NotFound):
                ad.delete_workspace(doomed["id"])  # already gone
            assert doomed["id"] not in {w["id"] for w in ad.list_workspaces()}
            gone = next(w for w in ad.list_workspaces(deleted=True) if w["id"] == doomed["id"])
            WorkspaceRecord.model_validate(gone, strict=True)
            assert gone["deleted_at"] and gone["keys"] == 0 and gone["sandboxes"] == 0
            # the name may be taken again
            again = ad.create_workspace("doomed")
            assert again["id"] != doomed["id"]
        with pytest.raises(AuthError):
            Sandbox.list(**kd)
        alive = tenancy.runsc_containers()
        assert running.id not in alive and paused.id not in alive
        assert not snap.exists()
        # the other workspace is untouched
        assert neighbour.exec("echo fine").stdout == "fine\n"
        # the records are kept: the deleted workspace's audit rows are still in the chain
        db = sqlite3.connect(f"file:{tenancy.home / DB_NAME}?mode=ro", uri=True)
        try:
            n = db.execute("SELECT COUNT(*) FROM audit WHERE sandbox IN (?, ?)",
                           (running.id, paused.id)).fetchone()[0]
        finally:
            db.close()
        assert n > 0
        with tenancy.client() as c:
            assert c.get("/audit/verify").json()["ok"]
    finally:
        neighbour.kill()
        for s in (running, paused, neighbour):
            s.close()


def test_a_tenant_sees_no_global_information(tenancy: Daemon) -> None:
    t = tenant(tenancy, "nosy")
    sbx = Sandbox.create(template="python", timeout="2m", **tenancy.sdk_kwargs(t["key"]))
    try:
        with tenancy.client(t["key"]) as c, tenancy.client() as adm:
            for path in ("/templates", "/templates/python"):
                mine, theirs = c.get(path).text, adm.get(path).text
                assert "/var/lib" not in mine and "rootfs" not in mine, mine[:500]
                assert "rootfs" in theirs
            ws = c.get("/workspace").json()
            assert "host" not in ws and ws["used"]["sandboxes"] == 1
            assert "host" in adm.get("/workspace").json()
            v = c.get("/audit/verify").json()
            assert set(v) == {"ok", "scope", "problems", "problem_count"} and v["ok"]
            assert {"rows", "head"} <= set(adm.get("/audit/verify").json())
            h = c.get("/health").json()
            assert set(h) == {"ok", "version", "backend"}
            assert "runsc" in adm.get("/health").json()
        assert all(i.rootfs is None for i in Templates(**tenancy.sdk_kwargs(t["key"])).list())
    finally:
        sbx.kill()
        sbx.close()
