"""The console's own routes, under ``/ui`` (outside the API's key check: the page must load
before anyone has signed in). Everything the page shows comes from the public API, called
with the session cookie (cpuosd.api.auth); these routes only serve the bundle and exchange a
key for a session.

- ``GET /ui/``: the page (``static/index.html``, with a fresh style nonce per answer and a
  strict Content-Security-Policy); ``GET /ui/assets/<name>``: its scripts and styles.
- ``POST /ui/session`` ``{"key": "cpk_..."}`` (JSON, from a page of this origin): a session
  cookie and ``{"workspace", "admin", "key", "csrf", "expires"}``; a bad key is 401 and
  says so.
- ``GET /ui/session``: the same for the cookie's session (401 without one).
- ``DELETE /ui/session`` (with ``X-Cpuos-Csrf``): signs out (the cookie is cleared).
"""

from __future__ import annotations

import json
import re
import secrets
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response

from ..api.deps import services_of
from ..errors import ApiError
from .bundle import STATIC
from .sessions import (COOKIE, COOKIE_TLS, Session, cookie_token, csrf_ok, header,
                       live_session, same_origin, sessions_of)

router = APIRouter(include_in_schema=False)
MAX_SIGN_IN_BODY = 4096
ASSET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
NONCE_MARK = "__CPUOS_STYLE_NONCE__"
TYPES = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml",
         ".woff2": "font/woff2", ".png": "image/png", ".json": "application/json",
         ".map": "application/json"}


def csp(nonce: str) -> str:
    """Scripts only from this origin (no inline script, no eval); styles from this origin,
    and inline ``<style>`` elements only with this answer's nonce (the terminal's renderer
    makes a few; ``main.tsx`` gives them the nonce); inline style attributes (the terminal
    colours 24-bit cells with them: they can load nothing, as images, fonts and connections
    are this origin's only); no frames, no plugins, no form posts elsewhere."""
    return ("default-src 'none'; script-src 'self'; "
            f"style-src 'self' 'nonce-{nonce}'; style-src-attr 'unsafe-inline'; "
            "img-src 'self' data: blob:; font-src 'self'; connect-src 'self'; "
            "manifest-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
            "form-action 'self'")


def _headers(nonce: str) -> dict[str, str]:
    return {"Content-Security-Policy": csp(nonce), "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY",
            "Cross-Origin-Opener-Policy": "same-origin",
            "Cross-Origin-Resource-Policy": "same-origin"}


NOT_BUILT = """<!doctype html><meta charset="utf-8"><title>cpuos console</title>
<h1>The cpuos console is not built</h1>
<p>This daemon's package has no console bundle. Build it where the source is
(<code>cd console &amp;&amp; npm ci &amp;&amp; npm run build</code>, or
<code>bash scripts/setup.sh</code>, which does it when Node.js 20.19 or later is there) and
restart cpuosd. The API and the SDKs work without it.</p>
"""


@router.get("/ui")
async def ui_root() -> Response:
    return RedirectResponse("/ui/", status_code=307)


@router.get("/ui/")
async def page() -> Response:
    nonce = secrets.token_urlsafe(18)
    headers = {**_headers(nonce), "Cache-Control": "no-store"}
    index = STATIC / "index.html"
    try:
        html = index.read_text()
    except OSError:
        return HTMLResponse(NOT_BUILT, status_code=503, headers=headers)
    return HTMLResponse(html.replace(NONCE_MARK, nonce), headers=headers)


@router.get("/ui/assets/{name}")
async def asset(name: str) -> Response:
    path = STATIC / "assets" / name
    if not ASSET_RE.fullmatch(name) or not path.is_file():
        raise ApiError("not_found", f"no console asset {name[:80]!r}")
    return FileResponse(path, media_type=TYPES.get(Path(name).suffix, "application/octet-stream"),
                        headers={**_headers("x"), "Cache-Control":
                                 "public, max-age=31536000, immutable"})


def _tls(request: Request) -> bool:
    return request.url.scheme in ("https", "wss")


def _who(request: Request, s: Session) -> dict[str, Any]:
    store = services_of(request.app).store
    w = store.workspace(s.workspace) or {"id": s.workspace, "name": "?"}
    rec = store.key_record(s.key_id) or {}
    return {"workspace": {"id": w["id"], "name": w["name"]},
            "admin": s.workspace == store.workspace_by_name("default"),
            "key": {"id": s.key_id, "label": rec.get("label")},
            "csrf": s.csrf, "expires": s.expires}


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers={"Cache-Control": "no-store"})


async def _small_body(request: Request) -> bytes:
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_SIGN_IN_BODY:
            raise ApiError("too_large", "sign-in body too large")
    return body


@router.post("/ui/session")
async def sign_in(request: Request) -> Response:
    headers = request.scope["headers"]
    if header(headers, b"origin") is not None and not same_origin(request.scope):
        return _error(ApiError("permission_denied", "sign in from the console's own page"))
    if not (header(headers, b"content-type") or "").startswith("application/json"):
        return _error(ApiError("invalid_argument", "send the key as JSON: {\"key\": \"...\"}"))
    try:
        raw = json.loads(await _small_body(request))
    except ApiError as e:
        return _error(e)
    except ValueError:
        return _error(ApiError("invalid_argument", "the body is not JSON"))
    key = raw.get("key") if isinstance(raw, dict) else None
    if not isinstance(key, str) or not key.strip():
        return _error(ApiError("invalid_argument", "paste an API key (cpk_...)"))
    found = services_of(request.app).store.key_lookup(key.strip())
    if found is None:
        return _error(ApiError("unauthorized", "that API key is not valid: it is unknown, "
                               "revoked, or of a deleted workspace"))
    sessions = sessions_of(request.app)
    token, s = sessions.create(*found)
    resp = JSONResponse(_who(request, s), headers={"Cache-Control": "no-store"})
    tls = _tls(request)
    resp.set_cookie(COOKIE_TLS if tls else COOKIE, token, max_age=int(sessions.ttl), path="/",
                    secure=tls, httponly=True, samesite="strict")
    return resp


@router.get("/ui/session")
async def whoami(request: Request) -> Response:
    s = live_session(request.scope)
    if s is None:
        return _error(ApiError("unauthorized", "not signed in" if cookie_token(
            request.scope["headers"]) is None else "the session has ended: sign in again"))
    return JSONResponse(_who(request, s), headers={"Cache-Control": "no-store"})


@router.delete("/ui/session")
async def sign_out(request: Request) -> Response:
    s = live_session(request.scope)
    if s is not None and not csrf_ok(s, request.scope["headers"]):
        return _error(ApiError("permission_denied", "signing out needs the session's "
                               "X-Cpuos-Csrf header"))
    token = cookie_token(request.scope["headers"])
    if token is not None:
        sessions_of(request.app).drop(token)
    resp = JSONResponse({"signed_out": True, "time": time.time()},
                        headers={"Cache-Control": "no-store"})
    tls = _tls(request)
    resp.delete_cookie(COOKIE_TLS if tls else COOKIE, path="/", secure=tls, httponly=True,
                       samesite="strict")
    return resp


@router.get("/ui/{name}")
async def top_file(name: str) -> Response:
    """Files at the bundle's top (the icon); anything else is the page (the app routes on
    the URL's fragment, so this is only a typed address)."""
    path = STATIC / name
    if ASSET_RE.fullmatch(name) and name != "index.html" and path.is_file():
        return FileResponse(path, media_type=TYPES.get(Path(name).suffix,
                                                       "application/octet-stream"),
                            headers={**_headers("x"), "Cache-Control": "public, max-age=3600"})
    return RedirectResponse("/ui/", status_code=307)
