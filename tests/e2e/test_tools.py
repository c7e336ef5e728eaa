"""cpuos.tools against a real daemon: the dispatcher's model-shaped results, its errors as
results, and the screenshot tool on a browser sandbox."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from cpuos import tools as tools_mod
from cpuos.tools import Tools, anthropic_tools, openai_tools
from cpuosd.templates.builder import template_info
from support.daemon import TEMPLATES, Daemon, png_size_and_colours

pytestmark = pytest.mark.e2e


@pytest.fixture
def tools(daemon: Daemon) -> Iterator[Tools]:
    t = Tools(timeout="5m", **daemon.sdk_kwargs())
    yield t
    t.close()


def test_schemas_name_the_same_tools() -> None:
    names = [t["function"]["name"] for t in openai_tools()]
    assert names == [t["name"] for t in anthropic_tools()] == list(tools_mod.TOOLS)
    assert {"create_sandbox", "run_code", "exec", "write_file", "read_file", "list_files",
            "expose_port", "screenshot", "pause", "resume", "kill"} == set(names)
    for t in anthropic_tools():
        assert t["input_schema"]["type"] == "object"


def test_files_and_errors_as_results(tools: Tools) -> None:
    r = tools.call("write_file", '{"path": "notes/a.txt", "content": "' + "x" * 30000 + '"}')
    assert not r.is_error and r.data["path"] == "/work/notes/a.txt" and r.data["size"] == 30000
    r = tools.call("read_file", {"path": "notes/a.txt", "max_chars": 1000})
    assert len(r.data["content"]) <= 1000 and "characters cut" in r.data["content"]
    r = tools.call("list_files", {"path": "/work/notes"})
    assert r.data["entries"] == [{"name": "a.txt", "type": "file", "size": 30000}]
    tools.call("run_code", {"code": "import matplotlib.pyplot as plt\nplt.plot([1, 2])\n"
                                    "plt.savefig('/work/fig.png')"})
    r = tools.call("read_file", {"path": "/work/fig.png"})
    assert r.images and r.images[0][0] == "image/png" and r.data["image"] == "image/png"
    for name, args, want in (
            ("exec", {}, "missing argument 'command'"),
            ("exec", {"command": 5}, "command must be a string"),
            ("exec", {"command": "true", "bogus": 1}, "unknown argument 'bogus'"),
            ("nope", {}, "unknown tool 'nope'"),
            ("run_code", "{not json", "not JSON"),
            ("read_file", {"path": "/nonexistent"}, "not_found")):
        r = tools.call(name, args)
        assert r.is_error and want in r.data["error"], (name, r.data)
    blocks = tools.call("exec", {"command": "echo ok"}).anthropic_content()
    assert json.loads(blocks[0]["text"])["stdout"] == "ok\n"


def test_screenshot_of_a_browser_sandbox(tools: Tools) -> None:
    if template_info(TEMPLATES, "browser") is None:
        pytest.skip(f"the browser template is not built in {TEMPLATES} "
                    "(`cpuosd template build browser`)")
    r = tools.call("create_sandbox", {"template": "browser", "network": "off"})
    assert not r.is_error, r.data
    page = "<html><body style='background: #1e90ff'><h1>hi</h1></body></html>"
    tools.call("write_file", {"path": "/work/site/index.html", "content": page})
    r = tools.call("exec", {"command": "cd /work/site && (nohup python3 -m http.server 8000 "
                            "--bind 127.0.0.1 >/tmp/http.log 2>&1 &); for i in $(seq 100); "
                            "do curl -sf -o /dev/null http://127.0.0.1:8000/ && exit 0; "
                            "sleep 0.1; done; exit 1", "timeout": 60})
    assert r.data["exit_code"] == 0, r.data
    r = tools.call("screenshot", {"url": "http://127.0.0.1:8000/index.html"})
    assert not r.is_error, r.data
    mime, png = r.images[0]
    w, h, colours = png_size_and_colours(png)
    assert mime == "image/png" and w > 100 and h > 100
    assert (0x1e, 0x90, 0xff) in colours
