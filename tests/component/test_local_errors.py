"""Error paths through the real daemon: bad keys, other workspaces, bad input, unknown
sandboxes and templates, a sandbox whose agent died, operations its backend lacks."""

from __future__ import annotations

import httpx
import pytest

from cpuos import AuthError, Conflict, InvalidArgument, NotFound, Sandbox
from support.daemon import wait_until
from support.local import TEMPLATE, LocalDaemon

pytestmark = pytest.mark.component


def test_keys_and_workspaces(sbx: Sandbox, local: LocalDaemon) -> None:
    with pytest.raises(AuthError):
        Sandbox.connect(sbx.id, api_url=local.url, api_key="cpk_not-a-key")
    with httpx.Client(base_url=local.url, headers={"Authorization": f"Bearer {local.key}"}
                      ) as c:
        r = c.post("/workspaces", json={"name": "tier0-other"})
        assert r.status_code == 201, r.text
        other_key = r.json()["key"]
        r = c.post("/sandboxes", json={"template": TEMPLATE, "env": {"1BAD": "x"}})
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_argument"
        assert "1BAD" in r.json()["error"]["message"]
        r = c.get("/health")
        assert r.json()["backend"] == "local" and r.json()["agent"] == "local process"
    # another workspace's sandbox does not exist for it
    with pytest.raises(NotFound):
        Sandbox.connect(sbx.id, api_url=local.url, api_key=other_key)


def test_unknown_sandbox_template_and_bad_input(local: LocalDaemon) -> None:
    with pytest.raises(NotFound):
        Sandbox.connect("sbx-000000000000", **local.sdk_kwargs())
    with pytest.raises(NotFound):
        Sandbox.create(template="no-such-template", **local.sdk_kwargs())
    with pytest.raises(InvalidArgument):
        Sandbox.create(template=TEMPLATE, timeout="forever", **local.sdk_kwargs())


def test_exec_input_errors(sbx: Sandbox) -> None:
    with pytest.raises(InvalidArgument):
        sbx.exec("")
    with pytest.raises(InvalidArgument):
        sbx.exec(["a\x00b"])


def test_pause_without_checkpoint_and_a_dead_agent(sbx: Sandbox, local: LocalDaemon) -> None:
    with pytest.raises(Conflict):  # the local backend cannot checkpoint
        sbx.pause()
    assert sbx.exec("echo alive").stdout == "alive\n"
    local.backend.agents[sbx.id].killpg()  # behind the daemon's back
    wait_until(lambda: sbx.info().state == "error", "the sandbox marked as failed", 15)
    assert sbx.info().reason == "exited"
    with pytest.raises(Conflict):
        sbx.exec("echo no")
