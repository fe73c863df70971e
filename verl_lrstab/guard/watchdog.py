"""``python -m verl_lrstab.guard.watchdog FD -- COMMAND...``: run verl so that it dies with the guard.

The guard starts this in a new session with the read end of a pipe (``FD``) whose write end only
the guard holds. The kernel closes that end whenever the guard dies, SIGKILL and the OOM killer
included, so the watchdog reads EOF and stops everything it started. It is a child subreaper
(``PR_SET_CHILD_SUBREAPER``): Ray's local daemons and workers that outlive verl's driver are
re-parented to it, so the process tree it stops is complete even when they left the session.
verl's driver also gets ``PR_SET_PDEATHSIG`` (SIGTERM when the watchdog goes).

Exit status: the command's (128 + N for a signal N); 143 when it was stopped.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

MODULE = "verl_lrstab.guard.watchdog"
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
GRACE_S = 10.0


def _prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the pipe and the process group still work
        pass


def descendants(root: int) -> list[psutil.Process]:
    """Every live process below ``root``."""
    try:
        return psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _send(processes: list[psutil.Process], sig: int) -> None:
    """Signal each process; one that is gone (or whose pid is another process's now) is skipped."""
    for process in processes:
        try:
            process.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def stop_tree(grace_s: float = GRACE_S) -> None:
    """SIGTERM every descendant, wait up to ``grace_s``, SIGKILL what is left; reap them all."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        _send(descendants(os.getpid()), sig)
        end = time.monotonic() + wait
        while time.monotonic() < end and _reap_all():
            time.sleep(0.1)
    _reap_all()


def _reap_all() -> bool:
    """Reap exited children; True while some child is still alive."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


ENV_RUN = "LRSTAB_GUARD_RUN"  # set in every process of a guarded launch (inherited): names the run folder


def _launch_processes(run_dir: str, exclude=()) -> list[psutil.Process]:
    me = os.getpid()
    # an environment that cannot be read (another user's process, a zombie) is None
    return [p for p in psutil.process_iter(["environ"]) if p.pid != me and p.pid not in exclude
            and (p.info["environ"] or {}).get(ENV_RUN) == run_dir]


def survivors(run_dir: str, exclude=()) -> list[int]:
    """Live processes of a guarded launch of ``run_dir`` (its :data:`ENV_RUN` in their environment):
    verl's driver, Ray's daemons and workers, whoever their parent is now (a killed watchdog's
    orphans are re-parented to init) and whichever guard started them."""
    return [p.pid for p in _launch_processes(run_dir, exclude)]


def stop_survivors(run_dir: str, grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM the :func:`survivors` of ``run_dir``, SIGKILL those left after ``grace_s``; return
    those still alive after that (none, unless a process ignores SIGKILL: one in the kernel's D state)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        left = _launch_processes(run_dir)
        _send(left, sig)
        end = time.monotonic() + wait
        while left and time.monotonic() < end:  # a zombie has no environment: it is not found again
            left = _launch_processes(run_dir)
            time.sleep(0.1)
        if not left:
            return []
    return survivors(run_dir)


def _child_setup():
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


# -- the guard's side: start verl under the watchdog, stop it ------------------------------------------
def start_supervised(cmd: list[str], cwd: Path, env: dict, stdout, keep_fds=()) -> tuple[subprocess.Popen, int]:
    """Start ``cmd`` under :mod:`.watchdog` in its own session; returns the process and the pipe's
    write end (the lifeline: the kernel closes it when this process dies, however it dies).
    ``keep_fds`` are passed on to the watchdog (not to verl): held open until it exits."""
    read, write = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-m", MODULE, str(read), "--", *cmd], cwd=cwd, env=env,
                                stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True,
                                pass_fds=(read, *keep_fds))
    except BaseException:
        os.close(write)
        raise
    finally:
        os.close(read)
    return proc, write


def raise_on_signal(signum, frame):
    """A SIGTERM handler: unwind (``finally`` blocks stop the child) with status 128 + signum."""
    raise SystemExit(128 + signum)


def stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """Stop verl and every process of its group (Ray's daemons included)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    fd = int(argv[0])
    command = argv[2:] if argv[1:2] == ["--"] else argv[1:]
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    proc = subprocess.Popen(command, preexec_fn=_child_setup)
    while True:
        if stopping:
            break
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready and os.read(fd, 1) == b"":  # EOF: the guard is gone
            break
        if proc.poll() is not None:
            stop_tree(grace_s=2.0)  # what verl's driver left behind (Ray daemons, workers)
            rc = proc.returncode
            return 128 - rc if rc < 0 else rc
    stop_tree()
    return 143


if __name__ == "__main__":
    sys.exit(main())
