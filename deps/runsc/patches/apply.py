"""cpuos's changes to the pinned gVisor, applied at build time (scripts/build-runsc.sh) to a
copy of the module (the build points go.mod's ``replace`` at it; the module cache is never
touched: Go refuses overlays of files in it). Each change is an exact text replacement that
fails the build loudly when its anchor is gone (a new gVisor version: re-check the change,
then bump PATCH_LEVEL in cpuosd/backends/runsc.py and patch_level in build-runsc.sh).

1. overlay_nr_inodes (runsc/boot/vfs.go): the upper (writable) tmpfs of an overlay mount
   takes an inode limit from its size: ``--overlay2=root:dir=D,size=5120m/98304`` means
   5120 MiB and at most 98304 inodes. gVisor sets none for an overlay's upper layer, and an
   empty file costs no page of the size limit but ~3 KiB of the sentry's own memory: a
   million empty files would take the sandbox past its host memory limit instead of
   stopping at ENOSPC.

    python3 apply.py <gvisor module dir> <copy dir>
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path

PATCHES = {
    "runsc/boot/vfs.go": [(
        '''	if mountConf.Size != "" {
		if upperOpts.GetFilesystemOptions.Data != "" {
			upperOpts.GetFilesystemOptions.Data += ","
		}
		upperOpts.GetFilesystemOptions.Data += "size=" + mountConf.Size
	}''',
        '''	if mountConf.Size != "" {
		if upperOpts.GetFilesystemOptions.Data != "" {
			upperOpts.GetFilesystemOptions.Data += ","
		}
		// cpuos: "size/nr_inodes" sets an inode limit too.
		size, inodes, _ := strings.Cut(mountConf.Size, "/")
		upperOpts.GetFilesystemOptions.Data += "size=" + size
		if inodes != "" {
			upperOpts.GetFilesystemOptions.Data += ",nr_inodes=" + inodes
		}
	}'''),
    ],
}


def main(module: Path, copy: Path) -> None:
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(module, copy, symlinks=True)
    for d, _, files in os.walk(copy):  # the module cache's files are read-only
        os.chmod(d, 0o755)
        for f in files:
            p = os.path.join(d, f)
            if not os.path.islink(p):
                os.chmod(p, os.stat(p).st_mode | stat.S_IWUSR)
    for rel, changes in PATCHES.items():
        dest = copy / rel
        text = dest.read_text()
        for old, new in changes:
            if text.count(old) != 1:
                sys.exit(f"patch for {rel}: its anchor is not in {module / rel} exactly once")
            text = text.replace(old, new)
        if '"strings"' not in text:
            sys.exit(f"patch for {rel}: the file no longer imports strings")
        dest.write_text(text)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
