"""A stand-in for verl's ``main_ppo`` (tests of ``lrstab guard``): verl's file-logger lines and checkpoint layout.

Run as ``tests/standin/python -m verl.trainer.main_ppo <verl overrides>`` (the wrapper ignores the
``-m``). It reads the overrides verl would (total steps, save_freq, default_local_dir, resume_mode,
resume_from_path, optim.lr, length_surge.decay_from_step/decay_period), resumes as verl 0.9.1 does
(``auto``: the tracker; ``resume_path``: the folder; the dataloader position from ``data.pt``) with
verl's output around the load (``Load from checkpoint folder: ...`` before, tqdm's ``Training
Progress`` after),
and per step appends ``{"step": N, "data": {...}}`` to ``$VERL_FILE_LOGGER_PATH`` and saves a
checkpoint every save_freq steps in verl's order: every rank's actor shards and fsdp_config.json,
then data.pt, then the tracker (each shard's text, and data.pt's ``written_by``, name the launch and
the step that wrote it: a checkpoint rewritten by a later launch shows). Its LR is its own implementation of the documented rule (the
trainer's side, independent of the package). What goes wrong is scripted by ``$STANDIN_SCRIPT``
(JSON): ``nan_batches`` (batch indices whose grad norm is NaN), ``nan_at`` ({launch: [steps]} with a NaN grad norm), ``crash_at`` ({launch: step}: exit
1 before that step), ``fail_resume`` (checkpoint steps that fail to load, with a traceback through
``_load_checkpoint``; with ``fail_log``, that file's text instead: verl's own output, recorded), ``die_loading`` (checkpoint steps whose load is killed: SIGKILL, no traceback), ``partial_save_at``
({launch: step}: die after rank 0's shard of that step), ``score`` ("pm1": a +-1 reward whose
accuracy falls from 0.44 to 0.05 from step 10), ``surge_at`` (a length surge from that step),
``hang_at`` ({launch: step}: sleep after that step: for kill tests), ``daemon`` (start a "Ray daemon" in its own session),
``fill_at`` ({launch: [step, folder]}: after that step, fill the folder's file system: a disk that fills up),
``fill_run_dir_at`` ({launch: step}: the same for the folder of the metrics file), ``pad_checkpoints`` (bytes of padding in each checkpoint), ``junk_at`` ({launch: step}:
four lines after that step's that are JSON but not verl's shape). Each launch records, in
``alive_at_launch_K.txt`` beside the counter, which pids of ``$STANDIN_PIDS`` were alive as it started. For ``lrstab admit``: ``$STANDIN_K3`` (the per-step
k3, comma-separated), ``$STANDIN_TAIL`` (the shares of tokens over each ``|d|`` edge, 1e-6 to 1,
comma-separated: the figure's data), ``$STANDIN_FAIL`` (fail with that error), ``$STANDIN_HANG`` (hang after step 1).
"""

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

WORLD = 2


SUPPORTED_LOGGERS = ("wandb", "mlflow", "swanlab", "vemlp_wandb", "tensorboard", "console", "clearml", "trackio",
                     "file")  # verl 0.9.1's Tracking.supported_backend


def overrides(argv):
    """The overrides as verl reads them: Hydra's own parser (quotes and escapes undone); a value Hydra
    refuses fails the launch as verl's Hydra main would."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([a for a in argv if "=" in a and not a.startswith("-")])
    out = {}
    for ov in parsed:
        value = ov.value()
        out[ov.key_or_group] = value if isinstance(value, (str, list)) else str(value).lower() \
            if isinstance(value, bool) else str(value)
    return out


def tracking_backends(value):
    """verl's Tracking: a string is one backend; each must be one it supports (else an AssertionError)."""
    backends = [value] if isinstance(value, str) else list(value)
    for backend in backends:
        assert backend in SUPPORTED_LOGGERS, f"{backend} is not supported"
    return backends


def scale(update, start, period):
    if start is None:
        return 1.0
    n = 0 if update <= start else 1 + (update - start - 1) // period
    return 1.0 if n == 0 else max(0.1, 0.5 ** n)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def fill(folder: Path) -> None:
    """Write ``folder/filler-*.bin`` until the file system is full (ENOSPC)."""
    for i in range(10**6):
        try:
            with open(folder / f"filler-{i}.bin", "wb") as f:
                f.write(b"\0" * 65536)
        except OSError:
            break
    try:  # and the last partial pages
        with open(folder / "filler-tail.bin", "wb") as f:
            while True:
                f.write(b"\0" * 512)
                f.flush()
    except OSError:
        pass


def main():
    o = overrides(sys.argv[1:])
    script = json.loads(Path(os.environ["STANDIN_SCRIPT"]).read_text()) if os.environ.get("STANDIN_SCRIPT") else {}
    counter = Path(os.environ.get("STANDIN_COUNTER", "standin_launches.txt"))
    launch = int(counter.read_text()) + 1 if counter.exists() else 1
    # atomic, so a test polling the counter never reads it half-written (empty)
    tmp = counter.with_name(counter.name + f".{os.getpid()}.tmp")
    tmp.write_text(str(launch))
    os.replace(tmp, counter)
    if os.environ.get("STANDIN_PIDS"):
        earlier = Path(os.environ["STANDIN_PIDS"])
        # which processes of the earlier launches are still alive as this one starts
        alive = [int(p) for p in (earlier.read_text().split() if earlier.exists() else []) if _alive(int(p))]
        counter.with_name(f"alive_at_launch_{launch}.txt").write_text(json.dumps(alive))
        with open(os.environ["STANDIN_PIDS"], "a") as f:
            f.write(f"{os.getpid()}\n")
    if script.get("daemon"):
        d = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        with open(os.environ["STANDIN_PIDS"], "a") as f:
            f.write(f"{d.pid}\n")
    if os.environ.get("STANDIN_FAIL"):  # lrstab admit's failing candidate
        print(f"ValueError: {os.environ['STANDIN_FAIL']}", file=sys.stderr, flush=True)
        return 1
    k3 = [float(v) for v in os.environ["STANDIN_K3"].split(",")] if os.environ.get("STANDIN_K3") else None
    tracking_backends(o.get("trainer.logger", ["console", "wandb"]))
    total, save_freq = int(o["trainer.total_training_steps"]), int(o.get("trainer.save_freq", -1))
    ckdir = Path(o.get("trainer.default_local_dir", "checkpoints"))
    lr0 = float(o.get("actor_rollout_ref.actor.optim.lr", 1e-3))
    key = "actor_rollout_ref.actor.optim.length_surge."
    start = int(o[key + "decay_from_step"]) if key + "decay_from_step" in o else None
    period = int(o[key + "decay_period"]) if key + "decay_period" in o else None
    mode = o.get("trainer.resume_mode", "auto")
    step0, batch0 = 0, 0
    folder = None
    if mode == "auto" and (ckdir / "latest_checkpointed_iteration.txt").exists():
        folder = ckdir / f"global_step_{int((ckdir / 'latest_checkpointed_iteration.txt').read_text())}"
    elif mode == "resume_path":
        folder = Path(o["trainer.resume_from_path"])
    if folder is not None:
        # what verl 0.9.1's RayPPOTrainer._load_checkpoint prints before it loads
        print(f"Load from checkpoint folder: {folder}", flush=True)
        step0 = int(re.search(r"global_step_(\d+)", str(folder)).group(1))
        print(f"Setting global step to {step0}\nResuming from {folder}", flush=True)
        if step0 in script.get("fail_resume", []) and script.get("fail_log"):  # what verl printed, recorded
            print(Path(script["fail_log"]).read_text(), flush=True)
            return 1
        if step0 in script.get("fail_resume", []):  # a worker's load_checkpoint raises, as Ray reports it
            print("Traceback (most recent call last):\n  File \"verl/trainer/ppo/ray_trainer.py\", line 1091, in "
                  "_load_checkpoint\n    self.actor_rollout_wg.load_checkpoint(\nray.exceptions.RayTaskError: "
                  f"RuntimeError: cannot load {folder}", file=sys.stderr, flush=True)
            return 1
        if step0 in script.get("die_loading", []):  # killed while loading (the OOM killer): no traceback
            os.kill(os.getpid(), 9)
        state = torch.load(folder / "data.pt", weights_only=False)
        batch0 = state["_num_yielded"]
    # fit() after the load: tqdm's bar on stderr
    print(f"Training Progress:   0%|          | {step0}/{total}", file=sys.stderr, flush=True)
    log = open(os.environ["VERL_FILE_LOGGER_PATH"], "a")
    for step in range(step0 + 1, total + 1):
        if script.get("crash_at", {}).get(str(launch)) == step:
            print("torch.OutOfMemoryError: stand-in crash", file=sys.stderr)
            return 1
        batch = batch0 + step - step0 - 1
        s = scale(step, start, period)
        length = 100.0 + (0.0 if step < script.get("surge_at", 10**9) else 40.0 * (step - script["surge_at"] + 1))
        if script.get("score") == "pm1":
            acc = 0.44 if step < 10 else 0.05
            score, low = 2 * acc - 1, -1.0
        else:
            score, low = 0.5, 0.0
        data = {"response_length/mean": length, "critic/score/mean": score, "critic/score/min": low,
                "actor/grad_norm": math.nan if batch in script.get("nan_batches", [])
                or step in script.get("nan_at", {}).get(str(launch), []) else 1.0,
                "actor/lr": lr0 * s, "data/batch_index": batch, "actor/lrstab/lr_scale": s}
        if k3 is not None:
            data["actor/mismatch/k3"] = k3[(step - 1) % len(k3)]
        if os.environ.get("STANDIN_TAIL"):
            shares = [float(v) for v in os.environ["STANDIN_TAIL"].split(",")]
            data["actor/mismatch/n_tokens"] = 100
            data.update({f"actor/mismatch/frac_over_{label}": share
                         for label, share in zip(("1e-6", "1e-5", "1e-4", "1e-3", "1e-2", "0.1", "1"), shares)})
        log.write(json.dumps({"step": step, "data": data}) + "\n")
        if script.get("junk_at", {}).get(str(launch)) == step:  # valid JSON, not verl's shape
            log.write('{"step": 5, "data": 0}\n[1, 2]\n{"data": {}}\n{"step": 1e400, "data": {}}\n')
        log.flush()
        if save_freq > 0 and step % save_freq == 0:
            actor = ckdir / f"global_step_{step}" / "actor"
            actor.mkdir(parents=True, exist_ok=True)
            for rank in range(WORLD):
                for prefix in ("model", "optim", "extra_state"):  # which launch wrote it: a rewrite shows
                    (actor / f"{prefix}_world_size_{WORLD}_rank_{rank}.pt").write_text(f"launch {launch} step {step}")
                if script.get("partial_save_at", {}).get(str(launch)) == step:
                    os._exit(1)
            if script.get("pad_checkpoints"):  # a checkpoint of that many bytes more
                (actor / "pad.bin").write_bytes(b"\0" * script["pad_checkpoints"])
            (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 1, "world_size": WORLD}))
            torch.save({"_num_yielded": batch + 1, "_sampler_iter_yielded": batch + 1,
                        "_sampler_iter_state": {"samples_yielded": 4 * (batch + 1)}, "written_by": [launch, step]},
                       actor.parent / "data.pt")
            (ckdir / "latest_checkpointed_iteration.txt").write_text(str(step))
        for key, where in (("fill_at", None), ("fill_run_dir_at", Path(os.environ["VERL_FILE_LOGGER_PATH"]).parent)):
            at = script.get(key, {}).get(str(launch))
            if at is not None and (at if where is not None else at[0]) == step:
                fill(where if where is not None else Path(at[1]))
        time.sleep(float(os.environ.get("STANDIN_STEP_S", "0.02")))
        if script.get("hang_at", {}).get(str(launch)) == step or os.environ.get("STANDIN_HANG"):
            time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
