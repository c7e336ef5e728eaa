/*
 * cpuos compat shim, preloaded in every template (/etc/ld.so.preload).
 *
 * Debian's runsc (release 2022-12-19) answers statx(2) with EINVAL when the
 * AT_NO_AUTOMOUNT flag is set. coreutils 9 passes that flag, so `ls -l`,
 * `stat`, `cp -a` ... fail inside the sandbox ("cannot statx: Invalid
 * argument"). There are no automount points in a sandbox, so dropping the
 * flag changes nothing else. Built from this source at template build time.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

int statx(int dirfd, const char *restrict path, int flags, unsigned int mask,
          struct statx *restrict buf) {
    return (int)syscall(SYS_statx, dirfd, path, flags & ~AT_NO_AUTOMOUNT, mask, buf);
}
