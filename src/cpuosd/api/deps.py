"""What a route needs, as FastAPI dependencies, each defined here once: the daemon's parts
(``cpuosd.wiring.Services``, attached to the app by its lifespan) and the caller's
workspace (the Guard in ``auth`` has checked its key). A route takes them as parameters:

    async def info(sid: str, mgr: ManagerDep, ws: Ws) -> dict[str, Any]: ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends
from starlette.requests import HTTPConnection

from ..accounting.audit import AuditLog
from ..accounting.usage import Meter
from ..errors import ApiError
from ..lifecycle.manager import Manager
from ..network.service import Network
from ..network.preview import Preview
from ..store import Store

if TYPE_CHECKING:
    from ..wiring import Services


def services_of(app: Any) -> Services:
    """The parts the app serves (``Services``), once its lifespan has attached them."""
    s: Services | None = getattr(app.state, "services", None)
    if s is None:
        raise ApiError("unavailable", "the daemon is starting")
    return s


def _manager(conn: HTTPConnection) -> Manager:
    return services_of(conn.app).manager


def _store(conn: HTTPConnection) -> Store:
    return services_of(conn.app).store


def _network(conn: HTTPConnection) -> Network | None:
    return services_of(conn.app).network


def _preview(conn: HTTPConnection) -> Preview:
    return services_of(conn.app).preview


def _audit(conn: HTTPConnection) -> AuditLog:
    return services_of(conn.app).audit


def _meter(conn: HTTPConnection) -> Meter:
    return services_of(conn.app).meter


ManagerDep = Annotated[Manager, Depends(_manager)]
StoreDep = Annotated[Store, Depends(_store)]
NetworkDep = Annotated[Network | None, Depends(_network)]
PreviewDep = Annotated[Preview, Depends(_preview)]
AuditDep = Annotated[AuditLog, Depends(_audit)]
MeterDep = Annotated[Meter, Depends(_meter)]


def workspace(conn: HTTPConnection) -> str:
    """The caller's workspace (the Guard has checked the key)."""
    wid: Any = getattr(conn.state, "workspace", None)
    if not isinstance(wid, str):  # not behind the Guard (it covers every keyed route)
        raise ApiError("unauthorized", "missing API key: send 'Authorization: Bearer <key>'")
    return wid


Ws = Annotated[str, Depends(workspace)]


def is_admin(conn: HTTPConnection, ws: str) -> bool:
    """Whether ``ws`` is the admin workspace (``default``)."""
    return bool(ws == services_of(conn.app).store.workspace_by_name("default"))


def require_admin(conn: HTTPConnection, ws: str) -> None:
    if not is_admin(conn, ws):
        raise ApiError("permission_denied", "only the admin workspace may do this")
