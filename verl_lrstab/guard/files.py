"""The guard's own file operations: atomic writes that leave no temporary file behind, an I/O error
that names the operation and the path, and the lock that keeps one guard per run directory.

A full or read-only disk must not kill the guard with a bare ``[Errno 28]``: every write the
guard makes goes through :func:`io_step`, which turns an ``OSError`` into a :class:`GuardIOError`
naming what was being done and where; the supervisor ends on it with its own exit status.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import psutil

from verl_lrstab.guard.lock import same_file, take_file_at


class GuardIOError(Exception):
    """One of the guard's own file operations failed (a full or read-only disk, a missing folder)."""

    def __init__(self, operation: str, path, err: OSError):
        self.operation, self.path, self.err = operation, str(path), err
        code = errno.errorcode.get(err.errno or 0, "")
        super().__init__(f"cannot {operation} {path}: {err.strerror or err}" + (f" ({code})" if code else ""))


@contextmanager
def io_step(operation: str, path):
    """Run the block; an ``OSError`` in it becomes a :class:`GuardIOError` naming ``operation`` and ``path``."""
    try:
        yield
    except GuardIOError:
        raise
    except OSError as err:
        raise GuardIOError(operation, path, err) from err


def say(text: str, file=None, flush: bool = True) -> None:
    """Print one of the guard's lines (to stderr unless ``file``). A closed output channel (``| head``
    gone: EPIPE; a closed terminal: EIO) must not stop the guard midway through a rollback: the
    stream is pointed at /dev/null (so later lines, and Python's flush at exit, go nowhere quietly)
    and the guard goes on; its events in the run folder are the record."""
    stream = sys.stderr if file is None else file
    try:
        print(text, file=stream, flush=flush)
    except OSError:
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, stream.fileno())
            os.close(null)
        except (OSError, ValueError, AttributeError):  # no descriptor (a test's StringIO): drop the line
            pass


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader (or a guard killed midway) sees the old or the new
    file; on failure the temporary file is removed and the old file stays. The new file keeps the
    old one's mode and group (a shared tracker stays writable by the team that shares it)."""
    tmp = path.with_name(f".{path.name}.lrstab-tmp")
    try:
        old = os.stat(path)
    except OSError:
        old = None
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            if old is not None:
                os.fchmod(f.fileno(), old.st_mode & 0o7777)
                try:
                    os.fchown(f.fileno(), -1, old.st_gid)
                except PermissionError:  # not a member of that group: the mode is kept, the group is ours
                    pass
            os.fsync(f.fileno())
        os.replace(tmp, path)
        sync_folder(path.parent)  # the rename itself durable before anything that relies on it is done
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# a file system that cannot fsync a folder (some FUSE and network ones) says so with these; any other error is one
_NO_DIR_SYNC = {errno.EINVAL, errno.EBADF, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EISDIR}


def sync_file(path) -> None:
    """Write the file ``path``'s data to the disk (what a rename of it then publishes survives a power loss)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_folder(path) -> None:
    """Write the folder ``path``'s entries to the disk: a rename into it, or a new file, survives a power loss
    (the file's own data is :func:`sync_file`'s). Skipped where the file system cannot sync a folder."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as err:
        if err.errno in _NO_DIR_SYNC:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in _NO_DIR_SYNC:
            raise
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: dict) -> None:
    """:func:`write_atomic` of ``data`` as JSON."""
    write_atomic(path, json.dumps(data, indent=1))


LOCK = "guard.lock"


class RunDirBusy(Exception):
    """Another guard holds the run directory (``pid``: the one written in the lock, or None)."""

    def __init__(self, path: Path, pid):
        self.path, self.pid = path, pid
        super().__init__(str(path))


def lock_run_dir(run_dir: Path, held: Optional[int] = None) -> int:
    """Take ``<run_dir>/guard.lock`` (an exclusive ``flock``) and write this process's pid in it;
    return the open descriptor (the lock lasts while it, or a process it is passed to, is open).
    The kernel drops the lock when its holders die, so a killed guard leaves no stale lock; the
    watchdog that stops verl inherits it, so the folder stays locked until verl is gone.

    Args:
        run_dir: the guard's run folder.
        held: the descriptor an earlier call returned (default None). It is returned as it is while
            it is still the file at the path; a lock file deleted or replaced since is taken anew (a
            lock on a deleted file keeps nobody out), and ``held`` is closed.
    """
    path = run_dir / LOCK
    if held is not None and same_file(held, path):
        return held
    with io_step("lock", path):
        fd = take_file_at(path, lambda: _flocked(path))
    try:
        with io_step("write the lock file", path):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    if held is not None:
        os.close(held)
    return fd


def _flocked(path: Path) -> int:
    """An ``flock``-ed descriptor of ``path`` (made when missing), or :class:`RunDirBusy` naming the holder's pid."""
    with io_step("open the lock file", path):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            pid = int(os.pread(fd, 32, 0).decode().strip() or 0) or None
        except (OSError, ValueError):
            pid = None
        os.close(fd)
        raise RunDirBusy(path, pid) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def pid_alive(pid) -> bool:
    """Whether ``pid`` (a number, or text of one) is a live process (a thread's id is not one)."""
    try:
        return psutil.pid_exists(int(pid))
    except (TypeError, ValueError):
        return False
