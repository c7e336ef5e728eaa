"""AsyncWorkspace: the caller's workspace (its limits, what it holds, its usage and cost,
its API keys) and, with the admin key, every workspace. Written once;
``cpuos._sync.workspace`` is generated from this file."""

from __future__ import annotations

from types import TracebackType
from typing import Any
from urllib.parse import quote

from .._errors import InvalidArgument
from .._models import ApiKeyInfo
from .sandbox import _AsyncHTTP


def _id(value: str, what: str) -> str:
    if not value or "/" in value or len(value) > 128:
        raise InvalidArgument(f"bad {what} {value[:80]!r}")
    return quote(value, safe="")


class AsyncWorkspace:
    """``AsyncWorkspace().usage()`` (this month), ``.usage(since="2026-12-01")``,
    ``.info()`` (limits, what its sandboxes hold; the admin also sees the host's room),
    ``.keys()``, ``.create_key(label)``, ``.revoke_key(id)``; with the admin key also
    ``.list_workspaces()``, ``.create_workspace(name)``, ``.delete_workspace(id)`` and
    ``workspace=`` on the key methods."""

    def __init__(self, api_url: str | None = None, api_key: str | None = None) -> None:
        self._http = _AsyncHTTP(api_url, api_key)

    async def close(self) -> None:
        await self._http.close()

    async def __aenter__(self) -> AsyncWorkspace:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def info(self) -> dict[str, Any]:
        d: dict[str, Any] = await self._http.request("GET", "/workspace")
        return d

    async def usage(self, *, since: str | float | None = None, until: str | float | None = None,
                    sandbox: str | None = None) -> dict[str, Any]:
        """Usage between since and until (epoch seconds or ISO 8601; default this month):
        ``total`` and per-sandbox ``sandboxes`` (running_seconds, vcpu_seconds,
        memory_gib_seconds, paused_seconds, snapshot_gib_seconds, cost), the ``prices``
        and the ``spending_cap`` (cap, month_spent, reached)."""
        params = {k: str(v) for k, v in (("since", since), ("until", until),
                                          ("sandbox", sandbox)) if v is not None}
        d: dict[str, Any] = await self._http.request("GET", "/usage", params=params)
        return d

    async def metrics(self) -> list[dict[str, Any]]:
        """``Sandbox.metrics()`` of each running and paused sandbox, in one request."""
        d = await self._http.request("GET", "/metrics")
        return list(d["sandboxes"])

    # ---- API keys: the caller's workspace's, or (the admin) any workspace's ---------------
    def _keys_path(self, workspace: str | None) -> str:
        return "/workspace/keys" if workspace is None else \
            f"/workspaces/{_id(workspace, 'workspace id')}/keys"

    async def keys(self, *, workspace: str | None = None) -> list[ApiKeyInfo]:
        """The workspace's keys (revoked ones too): ids, labels, dates, never a key."""
        d = await self._http.request("GET", self._keys_path(workspace))
        return [ApiKeyInfo.from_json(k) for k in d["keys"]]

    async def create_key(self, label: str = "default", *, workspace: str | None = None
                         ) -> ApiKeyInfo:
        """A new key; its ``key`` is in this answer only (it is stored hashed)."""
        d = await self._http.request("POST", self._keys_path(workspace),
                                     json={"label": label})
        return ApiKeyInfo.from_json(d)

    async def revoke_key(self, key_id: str, *, workspace: str | None = None) -> ApiKeyInfo:
        """Revoke a key: refused (401) from the next request on, and what it has in flight
        (streams, terminals) is ended. A workspace cannot revoke its own last live key
        (Conflict: make another first); the admin can, for another workspace."""
        d = await self._http.request(
            "DELETE", f"{self._keys_path(workspace)}/{_id(key_id, 'key id')}")
        return ApiKeyInfo.from_json(d)

    # ---- every workspace (admin) ------------------------------------------------------------
    async def list_workspaces(self, *, deleted: bool = False) -> list[dict[str, Any]]:
        """Every workspace: id, name, created_at, limits, settings, deleted_at, ``keys``
        (live ones) and ``sandboxes`` (alive) (admin)."""
        d = await self._http.request("GET", "/workspaces",
                                     params={"deleted": "true"} if deleted else None)
        return list(d["workspaces"])

    async def create_workspace(self, name: str, *, limits: dict[str, int] | None = None
                               ) -> dict[str, Any]:
        """A new workspace and its first key: id, name, ``key`` (shown once), limits
        (admin)."""
        d: dict[str, Any] = await self._http.request(
            "POST", "/workspaces", json={"name": name, "limits": limits or {}})
        return d

    async def delete_workspace(self, workspace_id: str) -> dict[str, Any]:
        """Delete a workspace (admin): its keys revoked, its sandboxes killed (paused ones'
        snapshots removed); its records (usage, audit) are kept. Returns what was done:
        keys_revoked, requests_ended, sandboxes_killed."""
        d: dict[str, Any] = await self._http.request(
            "DELETE", f"/workspaces/{_id(workspace_id, 'workspace id')}")
        return d
