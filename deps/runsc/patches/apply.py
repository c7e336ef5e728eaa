"""cpuos's changes to the pinned gVisor, applied at build time (scripts/build-runsc.sh) to a
copy of the module (the build points go.mod's ``replace`` at it; the module cache is never
touched: Go refuses overlays of files in it). Each change is an exact text replacement that
fails the build loudly when its anchor is gone, or a new file of this directory copied in
(a new gVisor version: re-check the changes, then bump PATCH_LEVEL in
cpuosd/backends/runsc.py and patch_level in build-runsc.sh).

Level 1:

1. overlay_nr_inodes (runsc/boot/vfs.go): the upper (writable) tmpfs of an overlay mount
   takes an inode limit from its size: ``--overlay2=root:dir=D,size=5120m/98304`` means
   5120 MiB and at most 98304 inodes. gVisor sets none for an overlay's upper layer, and an
   empty file costs no page of the size limit but ~3 KiB of the sentry's own memory: a
   million empty files would take the sandbox past its host memory limit instead of
   stopping at ENOSPC.

Level 2 (the audit trail's runtime monitoring, cpuosd.accounting.trace):

2. File-system points (points_cpuos.go.in -> pkg/sentry/syscalls/linux/): exit points for
   openat2, truncate, mknod(at), mkdir(at), rmdir, unlink(at), link(at), symlink(at),
   rename(at,at2), which gVisor has only as raw points (registers, no paths); and with the
   optional field ``cpuos_writes``, open/openat/creat report only successful opens that may
   write, with the path of the file opened (resolved from the new fd: /proc/self/fd/N,
   symlinks and dirfds cannot hide it). Paths are the ones the syscall used (copyInPath
   keeps them on the task: task_cpuos.go.in -> pkg/sentry/kernel/), resolved in the Sentry.
3. A point may decline (a nil message: pkg/sentry/kernel/task_syscall.go): the Sentry then
   sends nothing and loads no context, so reads cost nothing beyond the point's check.
4. cpuos's mode of the remote sink (remote_cpuos.go.in -> pkg/sentry/seccheck/sinks/remote/,
   sink config ``cpuos_coalesce``): a point costs the task a marshal and an append under a
   mutex, never a system call; a goroutine of the sink's sends what gathered every few
   milliseconds as batches (one message of records); a point repeated within the window
   is counted and sent once with the count (a 12-byte header); what does not fit waits
   for the next round (bounded; beyond, dropped and counted); the socket gets a 1 MiB
   send buffer.
5. Precompiled seccomp programs (precompile_seccomp.go.in, run by build-runsc.sh between
   this script and the build, as gVisor's Bazel build does): a sandbox's boot and restore
   install a ready program instead of building one (~110 ms of CPU each time here); only
   the Sentry variants cpuos runs are precompiled (netstack, no GPU/TPU/RDMA proxies).

Level 3:

6. The coalescing sink's flush (every few milliseconds while points come) looks only at
   the entries whose window ended, kept in the order they started, not at the whole map:
   with thousands of distinct points a second (a git checkout, a pip install) the scan of
   up to 4096 entries each round was most of the sink's cost (~7 % of the Sentry's CPU
   in a loop creating and removing files).

Level 4 (what a restored sandbox keeps of its restore):

7. A restore reads the memory image with at most 4 reads at once (runsc/boot/controller.go;
   gVisor: 128 worker goroutines, with GOMAXPROCS raised by 128 while they run). Each read
   in flight blocks a host thread, which the Go runtime keeps for good, and 130 Ps' span
   caches spread the Sentry's heap: an idle python sandbox restored from its template held
   ~30 more host threads (39-47 against 15) and ~4 MiB more of the Sentry's anonymous
   memory than the same sandbox booted cold. Create -> first exec and resume -> first exec
   took the same time with 4 (paired, 12 rounds: 0.97 and 1.00 of 128).
8. Once a restore is done (its pages loaded), the Sentry gives the free part of its heap
   back to the host (``debug.FreeOSMemory``, once, off the application's path): ~1.7 MiB
   more; the Go runtime's background scavenger returns it over minutes otherwise.

    python3 apply.py <gvisor module dir> <copy dir>
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path

# each file's changes: (anchor, replacement[, how many times the anchor is there: 1]); a
# file with changes must still import what the replacements use (IMPORTS)
PATCHES: dict[str, list[tuple[str, str] | tuple[str, str, int]]] = {
    "runsc/boot/vfs.go": [(
        """	if mountConf.Size != "" {
		if upperOpts.GetFilesystemOptions.Data != "" {
			upperOpts.GetFilesystemOptions.Data += ","
		}
		upperOpts.GetFilesystemOptions.Data += "size=" + mountConf.Size
	}""",
        """	if mountConf.Size != "" {
		if upperOpts.GetFilesystemOptions.Data != "" {
			upperOpts.GetFilesystemOptions.Data += ","
		}
		// cpuos: "size/nr_inodes" sets an inode limit too.
		size, inodes, _ := strings.Cut(mountConf.Size, "/")
		upperOpts.GetFilesystemOptions.Data += "size=" + size
		if inodes != "" {
			upperOpts.GetFilesystemOptions.Data += ",nr_inodes=" + inodes
		}
	}"""),
    ],
    # the field that turns open/openat/creat into cpuos's points
    "pkg/sentry/seccheck/syscall.go": [(
        """	FieldSyscallExecveEnvv = FieldSyscallPath + 1
)""",
        """	FieldSyscallExecveEnvv = FieldSyscallPath + 1
)

// cpuos: FieldSyscallCpuosWrites ("cpuos_writes") makes the open/openat/creat exit points
// report only successful opens that may write, with the opened file's path
// (pkg/sentry/syscalls/linux/points_cpuos.go).
const FieldSyscallCpuosWrites = FieldSyscallPath + 2"""),
    ],
    "pkg/sentry/seccheck/metadata_amd64.go": [
        ("""	addSyscallPoint(2, "open", nil)""",
         """	addSyscallPoint(2, "open", []FieldDesc{{ID: FieldSyscallCpuosWrites, Name: "cpuos_writes"}})"""),
        ("""	addSyscallPoint(85, "creat", []FieldDesc{
		{
			ID:   FieldSyscallPath,
			Name: "fd_path",
		},
	})""",
         """	addSyscallPoint(85, "creat", []FieldDesc{
		{
			ID:   FieldSyscallPath,
			Name: "fd_path",
		},
		{ID: FieldSyscallCpuosWrites, Name: "cpuos_writes"},
	})"""),
        ("""	addSyscallPoint(257, "openat", []FieldDesc{
		{
			ID:   FieldSyscallPath,
			Name: "fd_path",
		},
	})""",
         """	addSyscallPoint(257, "openat", []FieldDesc{
		{
			ID:   FieldSyscallPath,
			Name: "fd_path",
		},
		{ID: FieldSyscallCpuosWrites, Name: "cpuos_writes"},
	})"""),
        ("""	const lastSyscallInTable = 441""",
         """	// cpuos: file-system changes (pkg/sentry/syscalls/linux/points_cpuos.go)
	for sysno, name := range map[uintptr]string{76: "truncate", 82: "rename", 83: "mkdir",
		84: "rmdir", 86: "link", 87: "unlink", 88: "symlink", 133: "mknod", 258: "mkdirat",
		259: "mknodat", 263: "unlinkat", 264: "renameat", 265: "linkat", 266: "symlinkat",
		316: "renameat2", 437: "openat2"} {
		addSyscallPoint(sysno, name, nil)
	}

	const lastSyscallInTable = 441"""),
    ],
    "pkg/sentry/syscalls/linux/linux64.go": [
        (f"""		{num}{sp}syscalls.{kind}("{name}", {fn}{orig}),""",
         f"""		{num}{sp}syscalls.SupportedPoint("{name}", {fn}, cpuosPoint{fn}),""")
        for num, sp, kind, name, fn, orig in [
            ("2:", "   ", "SupportedPoint", "open", "Open", ", PointOpen"),
            ("76:", "  ", "Supported", "truncate", "Truncate", ""),
            ("82:", "  ", "Supported", "rename", "Rename", ""),
            ("83:", "  ", "Supported", "mkdir", "Mkdir", ""),
            ("84:", "  ", "Supported", "rmdir", "Rmdir", ""),
            ("85:", "  ", "SupportedPoint", "creat", "Creat", ", PointCreat"),
            ("86:", "  ", "Supported", "link", "Link", ""),
            ("87:", "  ", "Supported", "unlink", "Unlink", ""),
            ("88:", "  ", "Supported", "symlink", "Symlink", ""),
            ("133:", " ", "Supported", "mknod", "Mknod", ""),
            ("257:", " ", "SupportedPoint", "openat", "Openat", ", PointOpenat"),
            ("258:", " ", "Supported", "mkdirat", "Mkdirat", ""),
            ("259:", " ", "Supported", "mknodat", "Mknodat", ""),
            ("263:", " ", "Supported", "unlinkat", "Unlinkat", ""),
            ("264:", " ", "Supported", "renameat", "Renameat", ""),
            ("265:", " ", "Supported", "linkat", "Linkat", ""),
            ("266:", " ", "Supported", "symlinkat", "Symlinkat", ""),
            ("316:", " ", "Supported", "renameat2", "Renameat2", ""),
        ]
    ] + [(  # in both tables (amd64's and arm64's; the point is registered for amd64 only)
        """		437: syscalls.Supported("openat2", Openat2),""",
        """		437: syscalls.SupportedPoint("openat2", Openat2, cpuosPointOpenat2),""", 2)],
    # the paths a syscall used, for its point
    "pkg/sentry/syscalls/linux/path.go": [(
        """	pathname, err := t.CopyInString(addr, linux.PATH_MAX)
	if err != nil {
		return fspath.Path{}, err
	}
	return fspath.Parse(pathname), nil""",
        """	pathname, err := t.CopyInString(addr, linux.PATH_MAX)
	if err != nil {
		return fspath.Path{}, err
	}
	t.Cpuos.Paths[0], t.Cpuos.Paths[1] = t.Cpuos.Paths[1], pathname // cpuos: for its points
	return fspath.Parse(pathname), nil"""), (
        """	rootCleanup.Release()
	return taskPathOperation{""",
        """	rootCleanup.Release()
	cpuosNoteStart(t, start) // cpuos: the directory it is resolved from, for its points
	return taskPathOperation{"""),
    ],
    "pkg/sentry/syscalls/linux/sys_file.go": [(
        """	flags := how.Flags
	mode := how.Mode
""",
        """	flags := how.Flags
	mode := how.Mode
	t.Cpuos.HowFlags, t.Cpuos.HowMode = flags, mode // cpuos: for its openat2 point
"""), (
        """	if err != nil {
		return 0, nil, err
	}
	defer file.DecRef(t)

	fd, err := t.NewFDFrom(0, file, kernel.FDFlags{
		CloseOnExec: flags&linux.O_CLOEXEC != 0,
	})""",
        """	if err != nil {
		return 0, nil, err
	}
	defer file.DecRef(t)
	cpuosNoteOpened(t, file, flags) // cpuos: the file opened, for its trace point

	fd, err := t.NewFDFrom(0, file, kernel.FDFlags{
		CloseOnExec: flags&linux.O_CLOEXEC != 0,
	})"""),
    ],
    "pkg/sentry/kernel/task.go": [(
        """	goid atomicbitops.Int64 `state:"nosave"`
""",
        """	goid atomicbitops.Int64 `state:"nosave"`

	// Cpuos is what the current syscall read, for cpuos's trace points (task_cpuos.go).
	Cpuos CpuosScratch `state:"nosave"`
"""),
    ],
    # a point that declines sends nothing, and its context is loaded only when it is sent
    "pkg/sentry/kernel/task_syscall.go": [(
        """	if bits.IsAnyOn(fe, SecCheckExit) {
		fields := seccheck.Global.GetFieldSet(seccheck.GetPointForSyscall(seccheck.SyscallExit, sysno))
		var ctxData *pb.ContextData
		if !fields.Context.Empty() {
			ctxData = &pb.ContextData{}
			LoadSeccheckData(t, fields.Context, ctxData)
		}""",
        """	if bits.IsAnyOn(fe, SecCheckExit) {
		fields := seccheck.Global.GetFieldSet(seccheck.GetPointForSyscall(seccheck.SyscallExit, sysno))
		var ctxData *pb.ContextData
		if !fields.Context.Empty() {
			ctxData = &pb.ContextData{}
		}"""), (
        """		cb := s.LookupSyscallToProto(sysno)
		msg, msgType := cb(t, fields, ctxData, info)
		seccheck.Global.SentToSinks(func(c seccheck.Sink) error {
			return c.Syscall(t, fields, ctxData, msgType, msg)
		})
	}

	return
}""",
        """		cb := s.LookupSyscallToProto(sysno)
		msg, msgType := cb(t, fields, ctxData, info)
		if msg != nil { // cpuos: a point may decline
			if ctxData != nil {
				LoadSeccheckData(t, fields.Context, ctxData)
			}
			seccheck.Global.SentToSinks(func(c seccheck.Sink) error {
				return c.Syscall(t, fields, ctxData, msgType, msg)
			})
		}
	}

	return
}"""),
    ],
    "pkg/sentry/seccheck/sinks/remote/remote.go": [
        ("""	retries        int
	initialBackoff time.Duration
	maxBackoff     time.Duration
}""",
         """	retries        int
	initialBackoff time.Duration
	maxBackoff     time.Duration

	cpuos *cpuosCoalescer // cpuos: coalescing (cpuos.go), nil without "cpuos_coalesce"
}"""),
        ("""	if err := unix.Connect(int(f.Fd()), &addr); err != nil {
		return nil, fmt.Errorf("connect(%q): %w", path, err)
	}
""",
         """	if err := unix.Connect(int(f.Fd()), &addr); err != nil {
		return nil, fmt.Errorf("connect(%q): %w", path, err)
	}
	cpuosSocket(int(f.Fd()))
"""),
        ("""	if r.initialBackoff > r.maxBackoff {
		return nil, fmt.Errorf("initial backoff (%v) cannot be larger than max backoff (%v)", r.initialBackoff, r.maxBackoff)
	}
""",
         """	if r.initialBackoff > r.maxBackoff {
		return nil, fmt.Errorf("initial backoff (%v) cannot be larger than max backoff (%v)", r.initialBackoff, r.maxBackoff)
	}
	if ok, window, err := parseDuration(config, "cpuos_coalesce"); err != nil {
		return nil, err
	} else if ok && window > 0 {
		r.cpuos = newCpuosCoalescer(window)
		go r.cpuosRun()
	}
"""),
        ("""	if r.endpoint != nil {
		// It's possible to race with Point firing, but in the worst case they will
		// simply fail to be delivered.
		r.endpoint.Close()""",
         """	if r.cpuos != nil {
		r.cpuosStop()
	}
	if r.endpoint != nil {
		// It's possible to race with Point firing, but in the worst case they will
		// simply fail to be delivered.
		r.endpoint.Close()"""),
        ("""func (r *remote) write(msg proto.Message, msgType pb.MessageType) {
""",
         """func (r *remote) write(msg proto.Message, msgType pb.MessageType) {
	if r.cpuos != nil {
		r.cpuosWrite(msg, msgType)
		return
	}
"""),
    ],
    # 7. a restore's reads of the memory image: at most 4 at once
    "runsc/boot/controller.go": [
        ("""		stateio.NewPagesFileFDReaderDefault(int32(pagesFile.Release())),
		nil
}""", """		// cpuos: at most 4 reads at once (the default, 128, leaves a host thread per
		// read in flight and spreads the heap over 128 more Ps).
		stateio.NewPagesFileFDReader(int32(pagesFile.Release()), 256<<10, 4),
		nil
}"""),
    ],
    # 8. the free heap back to the host once a restore is done
    "runsc/boot/restore.go": [
        ("""	"strconv"
""", """	rdebug "runtime/debug"
	"strconv"
"""),
        ("""	log.Infof("Restore successful")
""", """	log.Infof("Restore successful")
	rdebug.FreeOSMemory() // cpuos: what the restore took and freed goes back to the host
"""),
    ],
    # 5. only the Sentry seccomp variants cpuos runs are precompiled (precompile_seccomp.go.in)
    "runsc/boot/filter/config/config_precompiled.go": [
        ("""			return []Options{netstack, hostNet, hostNetRaw}, nil""",
         """			_, _ = hostNet, hostNetRaw // cpuos: netstack only
			return []Options{netstack}, nil"""),
        ("""			for _, caps := range nvconf.PopularCapabilitySets() {""",
         """			for _, caps := range nvconf.PopularCapabilitySets()[:0] { // cpuos: no GPU proxy"""),
        ("""			return []Options{tpuProxyYes, tpuProxyNo}, nil""",
         """			_ = tpuProxyYes // cpuos: no TPU proxy
			return []Options{tpuProxyNo}, nil"""),
        ("""			return []Options{rdmaProxyYes, rdmaProxyNo}, nil""",
         """			_ = rdmaProxyYes // cpuos: no RDMA proxy
			return []Options{rdmaProxyNo}, nil"""),
    ],
}

IMPORTS = {"runsc/boot/vfs.go": ['"strings"']}

# new files: (this directory's file, where it goes in the module)
NEW_FILES = [
    ("points_cpuos.go.in", "pkg/sentry/syscalls/linux/points_cpuos.go"),
    ("task_cpuos.go.in", "pkg/sentry/kernel/task_cpuos.go"),
    ("remote_cpuos.go.in", "pkg/sentry/seccheck/sinks/remote/cpuos.go"),
]


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
        for old, new, *times in changes:
            n = times[0] if times else 1
            if text.count(old) != n:
                sys.exit(f"patch for {rel}: its anchor is not in {module / rel} {n} time(s)")
            text = text.replace(old, new)
        for imp in IMPORTS.get(rel, []):
            if imp not in text:
                sys.exit(f"patch for {rel}: the file no longer imports {imp}")
        dest.write_text(text)
    here = Path(__file__).resolve().parent
    for name, rel in NEW_FILES:
        if (copy / rel).exists():
            sys.exit(f"new file {rel}: the module has one already")
        shutil.copyfile(here / name, copy / rel)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
