"""Fixtures shared by several test files."""

import subprocess

import pytest


@pytest.fixture
def small_fs(tmp_path):
    """``small_fs(name)``: a 2 MB tmpfs mounted at ``tmp_path/name`` (a real file system that fills up
    or turns read-only; needs root, as CI runs)."""
    mounts = []

    def mount(name, size="2m"):
        folder = tmp_path / name
        folder.mkdir()
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"needs a small tmpfs (mount -t tmpfs, as root): {res.stderr.strip()}")
        mounts.append(folder)
        return folder

    yield mount
    for folder in reversed(mounts):
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@pytest.fixture
def length_surge_trainer(monkeypatch):
    """A V0 trainer object of verl's class whose length_surge run checks ran (as the glue records them), alive
    while the test holds it; no other length_surge trainer is known to the process meanwhile."""
    import weakref

    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from verl_lrstab.glue import driver

    class Trainer(RayPPOTrainer):
        def __init__(self):  # verl's own __init__ needs workers
            pass

    trainer = Trainer()
    monkeypatch.setattr(driver, "_checked", weakref.WeakKeyDictionary({trainer: False}))
    return trainer
