"""ram.py: the template RAM memfd — sealed against every kind of write, saved sparse,
loaded back sealed with the same pages."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from cpuosd.backends.microvm import ram

MiB = 1 << 20


def test_a_sealed_memfd_refuses_writes_but_maps_private() -> None:
    fd = ram.new("cpuos-t", 8 * MiB)
    try:
        os.pwrite(fd, b"template", 4 * MiB)
        assert not ram.sealed(fd)
        ram.seal(fd)
        assert ram.sealed(fd)
        for attempt in (lambda: os.pwrite(fd, b"x", 0), lambda: os.ftruncate(fd, MiB),
                        lambda: os.ftruncate(fd, 16 * MiB),
                        lambda: mmap.mmap(fd, MiB, flags=mmap.MAP_SHARED)):
            with pytest.raises(PermissionError):
                attempt()
        # reopened read-write (what a clone's QEMU does): still no write
        with open(f"/proc/self/fd/{fd}", "r+b", buffering=0) as f, \
                pytest.raises(PermissionError):
            f.write(b"x")
        # a private mapping (a clone's RAM): writable, copy on write
        m = mmap.mmap(fd, 8 * MiB, flags=mmap.MAP_PRIVATE,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
        assert m[4 * MiB:4 * MiB + 8] == b"template"
        m[4 * MiB:4 * MiB + 8] = b"my  copy"
        assert os.pread(fd, 8, 4 * MiB) == b"template"
        m.close()
    finally:
        os.close(fd)


def test_sealing_waits_for_shared_writers() -> None:
    fd = ram.new("cpuos-t", MiB)
    m = mmap.mmap(fd, MiB, flags=mmap.MAP_SHARED)  # the template's QEMU, still running
    try:
        with pytest.raises(OSError):
            ram.seal(fd)
        m.close()
        ram.seal(fd)
        assert ram.sealed(fd)
    finally:
        os.close(fd)


def test_fill_allocates_the_holes_and_keeps_the_data() -> None:
    fd = ram.new("cpuos-t", 16 * MiB)
    try:
        os.pwrite(fd, b"data", 8 * MiB)
        assert os.fstat(fd).st_blocks * 512 < MiB
        ram.fill(fd)
        assert os.fstat(fd).st_blocks * 512 >= 16 * MiB
        assert os.pread(fd, 4, 8 * MiB) == b"data" and os.pread(fd, 4, 0) == bytes(4)
        ram.seal(fd)
        # a private mapping's read of what was a hole allocates nothing in the memfd now
        m = mmap.mmap(fd, 16 * MiB, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
        assert sum(m[off] for off in range(0, 16 * MiB, 4096)) == ord("d")
        m.close()
    finally:
        os.close(fd)


def test_save_is_sparse_and_load_gives_the_same_pages_sealed(tmp_path: Path) -> None:
    fd = ram.new("cpuos-t", 64 * MiB)
    try:
        os.pwrite(fd, b"a" * 4096, 0)
        os.pwrite(fd, b"b" * 8192, 40 * MiB)
        ram.seal(fd)
        copied = ram.save(fd, tmp_path / "ram")
    finally:
        os.close(fd)
    assert copied == 3 * 4096
    st = (tmp_path / "ram").stat()
    assert st.st_size == 64 * MiB and st.st_blocks * 512 < MiB
    back = ram.load(tmp_path / "ram", "cpuos-t2")
    try:
        assert ram.sealed(back) and os.fstat(back).st_size == 64 * MiB
        assert os.pread(back, 4096, 0) == b"a" * 4096
        assert os.pread(back, 8192, 40 * MiB) == b"b" * 8192
        assert os.pread(back, 4096, 20 * MiB) == bytes(4096)
        assert os.fstat(back).st_blocks * 512 >= 64 * MiB  # filled before the seal
    finally:
        os.close(back)
