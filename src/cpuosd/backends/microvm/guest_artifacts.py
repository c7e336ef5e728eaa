"""Guest artifacts for the microVM backend, all built from Debian packages into a cache dir
(``$CPUOS_HOME/microvm``, or ``$CPUOS_MICROVM_DIR``), never into the repo:

* ``vmlinux``: the uncompressed kernel of ``linux-image-*-cloud-amd64`` (PVH entry), taken
  out of its ``vmlinuz`` the way the kernel's ``scripts/extract-vmlinux`` does: find the
  compressed payload by its magic, decompress, keep the first result that is an ELF;
* ``initramfs.cpio``: a small cpio (newc) with ``busybox-static``, the virtio-mmio modules
  and their dependencies (from each module's ``.modinfo``; the .deb has no modules.dep),
  and ``/init`` (below);
* ext4 images: the template's root filesystem (``mkfs.ext4 -d``, read-only in the guest)
  and a blank writable layer holding the agent package (copied, sparse, per sandbox).

``/init`` loads the modules, mounts the root image read-only and an overlayfs whose upper
layer is on the second disk, finds the agent's virtio-serial port by name and
``switch_root``\\ s into the agent with ``CPUOS_AGENT_SOCKET`` set to that port's device.
With ``cpuos.probe=1`` on the kernel command line it prints ``CPUOS-PROBE-OK`` to the
console once the modules are loaded and powers off (the boot probe).

Command line: ``python -m cpuosd.backends.microvm.guest_artifacts build|status|image``.
"""

from __future__ import annotations

import argparse
import bz2
import hashlib
import json
import lzma
import os
import shutil
import stat
import struct
import sys
import tempfile
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ... import procs
from ...config import Config

KERNEL_PACKAGE = "linux-image-cloud-amd64"
BUSYBOX_PACKAGE = "busybox-static"
GUEST_MODULES = ("virtio_mmio", "virtio_blk", "virtio_console", "virtio_net", "overlay")
PROBE_MARKER = "CPUOS-PROBE-OK"
AGENT_UID = 1000
ARTIFACTS_VERSION = 2


class KernelError(Exception):
    pass


def cache_dir(cfg: Config | None = None) -> Path:
    """The guest artifacts' directory of ``cfg`` (default: this process's environment's):
    CPUOS_MICROVM_DIR, else $CPUOS_HOME/microvm."""
    return (cfg or Config.from_env()).microvm_dir


@dataclass
class Artifacts:
    kernel_version: str
    vmlinux: str
    initrd: str
    modules: list[str]
    built_at: float

    def exist(self) -> bool:
        return Path(self.vmlinux).is_file() and Path(self.initrd).is_file()


def built_from_this_init(art: Artifacts) -> bool:
    """Whether art's initramfs carries this version's /init (an older build's agent may
    lack what the daemon now asks of it, e.g. setting the guest's address)."""
    try:
        return init_script() in Path(art.initrd).read_bytes()
    except OSError:
        return False


def current_artifacts(cache: Path | None = None) -> Artifacts | None:
    p = (cache or cache_dir()) / "kernel" / "current.json"
    try:
        data = json.loads(p.read_text())
        a = Artifacts(**data)
    except (OSError, ValueError, TypeError):
        return None
    return a if a.exist() else None


# ---- Debian packages ------------------------------------------------------------------------

def _run(argv: Sequence[str], cwd: Path | None = None) -> str:
    rc, out, err = procs.run_sync(argv, cwd=cwd)
    if rc != 0:
        raise KernelError(f"{' '.join(argv)} failed (exit {rc}): "
                          f"{(err or out).decode(errors='replace').strip()[-800:]}")
    return out.decode(errors="replace")


def resolve_kernel_package(meta: str = KERNEL_PACKAGE) -> str:
    """The versioned ``linux-image-<abi>-cloud-amd64`` the meta package depends on."""
    out = _run(["apt-cache", "depends", meta])
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("Depends:") and "linux-image-" in line:
            return line.split(":", 1)[1].strip().strip("<>")
    raise KernelError(f"cannot resolve {meta} (run apt-get update?); apt-cache said: {out[:300]}")


def download_deb(package: str, dest: Path) -> Path:
    """``apt-get download`` into ``dest`` (cached: an existing .deb is reused)."""
    dest.mkdir(parents=True, exist_ok=True)
    have = sorted(dest.glob(f"{package}_*.deb"))
    if have:
        return have[-1]
    _run(["apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", package], cwd=dest)
    have = sorted(dest.glob(f"{package}_*.deb"))
    if not have:
        raise KernelError(f"apt-get download {package} left no .deb in {dest}")
    return have[-1]


def extract_deb(deb: Path, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    _run(["dpkg-deb", "-x", str(deb), str(dest)])
    return dest


# ---- vmlinux out of vmlinuz -----------------------------------------------------------------

ELF_MAGIC = b"\x7fELF"
LZ4_LEGACY_MAGIC = b"\x02\x21\x4c\x18"
# (name, magic) in extract-vmlinux's order
MAGICS: tuple[tuple[str, bytes], ...] = (
    ("gzip", b"\x1f\x8b\x08"),
    ("xz", b"\xfd7zXZ\x00"),
    ("bzip2", b"BZh"),
    ("lzma", b"\x5d\x00\x00\x00"),
    ("lzo", b"\x89LZO"),
    ("lz4", LZ4_LEGACY_MAGIC),
    ("zstd", b"\x28\xb5\x2f\xfd"),
)


def lz4_block_decompress(src: bytes | memoryview, out: bytearray) -> None:
    """Append the decompression of one raw LZ4 block to ``out`` (pure Python)."""
    i, n = 0, len(src)
    while i < n:
        token = src[i]
        i += 1
        lit = token >> 4
        if lit == 15:
            while True:
                b = src[i]
                i += 1
                lit += b
                if b != 255:
                    break
        out += src[i:i + lit]
        i += lit
        if i >= n:
            break
        off = src[i] | (src[i + 1] << 8)
        i += 2
        if off == 0 or off > len(out):
            raise KernelError("lz4: bad match offset")
        ml = token & 15
        if ml == 15:
            while True:
                b = src[i]
                i += 1
                ml += b
                if b != 255:
                    break
        ml += 4
        start = len(out) - off
        if off >= ml:
            out += out[start:start + ml]
        else:
            chunk = bytes(out[start:])
            reps, rem = divmod(ml, off)
            out += chunk * reps + chunk[:rem]


def lz4_legacy_decompress(data: bytes | memoryview) -> bytes:
    """The LZ4 legacy frame format (``lz4 -l``; what the kernel's CONFIG_KERNEL_LZ4 uses).
    Stops at the end of the blocks; trailing data (the kernel appends its size) is ignored."""
    mv = memoryview(data)
    if bytes(mv[:4]) != LZ4_LEGACY_MAGIC:
        raise KernelError("not an lz4 legacy stream")
    i = 4
    out = bytearray()
    while i + 4 <= len(mv):
        (size,) = struct.unpack_from("<I", mv, i)
        if size == 0 or size > len(mv) - i - 4 or bytes(mv[i:i + 4]) == LZ4_LEGACY_MAGIC:
            break
        lz4_block_decompress(mv[i + 4:i + 4 + size], out)
        i += 4 + size
    return bytes(out)


def _cli(argv: Sequence[str], data: bytes | memoryview) -> bytes:
    """Run a decompressor CLI; like extract-vmlinux, errors about trailing data are ignored
    (the caller checks the output is an ELF)."""
    return procs.run_sync(argv, input=bytes(data))[1]


def _decompress(kind: str, data: memoryview) -> bytes:
    if kind == "gzip":
        return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data)
    if kind == "xz":
        return lzma.LZMADecompressor(lzma.FORMAT_XZ).decompress(data)
    if kind == "lzma":
        return lzma.LZMADecompressor(lzma.FORMAT_ALONE).decompress(data)
    if kind == "bzip2":
        return bz2.BZ2Decompressor().decompress(data)
    if kind == "zstd":
        try:
            import zstandard  # type: ignore[import-not-found]
        except ImportError:
            if shutil.which("zstd"):
                return _cli(["zstd", "-dcq"], data)
            raise KernelError("zstd payload: install zstd (Debian) or zstandard (PyPI)") from None
        return bytes(zstandard.ZstdDecompressor().decompressobj().decompress(bytes(data)))
    if kind == "lz4":
        if shutil.which("lz4"):
            out = _cli(["lz4", "-dcq"], data)
            if out.startswith(ELF_MAGIC):
                return out
        return lz4_legacy_decompress(data)
    if kind == "lzo":
        if shutil.which("lzop"):
            return _cli(["lzop", "-dcq"], data)
        raise KernelError("lzo payload: install lzop")
    raise KernelError(f"unknown compression {kind}")


def extract_vmlinux(image: bytes) -> tuple[bytes, str]:
    """(uncompressed ELF vmlinux, compression found) from a bzImage/vmlinuz."""
    if image.startswith(ELF_MAGIC):
        return image, "none"
    mv = memoryview(image)
    errors: list[str] = []
    for kind, magic in MAGICS:
        start = 0
        tried = 0
        while tried < 8:
            off = image.find(magic, start)
            if off < 0:
                break
            start = off + 1
            tried += 1
            try:
                out = _decompress(kind, mv[off:])
            except (KernelError, OSError, EOFError, ValueError, lzma.LZMAError,
                    zlib.error, IndexError) as e:
                errors.append(f"{kind}@{off}: {e}")
                continue
            if out.startswith(ELF_MAGIC):
                return out, kind
    raise KernelError("no compressed ELF kernel found in the image"
                      + (f" ({'; '.join(errors[:5])})" if errors else ""))


# ---- kernel modules -------------------------------------------------------------------------

def modinfo(ko: Path) -> dict[str, str]:
    """The ``.modinfo`` section of a module (ELF64, little-endian), as key -> value."""
    data = ko.read_bytes()
    if data[:4] != ELF_MAGIC or data[4] != 2 or data[5] != 1:
        raise KernelError(f"{ko}: not an ELF64 little-endian module")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def section(idx: int) -> tuple[int, int, int]:
        base = shoff + idx * shentsize
        name, = struct.unpack_from("<I", data, base)
        offset, size = struct.unpack_from("<QQ", data, base + 0x18)
        return name, offset, size

    _, stroff, _ = section(shstrndx)
    for idx in range(shnum):
        name_off, offset, size = section(idx)
        end = data.index(b"\0", stroff + name_off)
        if data[stroff + name_off:end] == b".modinfo":
            info: dict[str, str] = {}
            for item in data[offset:offset + size].split(b"\0"):
                k, sep, v = item.decode(errors="replace").partition("=")
                if sep and k not in info:
                    info[k] = v
            return info
    return {}


def _modname(p: Path) -> str:
    return p.name.split(".ko")[0].replace("-", "_")


def module_index(modules_root: Path) -> dict[str, Path]:
    return {_modname(p): p for p in modules_root.rglob("*.ko*")}


def module_closure(wanted: Iterable[str], index: dict[str, Path]) -> list[str]:
    """``wanted`` and every module they depend on, dependencies first."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        name = name.replace("-", "_")
        if name in order:
            return
        if name in visiting:
            raise KernelError(f"module dependency cycle at {name}")
        if name not in index:
            raise KernelError(f"module {name} not found")
        visiting.add(name)
        deps = modinfo(index[name]).get("depends", "")
        for d in filter(None, deps.split(",")):
            visit(d)
        visiting.discard(name)
        order.append(name)

    for w in wanted:
        visit(w)
    return order


# ---- cpio (newc) ----------------------------------------------------------------------------

class Cpio:
    """A minimal writer of the ``newc`` cpio format the kernel unpacks as an initramfs."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self._ino = 1

    def _entry(self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)
               ) -> None:
        nm = name.lstrip("/").encode() + b"\0"
        fields = [self._ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(nm), 0]
        self._ino += 1
        self.buf += b"070701" + b"".join(b"%08X" % f for f in fields) + nm
        self.buf += b"\0" * (-len(self.buf) % 4)
        self.buf += data
        self.buf += b"\0" * (-len(self.buf) % 4)

    def dir(self, name: str, mode: int = 0o755) -> None:
        self._entry(name, stat.S_IFDIR | mode)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self._entry(name, stat.S_IFREG | mode, data)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def chardev(self, name: str, major: int, minor: int, mode: int = 0o600) -> None:
        self._entry(name, stat.S_IFCHR | mode, rdev=(major, minor))

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        self.buf += b"\0" * (-len(self.buf) % 512)
        return bytes(self.buf)


INIT_SCRIPT = r"""#!/bin/busybox sh
# cpuos microVM init (initramfs): modules, disks, overlay root, then the agent.
/bin/busybox mount -t devtmpfs devtmpfs /dev
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
/bin/busybox --install -s /bin
export PATH=/bin
say() { echo "$*" > /dev/console 2>/dev/null || echo "$*"; }
fail() { say "CPUOS-INIT-FAILED: $*"; poweroff -f; }
say "CPUOS-INIT-START"
while read -r m; do
  insmod "/lib/modules/$m.ko" || fail "insmod $m"
done < /lib/modules/order
cmdline=" $(cat /proc/cmdline) "
case "$cmdline" in *" cpuos.probe=1 "*) say "@MARKER@"; sync; poweroff -f;; esac

find_disk() {
  for d in /sys/block/vd*; do
    [ "$(cat "$d/serial" 2>/dev/null)" = "$1" ] && { echo "/dev/${d##*/}"; return 0; }
  done
  return 1
}
find_port() {
  for p in /sys/class/virtio-ports/*; do
    [ "$(cat "$p/name" 2>/dev/null)" = "$1" ] && { echo "/dev/${p##*/}"; return 0; }
  done
  return 1
}
i=0
until root=$(find_disk cpuos-root) && ovl=$(find_disk cpuos-overlay) \
      && port=$(find_port cpuos.agent); do
  i=$((i + 1)); [ $i -gt 500 ] && fail "devices did not appear (root=$root overlay=$ovl)"
  usleep 10000
done
mkdir -p /mnt/lower /mnt/upper /mnt/root
mount -t ext4 -o ro,noload "$root" /mnt/lower || fail "mount root image"
mount -t ext4 -o rw,nodev,nosuid "$ovl" /mnt/upper || fail "mount overlay disk"
mkdir -p /mnt/upper/upper /mnt/upper/work
mount -t overlay overlay \
  -o lowerdir=/mnt/lower,upperdir=/mnt/upper/upper,workdir=/mnt/upper/work /mnt/root \
  || fail "mount overlay"
for w in $cmdline; do case "$w" in cpuos.hostname=*) hostname "${w#cpuos.hostname=}";; esac; done
chown @UID@:@UID@ "$port"
mkdir -p /mnt/root/dev /mnt/root/proc /mnt/root/sys /mnt/root/tmp /mnt/root/run
mount -t tmpfs -o mode=755,nosuid,nodev,size=16m tmpfs /mnt/root/run
mkdir -p /mnt/root/run/cpuos && chown @UID@:@UID@ /mnt/root/run/cpuos
mount --move /dev /mnt/root/dev
mount --move /proc /mnt/root/proc
mount --move /sys /mnt/root/sys
mkdir -p /mnt/root/dev/shm /mnt/root/dev/pts
mount -t tmpfs -o mode=1777,nosuid,nodev shm /mnt/root/dev/shm
mount -t devpts -o nosuid,noexec,newinstance,ptmxmode=0666,mode=0620 devpts /mnt/root/dev/pts
say "CPUOS-INIT-AGENT $port"
# the agent starts as root and keeps real uid 0 (commands, which run as @UID@, can neither
# signal nor trace it), takes @UID@ as its effective uid itself (cpuos_agent.privs) and
# keeps only these capabilities: CAP_SYS_ADMIN (hostname, RNG reseed, its exec cgroups),
# CAP_SYS_TIME (the clock after a restore), CAP_SETUID/CAP_SETGID (dropping to @UID@),
# CAP_NET_ADMIN (the interface's address: each clone and restore has its own)
caps="-all,+sys_admin,+sys_time,+setuid,+setgid,+net_admin"
drop=""
[ -x /mnt/root/usr/bin/setpriv ] && \
  drop="/usr/bin/setpriv --no-new-privs --inh-caps=-all --bounding-set=$caps --"
exec switch_root /mnt/root /usr/bin/env -i \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/home/user USER=user \
  LANG=C.UTF-8 PYTHONPATH=/opt/cpuos PYTHONDONTWRITEBYTECODE=1 CPUOS_AGENT_SOCKET="$port" \
  CPUOS_UID=@UID@ $drop /usr/bin/python3 -s -m cpuos_agent
"""


def init_script() -> bytes:
    return (INIT_SCRIPT.replace("@MARKER@", PROBE_MARKER)
            .replace("@UID@", str(AGENT_UID)).encode())


def build_initramfs(busybox: Path, modules: Sequence[tuple[str, Path]]) -> bytes:
    """The initramfs: busybox (static), ``/lib/modules/<name>.ko`` in load order, /init."""
    c = Cpio()
    for d in ("bin", "dev", "proc", "sys", "mnt", "lib", "lib/modules", "run", "tmp"):
        c.dir(d)
    c.chardev("dev/console", 5, 1)
    c.chardev("dev/null", 1, 3, 0o666)
    c.file("bin/busybox", busybox.read_bytes(), 0o755)
    c.symlink("bin/sh", "busybox")
    for name, path in modules:
        c.file(f"lib/modules/{name}.ko", path.read_bytes())
    c.file("lib/modules/order", "".join(f"{n}\n" for n, _ in modules).encode())
    c.file("init", init_script(), 0o755)
    return c.finish()


# ---- the whole build ------------------------------------------------------------------------

def build_kernel_artifacts(cache: Path | None = None, force: bool = False,
                           log: bool = False) -> Artifacts:
    """Download the packages, extract vmlinux, build the initramfs; cached by kernel version
    and the initramfs content. Returns the artifacts (recorded in kernel/current.json)."""
    cache = cache or cache_dir()

    def say(msg: str) -> None:
        if log:
            print(msg, file=sys.stderr)

    pkg = resolve_kernel_package()
    say(f"kernel package: {pkg}")
    debs = cache / "debs"
    kdeb = download_deb(pkg, debs)
    bdeb = download_deb(BUSYBOX_PACKAGE, debs)
    h = hashlib.sha256()
    for part in (kdeb.name, bdeb.name, init_script().decode(), ",".join(GUEST_MODULES),
                 str(ARTIFACTS_VERSION)):
        h.update(part.encode() + b"\0")
    digest = h.hexdigest()[:16]
    kver = pkg.removeprefix("linux-image-")
    final = cache / "kernel" / f"{kver}-{digest}"
    current = cache / "kernel" / "current.json"
    if (final / "manifest.json").exists() and not force:
        art = Artifacts(**json.loads((final / "manifest.json").read_text()))
        if art.exist():
            _write_json(current, asdict(art))
            return art
    (cache / "kernel").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache / "kernel", prefix=".build-") as tmp:
        work = Path(tmp)
        kx = extract_deb(kdeb, work / "kpkg")
        bx = extract_deb(bdeb, work / "bpkg")
        vmlinuz = next((kx / "boot").glob("vmlinuz-*"), None)
        if vmlinuz is None:
            raise KernelError(f"{kdeb.name} has no /boot/vmlinuz-*")
        t0 = time.monotonic()
        vmlinux, kind = extract_vmlinux(vmlinuz.read_bytes())
        say(f"vmlinux: {len(vmlinux) >> 20} MiB from a {kind} payload "
            f"in {time.monotonic() - t0:.1f}s")
        mroot = next((kx / "lib" / "modules").iterdir())
        index = module_index(mroot)
        names = module_closure(GUEST_MODULES, index)
        say(f"modules: {' '.join(names)}")
        busybox = bx / "bin" / "busybox"
        if not busybox.exists():
            raise KernelError(f"{bdeb.name} has no /bin/busybox")
        out = work / "out"
        out.mkdir()
        (out / "vmlinux").write_bytes(vmlinux)
        (out / "initramfs.cpio").write_bytes(
            build_initramfs(busybox, [(n, index[n]) for n in names]))
        art = Artifacts(kernel_version=mroot.name, vmlinux=str(final / "vmlinux"),
                        initrd=str(final / "initramfs.cpio"), modules=names,
                        built_at=time.time())
        _write_json(out / "manifest.json", asdict(art))
        shutil.rmtree(final, ignore_errors=True)
        os.rename(out, final)
    _write_json(current, asdict(art))
    return art


def _write_json(p: Path, data: object) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, p)


# ---- disk images ----------------------------------------------------------------------------

def tree_usage(tree: Path) -> tuple[int, int]:
    """(bytes allocated, number of inodes) of a directory tree, not following symlinks."""
    total, count = 0, 0
    for dirpath, dirnames, filenames in os.walk(tree):
        for n in dirnames + filenames:
            try:
                st = os.lstat(os.path.join(dirpath, n))
            except OSError:
                continue
            total += max(st.st_blocks * 512, 4096 if not stat.S_ISLNK(st.st_mode) else 0)
            count += 1
    return total, count + 1


def mkfs_ext4(out: Path, size_bytes: int, tree: Path | None, *, inodes: int | None = None,
              label: str = "cpuos", journal: bool = True) -> Path:
    """Make an ext4 image file of ``size_bytes`` (sparse), populated from ``tree`` when
    given (``mkfs.ext4 -d``); written to a temporary name and renamed into place."""
    mkfs = shutil.which("mkfs.ext4") or "/usr/sbin/mkfs.ext4"
    if not os.path.exists(mkfs):
        raise KernelError("mkfs.ext4 is not installed (apt-get install e2fsprogs)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.truncate(size_bytes)
    argv = [mkfs, "-q", "-F", "-L", label, "-m", "0", "-b", "4096",
            "-E", "lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0"]
    if not journal:
        argv += ["-O", "^has_journal"]
    if inodes:
        argv += ["-N", str(inodes)]
    if tree is not None:
        argv += ["-d", str(tree)]
    argv.append(str(tmp))
    try:
        _run(argv)
        # the jailed QEMU (an unprivileged uid) opens it: readable whatever the daemon's
        # umask (cpuosd.homedir); a writable layer is copied and chowned per sandbox
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def build_rootfs_image(tree: Path, out: Path) -> Path:
    """The template's tree as a read-only ext4 image (no journal; ~25% + 64 MiB free)."""
    if not tree.is_dir():
        raise KernelError(f"template tree {tree} is not a directory")
    used, count = tree_usage(tree)
    size = ((used * 5 // 4 + (64 << 20)) + (1 << 20) - 1) & ~((1 << 20) - 1)
    return mkfs_ext4(out, size, tree, inodes=count + count // 4 + 1024, label="cpuos-root",
                     journal=False)


def build_overlay_image(out: Path, size_mib: int, agent_dir: Path | None = None) -> Path:
    """A blank writable layer (``upper/``, ``work/``), with the agent package at
    ``upper/opt/cpuos/cpuos_agent`` when ``agent_dir`` (a dir holding ``cpuos_agent``) is
    given. Copied sparse per sandbox."""
    with tempfile.TemporaryDirectory(prefix="cpuos-overlay-") as tmp:
        # modes set explicitly (mkfs -d copies them into the guest, where the overlay's
        # upper root is the guest's / and the agent package is read as uid 1000): the
        # daemon's umask is 077 (cpuosd.homedir)
        stage = Path(tmp)
        for name in ("upper", "work"):
            (stage / name).mkdir()
            os.chmod(stage / name, 0o755)
        if agent_dir is not None:
            src = agent_dir / "cpuos_agent"
            dst = stage / "upper" / "opt" / "cpuos" / "cpuos_agent"
            dst.mkdir(parents=True)
            for p in (dst.parent.parent, dst.parent, dst):
                os.chmod(p, 0o755)
            for f in sorted(src.glob("*.py")):
                shutil.copyfile(f, dst / f.name)
                os.chmod(dst / f.name, 0o644)
        os.chmod(stage, 0o755)
        return mkfs_ext4(out, size_mib << 20, stage, label="cpuos-overlay")


def copy_sparse(src: Path, dst: Path) -> None:
    """Copy a (sparse) image file keeping its holes (SEEK_DATA/SEEK_HOLE)."""
    size = src.stat().st_size
    with open(src, "rb") as fi, open(dst, "xb") as fo:
        fo.truncate(size)
        copy_sparse_fd(fi.fileno(), fo.fileno(), size)


def copy_sparse_fd(fdi: int, fdo: int, size: int) -> int:
    """Copy the data ranges of fdi (SEEK_DATA/SEEK_HOLE: a file or a memfd) to the same
    offsets of fdo, which is already ``size`` long; returns the bytes copied."""
    pos = copied = 0
    while pos < size:
        try:
            data = os.lseek(fdi, pos, os.SEEK_DATA)
        except OSError:
            break  # no more data
        hole = min(os.lseek(fdi, data, os.SEEK_HOLE), size)
        left = hole - data
        while left > 0:
            try:
                n = os.copy_file_range(fdi, fdo, left, data, data)
            except OSError:
                n = 0
            if n <= 0:
                chunk = os.pread(fdi, min(left, 1 << 20), data)
                n = os.pwrite(fdo, chunk, data)
            data += n
            left -= n
            copied += n
        pos = hole
    return copied


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cpuosd.backends.microvm.guest_artifacts")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download the kernel + busybox, build vmlinux/initramfs")
    b.add_argument("--force", action="store_true")
    sub.add_parser("status", help="print the current artifacts")
    i = sub.add_parser("image", help="build an ext4 root image from a template tree")
    i.add_argument("tree")
    i.add_argument("out")
    ns = ap.parse_args(argv)
    try:
        if ns.cmd == "build":
            art = build_kernel_artifacts(force=ns.force, log=True)
            print(json.dumps(asdict(art), indent=1))
        elif ns.cmd == "status":
            cur = current_artifacts()
            print(json.dumps(asdict(cur) if cur else None, indent=1))
            return 0 if cur else 1
        else:
            print(build_rootfs_image(Path(ns.tree), Path(ns.out)))
    except KernelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
