#!/usr/bin/env python
"""What a run that does not name ``length_surge`` pays for the installed plugin: verl's own step
functions, wrapped (plugin installed) vs verl's originals, side by side in one process.

Not a timed test: a benchmark that prints ratios (target 1.000 within the noise it also prints).
The two variants alternate call by call (A B, B A, A B ...) on the same inputs, so drift of the
machine and the order within a pair hit both alike; the ratio is median(wrapped) / median(original).

- ``rollout_correction``: verl's ``compute_rollout_correction_and_add_to_batch`` (the driver's
  rollout correction) on a ``DataProto`` of 512 x 8192 tokens (``--quick``: 64 x 1024) with
  ``rollout_is=token``, and with ``rollout_rs=token_k3`` as well (where the plugin would measure
  the pre-rejection mismatch in a ``length_surge`` run).
- ``actor_update``: ``ActorRolloutRefWorker.update_actor`` (verl's ``TrainingWorker.train_mini_batch``
  inside) on verl's real FSDP2 CPU engine with ``lr_scheduler_type=constant``, a tiny Qwen2
  (``tests/engine_harness.py`` builds it and the batch as verl's V0 trainer sends it).

Usage::

    python scripts/bench_stock.py            # full shapes (~2 min on 2 CPU cores)
    python scripts/bench_stock.py --quick    # small shapes (~30 s)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def side_by_side(run_a, run_b, repeats: int) -> tuple:
    """Medians (s) of ``run_a`` and ``run_b`` called alternately, and the spread of the ratio.

    The spread is half the inter-quartile range of the per-pair ratios b/a: the noise the
    ratio of the medians should be read against.
    """
    run_a(), run_b()  # warm-up
    a, b = [], []
    for i in range(repeats):  # A B, then B A: who runs first (allocator, caches) alternates too
        pair = ((run_a, a), (run_b, b)) if i % 2 == 0 else ((run_b, b), (run_a, a))
        for fn, out in pair:
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    ratios = sorted(y / x for x, y in zip(a, b))
    q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
    return statistics.median(a), statistics.median(b), (q3 - q1) / 2


def bench_rollout_correction(quick: bool, repeats: int) -> list:
    import torch

    from verl import DataProto
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.trainer.ppo import rollout_corr_helper

    wrapped = rollout_corr_helper.compute_rollout_correction_and_add_to_batch
    original = getattr(wrapped, "_lrstab_original", None)
    if original is None:
        raise SystemExit("the plugin is not installed in this process (is verl-lrstab installed?)")
    n, t = (64, 1024) if quick else (512, 8192)
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(n, t, generator=gen)
    tensors = {"old_log_probs": old, "rollout_log_probs": old + 0.01 * torch.randn(n, t, generator=gen),
               "response_mask": torch.ones(n, t, dtype=torch.int64)}
    rows = []
    for label, config in (("rollout_is=token", RolloutCorrectionConfig(rollout_is="token")),
                          ("rollout_is=token, rollout_rs=token_k3",
                           RolloutCorrectionConfig(rollout_is="token", rollout_rs="token_k3", rollout_rs_threshold=1.0))):
        def call(fn, config=config):
            fn(DataProto.from_dict(tensors=dict(tensors)), config)

        a, b, noise = side_by_side(lambda: call(original), lambda: call(wrapped), repeats)
        rows.append((f"rollout correction {n}x{t}, {label}", a, b, noise))
    return rows


def bench_actor_update(quick: bool, repeats: int) -> list:
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("VERL_PLATFORM", "cpu")):
        os.environ.setdefault(key, value)
    import engine_harness as h

    os.environ.setdefault("MASTER_PORT", str(h.free_port()))
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    import torch

    torch.set_num_threads(1)
    import verl_lrstab_cpu.platform  # noqa: F401 - verl's "cpu" platform
    from verl.workers import engine_workers

    wrapped = engine_workers.TrainingWorker.train_mini_batch
    original = getattr(wrapped, "_lrstab_original", None)
    if original is None:
        raise SystemExit("the plugin is not installed in this process (is verl-lrstab installed?)")
    model = h.build_tiny_model(Path(tempfile.mkdtemp(prefix="lrstab-bench-")) / "model")
    worker = h.make_actor_worker(h.actor_rollout_ref_config(model, "constant", 1))
    lengths = list(h.BASE_LENGTHS)

    def update(fn):
        engine_workers.TrainingWorker.train_mini_batch = fn
        try:
            batch, _ = h.make_actor_batch(lengths, seed=0, world_size=1)
            worker.update_actor(batch)
        finally:
            engine_workers.TrainingWorker.train_mini_batch = wrapped

    a, b, noise = side_by_side(lambda: update(original), lambda: update(wrapped), repeats)
    torch.distributed.destroy_process_group()
    return [("actor update (FSDP2 CPU engine, constant LR)", a, b, noise)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shapes, fewer repeats")
    p.add_argument("--repeats", type=int, default=None, help="pairs per measurement (default 20, --quick 8)")
    p.add_argument("--sections", default="rollout_correction,actor_update")
    args = p.parse_args(argv)
    repeats = args.repeats or (8 if args.quick else 20)
    rows = []
    for section in args.sections.split(","):
        rows += {"rollout_correction": bench_rollout_correction, "actor_update": bench_actor_update}[section](
            args.quick, repeats)
    print(f"\n{'verl function (a run that does not name length_surge)':64s} {'verl ms':>9s} {'plugin ms':>9s} "
          f"{'ratio':>7s} {'± noise':>8s}")
    for name, a, b, noise in rows:
        print(f"{name:64s} {1e3 * a:9.2f} {1e3 * b:9.2f} {b / a:7.3f} {noise:8.3f}")
    print(f"(median of {repeats} alternating pairs; ratio = plugin / verl; noise = half the IQR of the pair ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
