"""Run a command with a private ``/dev/shm``: ``python contracts/private_shm.py -- CMD [ARG...]``
(``run_in_fresh_process`` in engine_driver.py runs every engine life so).

In a new mount namespace (with CAP_SYS_ADMIN, as root; otherwise in a new user namespace too,
the user mapped to itself) an empty tmpfs as large as the host's ``/dev/shm`` covers
``/dev/shm``, every other mount is a private copy of the host's as it was (what the host mounts
or unmounts later does not reach the life, so a busy copy here never stops the host's
``umount``), and CMD replaces this process. CMD and every process it starts see only that
tmpfs, and the host only its own: what they leave there (vLLM's shared-memory rings and a
killed engine's segments, never unlinked) goes with the namespace when the last of them exits,
and nothing they do touches another program's shared memory.

Where no namespace can be made (an unprivileged user where the kernel refuses user
namespaces; a Docker container without CAP_SYS_ADMIN, whose default seccomp profile refuses
``unshare``: there the container's own ``/dev/shm`` goes with the container), CMD runs in the
host's ``/dev/shm`` all the same. The first line on stderr says which: ``PRIVATE-SHM yes``, or
``PRIVATE-SHM no: REASON``.
"""

from __future__ import annotations

import ctypes
import os
import sys

MARKER = "PRIVATE-SHM "
SHM = "/dev/shm"
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x4000, 0x40000


def make_private() -> None:
    """Move this (single-threaded) process into a mount namespace whose ``/dev/shm`` is a
    fresh tmpfs; raises OSError saying which step the kernel refused."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.unshare.argtypes = [ctypes.c_int]
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    st = os.statvfs(SHM)
    size = st.f_blocks * st.f_frsize
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWNS) != 0:
        alone = os.strerror(ctypes.get_errno())
        check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS),
              f"unshare(CLONE_NEWNS): {alone}; unshare(CLONE_NEWUSER|CLONE_NEWNS)")
        for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                           ("/proc/self/gid_map", f"{gid} {gid} 1")):
            with open(path, "w") as f:
                f.write(text)
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    check(libc.mount(b"tmpfs", SHM.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={size}".encode()),
          f"mount -t tmpfs tmpfs {SHM}")


def main(argv: list[str]) -> None:
    if argv[:1] != ["--"] or len(argv) < 2:
        sys.exit("usage: python contracts/private_shm.py -- CMD [ARG...]")
    try:
        make_private()
        status = "yes"
    except OSError as e:
        status = "no: " + (e.strerror if e.filename is None else f"{e.filename}: {e.strerror}")
    sys.stderr.write(MARKER + status + "\n")
    sys.stderr.flush()
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
