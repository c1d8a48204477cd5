"""One trainer per run directory: an exclusive ``flock`` on ``<out>/.lock`` for the run's life.

A check ("does --out hold checkpoints?") cannot keep two trainers apart: both can pass it
before either writes. The lock can: ``flock`` is taken atomically by the kernel and released
when its file descriptor closes, which includes the process dying by any signal, so a crashed
run never leaves a stale lock behind. The file holds the holder's pid (for the message only;
the lock itself is the ``flock``). The file is never deleted: unlinking a lock file lets a
third process lock a fresh inode while the second still holds the old one.

Not for network filesystems without ``flock`` support (some NFS setups emulate it per host).
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

__all__ = ["LOCK_NAME", "RunLock", "RunLocked"]

LOCK_NAME = ".lock"


class RunLocked(Exception):
    """Another live process holds the run directory's lock; the message names both."""


class RunLock:
    """Hold ``<run_dir>/.lock`` exclusively until :meth:`release` (or the process ends)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_pid(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            who = f" (pid {holder})" if holder is not None else ""
            raise RunLocked(f"--out: {str(Path(run_dir))!r} is in use by another fusedres "
                            f"train{who}; wait for it to end, or choose another --out") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
