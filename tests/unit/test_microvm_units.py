"""Pure parts of the microVM backend: jailer arguments and cgroup limits, the vmlinux
extractor, the LZ4 legacy decoder, .modinfo parsing and dependency order, the cpio
writer, the guest /init, ext4 images and sparse copies. No root, no guest."""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from cpuosd.backends.microvm import guest_artifacts, jailer

# ---- jailer arguments -------------------------------------------------------------------------


def test_argv_round_trips_through_the_parser() -> None:
    argv = jailer.jailer_argv(
        sandbox_id="-ab-1", exec_file="/usr/bin/qemu-system-x86_64", uid=300001, gid=300002,
        chroot_base="/srv/jail", args=["-M", "microvm", "--", "-x"],
        files=["/lib/a.so", ("/usr/share/qemu/qboot.rom", "/usr/share/qemu/bios-microvm.bin")],
        binds=[("/img/root.ext4", "/disk/root.ext4", True), ("/s", "/agent", False)],
        netns="/run/netns/n1", cgroups=[("cpu.max", "200000 100000"), ("pids.max", "64")],
        cgroup_version=2, rlimits={"nofile": 100, "fsize": 4096}, devices=["kvm"],
        writable_dirs=["/run"], mount_proc=True, exec_dest="/usr/bin/qemu-system-x86_64",
        python="/py")
    assert argv[:4] == ["/py", "-I", "-m", "cpuosd.backends.microvm.jailer"]
    sep = argv.index("--")
    assert argv[sep + 1:] == ["-M", "microvm", "--", "-x"]
    cfg = jailer.parse_args(argv[4:])
    assert cfg.id == "-ab-1"
    assert cfg.exec_file == Path("/usr/bin/qemu-system-x86_64")
    assert (cfg.uid, cfg.gid) == (300001, 300002)
    assert cfg.files == [("/lib/a.so", "/lib/a.so"),
                         ("/usr/share/qemu/qboot.rom", "/usr/share/qemu/bios-microvm.bin")]
    assert cfg.binds == [("/img/root.ext4", "/disk/root.ext4", True), ("/s", "/agent", False)]
    assert cfg.netns == Path("/run/netns/n1")
    assert cfg.cgroups == [("cpu.max", "200000 100000"), ("pids.max", "64")]
    assert cfg.cgroup_version == 2
    assert cfg.rlimits == {"nofile": 100, "fsize": 4096, "core": 0}
    assert cfg.devices == ("kvm",)
    assert cfg.mount_proc and cfg.exec_dest == "/usr/bin/qemu-system-x86_64"
    assert cfg.args == ["-M", "microvm", "--", "-x"]


@pytest.mark.parametrize("good", ["a", "0", "-", "sbx-abc123", "a" * 64])
def test_good_ids(good: str) -> None:
    assert jailer.check_id(good) == good


@pytest.mark.parametrize("bad", ["", "A", "../x", "a/b", "a" * 65, "x\n", "a.b", " a", "é"])
def test_bad_ids(bad: str) -> None:
    with pytest.raises(jailer.JailError, match="invalid jail id"):
        jailer.check_id(bad)
    with pytest.raises(jailer.JailError):
        jailer.jail_paths(bad, "/usr/bin/qemu", "/srv")
    with pytest.raises(jailer.JailError):
        jailer.cleanup(bad, "/nonexistent")


def test_jail_paths() -> None:
    p = jailer.jail_paths("x1", "/usr/bin/qemu-system-x86_64", "/srv/j/")
    assert p.jail_dir == Path("/srv/j/qemu-system-x86_64/x1")
    assert p.root == p.jail_dir / "root"
    assert p.exec_in_jail == "/qemu-system-x86_64"
    assert p.host_path("/run/qmp.sock") == p.root / "run/qmp.sock"
    assert p.pid_file == p.jail_dir / "vmm.pid"
    q = jailer.jail_paths("x1", "/usr/bin/q", "/srv", "/usr/bin/q")
    assert q.exec_in_jail == "/usr/bin/q"
    with pytest.raises(jailer.JailError):
        jailer.jail_paths("x1", "/usr/bin/q", "/srv", "/a/../../b")


def test_cgroup_limits() -> None:
    assert jailer.cgroup_limits(2, cpus=1.5, memory_bytes=1 << 30, pids=64) == [
        ("cpu.max", "150000 100000"), ("memory.max", str(1 << 30)), ("memory.swap.max", "0"),
        ("pids.max", "64")]
    assert jailer.cgroup_limits(1, cpus=2, memory_bytes=1 << 30, pids=64) == [
        ("cpu.cfs_period_us", "100000"), ("cpu.cfs_quota_us", "200000"),
        ("memory.limit_in_bytes", str(1 << 30)), ("pids.max", "64")]
    assert jailer.cgroup_limits(1) == []


def test_cgroup_dirs(tmp_path: Path) -> None:
    for c in ("cpu", "memory", "pids"):
        (tmp_path / c).mkdir()
    assert jailer.cgroup_dirs("x", version=1, root=tmp_path) == [
        tmp_path / c / "cpuos-microvm" / "x" for c in ("cpu", "memory", "pids")]
    assert jailer.cgroup_dirs("x", "p/q", version=2, root=tmp_path) == [tmp_path / "p/q/x"]
    with pytest.raises(jailer.JailError):
        jailer.cgroup_dirs("x", "../escape", version=2, root=tmp_path)


def test_chroot_base_checks(tmp_path: Path) -> None:
    assert jailer.check_chroot_base(tmp_path.resolve()) == tmp_path.resolve()
    (tmp_path / "l").symlink_to(tmp_path)
    for bad in ("rel", str(tmp_path / "missing"), str(tmp_path / "l")):
        with pytest.raises(jailer.JailError, match="chroot base"):
            jailer.check_chroot_base(bad)


@pytest.mark.skipif(shutil.which("ldd") is None, reason="needs ldd")
def test_ldd_deps_of_a_dynamic_binary() -> None:
    deps = jailer.ldd_deps("/bin/ls")
    assert any(d.endswith("/libc.so.6") for d in deps)
    assert all(d.startswith("/") for d in deps)


# ---- vmlinux extraction -----------------------------------------------------------------------

FAKE_ELF = b"\x7fELF\x02\x01\x01" + bytes(range(256)) * 64


def _image(payload: bytes) -> bytes:
    return b"MZ" + b"\x00" * 500 + b"setup code \x1f\x8b" + payload + b"\x00\x10\x00\x00trailer"


@pytest.mark.parametrize("kind,compress", [
    ("gzip", gzip.compress), ("xz", lambda d: lzma.compress(d, lzma.FORMAT_XZ)),
    ("bzip2", bz2.compress),
    # the kernel's lzma header (extract-vmlinux's magic): props 0x5d, dict size 16 MiB
    ("lzma", lambda d: lzma.compress(d, lzma.FORMAT_ALONE, filters=[
        {"id": lzma.FILTER_LZMA1, "dict_size": 1 << 24}])),
])
def test_extract_vmlinux(kind: str, compress: object) -> None:
    out, found = guest_artifacts.extract_vmlinux(_image(compress(FAKE_ELF)))  # type: ignore[operator]
    assert out == FAKE_ELF and found == kind


def test_extract_vmlinux_already_elf_and_nothing_found() -> None:
    assert guest_artifacts.extract_vmlinux(FAKE_ELF) == (FAKE_ELF, "none")
    with pytest.raises(guest_artifacts.KernelError, match="no compressed ELF"):
        guest_artifacts.extract_vmlinux(b"MZ" + os.urandom(1000).replace(b"\x7fELF", b""))
    # a compressed payload that is not an ELF is skipped
    with pytest.raises(guest_artifacts.KernelError):
        guest_artifacts.extract_vmlinux(_image(gzip.compress(b"not an elf" * 100)))


def _lz4_block(literals: bytes, matches: list[tuple[int, int, bytes]]) -> bytes:
    """A hand-made LZ4 block: each (offset, length, literals-after) then final literals."""
    def ext(n: int) -> bytes:
        out = b""
        while n >= 255:
            out += b"\xff"
            n -= 255
        return out + bytes([n])

    blk = b""
    lit = literals
    for off, ml, nxt in matches:
        ln, m = len(lit), ml - 4
        token = (min(ln, 15) << 4) | min(m, 15)
        blk += bytes([token]) + (ext(ln - 15) if ln >= 15 else b"") + lit
        blk += struct.pack("<H", off) + (ext(m - 15) if m >= 15 else b"")
        lit = nxt
    ln = len(lit)
    blk += bytes([min(ln, 15) << 4]) + (ext(ln - 15) if ln >= 15 else b"") + lit
    return blk


def test_lz4_block_overlapping_and_long_matches() -> None:
    blk = _lz4_block(b"ab", [(2, 300, b"xyz" * 10), (1, 5, b"end")])
    out = bytearray()
    guest_artifacts.lz4_block_decompress(blk, out)
    assert bytes(out) == b"ab" + b"ab" * 150 + b"xyz" * 10 + b"zzzzz" + b"end"


def test_lz4_legacy_frame_with_trailer() -> None:
    b1 = _lz4_block(b"hello ", [(6, 12, b"world")])
    b2 = _lz4_block(b"0123456789abcdef" * 2, [])
    frame = (guest_artifacts.LZ4_LEGACY_MAGIC + struct.pack("<I", len(b1)) + b1
             + struct.pack("<I", len(b2)) + b2 + struct.pack("<I", 123456789))
    assert guest_artifacts.lz4_legacy_decompress(frame) == \
        b"hello " + b"hello hello " + b"world" + b"0123456789abcdef" * 2


@pytest.mark.skipif(shutil.which("lz4") is None, reason="needs the lz4 CLI (Debian lz4)")
def test_lz4_matches_the_reference_tool(tmp_path: Path) -> None:
    data = (FAKE_ELF + os.urandom(3000) + b"kernel text " * 5000) * 3
    comp = subprocess.run(["lz4", "-l", "-9", "-c"], input=data, capture_output=True,
                          check=True).stdout
    assert comp.startswith(guest_artifacts.LZ4_LEGACY_MAGIC)
    assert guest_artifacts.lz4_legacy_decompress(comp + b"\x00\x01\x02\x03") == data
    out, kind = guest_artifacts.extract_vmlinux(b"MZ" + b"\x00" * 100 + comp
                                                + b"\x10\x00\x00\x00")
    assert out == data and kind == "lz4"


# ---- modules ------------------------------------------------------------------------------------

def _fake_ko(path: Path, info: dict[str, str]) -> None:
    """A minimal ELF64 LE relocatable with a .shstrtab and a .modinfo section."""
    modinfo = b"".join(f"{k}={v}".encode() + b"\0" for k, v in info.items())
    shstr = b"\0.shstrtab\0.modinfo\0"
    data_off = 64
    shstr_off = data_off
    mod_off = shstr_off + len(shstr)
    sh_off = (mod_off + len(modinfo) + 7) & ~7
    hdr = bytearray(64)
    hdr[:7] = b"\x7fELF\x02\x01\x01"
    struct.pack_into("<HHI", hdr, 16, 1, 62, 1)
    struct.pack_into("<Q", hdr, 0x28, sh_off)
    struct.pack_into("<HHHHHH", hdr, 0x34, 64, 0, 0, 64, 3, 1)

    def sh(name: int, typ: int, off: int, size: int) -> bytes:
        return struct.pack("<IIQQQQIIQQ", name, typ, 0, 0, off, size, 0, 0, 1, 0)

    body = bytes(hdr) + shstr + modinfo
    body += b"\0" * (sh_off - len(body))
    body += sh(0, 0, 0, 0) + sh(1, 3, shstr_off, len(shstr)) + sh(11, 1, mod_off, len(modinfo))
    path.write_bytes(body)


def test_modinfo_and_dependency_order(tmp_path: Path) -> None:
    mods = {"virtio": "", "virtio_ring": "", "virtio_mmio": "virtio,virtio_ring",
            "virtio_blk": "virtio,virtio_ring", "failover": "", "net_failover": "failover",
            "virtio_net": "net_failover,virtio_ring,virtio"}
    for name, deps in mods.items():
        fname = name.replace("_", "-") if name == "net_failover" else name
        _fake_ko(tmp_path / f"{fname}.ko", {"license": "GPL", "depends": deps, "name": name})
    assert guest_artifacts.modinfo(tmp_path / "virtio_mmio.ko")["depends"] == "virtio,virtio_ring"
    index = guest_artifacts.module_index(tmp_path)
    assert set(index) == set(mods)
    order = guest_artifacts.module_closure(["virtio_mmio", "virtio_blk", "virtio_net"], index)
    assert sorted(order) == sorted(mods)
    for name, deps in mods.items():
        for d in filter(None, deps.split(",")):
            assert order.index(d) < order.index(name)
    with pytest.raises(guest_artifacts.KernelError, match="not found"):
        guest_artifacts.module_closure(["nope"], index)


# ---- initramfs ----------------------------------------------------------------------------------

def _parse_cpio(data: bytes) -> dict[str, tuple[int, bytes, int, int]]:
    out: dict[str, tuple[int, bytes, int, int]] = {}
    i = 0
    while True:
        assert data[i:i + 6] == b"070701", f"bad magic at {i}"
        f = [int(data[i + 6 + 8 * k:i + 14 + 8 * k], 16) for k in range(13)]
        mode, size, rmaj, rmin, nsize = f[1], f[6], f[9], f[10], f[11]
        name = data[i + 110:i + 110 + nsize - 1].decode()
        i = (i + 110 + nsize + 3) & ~3
        body = data[i:i + size]
        i = (i + size + 3) & ~3
        if name == "TRAILER!!!":
            return out
        out[name] = (mode, body, rmaj, rmin)


def test_initramfs_layout(tmp_path: Path) -> None:
    bb = tmp_path / "busybox"
    bb.write_bytes(b"\x7fELF busybox")
    ko = tmp_path / "virtio.ko"
    ko.write_bytes(b"module")
    data = guest_artifacts.build_initramfs(bb, [("virtio", ko), ("virtio_mmio", ko)])
    assert len(data) % 512 == 0
    ents = _parse_cpio(data)
    assert ents["bin/busybox"][1] == b"\x7fELF busybox"
    assert ents["bin/busybox"][0] & 0o777 == 0o755
    assert ents["bin/sh"][1] == b"busybox"
    assert ents["lib/modules/order"][1] == b"virtio\nvirtio_mmio\n"
    assert ents["lib/modules/virtio_mmio.ko"][1] == b"module"
    assert ents["dev/console"][2:] == (5, 1)
    init = ents["init"][1]
    assert ents["init"][0] & 0o111 and init.startswith(b"#!/bin/busybox sh\n")
    assert guest_artifacts.PROBE_MARKER.encode() in init and b"@" not in init


@pytest.mark.skipif(shutil.which("cpio") is None, reason="needs cpio")
def test_initramfs_readable_by_cpio(tmp_path: Path) -> None:
    bb = tmp_path / "busybox"
    bb.write_bytes(b"x")
    data = guest_artifacts.build_initramfs(bb, [])
    r = subprocess.run(["cpio", "-it"], input=data, capture_output=True, check=True)
    names = r.stdout.decode().split()
    assert {"init", "bin/busybox", "bin/sh", "dev/console", "lib/modules/order"} <= set(names)


@pytest.mark.skipif(shutil.which("dash") is None and shutil.which("busybox") is None,
                    reason="needs a POSIX sh to syntax-check /init")
def test_init_script_parses() -> None:
    sh = shutil.which("dash") or shutil.which("busybox")
    assert sh is not None
    argv = [sh, "-n"] if sh.endswith("dash") else [sh, "sh", "-n"]
    r = subprocess.run([*argv, "/dev/stdin"], input=guest_artifacts.init_script(),
                       capture_output=True)
    assert r.returncode == 0, r.stderr


# ---- images -------------------------------------------------------------------------------------

needs_mkfs = pytest.mark.skipif(
    not (shutil.which("mkfs.ext4") or os.path.exists("/usr/sbin/mkfs.ext4"))
    or not (shutil.which("debugfs") or os.path.exists("/usr/sbin/debugfs")),
    reason="needs e2fsprogs")


def _debugfs(img: Path, cmd: str) -> str:
    dbg = shutil.which("debugfs") or "/usr/sbin/debugfs"
    return subprocess.run([dbg, "-R", cmd, str(img)], capture_output=True, text=True,
                          check=True).stdout


@needs_mkfs
def test_rootfs_image_from_a_tree(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "usr" / "bin").mkdir(parents=True)
    (tree / "usr" / "bin" / "python3").write_bytes(b"#!" + b"x" * 10000)
    (tree / "etc").mkdir()
    (tree / "etc" / "hostname").write_text("template\n")
    (tree / "bin").symlink_to("usr/bin")
    img = guest_artifacts.build_rootfs_image(tree, tmp_path / "out" / "root.ext4")
    assert img.exists() and not list(img.parent.glob(".*.tmp"))
    assert "template" in _debugfs(img, "cat /etc/hostname")
    assert "python3" in _debugfs(img, "ls -l /usr/bin")
    assert "has_journal" not in _debugfs(img, "features")
    with pytest.raises(guest_artifacts.KernelError):
        guest_artifacts.build_rootfs_image(tmp_path / "missing", tmp_path / "x.ext4")


@needs_mkfs
def test_overlay_image_carries_the_agent(tmp_path: Path) -> None:
    agent = tmp_path / "agent"
    (agent / "cpuos_agent").mkdir(parents=True)
    (agent / "cpuos_agent" / "agent.py").write_text("print('hi')\n")
    img = guest_artifacts.build_overlay_image(tmp_path / "overlay.ext4", 64, agent)
    assert img.stat().st_size == 64 << 20
    assert img.stat().st_blocks * 512 < 16 << 20  # sparse
    assert "agent.py" in _debugfs(img, "ls /upper/opt/cpuos/cpuos_agent")
    assert "work" in _debugfs(img, "ls /")
    copy = tmp_path / "copy.ext4"
    guest_artifacts.copy_sparse(img, copy)
    assert copy.read_bytes() == img.read_bytes()
    assert copy.stat().st_blocks <= img.stat().st_blocks + 64


def test_copy_sparse_keeps_holes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    with open(src, "wb") as f:
        f.truncate(64 << 20)
        f.seek(1 << 20)
        f.write(b"a" * 5000)
        f.seek(40 << 20)
        f.write(b"b" * 70000)
    dst = tmp_path / "dst"
    guest_artifacts.copy_sparse(src, dst)
    assert dst.stat().st_size == src.stat().st_size
    with open(src, "rb") as a, open(dst, "rb") as b:
        while True:
            x, y = a.read(1 << 20), b.read(1 << 20)
            assert x == y
            if not x:
                break
    assert dst.stat().st_blocks * 512 < 1 << 20
    with pytest.raises(FileExistsError):
        guest_artifacts.copy_sparse(src, dst)


def test_one_option_table_writes_and_parses_every_field() -> None:
    import dataclasses

    cfg = jailer.JailConfig(
        id="j-1", exec_file=Path("/usr/bin/q"), uid=300001, gid=300001,
        chroot_base=Path("/srv/jail"), args=["-x", "--", "-y"], files=[("/a", "/b")],
        binds=[("/s", "/d", False)], netns=Path("/run/netns/n"), cgroups=[("pids.max", "9")],
        cgroup_version=1, parent_cgroup="p", rlimits={"nofile": 7, "core": 0, "fsize": 1},
        devices=("kvm",), writable_dirs=("/run", "/tmp"), mount_proc=True, exec_dest="/q",
        keep_fds=(5, 9), detach=True)
    assert {o.field for o in jailer.OPTIONS} | {"args"} == {
        f.name for f in dataclasses.fields(jailer.JailConfig)}  # no field left out
    assert jailer.parse_args(jailer.config_argv(cfg, "/py")[4:]) == cfg
    bare = jailer.JailConfig(id="j-2", exec_file=Path("/q"), uid=1, gid=1,
                             chroot_base=Path("/c"))
    assert jailer.parse_args(jailer.config_argv(bare, "/py")[4:]) == bare
