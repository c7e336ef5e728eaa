"""The E2B surface's parts that need no daemon: the generated code is fresh, keys have E2B's
shape, signed file URLs match what E2B's SDK signs, templates map, and cpuos's cell frames
become the code interpreter's NDJSON lines as E2B's SDK parses them."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cpuos_agent import protocol as P
from cpuosd.config import Config
from cpuosd.e2b.plain import _ndjson
from cpuosd.e2b.state import E2B, new_e2b_key, parse_templates

REPO = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh() -> None:
    pytest.importorskip("grpc_tools")
    r = subprocess.run([sys.executable, "scripts/gen_e2b_proto.py", "--check"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_key_shape() -> None:
    k = new_e2b_key()
    assert re.fullmatch(r"^e2b_[0-9a-f]+$", k) and len(k) == 44  # the JS SDK's check


def test_templates() -> None:
    m = parse_templates("base=python; code-interpreter-v1=code-interpreter,python;bad")
    assert m == {"base": ["python"], "code-interpreter-v1": ["code-interpreter", "python"]}


def test_signed_urls_match_the_sdk(tmp_path: Path) -> None:
    sig = pytest.importorskip("e2b.sandbox.signature")
    e = E2B(Config(home=tmp_path))
    tok = e.envd_token("sbx-aaaaaaaaaaaa")
    s = sig.get_signature("a/b.txt", "read", "user", tok)
    assert e.signed("sbx-aaaaaaaaaaaa", "a/b.txt", "read", "user", s["signature"], None)
    assert not e.signed("sbx-aaaaaaaaaaaa", "a/b.txt", "write", "user", s["signature"], None)
    assert not e.signed("sbx-bbbbbbbbbbbb", "a/b.txt", "read", "user", s["signature"], None)
    later = sig.get_signature("x", "write", None, tok, 60)
    assert e.signed("sbx-aaaaaaaaaaaa", "x", "write", None, later["signature"],
                    str(later["expiration"]))
    gone = sig.get_signature("x", "write", None, tok, -60)
    assert not e.signed("sbx-aaaaaaaaaaaa", "x", "write", None, gone["signature"],
                        str(gone["expiration"]))
    # tokens are per sandbox and survive a restart (the key is on disk)
    assert E2B(Config(home=tmp_path)).envd_token("sbx-aaaaaaaaaaaa") == tok
    assert (tmp_path / "e2b.key").stat().st_mode & 0o777 == 0o600


def test_cell_frames_as_ndjson() -> None:
    frames = [P.encode({"t": "started", "exec_id": "run-1"}),
              P.encode({"t": "out", "fd": 1}, b"hi\n"),
              P.encode({"t": "item", "n": 0, "main": False, "mime": "image/png"}, b"\x89PNG"),
              P.encode({"t": "item", "n": 0, "main": False, "mime": "text/plain"}, b"<Fig>"),
              P.encode({"t": "item", "n": 1, "main": True, "mime": "text/plain"}, b"'s'"),
              P.encode({"t": "exception", "ename": "E", "evalue": "v"}, b"tb"),
              P.encode({"t": "done", "status": "error", "execution_count": 3})]

    async def src() -> AsyncIterator[bytes]:
        for f in frames:
            yield f

    async def collect() -> list[dict[str, object]]:
        out = b"".join([b async for b in _ndjson(src())])
        assert b"\n\n" not in out and out.endswith(b"\n")  # (the SDK json.loads each line)
        return [json.loads(line) for line in out.splitlines()]

    lines = asyncio.run(collect())
    assert [x["type"] for x in lines] == ["stdout", "result", "result", "error",
                                          "number_of_executions", "end_of_execution"]
    assert lines[1]["png"] == "iVBORw==" and lines[1]["text"] == "<Fig>"
    assert lines[2] == {"type": "result", "is_main_result": True, "text": "s"}
    assert lines[3] == {"type": "error", "name": "E", "value": "v", "traceback": "tb"}
    assert lines[4]["execution_count"] == 3
    # and E2B's own parser takes them
    models = pytest.importorskip("e2b_code_interpreter.models")
    ex = models.Execution()
    for x in lines:
        models._parse_output(ex, json.dumps(x))
    assert ex.text == "s" and ex.error.name == "E" and ex.execution_count == 3
