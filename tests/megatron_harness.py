"""Drive verl's real actor worker on its Megatron engine on CPU (one process, no Ray).

The Megatron counterpart of ``tests/engine_harness.py`` (same tiny Qwen2, same batches, same
surge scenario), used by ``tests/test_megatron_worker.py``. Real: verl's ``ppo_megatron_trainer``
config, ``ActorRolloutRefWorker(role="actor")`` with ``init_model`` (``TrainingWorker``,
``MegatronEngine``: mbridge's vanilla bridge, megatron-core's GPTModel, DDP, optimizer and our
scheduler through the plugin), ``update_actor``, and ``save_checkpoint`` / ``load_checkpoint``
through ``MegatronCheckpointManager``'s dist-checkpoint. Test-only: the CUDA stand-ins of
``tests/megatron_cpu.py`` (megatron-core has no CPU mode).

    python tests/megatron_harness.py --model DIR --out run.json --steps 12 [--scheduler constant]
        [--save-at 8 --ckpt DIR] [--first 9 --resume-from DIR]

The JSON holds ``describe`` (engine, optimizer, scheduler, wraps) and one record per actor
update (:func:`engine_harness.run_steps`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine_harness as eh  # noqa: E402


def actor_rollout_ref_config(model_path: str, scheduler: str, total_steps: int, options=()):
    """verl's ``ppo_megatron_trainer`` ``actor_rollout_ref`` node with the CPU overrides."""
    from hydra import compose, initialize_config_module

    a = "actor_rollout_ref"
    overrides = [
        f"{a}.model.path={model_path}",
        f"{a}.model.use_remove_padding=False",
        f"{a}.actor.ppo_mini_batch_size={eh.mini_batch_size(1)}",
        f"{a}.actor.ppo_micro_batch_size_per_gpu={eh.MICRO_BATCH}",
        f"{a}.actor.shuffle=False",
        f"{a}.rollout.log_prob_micro_batch_size_per_gpu={eh.MICRO_BATCH}",
        f"{a}.actor.use_kl_loss=False",
        f"{a}.actor.optim.lr={eh.LR}",
        f"{a}.actor.optim.lr_warmup_steps={eh.WARMUP_STEPS}",
        f"{a}.actor.optim.total_training_steps={total_steps}",
        # the mbridge package (megatron-bridge 0.5.2, verl's default, is not on PyPI)
        f"{a}.actor.megatron.vanilla_mbridge=True",
        f"{a}.actor.megatron.sequence_parallel=False",
        # docs/megatron.md: the DistributedOptimizer's resume needs TE/Apex (torch's AdamW path asserts)
        f"{a}.actor.megatron.use_distributed_optimizer=False",
        f"+{a}.actor.megatron.override_transformer_config.masked_softmax_fusion=False",
        f"+{a}.actor.megatron.override_transformer_config.hidden_dropout=0.0",
        f"+{a}.actor.megatron.override_transformer_config.attention_dropout=0.0",
    ]
    if scheduler == "length_surge":
        overrides.append(f"{a}.actor.optim.lr_decay_style=length_surge")
        overrides += [f"+{a}.actor.optim.length_surge.{k}={v}" for k, v in eh.SURGE_OPTIONS.items()]
        overrides += [f"++{a}.actor.optim.length_surge.{o}" for o in options]  # KEY=VALUE (lrstab guard's form)
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_megatron_trainer", overrides=overrides).actor_rollout_ref


def describe(worker) -> dict:
    from verl.workers.engine.megatron import transformer_impl

    engine = worker.actor.engine
    sched = engine.lr_scheduler
    return {
        "engine_class": f"{type(engine).__module__}.{type(engine).__qualname__}",
        "is_megatron_engine": isinstance(engine, transformer_impl.MegatronEngine),
        "optimizer_class": type(engine.optimizer).__name__,
        "optimizer_config_class": type(engine.optimizer_config).__name__,
        "use_checkpoint_opt_param_scheduler": engine.optimizer_config.use_checkpoint_opt_param_scheduler,
        "scheduler_class": f"{type(sched).__module__}.{type(sched).__qualname__}",
        "scheduler_mro": [f"{c.__module__}.{c.__qualname__}" for c in type(sched).__mro__],
        "engine_wrapped": getattr(transformer_impl.MegatronEngine._build_lr_scheduler, "_lrstab_original", None) is not None,
        "param_groups": [{k: v for k, v in g.items() if k in ("wd_mult", "max_lr", "weight_decay")}
                         for g in engine.optimizer.param_groups],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--scheduler", default="length_surge", choices=["length_surge", "constant"])
    parser.add_argument("--first", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12, help="last update")
    parser.add_argument("--save-at", type=int, default=None)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--resume-from", default=None)
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a length_surge option over SURGE_OPTIONS (repeatable), as lrstab guard passes them")
    args = parser.parse_args(argv)
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                       ("VERL_PLATFORM", "cpu")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(eh.free_port()))
    import torch

    import verl_lrstab_cpu.platform  # noqa: F401 - registers verl's "cpu" platform (gloo)
    from megatron_cpu import verl_megatron_on_cpu

    torch.manual_seed(0)
    torch.set_num_threads(1)  # the same arithmetic in every process (resume compares losses)
    config = actor_rollout_ref_config(args.model, args.scheduler, total_steps=20, options=args.option)
    result = {}
    tag = {"tag_steps": args.scheduler == "length_surge"}  # the driver glue tags a length_surge run's batches
    with verl_megatron_on_cpu():
        worker = eh.make_actor_worker(config)
        result["describe"] = describe(worker)
        sched = worker.actor.engine.lr_scheduler
        if not hasattr(sched, "get_last_lr"):  # megatron-core's stock scheduler: what run_steps records
            sched.get_last_lr = lambda: [g["lr"] for g in worker.actor.engine.optimizer.param_groups]
        if args.resume_from:
            worker.load_checkpoint(args.resume_from)
            result["resumed_lr"] = worker.actor.engine.optimizer.param_groups[0]["lr"]
        if args.save_at:  # as verl's trainer: save after update save_at, go on
            result["records"] = eh.run_steps(worker, args.first, args.save_at, 0, 1, **tag)
            worker.save_checkpoint(args.ckpt, global_step=args.save_at)
            result["checkpoint_files"] = sorted(str(p.relative_to(args.ckpt)) for p in Path(args.ckpt).rglob("*")
                                                if p.is_file())
            result["records"] += eh.run_steps(worker, args.save_at + 1, args.steps, 0, 1, **tag)
        else:
            result["records"] = eh.run_steps(worker, args.first, args.steps, 0, 1, **tag)
    Path(args.out).write_text(json.dumps(result, default=str))


if __name__ == "__main__":  # spawned helpers of dist_checkpointing re-import the main module: keep this guard
    import warnings

    warnings.simplefilter("ignore")
    main()
