import io
import os
import random

import pytest

from cpuos_agent import protocol as P


def test_round_trip_any_split() -> None:
    frames = [({"t": "out", "id": i, "fd": 1 + i % 2}, os.urandom(random.randint(0, 70000)))
              for i in range(40)]
    blob = b"".join(P.encode(h, p) for h, p in frames)
    rng = random.Random(7)
    for _ in range(20):
        dec = P.FrameDecoder()
        got = []
        pos = 0
        while pos < len(blob):
            n = rng.randint(1, 50000)
            got += dec.feed(blob[pos:pos + n])
            pos += n
        assert got == frames and dec.pending == 0


def test_sync_reader_and_clean_eof() -> None:
    f = io.BytesIO(P.encode({"t": "hello"}) + P.encode({"t": "data", "id": 3}, b"\x00\xff"))
    assert P.read_frame_sync(f) == ({"t": "hello"}, b"")
    assert P.read_frame_sync(f) == ({"t": "data", "id": 3}, b"\x00\xff")
    assert P.read_frame_sync(f) is None


def test_truncated_frame_is_an_error() -> None:
    blob = P.encode({"t": "x"}, b"abc")
    with pytest.raises(P.ProtocolError):
        P.read_frame_sync(io.BytesIO(blob[:-1]))


@pytest.mark.parametrize("blob", [
    b"\x00\x00\x00\x00\x00\x00\x00\x00",                      # empty header
    b"\xff\xff\xff\xff\x00\x00\x00\x00",                      # header too large
    b"\x00\x00\x00\x02\xff\xff\xff\xff{}",                    # payload too large
    b"\x00\x00\x00\x02\x00\x00\x00\x00[]",                    # header not an object
    b"\x00\x00\x00\x02\x00\x00\x00\x00{}",                    # no type
    b"\x00\x00\x00\x03\x00\x00\x00\x00\xff\xfe{",             # not JSON/UTF-8
])
def test_hostile_frames_rejected(blob: bytes) -> None:
    with pytest.raises(P.ProtocolError):
        P.FrameDecoder().feed(blob)


def test_encoder_refuses_oversize() -> None:
    with pytest.raises(P.ProtocolError):
        P.encode({"t": "x"}, b"x" * (P.MAX_PAYLOAD + 1))
