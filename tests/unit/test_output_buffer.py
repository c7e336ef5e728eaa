import os
import random

from cpuos._models import OutputBuffer


def test_small_output_kept_whole() -> None:
    b = OutputBuffer(100)
    b.add(b"hello ")
    b.add(b"world")
    assert b.value() == b"hello world" and not b.truncated and b.total == 11


def test_head_and_tail_kept_exactly() -> None:
    data = os.urandom(100_000)
    rng = random.Random(1)
    b = OutputBuffer(1000)
    pos = 0
    while pos < len(data):
        n = rng.randint(1, 3000)
        b.add(data[pos:pos + n])
        pos += n
    assert b.truncated and b.total == len(data)
    assert b.value() == data[:500] + data[-500:]


def test_exactly_cap_is_not_truncated() -> None:
    b = OutputBuffer(10)
    b.add(b"0123456789")
    assert b.value() == b"0123456789" and not b.truncated
    b.add(b"x")
    assert b.truncated and b.value() == b"01234" + b"6789x"
