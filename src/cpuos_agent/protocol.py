"""The one wire format of cpuos, shared by the host (daemon, SDK) and the guest agent.

A *frame* is::

    u32 header_len | u32 payload_len | header (UTF-8 JSON object) | payload (raw bytes)

(big-endian). The header always carries ``t`` (the message type) and, for
messages that belong to a request, ``id`` (the stream id chosen by the host).
Bulk data (stdout/stderr chunks, file chunks) travels in the payload, never as
base64.

The same framing is used between the daemon and the SDK for streamed exec
output (``application/x-cpuos-frames``) and, when the client asks for it (``Accept``), for
file reads: ``data`` frames (the bytes in the payload), then ``eof`` (``size``: the byte
count) or ``error`` (``code``, ``message``, ``size``). A stream without its ``eof`` or
``error`` was cut: the client reports an error, never a short file.

Agent file reads: ``read`` is answered ``ok`` (``size``; ``exact``: exactly ``size``
bytes follow, else the length is known at ``eof``), ``data``..., ``eof`` or ``err``; the
host ends one early with ``kill`` on its id. ``list`` is answered ``ok`` with the entries
as a JSON array in the payload (a header holds at most ``MAX_HEADER`` bytes).

This module is stdlib-only: it is imported inside every sandbox.
"""

from __future__ import annotations

import json
import re
import struct
from typing import Any

# 2: the hello carries the per-sandbox agent key (the host refuses other versions)
# 3: background commands (exec ``background``; bg_list, bg_info, bg_attach, bg_signal,
#    bg_wait, bg_stdin, bg_resize), terminals (exec ``pty``: {cols, rows}), stdin with flow
#    control (``stdin`` frames carry ``close``/``ack``; the agent answers ``stdin_credit``
#    and ``stdin_closed``), directories (``tar``, ``untar``), ``watch`` (``events``)
# (within 3, unanswered: ``memory`` {watched, high}, id 0: the host watches the sandbox's
# memory for the agent's OOM guard; an agent that does not know it answers an ``err`` on
# id 0, which the host ignores, and keeps looking for itself)
PROTOCOL_VERSION = 3
# where the host leaves the agent its key before a cold boot; it removes the file once the
# agent has said hello, before any command runs (the agent keeps the key in memory, which
# no command can read: the agent is not dumpable)
KEY_PATH = "/run/cpuos/agent.key"
KEY_RE = r"[0-9a-f]{64}"
CONTENT_TYPE = "application/x-cpuos-frames"

MAX_HEADER = 64 * 1024
MAX_PAYLOAD = 4 * 1024 * 1024
CHUNK = 256 * 1024
# Bytes of stream data the agent may send ahead of the host's credits (per stream).
WINDOW = 8 * 1024 * 1024
# Bytes of stdin the host may have sent to a command and not yet had back as
# ``stdin_credit`` (written to the command's pipe), per stream.
STDIN_WINDOW = 8 * 1024 * 1024

_PREFIX = struct.Struct("!II")
PREFIX_LEN = _PREFIX.size


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame."""


Header = dict[str, Any]


def encode(header: Header, payload: bytes | bytearray | memoryview = b"") -> bytes:
    h = json.dumps(header, separators=(",", ":")).encode()
    if len(h) > MAX_HEADER:
        raise ProtocolError(f"header too large ({len(h)} bytes)")
    if len(payload) > MAX_PAYLOAD:
        raise ProtocolError(f"payload too large ({len(payload)} bytes)")
    return b"".join((_PREFIX.pack(len(h), len(payload)), h, payload))


def parse_prefix(prefix: bytes) -> tuple[int, int]:
    hlen, plen = _PREFIX.unpack(prefix)
    if hlen == 0 or hlen > MAX_HEADER:
        raise ProtocolError(f"bad header length {hlen}")
    if plen > MAX_PAYLOAD:
        raise ProtocolError(f"bad payload length {plen}")
    return hlen, plen


def parse_header(raw: bytes) -> Header:
    try:
        h = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"header is not JSON: {e}") from None
    if not isinstance(h, dict) or not isinstance(h.get("t"), str):
        raise ProtocolError("header must be an object with a string 't'")
    return h


class FrameDecoder:
    """Incremental decoder: feed bytes, get complete frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[Header, bytes]]:
        self._buf += data
        out: list[tuple[Header, bytes]] = []
        buf = self._buf
        pos = 0
        n = len(buf)
        while n - pos >= PREFIX_LEN:
            hlen, plen = parse_prefix(bytes(buf[pos : pos + PREFIX_LEN]))
            end = pos + PREFIX_LEN + hlen + plen
            if end > n:
                break
            hstart = pos + PREFIX_LEN
            header = parse_header(bytes(buf[hstart : hstart + hlen]))
            out.append((header, bytes(buf[hstart + hlen : end])))
            pos = end
        if pos:
            del buf[:pos]
        return out

    @property
    def pending(self) -> int:
        return len(self._buf)


def read_frame_sync(f: Any) -> tuple[Header, bytes] | None:
    """Read one frame from a binary file-like object; None on clean EOF."""
    prefix = _read_exact(f, PREFIX_LEN, allow_eof=True)
    if prefix is None:
        return None
    hlen, plen = parse_prefix(prefix)
    raw = _read_exact(f, hlen + plen, allow_eof=False)
    assert raw is not None
    return parse_header(raw[:hlen]), raw[hlen:]


def _read_exact(f: Any, n: int, allow_eof: bool) -> bytes | None:
    chunks = []
    got = 0
    while got < n:
        b = f.read(n - got)
        if not b:
            if got == 0 and allow_eof:
                return None
            raise ProtocolError("connection closed in the middle of a frame")
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


# The error codes: the one table for agent, daemon and SDK.
# code -> (HTTP status the daemon answers with, the SDK's exception class, may the agent
# report it: anything else from an agent becomes "internal")
ERROR_CODES: dict[str, tuple[int, str, bool]] = {
    "invalid_argument": (422, "InvalidArgument", True),
    "unauthorized": (401, "AuthError", False),
    "permission_denied": (403, "PermissionDenied", True),
    "not_found": (404, "NotFound", True),
    "conflict": (409, "Conflict", False),
    "already_exists": (409, "Conflict", True),
    "is_a_directory": (409, "Conflict", True),
    "not_a_directory": (409, "Conflict", True),
    "too_large": (413, "InvalidArgument", False),
    "limit_exceeded": (429, "LimitExceeded", True),
    "spending_cap": (402, "LimitExceeded", False),
    "no_space": (507, "NoSpace", True),
    "timeout": (504, "Timeout", False),
    "unavailable": (503, "Unavailable", False),
    "internal": (500, "ServerError", False),
}
AGENT_ERROR_CODES = frozenset(c for c, (_, _, agent) in ERROR_CODES.items() if agent)

E_NOT_FOUND = "not_found"
E_INVALID = "invalid_argument"
E_PERMISSION = "permission_denied"
E_EXISTS = "already_exists"
E_IS_DIR = "is_a_directory"
E_NOT_DIR = "not_a_directory"
E_NO_SPACE = "no_space"
E_INTERNAL = "internal"
E_LIMIT = "limit_exceeded"


# Durations in requests: "15m", "2m30s", "1h", "90s", "250ms" or a number of seconds (the
# SDK, the CLI and the daemon parse them alike).
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: object, what: str = "duration") -> float:
    """Seconds as a float; ValueError with a readable message on anything else."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a duration like '15m' or seconds, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        s = value.strip().lower().replace(" ", "")
        try:
            seconds = float(s)
        except ValueError:
            pos, seconds = 0, 0.0
            for m in _PART.finditer(s):
                if m.start() != pos:
                    break
                seconds += float(m.group(1)) * _UNITS[m.group(2)]
                pos = m.end()
            if pos != len(s) or not s:
                raise ValueError(
                    f"{what}: bad duration {value!r}; use e.g. '15m', '2m30s', '1h' or seconds"
                ) from None
    else:
        raise ValueError(f"{what}: expected a duration like '15m' or seconds, got {value!r}")
    if seconds != seconds or seconds <= 0 or seconds == float("inf"):
        raise ValueError(f"{what}: must be a positive duration, got {value!r}")
    return seconds


# Sizes in requests: "512MiB", "1GiB", "1.5G", "2048M" (powers of 1024 either way) or a
# number of MiB.
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?")
_SIZE_MIB = {"k": 1 / 1024, "": 1.0, "m": 1.0, "g": 1024.0, "t": 1024.0 * 1024}


def parse_size_mib(value: object, what: str = "size") -> int:
    """MiB as an int (rounded up); ValueError with a readable message on anything else.
    A bare number is MiB."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{what}: expected a size like '1GiB' or '512MiB', got {value!r}")
    if isinstance(value, (int, float)):
        mib = float(value)
    else:
        m = _SIZE.fullmatch(value.strip().lower())
        if m is None:
            raise ValueError(f"{what}: bad size {value!r}; use e.g. '1GiB', '512MiB' or MiB")
        mib = float(m.group(1)) * _SIZE_MIB[m.group(2)]
    if mib != mib or mib <= 0 or mib == float("inf"):
        raise ValueError(f"{what}: must be a positive size, got {value!r}")
    return int(-(-mib // 1))
