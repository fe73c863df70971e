"""One guard per checkpoint folder: the guard's hold on verl's ``trainer.default_local_dir``.

Two trainers on one checkpoint folder save over each other's ``global_step_N`` in place, whatever
run folder each guard was given. So the lock is taken on the checkpoint folder itself, with the
kernel's own ``flock``:

- on the folder (an ``O_DIRECTORY`` descriptor): there is no lock file to delete, and removing the
  folder would remove the checkpoints too. File systems that do not lock folders (NFS emulates
  ``flock`` with byte-range locks, which need a file open for writing) skip this one;
- on ``<trainer.default_local_dir>/.lrstab_guard.lock``, which also tells a second guard who holds
  the folder (pid and run folder). A lock file can be deleted while held; so the guard takes it
  only when the file it locked is still the one at that path (same inode), and checks that again
  while verl runs (:meth:`CheckpointLock.check`): a deleted or replaced lock file is taken anew.

The kernel drops both when their holders die: a killed guard leaves no stale lock. The watchdog
that stops verl holds them too, so the folder stays locked until verl is gone.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Callable, Optional

LOCK_FILE = ".lrstab_guard.lock"
_NO_DIR_LOCK = (errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.EACCES)


class CheckpointsBusy(Exception):
    """Another process holds the checkpoint folder (``holder``: what its lock file says, or ``{}``)."""

    def __init__(self, checkpoint_dir: Path, holder: dict):
        self.checkpoint_dir, self.holder = checkpoint_dir, holder
        super().__init__(str(checkpoint_dir))


def same_file(fd: int, path: Path) -> bool:
    """Whether the open descriptor ``fd`` is the file at ``path`` now (not a deleted or replaced one)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def take_file_at(path: Path, locked: Callable[[], int]) -> int:
    """A descriptor from ``locked()`` (an ``flock``-ed open of ``path``) that is the file at ``path`` now: a file
    deleted or replaced between open and flock is not it (``OSError`` EAGAIN when that keeps happening)."""
    for _ in range(20):
        fd = locked()
        if same_file(fd, path):
            return fd
        os.close(fd)
    raise OSError(errno.EAGAIN, "the lock file keeps being replaced", str(path))


def read_holder(path: Path) -> dict:
    """What the lock file ``path`` says of its holder (``pid``, ``run_dir``, ``host``), or ``{}``."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def flock_holder(path: Path) -> Optional[int]:
    """The pid holding an ``flock`` on ``path`` (from /proc/locks; None when it is not found)."""
    try:
        st = os.stat(path)
        key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == key and parts[4].isdigit():
                    return int(parts[4]) or None
    except (OSError, ValueError):
        pass
    return None


class CheckpointLock:
    """The exclusive hold of one guard on the checkpoint folder ``checkpoint_dir`` (see the module docstring).

    Args:
        checkpoint_dir: verl's ``trainer.default_local_dir`` (made when missing, as verl would).
        run_dir: the guard's run folder (written in the lock file: a refused guard names it).
    """

    def __init__(self, checkpoint_dir: Path, run_dir: Path):
        self.checkpoint_dir, self.run_dir = Path(checkpoint_dir), Path(run_dir)
        self.path = self.checkpoint_dir / LOCK_FILE
        self._dir_fd: Optional[int] = None
        self._file_fd: Optional[int] = None
        self.previous: dict = {}  # what the lock file said before this guard took it (the last guard's run folder)

    def acquire(self) -> "CheckpointLock":
        """Take both locks, or raise :class:`CheckpointsBusy` (an ``OSError`` when the folder cannot be made)."""
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.previous = read_holder(self.path)
        fd = os.open(self.checkpoint_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._dir_fd = fd
        except BlockingIOError:
            os.close(fd)
            raise CheckpointsBusy(self.checkpoint_dir, self._holder(self.checkpoint_dir)) from None
        except OSError as err:
            os.close(fd)
            if err.errno not in _NO_DIR_LOCK:
                raise
        try:
            self._take_file()
        except BaseException:
            self.release()
            raise
        return self

    def _holder(self, locked: Path) -> dict:
        holder = read_holder(self.path)
        pid = flock_holder(locked)
        if pid is not None and holder.get("pid") != pid:  # the lock file was rewritten or deleted: the kernel's word
            holder = {"pid": pid}
        return holder

    def _take_file(self) -> None:
        """Lock the lock file that is at :attr:`path` now (a file deleted between open and flock is not it)."""
        fd = take_file_at(self.path, self._locked_file)
        self._write({"pid": os.getpid(), "run_dir": str(self.run_dir), "host": socket.gethostname()}, fd)
        old, self._file_fd = self._file_fd, fd
        if old is not None:
            os.close(old)

    def _write(self, holder: dict, fd: int) -> None:
        """Say who holds the lock (for a refused guard's message; through another descriptor: see
        :meth:`_locked_file`). A full or read-only disk leaves it unwritten: the lock holds, and
        /proc/locks still names the holder."""
        try:
            with open(self.path, "r+") as f:
                if same_file(f.fileno(), self.path) and same_file(fd, self.path):
                    f.truncate(0)
                    f.write(json.dumps(holder) + "\n")
        except OSError:
            pass

    def restore_previous(self) -> None:
        """Put back what the lock file said before this guard took it (a guard refused after taking it)."""
        if self._file_fd is not None and self.previous:
            self._write(self.previous, self._file_fd)

    def _locked_file(self) -> int:
        """An ``flock``-ed descriptor of :attr:`path`, open read-only where the file system allows (a file
        held open for writing would keep an admin from remounting the checkpoint disk read-only); NFS
        locks only a file open for writing."""
        for flags in (os.O_RDONLY, os.O_RDWR):
            fd = os.open(self.path, flags | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                os.close(fd)
                raise CheckpointsBusy(self.checkpoint_dir, self._holder(self.path)) from None
            except OSError as err:
                os.close(fd)
                if err.errno != errno.EBADF or flags == os.O_RDWR:
                    raise
            except BaseException:
                os.close(fd)
                raise
        raise AssertionError("unreachable")

    def check(self) -> None:
        """While verl runs: the lock file at :attr:`path` must still be the one held. A deleted or
        replaced one is taken anew (:class:`CheckpointsBusy` if another guard took it meanwhile)."""
        if self._file_fd is not None and not same_file(self._file_fd, self.path):
            self._take_file()

    def fds(self) -> tuple:
        """The descriptors that hold the locks (passed on to the watchdog)."""
        return tuple(fd for fd in (self._dir_fd, self._file_fd) if fd is not None)

    @property
    def held(self) -> bool:
        return self._file_fd is not None

    def release(self) -> None:
        for name in ("_file_fd", "_dir_fd"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)
