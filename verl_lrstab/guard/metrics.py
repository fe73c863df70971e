"""The running launch's metrics file, followed by the file rather than its name.

verl's file logger opens ``VERL_FILE_LOGGER_PATH`` once (``open(path, "wb")``) and writes there
until it exits, whatever happens to the name: a file renamed or replaced while the guard watches it
(a user tidying up, a log rotation) still receives verl's lines. So the guard creates the file before
verl starts and reads it through a descriptor it holds: renamed, deleted or replaced, the file
verl writes is the one the guard reads, and the trouble in it is still seen. After the launch, the
lines read are put back under the name when it no longer holds them (the run's state names it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from verl_lrstab.guard.files import write_atomic
from verl_lrstab.runs import read_metrics


class MetricsFile:
    """verl's metrics file of one launch (``path``), created empty and held open for reading."""

    def __init__(self, path: Path):
        self.path = Path(path)
        with open(self.path, "ab"):  # verl opens it "wb" later: the same file, still empty
            pass
        self._fd: Optional[int] = os.open(self.path, os.O_RDONLY)  # None once closed
        self.moved = False  # the name no longer holds the file read (renamed, deleted or replaced)

    def _held(self) -> int:
        if self._fd is None:
            raise ValueError(f"{self.path}: read after close")
        return self._fd

    def _via(self) -> Path:
        return Path(f"/proc/self/fd/{self._held()}")  # the held file, whatever its name now

    def read(self) -> dict[int, dict]:
        """``{step: metrics}`` of the file verl writes (:func:`verl_lrstab.runs.read_metrics`)."""
        self._follow()
        return read_metrics(self._via(), name=self.path)

    def _follow(self) -> None:
        own = os.fstat(self._held())
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            self.moved = True
            return
        if (now.st_dev, now.st_ino) == (own.st_dev, own.st_ino):
            return
        self.moved = True
        if own.st_size == 0 and now.st_size > 0:  # replaced before verl opened it: verl writes the new one
            fd = os.open(self.path, os.O_RDONLY)
            os.close(self._held())
            self._fd = fd

    def put_back(self) -> bool:
        """When the name no longer holds the file read, write its lines there again (write + rename);
        True when it did."""
        self._follow()
        if not self.moved:
            return False
        with open(self._via(), "rb") as f:
            write_atomic(self.path, f.read().decode(errors="replace"))
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
