"""The web console's bundle (src/cpuosd/console/static, built from console/ by `npm run
build`, which scripts/setup.sh runs) was built from the sources in this tree: the build
stamps the hash of its sources into build.json (console/scripts/stamp.mjs) and this test
computes it again (cpuosd.console.bundle). A bundle built from other sources, or none,
fails here; a stamp computed another way than bundle.py's fails too."""

from __future__ import annotations

import json
import re

from cpuosd.console.bundle import STAMP, STATIC, built_hash, repo_console_dir, sources_hash

REBUILD = "run `npm ci && npm run build` in console/ (scripts/setup.sh and scripts/test.sh do)"


def test_bundle_is_built_from_these_sources() -> None:
    built = built_hash()
    assert built is not None, f"no console bundle in {STATIC}: {REBUILD}"
    assert built == sources_hash(repo_console_dir()), f"the console bundle is stale: {REBUILD}"


def test_bundle_has_the_page_its_scripts_and_no_inline_code() -> None:
    html = (STATIC / "index.html").read_text()
    assert "__CPUOS_STYLE_NONCE__" in html  # the daemon puts each answer's nonce there
    scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", html, re.S)
    assert scripts and all(body.strip() == "" and 'src="/ui/assets/' in attrs
                           for attrs, body in scripts), scripts  # no inline script
    assert "<style" not in html and " style=" not in html
    for ref in re.findall(r'(?:src|href)="/ui/(assets/[^"]+)"', html):
        assert (STATIC / ref).is_file(), ref
    assert json.loads((STATIC / STAMP).read_text())["sources"] == built_hash()
