"""The daemon's configuration (cpuosd.config): every variable declared once, the environment
read in config.py alone, defaults and errors as documented, README.md's table current."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cpuosd.config import Config, ConfigError, declarations, effective
from cpuosd.main import load_config

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "cpuosd"

# The places in cpuosd (besides config.py) that may touch os.environ, and why: none of them
# reads configuration. (path under src/cpuosd, enclosing function) -> reason
ALLOWED = {
    ("api/templates.py", "_start"):
        "the template build child inherits the daemon's environment (its own Config), with "
        "the daemon's home and templates directory set explicitly",
    ("templates/builder.py", "run_steps"):
        "the operator's http(s)_proxy variables passed on to build steps",
    ("backends/microvm/jailer.py", "main"):
        "the jailer clears its environment before it execs the VMM",
}
# CPUOS_* names in cpuosd that are not the daemon's configuration: set inside sandboxes
# for the agent, or read by the SDK and CLI (tests/support drops them for test daemons)
NOT_CONFIG = {"CPUOS_AGENT_SOCKET", "CPUOS_UID", "CPUOS_TEMPLATE_SNAPSHOT", "CPUOS_API_KEY",
              "CPUOS_API_URL"}


def sources() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "e2b/gen" not in p.as_posix())


def environment_uses(tree: ast.AST) -> list[tuple[str, int]]:
    """(enclosing function or "<module>", line) of each os.environ / os.getenv / putenv /
    unsetenv / environb and of each ``from os import environ...``."""
    found: list[tuple[str, int]] = []
    names = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = child.name
            if (isinstance(child, ast.Attribute) and child.attr in names
                    and isinstance(child.value, ast.Name) and child.value.id == "os"):
                found.append((where, child.lineno))
            elif isinstance(child, ast.ImportFrom) and child.module == "os" and any(
                    a.name in names for a in child.names):
                found.append((where, child.lineno))
            visit(child, inner)

    visit(tree, "<module>")
    return found


def test_only_config_reads_the_environment() -> None:
    bad = []
    for path in sources():
        rel = path.relative_to(SRC).as_posix()
        if rel == "config.py":
            continue
        for where, line in environment_uses(ast.parse(path.read_text(), str(path))):
            if (rel, where) not in ALLOWED and (rel, "*") not in ALLOWED:
                bad.append(f"src/cpuosd/{rel}:{line} (in {where})")
    assert not bad, ("the environment is read outside cpuosd/config.py (declare the "
                     "variable there and pass the Config down): " + ", ".join(bad))


def test_the_rule_sees_what_it_must() -> None:
    tree = ast.parse("import os\nfrom os import getenv\nX = os.environ.get('A')\n"
                     "def f():\n    return os.getenv('B')\n")
    assert environment_uses(tree) == [("<module>", 2), ("<module>", 3), ("f", 5)]


def test_every_cpuos_variable_is_declared_once() -> None:
    declared = [d.var.env for d in declarations()]
    assert len(declared) == len(set(declared)), "a variable declared twice"
    assert len(declared) >= 78
    seen: set[str] = set()
    for path in sources():
        seen |= set(re.findall(r"CPUOS_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_])", path.read_text()))
    missing = sorted(seen - set(declared) - NOT_CONFIG)
    assert not missing, f"named in cpuosd but not declared in cpuosd/config.py: {missing}"
    assert not NOT_CONFIG & set(declared)


def test_no_environment_is_the_declared_defaults() -> None:
    assert Config.from_env({}) == Config()
    # "" counts as unset
    assert Config.from_env({d.var.env: "" for d in declarations()}) == Config()


def test_documented_defaults_parse_to_the_defaults() -> None:
    """What README.md shows as a default, given as the value, is the default."""
    for d in declarations():
        text = d.default_text.split(" (")[0]
        if text:
            assert d.var.parse(d.var.env, text) == d.default, d.var.env


def test_values_parse_into_their_sections() -> None:
    cfg = Config.from_env({
        "CPUOS_HOME": "/srv/c", "CPUOS_PORT": "8000", "CPUOS_NETWORK": "0",
        "CPUOS_NET_POOL": "10.77.0.0/16", "CPUOS_DENY_PORTS": "1, 2", "CPUOS_IDLE_TIMEOUT": "5m",
        "CPUOS_IDLE_PAUSE_PARALLEL": "0", "CPUOS_POOL_TEMPLATES": "python, Bad!, browser",
        "CPUOS_AUDIT_RETENTION": "forever", "CPUOS_AUDIT_MIN_FREE": "0",
        "CPUOS_PRICE_VCPU_HOUR": "1.5", "CPUOS_HOST_MEMORY_MIB": "4096", "CPUOS_RUNSC": "/x",
        "CPUOS_UPLINK_NETNS": "inet", "OTHER": "ignored"})
    assert (cfg.home, cfg.port, cfg.templates_dir, cfg.microvm_dir) == (
        Path("/srv/c"), 8000, Path("/srv/c/templates"), Path("/srv/c/microvm"))
    assert not cfg.network.enabled and cfg.network.pool == "10.77.0.0/16"
    assert cfg.network.deny_ports == {1, 2} and cfg.network.uplink_netns == "inet"
    assert (cfg.idle.timeout, cfg.idle.pause_parallel) == (300.0, 1)
    assert cfg.pool.templates == ("python", "browser")
    assert cfg.audit.retention is None and cfg.audit.min_free is None
    assert cfg.pricing.vcpu_hour == 1.5 and cfg.limits.host_memory_mib == 4096
    assert cfg.runsc.path == "/x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1  # type: ignore[misc]


@pytest.mark.parametrize(("env", "message"), [
    ({"CPUOS_PORT": "http"}, "CPUOS_PORT='http': not an integer"),
    ({"CPUOS_ADMIT_CPU": "most"}, "CPUOS_ADMIT_CPU='most': not a number"),
    ({"CPUOS_NET_ID": "TOOLONG"}, "CPUOS_NET_ID='TOOLONG': up to 4 of [a-z0-9]"),
    ({"CPUOS_NET_POOL": "10.0.0.0/33"}, "CPUOS_NET_POOL='10.0.0.0/33'"),
    ({"CPUOS_DENY_CIDRS": "10.1.0.0/16,nope"}, "CPUOS_DENY_CIDRS: 'nope'"),
    ({"CPUOS_IDLE_TIMEOUT": "soon"}, "CPUOS_IDLE_TIMEOUT"),
    ({"CPUOS_AUDIT_MIN_FREE": "lots"}, "CPUOS_AUDIT_MIN_FREE"),
    ({"CPUOS_AUDIT_SANDBOX_ROWS": "-1"}, "CPUOS_AUDIT_SANDBOX_ROWS must not be negative"),
    ({"CPUOS_ROLE": "master"}, "CPUOS_ROLE='master': one of all, node, api"),
    ({"CPUOS_MEMBERSHIP": "etcd"}, "CPUOS_MEMBERSHIP='etcd': one of store, kubernetes"),
    ({"CPUOS_DATABASE_URL": "sqlite:///x.db"}, "CPUOS_DATABASE_URL must be a postgresql://"),
    ({"CPUOS_SNAPSHOT_STORE": "ftp://x"}, "CPUOS_SNAPSHOT_STORE must be s3://"),
    ({"CPUOS_NODE_LEASE": "soon"}, "CPUOS_NODE_LEASE"),
])
def test_a_bad_value_is_one_line_naming_the_variable(env: dict[str, str], message: str
                                                     ) -> None:
    with pytest.raises(ConfigError) as e:
        Config.from_env(env)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_home_from_the_command_line_leaves_the_environment_alone(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CPUOS_HOME", raising=False)
    monkeypatch.delenv("CPUOS_TEMPLATES_DIR", raising=False)
    cfg = load_config(home=str(tmp_path), port=9999)
    assert (cfg.home, cfg.port, cfg.templates_dir) == (tmp_path, 9999, tmp_path / "templates")
    assert "CPUOS_HOME" not in os.environ


def cpuosd(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CPUOS_")}
    return subprocess.run([sys.executable, "-m", "cpuosd", *args], env={**clean, **env},
                          capture_output=True, text=True, timeout=60)


def test_cpuosd_config_prints_the_effective_configuration(tmp_path: Path) -> None:
    r = cpuosd("config", "--json", "--home", str(tmp_path),
               env={"CPUOS_POOL_SIZE": "0", "CPUOS_PREVIEW_DOMAIN": "sbx.example.com"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {d.var.env for d in declarations()}
    assert out["CPUOS_HOME"] == str(tmp_path)
    assert out["CPUOS_TEMPLATES_DIR"] == str(tmp_path / "templates")  # the one in effect
    assert (out["CPUOS_POOL_SIZE"], out["CPUOS_PREVIEW_DOMAIN"]) == ("0", "sbx.example.com")
    assert out["CPUOS_DEFAULT_NETWORK"] == "allowlist"
    text = cpuosd("config", env={}).stdout.splitlines()
    assert len(text) == len(out) and text[0].startswith("CPUOS_HOME ")


def test_secrets_are_masked() -> None:
    secrets = {d.var.env for d in declarations() if d.var.secret}
    assert {"CPUOS_NODE_TOKEN", "CPUOS_DATABASE_URL", "CPUOS_S3_SECRET_ACCESS_KEY"} <= secrets
    rows = {n: v for n, v, _ in effective(Config.from_env({
        "CPUOS_NODE_TOKEN": "t" * 32, "CPUOS_DATABASE_URL": "postgresql://u:pw@db/cpuos"}))}
    assert rows["CPUOS_NODE_TOKEN"] == rows["CPUOS_DATABASE_URL"] == "****"
    assert rows["CPUOS_S3_SECRET_ACCESS_KEY"] == ""  # (unset: nothing to mask)
    assert rows["CPUOS_PORT"] == "7770"


def test_the_cluster_section() -> None:
    cfg = Config.from_env({"CPUOS_ROLE": "node", "CPUOS_NODE_LEASE": "3",
                           "CPUOS_NODE_FENCE_AFTER": "never", "CPUOS_MEMBERSHIP": "kubernetes",
                           "CPUOS_SNAPSHOT_STORE": "s3://b/p", "CPUOS_S3_PART_MIB": "16",
                           "CPUOS_AUDIT_KEY_FILE": "/etc/cpuos/audit.key"})
    c = cfg.cluster
    assert (c.role, c.node_lease, c.node_fence_after, c.membership) == (
        "node", 3.0, 0.0, "kubernetes")
    assert (c.snapshot_store, c.s3_part_mib) == ("s3://b/p", 16)
    assert cfg.audit_key_path == Path("/etc/cpuos/audit.key")
    assert Config.from_env({"CPUOS_HOME": "/h"}).audit_key_path == Path("/h/audit.key")
    assert load_config(role="api").cluster.role == "api"


def test_a_bad_value_stops_the_daemon_with_one_line() -> None:
    for args in ((), ("config",)):
        r = cpuosd(*args, env={"CPUOS_IDLE_PAUSE_PARALLEL": "two"})
        assert r.returncode == 2
        assert r.stderr == "cpuosd: CPUOS_IDLE_PAUSE_PARALLEL='two': not an integer\n"


def test_readme_table_is_current() -> None:
    r = subprocess.run([sys.executable, "scripts/gen_config_docs.py", "--check"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
