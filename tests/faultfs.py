"""A real filesystem that fails on demand: a FUSE passthrough (fusepy over libfuse2) of a
backing directory, in its own process, that returns an errno for the operations a test names.

    with FaultFS(tmp_path) as fs:          # fs.mount: where to put the store
        fs.record(True)                    # log every operation from now on
        ...                                # the work whose operations we want
        ops = fs.take_log()                # [(op, path), ...] in the order the kernel asked
        fs.fail("readdir", r"/default/manifests$", errno.EIO, after=0, times=1)
        ...                                # the same work: that listing fails with EIO once
        fs.clear()
        fs.slow("getattr", r"/objects/", s)    # those calls take s seconds longer, then succeed
        fs.most_at_once("getattr")             # the most served at once since the last clear

``fs.set_clock(seconds)`` puts the filesystem's clock that far from the kernel's: every time
getattr reports is the backing file's moved by it, so a file stamped through the mount (a
write, ``utimens`` with the kernel's now) reads back stamped by the filesystem's clock. The
files stamped before keep their times only if the test moves their backing mtimes back by
the same step (a clock step: ``test_fault_properties.py``). Times a caller sets explicitly
through the mount are taken as the kernel's too (the store only ever stamps "now").

Paths are the filesystem's own (``/default/manifests``), matched with ``re.search``. Every
operation goes to the backing directory, so inodes (``use_ino``, ``readdir_ino``), sizes,
modes and mtimes are the backing files'. Attribute and entry caching are off, and the page
cache is dropped on every open, so each listing, lookup and read of the test reaches this
process (a mapped read of a failing file faults with SIGBUS, as on a failing disk).

Needs root (or a ``fuse`` group), ``/dev/fuse``, Debian's ``libfuse2`` and PyPI's ``fusepy``:
``make test`` installs both (``tests/setup-host.sh``).
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# Operations a rule may name: the kernel's requests as fusepy passes them on.
OPS = ("getattr", "readdir", "open", "opendir", "read", "write", "create", "release",
       "releasedir", "flush", "fsync", "fsyncdir", "rename", "unlink", "mkdir", "rmdir",
       "utimens", "truncate", "statfs", "chmod", "access", "link", "symlink", "readlink",
       "mknod")


@dataclass(frozen=True)
class Rule:
    op: str
    path: str  # a regular expression, searched in the filesystem's path
    errno: int
    after: int = 0  # let this many matching calls through first
    times: int = 1  # then fail this many (-1: every later one)
    truncate_to: int = -1  # >= 0: instead of failing, cut the file to this size, then go on
    delay_s: float = 0.0  # > 0: instead of failing, take this long first (a disk that must seek)

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"faultfs: op {self.op!r} is not one of {', '.join(OPS)}")
        re.compile(self.path)


class FaultFS:
    """The filesystem mounted at ``base/mnt`` over ``base/backing``, in a child process."""

    def __init__(self, base: Path) -> None:
        self.backing = Path(base) / "backing"
        self.mount = Path(base) / "mnt"
        self._socket_path = Path(base) / "faultfs.sock"
        # The server's own messages (fusepy logs an operation that raised): a file, never a
        # pipe nobody reads, whose filling would block the server and every caller with it.
        self.log_path = Path(base) / "faultfs.log"
        self._proc: subprocess.Popen | None = None

    @classmethod
    def attach(cls, base: str | Path) -> "FaultFS":
        """The rules of a FaultFS another process mounted at ``base`` (not unmounted here)."""
        return cls(Path(base))

    def __enter__(self) -> "FaultFS":
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mount.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, __file__, str(self.backing), str(self.mount), str(self._socket_path)],
                stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 20
        while not (os.path.ismount(self.mount) and self._socket_path.exists()):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                err = self.log_path.read_text(errors="replace")[-4000:] if self._proc.poll() is not None else ""
                self.__exit__(None, None, None)
                raise RuntimeError(f"faultfs did not mount at {self.mount}: {err.strip() or 'timeout'} "
                                   "(needs /dev/fuse, Debian's libfuse2 and fusepy: run make test's set-up)")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is None:
            return
        if os.path.ismount(self.mount):
            subprocess.run(["umount", "-l", str(self.mount)], check=False)
        # Detached, it lives on while a test's store holds a descriptor there: end it (those
        # descriptors then answer ENOTCONN).
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    # ------------------------------------------------------------------ control

    def _ask(self, **request) -> object:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(self._socket_path))
            s.sendall(json.dumps(request).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = s.recv(1 << 20)
                if not chunk:
                    break
                data += chunk
        reply = json.loads(data)
        if "error" in reply:
            raise RuntimeError(f"faultfs: {reply['error']}")
        return reply.get("result")

    def fail(self, op: str, path: str, err: int = errno.EIO, *, after: int = 0, times: int = 1) -> None:
        """Add a rule: the ``after``+1-th and later matching calls fail with ``err``, ``times``
        of them (-1: all)."""
        rule = Rule(op, path, err, after, times)
        self._ask(cmd="fail", rule=rule.__dict__)

    def truncate_on(self, op: str, path: str, size: int, *, after: int = 0) -> None:
        """Add a rule: at the ``after``+1-th matching call the file is cut to ``size`` bytes
        (as another program truncating it under a reader), and the call goes on."""
        rule = Rule(op, path, 0, after, 1, size)
        self._ask(cmd="fail", rule=rule.__dict__)

    def slow(self, op: str, path: str, seconds: float, *, after: int = 0, times: int = -1) -> None:
        """Add a rule: the ``after``+1-th and later matching calls (``times`` of them, -1: all)
        take ``seconds`` longer, as on a disk that must seek for each, and then succeed."""
        rule = Rule(op, path, 0, after, times, delay_s=float(seconds))
        self._ask(cmd="fail", rule=rule.__dict__)

    def most_at_once(self, op: str) -> int:
        """The most ``op`` calls the filesystem has served at once since the last ``clear``
        (it serves several callers on threads of its own)."""
        return int(self._ask(cmd="peak", op=op))

    def clear(self) -> None:
        """Remove every rule."""
        self._ask(cmd="clear")

    def set_clock(self, seconds: float) -> None:
        """The filesystem's clock ``seconds`` from the kernel's (0: the kernel's): added to
        every time getattr reports from now on."""
        self._ask(cmd="clock", seconds=float(seconds))

    def fired(self) -> int:
        """How many calls the rules have failed since the last ``clear``."""
        return int(self._ask(cmd="fired"))

    def record(self, on: bool) -> None:
        """Start (clearing the log) or stop logging operations."""
        self._ask(cmd="record", on=on)

    def take_log(self) -> list[tuple[str, str]]:
        """The logged (op, path) pairs, oldest first; logging stops."""
        return [tuple(item) for item in self._ask(cmd="take_log")]


# ---------------------------------------------------------------------------- the server


def _serve(backing: str, mount: str, socket_path: str) -> None:
    from fuse import FUSE, FuseOSError, Operations  # fusepy: only in the child

    lock = threading.Lock()
    rules: list[dict] = []
    state = {"fired": 0, "log": None, "clock_ns": 0, "busy": {}, "peak": {}}

    def check(op: str, path: str | None) -> float:
        """Raise the error a rule says, or return how long the call is to take first."""
        # None: a file removed while open (``hard_remove``), reached through its descriptor
        path = "" if path is None else path
        delay = 0.0
        with lock:
            if state["log"] is not None:
                state["log"].append((op, path))
            for rule in rules:
                if rule["op"] != op or not re.search(rule["path"], path):
                    continue
                if rule["after"] > 0:
                    rule["after"] -= 1
                    continue
                if rule["times"] == 0:
                    continue
                if rule["times"] > 0:
                    rule["times"] -= 1
                state["fired"] += 1
                if rule["truncate_to"] >= 0:
                    if path:
                        os.truncate(real(path), rule["truncate_to"])
                    continue
                if rule["delay_s"] > 0:
                    delay = max(delay, rule["delay_s"])
                    continue
                raise FuseOSError(rule["errno"])
        return delay

    def real(path: str) -> str:
        return os.path.join(backing, path.lstrip("/"))

    def oserror(fn):
        def wrapped(self, path, *args):
            op = fn.__name__
            delay = check(op, path)
            with lock:
                busy = state["busy"][op] = state["busy"].get(op, 0) + 1
                state["peak"][op] = max(state["peak"].get(op, 0), busy)
            try:
                time.sleep(delay)
                return fn(self, path, *args)
            except OSError as exc:
                raise FuseOSError(exc.errno or errno.EIO) from None
            finally:
                with lock:
                    state["busy"][op] -= 1
        wrapped.__name__ = fn.__name__
        return wrapped

    class Passthrough(Operations):
        use_ns = True

        @oserror
        def getattr(self, path, fh=None):
            st = os.fstat(fh) if path is None and fh is not None else os.lstat(real(path))
            out = {k: getattr(st, k) for k in ("st_mode", "st_ino", "st_nlink", "st_uid", "st_gid",
                                                "st_size", "st_blocks", "st_blksize")}
            off = state["clock_ns"]
            out.update(st_atime=st.st_atime_ns + off, st_mtime=st.st_mtime_ns + off,
                       st_ctime=st.st_ctime_ns + off)
            return out

        @oserror
        def readdir(self, path, fh):
            out = [(".", None, 0), ("..", None, 0)]
            with os.scandir(real(path)) as it:
                for e in it:
                    st = e.stat(follow_symlinks=False)
                    out.append((e.name, {"st_ino": e.inode(), "st_mode": st.st_mode}, 0))
            return out

        @oserror
        def opendir(self, path):
            os.stat(real(path))
            return 0

        @oserror
        def releasedir(self, path, fh):
            return 0

        @oserror
        def fsyncdir(self, path, datasync, fh):
            fd = os.open(real(path), os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            return 0

        @oserror
        def access(self, path, amode):
            if not os.access(real(path), amode, follow_symlinks=False):
                raise FuseOSError(errno.EACCES)
            return 0

        @oserror
        def open(self, path, flags):
            return os.open(real(path), flags & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC) | os.O_NOFOLLOW)

        @oserror
        def create(self, path, mode, fi=None):
            return os.open(real(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)

        @oserror
        def read(self, path, size, offset, fh):
            return os.pread(fh, size, offset)

        @oserror
        def write(self, path, data, offset, fh):
            return os.pwrite(fh, data, offset)

        @oserror
        def truncate(self, path, length, fh=None):
            if fh is not None:
                os.ftruncate(fh, length)
            else:
                os.truncate(real(path), length)
            return 0

        @oserror
        def flush(self, path, fh):
            return 0

        @oserror
        def release(self, path, fh):
            os.close(fh)
            return 0

        @oserror
        def fsync(self, path, datasync, fh):
            (os.fdatasync if datasync else os.fsync)(fh)
            return 0

        @oserror
        def rename(self, old, new):
            os.rename(real(old), real(new))
            return 0

        @oserror
        def unlink(self, path):
            os.unlink(real(path))
            return 0

        @oserror
        def mkdir(self, path, mode):
            os.mkdir(real(path), mode)
            return 0

        @oserror
        def rmdir(self, path):
            os.rmdir(real(path))
            return 0

        @oserror
        def mknod(self, path, mode, dev):
            os.mknod(real(path), mode, dev)
            return 0

        @oserror
        def symlink(self, target, source):
            os.symlink(source, real(target))
            return 0

        @oserror
        def readlink(self, path):
            return os.readlink(real(path))

        @oserror
        def link(self, target, source):
            os.link(real(source), real(target))
            return 0

        @oserror
        def chmod(self, path, mode):
            os.chmod(real(path), mode, follow_symlinks=False)
            return 0

        @oserror
        def utimens(self, path, times=None):
            if times is None:
                os.utime(real(path), follow_symlinks=False)
            else:
                os.utime(real(path), ns=tuple(int(t) for t in times), follow_symlinks=False)
            return 0

        @oserror
        def statfs(self, path):
            sv = os.statvfs(real(path))
            return {k: getattr(sv, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                                                "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")}

    def control() -> None:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tmp = socket_path + ".tmp"
        server.bind(tmp)
        server.listen(8)
        while not os.path.ismount(mount):
            time.sleep(0.01)
        os.rename(tmp, socket_path)  # it appears once the mount answers
        while True:
            conn, _ = server.accept()
            with conn:
                data = b""
                while not data.endswith(b"\n"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                try:
                    reply = {"result": handle(json.loads(data))}
                except Exception as exc:  # noqa: BLE001 - the reply carries it to the test
                    reply = {"error": f"{type(exc).__name__}: {exc}"}
                conn.sendall(json.dumps(reply).encode() + b"\n")

    def handle(req: dict) -> object:
        with lock:
            cmd = req["cmd"]
            if cmd == "fail":
                rules.append(dict(Rule(**req["rule"]).__dict__))
            elif cmd == "clear":
                rules.clear()
                state["fired"] = 0
                state["peak"] = {}
            elif cmd == "peak":
                return state["peak"].get(req["op"], 0)
            elif cmd == "clock":
                state["clock_ns"] = int(req["seconds"] * 1e9)
            elif cmd == "fired":
                return state["fired"]
            elif cmd == "record":
                state["log"] = [] if req["on"] else None
            elif cmd == "take_log":
                log, state["log"] = state["log"] or [], None
                return log
            else:
                raise ValueError(f"unknown command {cmd!r}")
        return None

    threading.Thread(target=control, daemon=True).start()
    FUSE(Passthrough(), mount, foreground=True, nothreads=False, use_ino=True, readdir_ino=True,
         attr_timeout=0, entry_timeout=0, hard_remove=True, negative_timeout=0, fsname="faultfs", subtype="faultfs")


if __name__ == "__main__":
    _serve(*sys.argv[1:4])
