"""The private directory of the daemons' sockets and the rules that keep it private: the directory is ours, 0700,
never a symlink; each socket is 0600 and bound only by the daemon holding its lock file (flock), which is also the
only one allowed to replace a stale socket a crash left behind; every connection's peer uid is checked.
"""
from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import struct
from pathlib import Path

from surge import envs

_MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL


class UnsafePathError(ValueError):
    """A path the weight cache refuses to use: a symlink, someone else's, or open to others."""


class LockHeldError(RuntimeError):
    """Another live daemon owns this socket."""


def resolve_socket_dir(path: str | os.PathLike | None) -> Path:
    return Path(path).expanduser().absolute() if path else envs.SURGE_WEIGHT_CACHE_DIR.absolute()


def check_private_dir(path: Path) -> None:
    """UnsafePathError unless `path` is a real directory (not a symlink) owned by us and closed to others."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "no such directory", str(path)) from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{path} is a symlink or not a directory; refusing it as the weight-cache directory")
    if st.st_uid != os.getuid():
        raise UnsafePathError(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})")
    if st.st_mode & 0o077:
        raise UnsafePathError(f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}; 700 is required)")


def ensure_private_dir(path: Path) -> Path:
    """Create `path` 0700 if missing (its parents with the usual permissions); tighten a directory of ours that is
    open to others; refuse symlinks and other users' directories."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISLNK(st.st_mode) and stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o077:
        os.chmod(path, 0o700)
    check_private_dir(path)
    return path


def check_socket(path: Path) -> None:
    """An engine trusts a socket only if it is a socket (not a symlink) owned by us."""
    st = os.lstat(path)
    if not stat.S_ISSOCK(st.st_mode):
        raise UnsafePathError(f"{path} is not a socket (a symlink or a file); refusing to connect")
    if st.st_uid != os.getuid():
        raise UnsafePathError(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})")


def lock_path(socket_path: Path) -> Path:
    return socket_path.with_name(socket_path.name + ".lock")


class DaemonLock:
    """An exclusive flock on `<socket>.lock`, held for the daemon's life (the kernel drops it when the process
    dies, however it dies); the file holds the owner's pid, for messages."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                holder = lock_holder(self.path)
                raise LockHeldError(f"another weight-cache daemon{f' (pid {holder})' if holder else ''} holds "
                                    f"{self.path}: one daemon per device and directory") from None
            # Its previous owner may have unlinked the file between our open and our lock: lock the new one.
            try:
                same = os.fstat(fd).st_ino == os.lstat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd

    def release(self) -> None:
        """Unlink while still holding the lock, so no one can lock a file that is about to disappear."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None


def lock_holder(path: Path) -> int | None:
    """The pid written in a lock file, if that process is alive (a daemon still loading, or serving)."""
    try:
        pid = int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return None
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return pid


def bind_socket(path: Path, backlog: int = 64) -> socket.socket:
    """Bind the daemon's socket (the caller holds its lock): a stale socket is replaced; the new one is bound under a
    temporary name, made 0600, then renamed into place, so engines only ever see a finished, private socket."""
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise ValueError(f"socket path {path} is longer than {_MAX_SOCKET_PATH} bytes; choose a shorter "
                         "--weight-cache-dir")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
            raise UnsafePathError(f"{path} exists and is not a socket of ours; refusing to replace it")
        os.unlink(path)  # stale: its daemon died without cleaning up (we hold the lock, so no one serves it)
    tmp = path.with_name(f".bind-{os.getpid()}")
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(tmp))
        os.chmod(tmp, 0o600)
        sock.listen(backlog)
        os.rename(tmp, path)
    except BaseException:
        sock.close()
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return sock


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (SO_PEERCRED)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    return pid, uid, gid
