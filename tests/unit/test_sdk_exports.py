"""The SDK's package imports its public names when first used (cpuos/__init__.py): the
table of names it imports at run time and the imports type checkers read say the same,
every name resolves, and the daemon does not load the client."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import cpuos


def _checked_imports() -> dict[str, tuple[str, ...]]:
    """The ``if TYPE_CHECKING:`` block's imports, by module (as the file says them)."""
    tree = ast.parse(Path(cpuos.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If)
                 and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING")
    out: dict[str, tuple[str, ...]] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module is not None
        assert all(a.asname == a.name for a in node.names), "re-exported as X as X"
        out["." * node.level + node.module] = tuple(a.name for a in node.names)
    return out


def test_the_lazy_table_and_the_type_checkers_imports_agree() -> None:
    assert _checked_imports() == cpuos._EXPORTS


def test_every_public_name_resolves() -> None:
    for name in cpuos.__all__:
        assert getattr(cpuos, name) is not None, name
        assert name in dir(cpuos)
    assert cpuos.Sandbox.__module__ == "cpuos._sync.sandbox"
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        cpuos.Nope  # noqa: B018


def test_the_daemon_does_not_load_the_client() -> None:
    """The daemon's app imports the SDK's error table, not its client (nor httpx, with its
    command line's rich and pygments: ~0.1 s of every daemon's start); nor cryptography's
    x509, which only a sandbox with secrets needs (~40 ms)."""
    code = ("import sys, cpuosd.errors, cpuosd.api.app, cpuosd.wiring; "
            "print(sorted(m for m in ('httpx', 'cpuos._sync.sandbox', 'cryptography') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]"
