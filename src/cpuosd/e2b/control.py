"""E2B's control plane (REST/JSON, E2B's ``spec/openapi.yml``) over cpuos's lifecycle.

Auth: ``X-API-Key`` (or ``Authorization: Bearer``) with a cpuos key or an E2B-format key of
the same workspace; errors are E2B's ``{"code", "message"}``. Every route is a call of the
Manager's public operations, the ones cpuos's own API makes (admission, limits, network
policy, audit, usage and events follow from them)."""

from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Any
from urllib.parse import parse_qsl, unquote

from fastapi import FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api.models import CreateSandbox
from ..api.sandboxes import sandbox_size
from ..api.usage import sandbox_metrics
from ..agentconn import TransportError
from ..errors import STATUS, ApiError, api_error
from ..network.policy import Policy
from ..store import SandboxRow
from .state import E2B, ENVD_VERSION, E2BError, new_e2b_key
from ..lifecycle.states import GONE, State

log = logging.getLogger("cpuosd.e2b")

# our state -> E2B's
E2B_STATES = {State.CREATING: "running", State.RUNNING: "running", State.RESUMING: "running",
              State.PAUSING: "paused", State.PAUSED: "paused"}
DEFAULT_TIMEOUT = 300
MAX_LIST = 1000


class NetworkConfig(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    allow_out: list[str] | None = Field(None, alias="allowOut")
    deny_out: list[str] | None = Field(None, alias="denyOut")
    allow_public_traffic: bool | None = Field(None, alias="allowPublicTraffic")


class NewSandbox(BaseModel):
    """``NewSandboxV2`` (and v1's ``NewSandbox``): unknown fields are accepted and ignored
    (E2B adds fields; an SDK newer than this layer still works)."""
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    template_id: str = Field("base", alias="templateID", max_length=128)
    timeout: int | None = Field(None, ge=0)
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = Field(None, alias="envVars")
    auto_pause: bool | None = Field(None, alias="autoPause")
    secure: bool | None = None
    allow_internet_access: bool | None = None
    network: NetworkConfig | None = None


class TimeoutBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    timeout: int = Field(ge=0)


class ForkBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    timeout: int | None = Field(None, ge=0)
    count: int = Field(1, ge=1, le=16)


class ConnectBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    timeout: int | None = Field(None, ge=0)


def _iso(t: float | None) -> str:
    return dt.datetime.fromtimestamp(t or 0, dt.UTC).isoformat().replace("+00:00", "Z")


def _e2b_error(e: ApiError) -> E2BError:
    status = STATUS.get(e.code, 500)
    if e.code == "invalid_argument" and status == 422:
        status = 400
    if e.code in ("limit_exceeded",):
        status = 429
    return E2BError(status, e.message)


def build(e2b: E2B) -> FastAPI:
    app = FastAPI(title="cpuos: E2B-compatible control plane", openapi_url=None,
                  docs_url=None, redoc_url=None)

    @app.exception_handler(E2BError)
    async def _own(_: Request, e: E2BError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ApiError)
    async def _api(_: Request, e: ApiError) -> JSONResponse:
        err = _e2b_error(e)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(TransportError)
    async def _transport(_: Request, e: TransportError) -> JSONResponse:
        err = _e2b_error(api_error(e))
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        msg = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ())[1:])}: "
                        f"{err.get('msg')}" for err in e.errors())
        return JSONResponse({"code": 400, "message": msg or "invalid request"}, 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"code": e.status_code, "message": str(e.detail)}, e.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("e2b control plane")
        return JSONResponse({"code": 500, "message": f"internal error: {type(e).__name__}"},
                            500)

    def ws_of(request: Request) -> str:
        wid = request.scope.get("state", {}).get("workspace")
        if not isinstance(wid, str):
            raise E2BError(401, "missing API key: send X-API-Key")
        return wid

    def get(request: Request, sid: str) -> SandboxRow:
        try:
            row = e2b.mgr.get(ws_of(request), sid)
        except ApiError:
            raise E2BError(404, f"sandbox {sid!r} not found") from None
        if row.state in GONE:
            raise E2BError(404, f"sandbox {sid!r} not found")
        return row

    def sandbox(row: SandboxRow) -> dict[str, Any]:
        """E2B's ``Sandbox`` (the create and connect answer)."""
        facts = e2b.facts(row.id) or {}
        out: dict[str, Any] = {
            "templateID": facts.get("alias") or row.template, "sandboxID": row.id,
            "clientID": "cpuos", "envdVersion": ENVD_VERSION,
            "envdAccessToken": e2b.envd_token(row.id),
            "trafficAccessToken": e2b.traffic_token(row.id),
            "domain": e2b.domain()}
        return out

    def detail(row: SandboxRow, listed: bool = False) -> dict[str, Any]:
        facts = e2b.facts(row.id) or {}
        started = row.started_at or row.created_at
        if row.state == State.PAUSED:
            end = time.time() + float(row.remaining or 0)
        else:
            end = row.deadline or started
        out: dict[str, Any] = {
            "templateID": facts.get("alias") or row.template, "sandboxID": row.id,
            "clientID": "cpuos", "startedAt": _iso(started), "endAt": _iso(end),
            "envdVersion": ENVD_VERSION, "cpuCount": int(row.spec.vcpus or 0),
            "memoryMB": int(row.spec.memory_mib or 0),
            "diskSizeMB": int(row.spec.disk_mib or 0),
            "state": E2B_STATES.get(row.state, "running"), "metadata": row.metadata}
        if not listed:
            out.update(envdAccessToken=e2b.envd_token(row.id), domain=e2b.domain(),
                       allowInternetAccess=(row.spec.network or {}).get("mode")
                       != "off")
        return out

    async def create(request: Request, body: NewSandbox) -> JSONResponse:
        ws = ws_of(request)
        mgr = e2b.mgr
        timeout = float(body.timeout if body.timeout is not None else DEFAULT_TIMEOUT)
        if timeout > mgr.cfg.sandbox.max_timeout:
            raise E2BError(400, f"timeout may be at most {mgr.cfg.sandbox.max_timeout:.0f}s")
        network: dict[str, Any] | None = None
        if body.allow_internet_access is False:
            network = Policy.parse("off").to_json()
        elif body.network is not None and body.network.allow_out:
            network = Policy.parse({"allow": body.network.allow_out}).to_json()
        else:  # the workspace's default, else the daemon's (as cpuos's own create)
            w = e2b.store.workspace(ws) or {}
            network = (w.get("settings") or {}).get("default_network")
        template = e2b.template_for(body.template_id)
        try:
            # cpuos's own request model checks names, environment and metadata
            req = CreateSandbox.model_validate({"template": template, "timeout": timeout,
                                                "metadata": body.metadata or {},
                                                "env": body.env_vars or {}})
        except ValidationError as err:
            raise E2BError(400, "; ".join(str(x.get("msg")) for x in err.errors())
                           ) from None
        size = sandbox_size(req, e2b.store.workspace(ws), mgr.cfg, mgr.admission.limits(ws))
        row = await mgr.create(ws, req.template, float(req.timeout), req.metadata, req.env,
                               size["vcpus"], size["memory_mib"],
                               "pause" if body.auto_pause else "kill", network=network,
                               pids=size["pids"], disk_mib=size["disk_mib"])
        public = not (body.network is not None and body.network.allow_public_traffic is False)
        e2b.remember(row.id, body.template_id, public, {})
        return JSONResponse(sandbox(row), status_code=201)

    @app.post("/v2/sandboxes", status_code=201)
    async def create_v2(request: Request, body: NewSandbox) -> JSONResponse:
        return await create(request, body)

    @app.post("/sandboxes", status_code=201)
    async def create_v1(request: Request, body: NewSandbox) -> JSONResponse:
        return await create(request, body)

    def listed(request: Request, states: str | None, metadata: str | None,
               order: str | None, started_after: str | None = None,
               template: str | None = None) -> list[SandboxRow]:
        want = {s.strip() for s in (states or "running,paused").split(",") if s.strip()}
        if want - {"running", "paused"}:
            raise E2BError(400, "state must be running and/or paused")
        filt: dict[str, str] = {}
        if metadata:
            filt = {unquote(k): unquote(v) for k, v in parse_qsl(metadata,
                                                                 keep_blank_values=True)}
        after = 0.0
        if started_after:
            try:
                after = dt.datetime.fromisoformat(started_after.replace("Z", "+00:00")
                                                  ).timestamp()
            except ValueError:
                raise E2BError(400, "startedAfter must be an RFC 3339 time") from None
        rows = [r for r in e2b.store.list_sandboxes(ws_of(request), tuple(E2B_STATES))
                if E2B_STATES[r.state] in want
                and all(r.metadata.get(k) == v for k, v in filt.items())
                and (r.started_at or r.created_at) >= after - 1e-6
                and (template is None
                     or template in (r.template, (e2b.facts(r.id) or {}).get("alias")))]
        # (a sandbox from the warm pool was made before it was handed out: its start counts)
        rows.sort(key=lambda r: (r.started_at or r.created_at, r.id), reverse=order != "asc")
        return rows

    @app.get("/v2/sandboxes")
    async def list_v2(request: Request, state: str | None = None,
                      metadata: str | None = None, order: str | None = None,
                      limit: int = Query(100, ge=1, le=MAX_LIST),
                      next_token: str | None = Query(None, alias="nextToken"),
                      started_after: str | None = Query(None, alias="startedAfter"),
                      template: str | None = None) -> Response:
        rows = listed(request, state, metadata, order, started_after, template)
        start = 0
        if next_token:
            ids = [r.id for r in rows]
            if next_token not in ids:
                raise E2BError(400, "bad nextToken")
            start = ids.index(next_token)
        page = rows[start:start + limit]
        headers = {}
        if start + limit < len(rows):
            headers["x-next-token"] = rows[start + limit].id
        return JSONResponse([detail(r, listed=True) for r in page], headers=headers)

    @app.get("/sandboxes")
    async def list_v1(request: Request, metadata: str | None = None) -> list[dict[str, Any]]:
        return [detail(r, listed=True) for r in listed(request, None, metadata, None)]

    @app.get("/sandboxes/{sid}")
    async def info(sid: str, request: Request) -> dict[str, Any]:
        return detail(get(request, sid))

    @app.delete("/sandboxes/{sid}", status_code=204)
    async def kill(sid: str, request: Request) -> Response:
        get(request, sid)
        await e2b.mgr.kill(sid, reason="killed")
        return Response(status_code=204)

    @app.post("/sandboxes/{sid}/timeout", status_code=204)
    async def set_timeout(sid: str, body: TimeoutBody, request: Request) -> Response:
        get(request, sid)
        if body.timeout > e2b.mgr.cfg.sandbox.max_timeout:
            raise E2BError(400, "timeout too long")
        e2b.mgr.set_timeout(ws_of(request), sid, float(body.timeout))
        return Response(status_code=204)

    @app.post("/sandboxes/{sid}/refreshes", status_code=204)
    async def refresh(sid: str, request: Request) -> Response:
        """(older SDKs' keep-alive: the deadline is left as it is)"""
        get(request, sid)
        return Response(status_code=204)

    @app.post("/sandboxes/{sid}/pause", status_code=204)
    async def pause(sid: str, request: Request) -> Response:
        row = get(request, sid)
        if row.state in (State.PAUSED, State.PAUSING):
            raise E2BError(409, f"sandbox {sid} is already paused")
        await e2b.mgr.snapshots.pause(ws_of(request), sid)
        return Response(status_code=204)

    async def connect(request: Request, sid: str, timeout: int | None) -> JSONResponse:
        ws = ws_of(request)
        row = get(request, sid)
        status = 200
        if row.state in (State.PAUSED, State.PAUSING):
            row = await e2b.mgr.snapshots.resume(ws, sid)
            status = 201
        if timeout is not None:  # only ever later (E2B: connect never shortens it)
            row = e2b.mgr.get(ws, sid)
            if row.state == State.RUNNING and (row.deadline or 0) < time.time() + timeout:
                row = e2b.mgr.set_timeout(ws, sid, float(timeout))
        return JSONResponse(sandbox(row), status_code=status)

    @app.post("/v2/sandboxes/{sid}/connect")
    async def connect_v2(sid: str, request: Request, body: ConnectBody | None = None
                         ) -> JSONResponse:
        return await connect(request, sid, body.timeout if body else None)

    @app.post("/sandboxes/{sid}/connect")
    async def connect_v1(sid: str, request: Request, body: ConnectBody | None = None
                         ) -> JSONResponse:
        return await connect(request, sid, body.timeout if body else None)

    @app.post("/sandboxes/{sid}/resume", status_code=201)
    async def resume(sid: str, request: Request, body: ConnectBody | None = None
                     ) -> JSONResponse:
        row = get(request, sid)
        if row.state not in (State.PAUSED, State.PAUSING):
            raise E2BError(409, f"sandbox {sid} is not paused")
        resp = await connect(request, sid, body.timeout if body else None)
        resp.status_code = 201
        return resp

    @app.post("/sandboxes/{sid}/fork", status_code=201)
    async def fork(sid: str, request: Request, body: ForkBody | None = None
                   ) -> JSONResponse:
        """cpuos's fork: one checkpoint, restored as many times (memory, processes, files);
        the forks are E2B sandboxes as their parent is."""
        body = body or ForkBody.model_validate({})
        ws = ws_of(request)
        parent = get(request, sid)
        rows = await e2b.mgr.snapshots.fork(ws, sid, body.count)
        facts = e2b.facts(sid) or {}
        out = []
        for r in rows:
            e2b.remember(r.id, facts.get("alias") or parent.template,
                         bool(facts.get("public", True)), {})
            if body.timeout is not None:
                r = e2b.mgr.set_timeout(ws, r.id, float(body.timeout))
            out.append({"sandbox": sandbox(r)})
        return JSONResponse(out, status_code=201)

    @app.get("/sandboxes/{sid}/metrics")
    async def metrics(sid: str, request: Request, start: int | None = None,
                      end: int | None = None) -> list[dict[str, Any]]:
        """One point: what the host measures now (cpuos keeps no history); none when the
        range asked for does not hold now."""
        row = get(request, sid)
        now = time.time()
        if (start is not None and now < start - 10) or (end is not None and now > end + 10):
            return []
        m = await sandbox_metrics(e2b.mgr, row)
        vcpus = int(row.spec.vcpus or 0)
        return [{"timestamp": _iso(now), "timestampUnix": int(now), "cpuCount": vcpus,
                 "cpuUsedPct": float(m.get("cpu_percent_avg") or 0.0),
                 "memUsed": int(m.get("memory_bytes") or 0),
                 "memTotal": int(m.get("memory_limit_bytes") or 0), "memCache": 0,
                 "diskUsed": int(m.get("disk_used_bytes") or 0),
                 "diskTotal": int(m.get("disk_limit_bytes") or 0)}]

    @app.post("/keys", status_code=201)
    async def new_key(request: Request) -> dict[str, Any]:
        """cpuos's own: a key in E2B's format (``e2b_<hex>``) for the caller's workspace
        (the JS SDK refuses any other shape before it sends a request); listed and revoked
        with the workspace's other keys (``/workspace/keys``)."""
        kid, rec = e2b.store.new_key(ws_of(request), "e2b", new_e2b_key())
        log.info("API key %s (e2b) made for workspace %s", kid, ws_of(request))
        return {"key": rec["key"], "id": kid, "workspace": ws_of(request)}

    return app
