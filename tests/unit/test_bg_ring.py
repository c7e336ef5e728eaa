"""The agent's output ring for background commands (cpuos_agent.bg.Ring)."""

from __future__ import annotations

from cpuos_agent.bg import MAX_CHUNKS, Ring


def _bytes(chunks: list[tuple[int, int, bytes]]) -> bytes:
    return b"".join(c[2] for c in chunks)


def test_ring_keeps_the_tail_with_true_offsets() -> None:
    r = Ring(10)
    r.append(1, b"abcdef")
    r.append(2, b"ghijkl")
    assert (r.start, r.end, r.size) == (2, 12, 10)
    got = r.read(0, 100)
    assert got[0][0] == 2 and _bytes(got) == b"cdefghijkl"
    assert [c[1] for c in got] == [1, 2]
    assert _bytes(r.read(7, 100)) == b"hijkl"
    assert r.read(12, 100) == []
    assert _bytes(r.read(3, 4)) == b"defg"  # a limit cuts across chunks


def test_ring_bigger_than_cap_and_many_small_writes() -> None:
    r = Ring(8)
    r.append(1, b"0123456789abc")
    assert (r.start, r.end) == (5, 13) and _bytes(r.read(0, 100)) == b"56789abc"
    r = Ring(1 << 20)
    for i in range(3 * MAX_CHUNKS):  # alternating fds: no merging; the index stays bounded
        r.append(1 + i % 2, b"x")
    assert len(r.chunks) <= MAX_CHUNKS and r.end == 3 * MAX_CHUNKS
    assert r.start == r.end - len(r.chunks)
    offs = [c[0] for c in r.read(0, 1 << 20)]
    assert offs == list(range(r.start, r.end))
