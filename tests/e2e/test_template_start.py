"""A custom template with env, workdir, a start command and a ready check: booted once,
snapshotted with its server running, and every sandbox restored with it already up.
Builds a small template (~30 s), so it is marked slow."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpuos import Sandbox
from cpuosd.templates.builder import TemplateSpec, build
from support.daemon import TEMPLATES, Daemon

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SPEC = """
name = "cpuos-test-web"
apt = ["python3"]
env = { GREETING = "hello from the template" }
workdir = "/srv"
copy = [{ src = "index.html", dest = "/srv/index.html" }]
start = "python3 -m http.server 8000 --bind 127.0.0.1 --directory /srv"
ready = { port = 8000, timeout = 30 }
"""


def test_template_start_command_survives_the_snapshot(daemon: Daemon, tmp_path: Path) -> None:
    (tmp_path / "index.html").write_text("<h1>served before the snapshot</h1>")
    (tmp_path / "web.toml").write_text(SPEC)
    build(TemplateSpec.load(str(tmp_path / "web.toml")), TEMPLATES)
    kw = daemon.sdk_kwargs()
    a = Sandbox.create(template="cpuos-test-web", timeout="2m", **kw)
    b = Sandbox.create(template="cpuos-test-web", timeout="2m", **kw)
    try:
        for s in (a, b):
            r = s.exec("echo $GREETING; pwd; "
                       "python3 -c \"import urllib.request as u; "
                       "print(u.urlopen('http://127.0.0.1:8000/index.html').read().decode())\"")
            assert r.stdout.splitlines() == ["hello from the template", "/srv",
                                             "<h1>served before the snapshot</h1>"], r
    finally:
        for s in (a, b):
            s.kill()
            s.close()
