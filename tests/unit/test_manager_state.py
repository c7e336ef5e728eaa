"""Runtime state lives on the objects that own it, not in modules: two Managers in one
process (tier 0 starts several daemons in one) share no exec stdin streams and no browser
page cache, and no module of the daemon keeps an empty container to fill at run time."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import cpuosd
from cpuosd.agentconn import AgentChannel, Stream
from cpuosd.browser import MAX_TARGETS
from cpuosd.config import Config
from cpuosd.errors import ApiError
from cpuosd.lifecycle.manager import Manager
from cpuosd.store import SqliteStore
from support.fakes import FakeBackend

# module-level containers that are the process's by nature (cpuosd.procs: the children
# this process started, which only it can reap)
PROCESS_WIDE = {("procs.py", "_owned")}


async def _nothing() -> AsyncIterator[bytes]:
    chunks: list[bytes] = []  # a body of no chunks
    for b in chunks:
        yield b


def test_two_managers_share_no_runtime_state(tmp_path: Path) -> None:
    async def main() -> None:
        mgrs = []
        for name in ("a", "b"):
            cfg = Config(home=tmp_path / name)
            mgrs.append(Manager(cfg, SqliteStore(cfg.db_path), FakeBackend()))
        m1, m2 = mgrs
        st = Stream(AgentChannel(tmp_path / "agent.sock"), 1)
        m1.exec_stdin.add("sbx-000000000001", "e1", st)
        with pytest.raises(ApiError) as e:  # the other daemon never started that exec
            await m2.exec_stdin.write("sbx-000000000001", "e1", _nothing(), close=False)
        assert e.value.code == "not_found"
        assert await m1.exec_stdin.write("sbx-000000000001", "e1", _nothing(), close=False
                                         ) == {"exec_id": "e1", "sent": 0, "closed": False}
        m1.exec_stdin.end("sbx-000000000001", "e1", st)
        assert st.stdin_closed == "the command ended"
        with pytest.raises(ApiError):
            await m1.exec_stdin.write("sbx-000000000001", "e1", _nothing(), close=False)

        m1.browser_targets.remember("sbx-000000000001@10.0.0.2", "T1")
        assert m1.browser_targets.get("sbx-000000000001@10.0.0.2") == "T1"
        assert m2.browser_targets.get("sbx-000000000001@10.0.0.2") is None
        for i in range(MAX_TARGETS):  # bounded: the oldest go first
            m1.browser_targets.remember(f"k{i}", "T")
        assert m1.browser_targets.get("sbx-000000000001@10.0.0.2") is None
        assert m1.browser_targets.get(f"k{MAX_TARGETS - 1}") == "T"

    asyncio.run(main())


def _empty_container(v: ast.expr) -> bool:
    if isinstance(v, (ast.Dict, ast.Set, ast.List)):
        return not (v.keys if isinstance(v, ast.Dict) else v.elts)
    if isinstance(v, ast.Call) and not v.args and not v.keywords:
        f = v.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) \
            else ""
        return name in ("dict", "set", "list", "deque", "Counter", "defaultdict",
                        "OrderedDict", "WeakValueDictionary", "WeakSet")
    return False


def test_no_module_keeps_runtime_state() -> None:
    root = Path(cpuosd.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            for t in targets:
                if isinstance(t, ast.Name) and _empty_container(value):
                    where = (str(path.relative_to(root)), t.id)
                    if where not in PROCESS_WIDE:
                        found.append(f"{where[0]}: {t.id}")
    assert not found, f"module-level runtime state (put it on its owner): {found}"
