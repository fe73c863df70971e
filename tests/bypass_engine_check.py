"""Bypass mode on verl's real actor worker (FSDP2 engine, ``ppo_loss``), one process per DP rank, no Ray.

Used by ``tests/e2e/test_bypass_e2e.py``. Built on ``tests/engine_harness.py`` (verl's Hydra
config, ``ActorRolloutRefWorker.init_model``, the V0 trainer's batch layout; 8 rows per rank,
2 mini-batches of 4, micro-batches of 2, no shuffling). Per update: verl's own
``compute_log_prob`` gives the trainer's log-probs L with the pre-update weights; the
"rollout" log-probs are L + noise; the batch is handed to ``update_actor`` as bypass mode
does (``old_log_probs`` = ``rollout_log_probs``). The record holds the logged figures and the
expected ones: :func:`verl_lrstab.mismatch.compute_stats` of L vs rollout over this rank's
first mini-batch (rows 0-3), to be summed over the ranks by the test.

Usage (env ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)::

    python tests/bypass_engine_check.py --model DIR --out rank.json --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import engine_harness as h  # noqa: E402

NOISE = 0.05
FIRST_MINI_BATCH = h.ROWS_PER_RANK // h.MINI_BATCHES  # rows of a rank's first mini-batch


def trainer_log_probs(worker, batch):
    """verl's ``compute_log_prob`` (eval forward, pre-update weights) as a padded ``(bs, R)`` tensor."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    infer = batch.clone()
    tu.assign_non_tensor(infer, calculate_entropy=False, compute_loss=False, temperature=1.0)
    output = worker.compute_log_prob(infer)
    return no_padding_2_padding(tu.get(output, "log_probs"), batch)


def as_bypass_batch(batch, rollout):
    """``batch`` with ``rollout_log_probs`` = ``old_log_probs`` = ``rollout`` (V0 layout: padded ``(bs, R)``)."""
    batch["rollout_log_probs"] = rollout.clone()
    batch["old_log_probs"] = rollout.clone()
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("VERL_PLATFORM", "cpu")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(h.free_port()))
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    import torch

    torch.set_num_threads(1)
    import verl_lrstab_cpu.platform  # noqa: F401 - registers verl's "cpu" platform
    from verl.utils import tensordict_utils as tu

    from verl_lrstab import mismatch
    from verl_lrstab.glue.steps import STEP_POSITION_KEY

    if not Path(args.model, "config.json").exists():
        h.build_tiny_model(args.model)
    worker = h.make_actor_worker(h.actor_rollout_ref_config(args.model, "length_surge", world_size, True))
    scheduler = worker.actor.engine.lr_scheduler
    records = []
    for step in range(1, args.steps + 1):
        lengths = h.response_lengths_at(step, rank, world_size)
        batch, _ = h.make_actor_batch(lengths, seed=1000 * step + rank, world_size=world_size)
        trainer = trainer_log_probs(worker, batch)
        gen = torch.Generator().manual_seed(7 * step + rank)
        mask = (torch.arange(trainer.shape[1])[None] < torch.tensor(lengths)[:, None]).long()
        rollout = trainer + NOISE * torch.randn(trainer.shape, generator=gen) * mask
        # the V0 driver glue's tag (RayPPOTrainer._update_actor: one update per trainer step, sync)
        tu.assign_non_tensor_data(batch, STEP_POSITION_KEY, [0, 1, 0])
        first = slice(0, FIRST_MINI_BATCH)
        expected = mismatch.compute_stats(trainer[first], rollout[first], mask[first])
        whole = mismatch.compute_stats(trainer, rollout, mask)
        output = worker.update_actor(as_bypass_batch(batch, rollout))
        metrics = tu.get(output, "metrics") if output is not None else {}
        trig = scheduler.schedule.mismatch_trigger
        records.append({
            "step": step,
            "logged": {k: (v[0] if isinstance(v, list) else v) for k, v in metrics.items()
                       if k.startswith(("mismatch/", "lrstab/"))},
            "ppo_kl": [float(v) for v in metrics.get("actor/ppo_kl", [])],
            "expected_first_stats": expected.tolist(),
            "whole_batch_stats": whole.tolist(),
            "trigger": {"fired_step": trig.fired_step, "num_skipped": trig.num_skipped, "last_step": trig.last_step},
        })
    Path(args.out).write_text(json.dumps({"rank": rank, "world_size": world_size, "records": records}, indent=1))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
