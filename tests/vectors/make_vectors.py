"""Writes the shared test vectors in this folder (checked by the Python SDK's unit tests and
by sdk/js's): ``exec_frames.json`` (the frame format of exec streams and framed file reads,
cpuos_agent.protocol), ``durations.json`` (the duration grammar) and ``sizes.json`` (sizes
in MiB). Run it after changing
either, and review the diff: the vectors are the contract both SDKs are held to.

    .venv/bin/python tests/vectors/make_vectors.py
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from cpuos_agent import protocol as P

HERE = Path(__file__).parent


def frame(h: dict[str, Any], payload: bytes = b"") -> bytes:
    return P.encode(h, payload)


def raw(hdr: bytes, payload: bytes = b"") -> bytes:
    return struct.pack("!II", len(hdr), len(payload)) + hdr + payload


def good(name: str, data: bytes, frames: list[tuple[dict[str, Any], bytes]], pending: int = 0,
         canonical: bool = True) -> dict[str, Any]:
    return {"name": name, "hex": data.hex(), "canonical": canonical and not pending,
            "pending": pending,
            "frames": [{"header": h, "payload_hex": p.hex()} for h, p in frames]}


def exec_stream(name: str, frames: list[tuple[dict[str, Any], bytes]],
                expect: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "hex": b"".join(frame(h, p) for h, p in frames).hex(),
            "expect": expect}


def main() -> None:
    started = ({"t": "started", "exec_id": "exe-0123456789ab"}, b"")
    exit0 = ({"t": "exit", "exit_code": 0, "signal": None, "timed_out": False,
              "killed": False, "duration": 0.25}, b"")
    binary = bytes(range(256))
    big = b"x" * 1000
    unicode_hdr = {"t": "error", "code": "internal", "message": "caf\u00e9 \u2603 \U0001F600"}
    valid = [
        good("started", frame(*started), [started]),
        good("stdout chunk", frame({"t": "out", "fd": 1}, b"hello\n"),
             [({"t": "out", "fd": 1}, b"hello\n")]),
        good("stderr chunk of every byte value", frame({"t": "out", "fd": 2}, binary),
             [({"t": "out", "fd": 2}, binary)]),
        good("empty payload", frame({"t": "eof", "size": 0}), [({"t": "eof", "size": 0}, b"")]),
        good("a 1000-byte payload", frame({"t": "data"}, big), [({"t": "data"}, big)]),
        good("three frames back to back",
             frame(*started) + frame({"t": "out", "fd": 1}, b"a") + frame(*exit0),
             [started, ({"t": "out", "fd": 1}, b"a"), exit0]),
        # Python's json escapes non-ASCII; a header written as raw UTF-8 must decode alike
        good("non-ASCII header, escaped", frame(unicode_hdr), [(unicode_hdr, b"")]),
        good("non-ASCII header, raw UTF-8",
             raw(json.dumps(unicode_hdr, ensure_ascii=False).encode()), [(unicode_hdr, b"")],
             canonical=False),
        good("header with spaces and extra fields",
             raw(b'{ "t" : "exit", "exit_code": 1, "x": [1, {"y": null}] }'),
             [({"t": "exit", "exit_code": 1, "x": [1, {"y": None}]}, b"")], canonical=False),
        good("a whole frame, then half a prefix",
             frame({"t": "out", "fd": 1}, b"ab") + b"\x00\x00\x00",
             [({"t": "out", "fd": 1}, b"ab")], pending=3),
        good("a prefix and part of its header",
             frame({"t": "out", "fd": 1}, b"abc")[:12], [], pending=12),
        good("nothing", b"", []),
    ]
    max_hdr = b'{"t":"x","p":"' + b"a" * (P.MAX_HEADER - 16) + b'"}'
    assert len(max_hdr) == P.MAX_HEADER
    valid.append(good("header of exactly MAX_HEADER bytes", raw(max_hdr),
                      [(json.loads(max_hdr), b"")]))
    errors = [
        {"name": "header length 0", "hex": struct.pack("!II", 0, 0).hex()},
        {"name": "header length over MAX_HEADER",
         "hex": struct.pack("!II", P.MAX_HEADER + 1, 0).hex()},
        {"name": "payload length over MAX_PAYLOAD",
         "hex": struct.pack("!II", 2, P.MAX_PAYLOAD + 1).hex()},
        {"name": "header not JSON", "hex": raw(b"{nope}").hex()},
        {"name": "header not UTF-8", "hex": raw(b'{"t":"\xff"}').hex()},
        {"name": "header an array", "hex": raw(b'["t"]').hex()},
        {"name": "header without t", "hex": raw(b'{"x":1}').hex()},
        {"name": "t not a string", "hex": raw(b'{"t":1}').hex()},
        {"name": "a bad frame after a good one",
         "hex": (frame(*started) + raw(b"[]")).hex()},
    ]
    streams = [
        exec_stream("stdout and stderr interleaved, exit 0", [
            started, ({"t": "out", "fd": 1}, b"one\n"), ({"t": "out", "fd": 2}, b"err1\n"),
            ({"t": "out", "fd": 1}, b"tw"), ({"t": "out", "fd": 1}, b"o\nthree"),
            ({"t": "out", "fd": 2}, b"err2\n"), exit0],
            {"exec_id": "exe-0123456789ab", "exit_code": 0, "signal": None,
             "timed_out": False, "stdout_hex": b"one\ntwo\nthree".hex(),
             "stderr_hex": b"err1\nerr2\n".hex(), "stdout_lines": ["one", "two", "three"],
             "stderr_lines": ["err1", "err2"]}),
        exec_stream("UTF-8 split across chunks, CRLF, exit 1", [
            started, ({"t": "out", "fd": 1}, "caf\u00e9\r\n".encode()[:4]),
            ({"t": "out", "fd": 1}, "caf\u00e9\r\n".encode()[4:] + b"\n"),
            ({"t": "exit", "exit_code": 1, "signal": None, "timed_out": False,
              "killed": False, "duration": 0.1}, b"")],
            {"exec_id": "exe-0123456789ab", "exit_code": 1, "signal": None,
             "timed_out": False, "stdout_hex": "caf\u00e9\r\n\n".encode().hex(),
             "stderr_hex": "", "stdout_lines": ["caf\u00e9", ""], "stderr_lines": []}),
        exec_stream("timed out: killed by SIGKILL", [
            started, ({"t": "out", "fd": 1}, b"tick\n"),
            ({"t": "exit", "exit_code": 137, "signal": 9, "timed_out": True, "killed": False,
              "duration": 1.0}, b"")],
            {"exec_id": "exe-0123456789ab", "exit_code": 137, "signal": 9,
             "timed_out": True, "stdout_hex": b"tick\n".hex(), "stderr_hex": "",
             "stdout_lines": ["tick"], "stderr_lines": []}),
        exec_stream("an error frame ends the stream", [
            started, ({"t": "out", "fd": 1}, b"partial"),
            ({"t": "error", "code": "unavailable", "message": "sandbox agent disconnected"},
             b"")],
            {"error": {"code": "unavailable", "class": "Unavailable"}}),
        exec_stream("no exit frame", [started, ({"t": "out", "fd": 1}, b"x\n")],
                    {"error": {"code": "unavailable", "class": "Unavailable"}}),
        exec_stream("unknown frames and fds are ignored", [
            started, ({"t": "progress", "n": 1}, b""), ({"t": "out", "fd": 3}, b"no"),
            ({"t": "out", "fd": 1}, b"yes\n"), exit0],
            {"exec_id": "exe-0123456789ab", "exit_code": 0, "signal": None,
             "timed_out": False, "stdout_hex": b"yes\n".hex(), "stderr_hex": "",
             "stdout_lines": ["yes"], "stderr_lines": []}),
    ]
    doc = {
        "about": "Frames (cpuos_agent.protocol): u32 header_len | u32 payload_len (big-endian) "
                 "| header (UTF-8 JSON object with a string t) | payload. 'valid': decoding "
                 "hex gives frames, with 'pending' bytes left over (an incomplete frame); "
                 "'canonical': the encoder gives exactly hex. 'errors': the decoder must "
                 "refuse. 'exec_streams': a whole exec response body and what an SDK makes "
                 "of it (lines: line-buffered callbacks, no newline, CR before it dropped). "
                 "Written by make_vectors.py.",
        "max_header": P.MAX_HEADER, "max_payload": P.MAX_PAYLOAD,
        "valid": valid, "errors": errors, "exec_streams": streams,
    }
    (HERE / "exec_frames.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")

    ok: list[tuple[Any, float]] = [
        ("15m", 900), ("2m30s", 150), ("1h", 3600), ("90s", 90), ("250ms", 0.25),
        ("1d", 86400), ("1.5h", 5400), ("1h2m3s", 3723), (" 2 M ", 120), ("30", 30),
        ("0.5", 0.5), (90, 90), (1.5, 1.5), ("1e3", 1000), ("10s500ms", 10.5)]
    for v, want in ok:
        assert P.parse_duration(v) == want, v
    bad: list[Any] = ["", " ", "0", "0s", "-1", "-5m", "abc", "5x", "m", "1m-", "1 m x",
                      "inf", "nan", 0, -3, True, None, [1]]
    for v in bad:
        try:
            P.parse_duration(v)
        except ValueError:
            continue
        raise AssertionError(f"{v!r} parsed")
    (HERE / "durations.json").write_text(json.dumps(
        {"about": "The duration grammar (cpuos_agent.protocol.parse_duration): 'ok' are "
                  "[input, seconds]; 'bad' must be refused. Written by make_vectors.py.",
         "ok": ok, "bad": bad}, indent=1) + "\n")

    sizes_ok: list[tuple[Any, int]] = [
        ("512MiB", 512), ("1GiB", 1024), ("1.5G", 1536), ("2048M", 2048), ("512", 512),
        ("1gb", 1024), (" 2 GiB ", 2048), ("1T", 1 << 20), ("1536k", 2), ("0.5", 1),
        (256, 256), (1.2, 2), ("1kb", 1)]
    for v, want_mib in sizes_ok:
        assert P.parse_size_mib(v) == want_mib, v
    sizes_bad: list[Any] = ["", "abc", "1x", "1 GiB x", "-1G", "0", "0MiB", "G", "1e3M", 0, -5,
                            True, None, [1]]
    for v in sizes_bad:
        try:
            P.parse_size_mib(v)
        except ValueError:
            continue
        raise AssertionError(f"{v!r} parsed")
    (HERE / "sizes.json").write_text(json.dumps(
        {"about": "Sizes in MiB (cpuos_agent.protocol.parse_size_mib: powers of 1024, a bare "
                  "number is MiB, rounded up): 'ok' are [input, MiB]; 'bad' must be refused. "
                  "Written by make_vectors.py.",
         "ok": sizes_ok, "bad": sizes_bad}, indent=1) + "\n")


if __name__ == "__main__":
    main()
