"""Model-shaped output (for_model, clip) and the daemon's checks of what a kernel driver
sends (cpuosd.lifecycle.interpreter): no daemon needed."""

from __future__ import annotations

import base64
import json

from cpuos import CodeError, CodeResult, ExecResult, Result
from cpuos._for_model import clip
from cpuos_agent.protocol import FrameDecoder
from cpuosd.lifecycle.interpreter import _done, _frames_of


def test_clip_keeps_short_text() -> None:
    assert clip("hello", 10) == "hello"


def test_clip_cuts_10_mb_to_the_limit_with_head_tail_and_marker() -> None:
    text = "start" + "€" * 10_000_000 + "end"
    out = clip(text, 4000)
    assert len(out) <= 4000
    assert out.startswith("start€") and out.endswith("€end")
    assert "[... 9,99" in out and "characters cut ...]" in out
    out.encode("utf-8")  # whole code points only: encodes without error


def test_clip_says_about_when_bytes_were_dropped_upstream() -> None:
    out = clip("x" * 100, 4000, already_cut=5000)
    assert "about 5,000 characters cut" in out and out.count("x") == 100


def test_clip_tiny_limit_is_a_plain_head() -> None:
    assert clip("abcdefgh", 3) == "abc"


def test_exec_result_for_model() -> None:
    r = ExecResult(exit_code=3, stdout_bytes=("ü" * 3_000_000).encode(), stderr_bytes=b"err",
                   duration=1.0, stdout_total=6_000_000, stderr_total=3)
    fm = r.for_model(stdout_chars=4000, stderr_chars=2000)
    assert fm["exit_code"] == 3 and fm["stderr"] == "err" and fm["images"] == 0
    assert len(fm["stdout"]) <= 4000 and "\ufffd" not in fm["stdout"]


def test_exec_result_cut_mid_sequence_upstream_shows_no_broken_char() -> None:
    # an output buffer cut between the two bytes of a 'ü': the head/tail join is cut away
    raw = ("ü" * 5000).encode()
    r = ExecResult(exit_code=0, stdout_bytes=raw[:5001] + raw[-5001:], stderr_bytes=b"",
                   duration=0.1, stdout_total=10_000_000, truncated=True)
    fm = r.for_model(stdout_chars=1000)
    assert "\ufffd" not in fm["stdout"] and "about" in fm["stdout"]


def test_code_result_for_model() -> None:
    png = b"\x89PNG\r\n\x1a\n..."
    r = CodeResult(stdout_bytes=b"out", results=[Result(is_main_result=True, text="42"),
                                                 Result(png=png, text="<Figure>")],
                   error=CodeError("ZeroDivisionError", "division by zero", "Traceback..."))
    fm = r.for_model()
    assert fm["error"].startswith("ZeroDivisionError: division by zero\nTraceback")
    assert fm["stdout"] == "out" and fm["result"] == "42" and fm["images"] == 1
    assert r.images == [png] and r.text == "42"


def test_driver_lines_are_checked_and_rebuilt() -> None:
    items = [0]
    png = b"\x89PNG\r\n\x1a\nabc"
    b64 = base64.encodebytes(png).decode()  # with line breaks, as Jupyter sends it
    frames = _frames_of({"t": "display", "main": "yes", "data": {
        "image/png": b64, "text/plain": "fig", "application/x-evil": "x",
        "image/jpeg": "!!not base64!!", "text/html": 42}}, items)
    got = [fr for chunk in frames for fr in FrameDecoder().feed(chunk)]
    assert {(h["mime"], p) for h, p in got} == {("image/png", png), ("text/plain", b"fig")}
    assert all(h["main"] is False and h["n"] == 0 for h, _ in got)
    assert _frames_of({"t": "stream", "name": "evil", "text": "x"}, items)  # -> stdout
    assert _frames_of({"t": "stream", "text": 5}, items) == []
    assert _frames_of({"t": "unknown"}, items) == []
    d = _done({"status": "pwned", "execution_count": "1", "timed_out": 1,
               "message": "m" * 10_000}, 0.5)
    assert d["status"] == "error" and d["execution_count"] is None
    assert d["timed_out"] is False and len(d["message"]) == 500
    json.dumps(d)


def test_display_items_are_counted_and_capped() -> None:
    items = [0]
    for _ in range(100):
        _frames_of({"t": "display", "data": {"text/plain": "x"}}, items)
    assert items[0] == 64
