"""The ``browser`` template: headless chromium started before the template snapshot, driven
by Playwright over CDP through the daemon's preview proxy and by the helpers of
``sbx.browser``; its browsing follows the sandbox's egress policy. The pages are served by
a server inside the sandbox (no traffic leaves the host: the sandboxes' network is off)."""

from __future__ import annotations

import io
from collections.abc import Iterator

import httpx
import pytest

from cpuos import Conflict, InvalidArgument, NotFound, Sandbox, Unavailable
from cpuosd.templates.builder import template_info
from support.daemon import TEMPLATES, Daemon

pytestmark = [pytest.mark.e2e]

RED = (255, 0, 0)
PAGE = """<!doctype html>
<html><head><title>cpuos browser test</title>
<style>body { margin: 0; background: #ff0000; }
#panel { position: absolute; left: 20px; top: 20px; width: 300px; height: 120px;
         background: #ffffff; }</style></head>
<body><div id="panel">
<button id="go" onclick="document.getElementById('out').textContent = 'clicked ' +
  (++window.clicks)">go</button>
<span id="out">not yet</span>
<input id="name" oninput="document.getElementById('echo').textContent = this.value">
<span id="echo"></span>
</div><script>window.clicks = 0;</script></body></html>
"""


def need_template() -> None:
    if template_info(TEMPLATES, "browser") is None:
        pytest.skip(f"the browser template is not built in {TEMPLATES} "
                    "(`cpuosd template build browser`; scripts/test.sh builds it)")


def serve(s: Sandbox) -> str:
    """PAGE on port 8000 inside the sandbox (loopback only); its URL as the browser sees it."""
    s.files.write("/work/site/index.html", PAGE)
    r = s.exec("cd /work/site && (nohup python3 -m http.server 8000 --bind 127.0.0.1 "
               ">/tmp/http.log 2>&1 &)")
    assert r.exit_code == 0, r
    r = s.exec("for i in $(seq 100); do curl -sf -o /dev/null http://127.0.0.1:8000/ && exit 0;"
               " sleep 0.1; done; exit 1", timeout="1m")
    assert r.exit_code == 0, "the page server inside did not come up"
    return "http://127.0.0.1:8000/index.html"


@pytest.fixture(scope="module")
def bsbx(daemon: Daemon) -> Iterator[Sandbox]:
    need_template()
    s = Sandbox.create(template="browser", timeout="10m", network="off", **daemon.sdk_kwargs())
    try:
        yield s
    finally:
        s.kill()
        s.close()


def test_browser_runs_from_the_snapshot_as_the_sandbox_user_with_its_own_sandbox(
        bsbx: Sandbox) -> None:
    """chromium was started by the template's start command before the snapshot (the
    restored sandbox has it running), as the unprivileged sandbox user with its own profile,
    and its renderers are in chromium's own sandbox (namespaces, seccomp), not
    --no-sandbox."""
    r = bsbx.exec("ps -eo uid,args | grep '[c]hromium'")
    lines = r.stdout.splitlines()
    assert lines and all(line.split()[0] == "1000" for line in lines), r.stdout
    assert "--user-data-dir=/home/user/.config/cpuos-browser" in r.stdout
    assert "--no-sandbox" not in r.stdout
    r = bsbx.exec("for p in $(pgrep -f -- '--type=renderer'); do "
                  "grep -E '^(Seccomp|NoNewPrivs):' /proc/$p/status; "
                  "[ \"$(readlink /proc/$p/ns/user)\" != \"$(readlink /proc/self/ns/user)\" ] "
                  "&& echo own-userns; done")
    assert "Seccomp:\t2" in r.stdout and "own-userns" in r.stdout, r.stdout


def test_playwright_over_cdp_reads_title_and_dom_after_click(bsbx: Sandbox) -> None:
    from playwright.sync_api import sync_playwright

    url = serve(bsbx)
    cdp = bsbx.browser.cdp_url()
    assert cdp.startswith("ws://") and "/devtools/browser/" in cdp and "cpuos_token=" in cdp
    with sync_playwright() as p:
        browser = p.chromium.connect_over_cdp(cdp, timeout=60_000)
        try:
            ctx = browser.contexts[0]
            page = ctx.pages[0] if ctx.pages else ctx.new_page()
            page.goto(url)
            assert page.title() == "cpuos browser test"
            assert page.text_content("#out") == "not yet"
            page.click("#go")
            page.wait_for_function("document.getElementById('out').textContent !== 'not yet'")
            assert page.text_content("#out") == "clicked 1"
        finally:
            browser.close()  # disconnects; the sandbox's browser stays up
    # the helpers see the page Playwright left (one browser, one page)
    assert "clicked 1" in bsbx.browser.content()


def test_cdp_url_needs_its_token(bsbx: Sandbox) -> None:
    cdp = bsbx.browser.cdp_url()
    http = cdp.replace("ws://", "http://", 1).split("?")[0]
    with httpx.Client(trust_env=False) as c:
        upgrade = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
                   "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
        assert c.get(http, headers=upgrade).status_code == 401
        assert c.get(http + "?cpuos_token=wrong", headers=upgrade).status_code == 403


def test_helpers_goto_fill_click_content_and_screenshot(bsbx: Sandbox) -> None:
    from PIL import Image

    url = serve(bsbx)
    r = bsbx.browser.goto(url)
    assert r == {"url": url, "status": 200, "title": "cpuos browser test"}
    bsbx.browser.fill("#name", "héllo wörld")
    bsbx.browser.click("#go")
    bsbx.browser.click("#go")
    html = bsbx.browser.content()
    assert '<span id="echo">héllo wörld</span>' in html, html
    assert '<span id="out">clicked 2</span>' in html, html
    png = bsbx.browser.screenshot()
    img = Image.open(io.BytesIO(png))
    # the template's --window-size=1280,800; headless keeps room for a window's frame
    assert img.format == "PNG" and img.size[0] == 1280 and 600 < img.size[1] <= 800, img.size
    rgb = img.convert("RGB")
    assert rgb.getpixel((640, 500)) == RED  # the page's background
    assert rgb.getpixel((300, 130)) == (255, 255, 255)  # the panel
    full = Image.open(io.BytesIO(bsbx.browser.screenshot(full_page=True)))
    assert full.format == "PNG" and full.size[0] > 0


def test_helper_errors(bsbx: Sandbox, daemon: Daemon) -> None:
    serve(bsbx)
    bsbx.browser.goto("http://127.0.0.1:8000/index.html")
    with pytest.raises(NotFound):
        bsbx.browser.click("#nothing-here")
    with pytest.raises(NotFound):
        bsbx.browser.fill("#nothing-here", "x")
    with pytest.raises(Conflict):
        bsbx.browser.fill("#out", "x")  # a span takes no text
    with pytest.raises(InvalidArgument):
        bsbx.browser.goto("javascript:alert(1)")
    with pytest.raises(InvalidArgument):
        bsbx.browser.click("#go[")  # not a CSS selector
    with pytest.raises(Unavailable) as e:
        bsbx.browser.goto("http://127.0.0.1:8001/")  # nobody listens there
    assert e.value.details["error"] == "net::ERR_CONNECTION_REFUSED"


def test_network_off_fails_cleanly_and_quickly(bsbx: Sandbox) -> None:
    """With the network off an external page fails at once with chromium's error (the
    name is refused by the daemon's resolver, a connection by the firewall), well within
    the navigation's own bound, and the attempt is recorded."""
    assert bsbx.info().network == {"mode": "off", "allow": []}
    with pytest.raises(Unavailable) as e:
        bsbx.browser.goto("http://example.test/", timeout="20s")
    assert e.value.details["error"] == "net::ERR_NAME_NOT_RESOLVED", e.value.details
    with pytest.raises(Unavailable) as e:
        bsbx.browser.goto("http://198.51.100.7/", timeout="20s")
    assert e.value.details["error"] in ("net::ERR_CONNECTION_REFUSED",
                                        "net::ERR_ADDRESS_UNREACHABLE"), e.value.details
    recs = bsbx.network.connections(limit=1000)
    assert any(r["proto"] == "dns" and r.get("name") == "example.test"
               and r["verdict"] == "denied" for r in recs), recs
    # the browser is still usable afterwards
    assert bsbx.browser.goto("about:blank")["url"] == "about:blank"


def test_the_browser_can_be_started_again(bsbx: Sandbox) -> None:
    """A clone's profile lock names the template's boot: the launcher clears it, so the
    user can stop the browser and start it again (with flags of their own)."""
    r = bsbx.exec("pkill -f '[/]usr/lib/chromium/'; pkill -x socat; "
                  "for i in $(seq 100); do pgrep -f '[/]usr/lib/chromium/' >/dev/null || break; "
                  "sleep 0.1; done; (nohup cpuos-browser --lang=en-GB >/tmp/b.log 2>&1 &); "
                  "for i in $(seq 300); do "
                  "curl -sf -o /dev/null http://127.0.0.1:9222/json/version && exit 0; "
                  "sleep 0.1; done; cat /tmp/b.log; exit 1", timeout="1m")
    assert r.exit_code == 0, r.stdout + r.stderr
    url = serve(bsbx)
    assert bsbx.browser.goto(url)["title"] == "cpuos browser test"
    assert "--lang=en-GB" in bsbx.exec("ps -eo args").stdout


def test_helpers_on_a_sandbox_without_a_browser(daemon: Daemon) -> None:
    if template_info(TEMPLATES, "python") is None:
        pytest.skip(f"the python template is not built in {TEMPLATES}")
    s = Sandbox.create(template="python", timeout="2m", **daemon.sdk_kwargs())
    try:
        with pytest.raises(Conflict) as e:
            s.browser.screenshot()
        assert "browser" in str(e.value)
    finally:
        s.kill()
        s.close()
