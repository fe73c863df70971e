"""Drive verl's real actor worker (FSDP2 engine, ``ppo_loss``) on CPU without Ray.

Used by ``tests/test_engine.py``, one process per scenario: verl's process group, its
platform singleton and the plugin's import hooks are process-global, so a fresh
engine in a fresh process is the only honest "resume" and the only clean "stock" run.

What is real here: verl's Hydra ``ppo_trainer`` config, ``ActorRolloutRefWorker``
(role ``actor``) with its ``init_model`` (``TrainingWorker``, ``FSDPEngine`` with the
FSDP2 strategy, ``partial(ppo_loss, config=actor_config)``), ``update_actor`` on a batch
in the layout verl's V0 trainer sends (``RayPPOTrainer._update_actor``: ``DataProto``
-> ``to_tensordict`` -> ``left_right_2_no_padding`` -> the same non-tensor keys), and
``save_checkpoint`` / ``load_checkpoint`` through ``FSDPCheckpointManager``. What is
made up: a tiny random Qwen2 model with a byte-level tokenizer, and the rollout data
(response lengths chosen per step, random advantages).

Usage (env: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; defaults: one rank)::

    python tests/engine_harness.py --model DIR --out run.json --steps 12 [--scheduler constant]
        [--save-at 8 --ckpt DIR] [--first 9 --resume-from DIR] [--no-plugin]

The JSON holds one record per actor update (see :func:`run_steps`) and a header
describing the engine, the scheduler and the wrappers found.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

# -- the scenario shared by the tests (tests/test_engine.py reads these) --------------------------
LR = 1e-3
WARMUP_STEPS = 2
# Small windows so that a surge shows within ~10 updates (the defaults need ~40).
SURGE_OPTIONS = {
    "detector": "ratio",  # the level-vs-baseline rule, whose small windows give a surge at a known update
    "skip_first_steps": 2,
    "fast_window": 2,
    "horizon": 4,
    "baseline_window": 2,
    "patience": 2,
    "ratio_threshold": 1.5,
    "period_factor": 1.25,
    "gamma": 0.5,
    "min_lr_ratio": 0.3,  # reached at the second halving (0.25 < 0.3)
    "origin": "start",  # the paper's form, written out in test_engine.expected_lr (the default halves at the surge)
}
ROWS_PER_RANK = 8
MINI_BATCHES = 2  # optimizer steps per actor update: the signal must cover the whole batch
MICRO_BATCH = 2
PROMPT_WIDTH = 6
RESPONSE_WIDTH = 24
SURGE_ONSET = 7  # first update whose batch is long
SURGE_FACTOR = 3
# --mismatch: rollout log-probs differ from old_log_probs; the decay starts on the mismatch
# (fixed budget far below it: fires after skip_first_steps + patience valid steps).
MISMATCH_OPTIONS = {"trigger": "mismatch", "mismatch_budget": 1e-9}
ROLLOUT_NOISE = 0.05
# Uneven on purpose: the first mini-batch (rows 0-3) averages 3, the whole batch 4.
BASE_LENGTHS = (2, 3, 4, 3, 5, 6, 4, 5)


def response_lengths_at(step: int, rank: int, world_size: int) -> list[int]:
    """Per-sample response lengths of ``rank``'s local batch at update ``step`` (1-based).

    Only the last rank's batches grow (x ``SURGE_FACTOR`` from ``SURGE_ONSET``): with DP=2
    rank 0 alone never surges, so only a global mean keeps the ranks in step.
    """
    grows = rank == world_size - 1 and step >= SURGE_ONSET
    return [n * SURGE_FACTOR if grows else n for n in BASE_LENGTHS]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- assets -----------------------------------------------------------------------------------------
def build_tiny_model(path: str | os.PathLike) -> str:
    """Save a random Qwen2 (hidden 32, 2 layers, ~27k parameters) and a byte-level tokenizer.

    Args:
        path: output directory (created).

    Returns:
        ``path`` as a string, loadable by verl's ``HFModelConfig``.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # 256 byte symbols, no merges: nothing to train, and any text encodes.
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>").save_pretrained(path)
    config = Qwen2Config(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"],
    )
    with torch.random.fork_rng():  # leave the caller's RNG alone
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


# -- verl objects -------------------------------------------------------------------------------------
def actor_rollout_ref_config(model_path: str, scheduler: str, world_size: int, mismatch_trigger: bool = False):
    """verl's Hydra ``ppo_trainer`` config, ``actor_rollout_ref`` node, with the CPU overrides.

    Args:
        model_path: the tiny model's directory.
        scheduler: ``optim.lr_scheduler_type`` (``length_surge`` adds :data:`SURGE_OPTIONS`).
        world_size: data-parallel size (sets the mini-batch size).
        mismatch_trigger: add :data:`MISMATCH_OPTIONS` (the decay is started by the mismatch).
    """
    from hydra import compose, initialize_config_module

    a = "actor_rollout_ref"
    overrides = [
        f"{a}.model.path={model_path}",
        # as configs/cpu_demo.yaml: no flash-attn on CPU, FSDP2 (FSDP1 needs GPU tensors), float32, no torch.compile
        f"{a}.model.use_remove_padding=False",
        f"+{a}.model.override_config.attn_implementation=sdpa",
        f"{a}.model.enable_gradient_checkpointing=False",
        f"{a}.actor.strategy=fsdp2",
        f"{a}.actor.fsdp_config.dtype=float32",
        f"{a}.actor.use_torch_compile=False",
        f"{a}.actor.ppo_mini_batch_size={mini_batch_size(world_size)}",
        f"{a}.actor.ppo_micro_batch_size_per_gpu={MICRO_BATCH}",
        f"{a}.actor.shuffle=False",
        f"{a}.rollout.log_prob_micro_batch_size_per_gpu={MICRO_BATCH}",
        f"{a}.actor.use_kl_loss=False",
        f"{a}.actor.optim.lr={LR}",
        f"{a}.actor.optim.lr_warmup_steps={WARMUP_STEPS}",
        f"{a}.actor.optim.lr_scheduler_type={scheduler}",
    ]
    if scheduler == "length_surge":
        options = {**SURGE_OPTIONS, **(MISMATCH_OPTIONS if mismatch_trigger else {})}
        overrides += [f"+{a}.actor.optim.length_surge.{k}={v}" for k, v in options.items()]
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides).actor_rollout_ref


def mini_batch_size(world_size: int) -> int:
    """Global mini-batch size (verl's ``ppo_mini_batch_size * rollout.n``, n = 1 here)."""
    return ROWS_PER_RANK * world_size // MINI_BATCHES


def make_actor_worker(config):
    """``ActorRolloutRefWorker(role="actor")`` after ``init_model``, as verl's trainer builds it."""
    from verl.workers.engine_workers import ActorRolloutRefWorker

    worker = ActorRolloutRefWorker(config, role="actor")
    worker.init_model()
    return worker


def make_actor_batch(lengths: list[int], seed: int, world_size: int, rollout_log_probs: bool = False,
                     step_position: list | None = None):
    """One rank's ``update_actor`` input, built the way ``RayPPOTrainer._update_actor`` builds it.

    Args:
        lengths: per-sample response lengths (right padding to :data:`RESPONSE_WIDTH`).
        seed: seeds tokens, prompt padding and advantages.
        world_size: data-parallel size (verl's ``mini_batch_size`` is global).
        rollout_log_probs: add the rollout engine's log-probs (old_log_probs + noise).
        step_position: the trainer-step tag ``[index, count, is_async]`` the V0 driver glue puts
            in ``meta_info`` for a ``length_surge`` run (``verl_lrstab.glue.driver``); None: untagged.

    Returns:
        ``(tensordict, logged_mean)``: the batch, and the ``response_length/mean`` verl's
        ``compute_data_metrics`` logs for it (the figure the scheduler must be fed).
    """
    import torch

    from verl import DataProto
    from verl.trainer.ppo.metric_utils import compute_data_metrics
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    tag = {}
    if step_position is not None:
        from verl_lrstab.glue.steps import STEP_POSITION_KEY

        tag = {STEP_POSITION_KEY: list(step_position)}
    gen = torch.Generator().manual_seed(seed)
    rows, width = len(lengths), RESPONSE_WIDTH
    prompts = torch.randint(0, 256, (rows, PROMPT_WIDTH), generator=gen)
    responses = torch.randint(0, 256, (rows, width), generator=gen)
    prompt_len = torch.randint(3, PROMPT_WIDTH + 1, (rows,), generator=gen)
    prompt_mask = (torch.arange(PROMPT_WIDTH)[None] >= (PROMPT_WIDTH - prompt_len)[:, None]).long()  # left pad
    response_mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()  # right pad
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    advantages = torch.randn(rows, width, generator=gen) * response_mask
    scores = torch.zeros(rows, width)
    scores[torch.arange(rows), torch.tensor(lengths) - 1] = advantages[:, 0]  # outcome reward on the last token
    batch = DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask.clone(),
            "old_log_probs": torch.full((rows, width), -5.5),
            "advantages": advantages,
            "returns": advantages.clone(),
            "token_level_scores": scores,
            "token_level_rewards": scores.clone(),
        },
        meta_info={"multi_turn": False, "temperature": 1.0, **tag},
    )
    if rollout_log_probs:
        noise = ROLLOUT_NOISE * torch.randn(rows, width, generator=gen)
        batch.batch["rollout_log_probs"] = batch.batch["old_log_probs"] + noise * response_mask
    logged_mean = compute_data_metrics(batch, use_critic=False)["response_length/mean"]
    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(
        td,
        calculate_entropy=False,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=mini_batch_size(world_size),
        mini_batch_size=mini_batch_size(world_size),
        epochs=1,
        seed=42,
        dataloader_kwargs={"shuffle": False},
        compute_loss=True,
    )
    return td, logged_mean


def _plain(value):
    """Metric values as JSON-able Python numbers."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item"):
        return value.item()
    return value


def run_steps(worker, first: int, last: int, rank: int, world_size: int, rollout_log_probs: bool = False,
              updates_per_step: int = 1, tag_steps: bool = True) -> list[dict]:
    """Run actor updates ``first..last`` (1-based) and record what verl and the scheduler report.

    ``tag_steps``: add the trainer-step tag as verl's driver glue does for a ``length_surge`` run
    (V0: ``[0, 1, 0]`` in ``meta_info``; with ``updates_per_step > 1``, V1 ``separate_async``:
    ``[index, count, 1]`` as one ``extra_info`` value). The worker refuses an untagged batch.

    Returns:
        One dict per update: ``step``, ``lengths`` and ``logged_mean`` (this rank's batch, see
        :func:`make_actor_batch`),
        ``metrics`` (``lrstab/*``, ``lr``, ``loss``, ``grad_norm`` as verl returns them),
        ``optimizer_lr``, ``last_lr`` and ``scheduler_state`` (``state_dict()``), ``seconds``.
    """
    from verl.utils import tensordict_utils as tu

    engine = worker.actor.engine
    records = []
    for step in range(first, last + 1):
        lengths = response_lengths_at(step, rank, world_size)
        v0_tag = [0, 1, 0] if tag_steps and updates_per_step == 1 else None  # RayPPOTrainer._update_actor's glue
        batch, logged_mean = make_actor_batch(lengths, seed=1000 * step + rank, world_size=world_size,
                                              rollout_log_probs=rollout_log_probs, step_position=v0_tag)
        if tag_steps and updates_per_step > 1:  # what the V1 separate_async driver glue adds
            from verl_lrstab.glue.steps import STEP_POSITION_KEY

            # as V1 hands extra_info to the worker: one NonTensorData value (transferqueue_utils)
            tu.assign_non_tensor_data(batch, STEP_POSITION_KEY, [(step - 1) % updates_per_step, updates_per_step, 1])
        start = time.perf_counter()
        output = worker.update_actor(batch)
        seconds = time.perf_counter() - start
        metrics = tu.get(output, "metrics") if output is not None else {}
        keep = {k: _plain(v) for k, v in metrics.items()
                if k.startswith(("lrstab/", "mismatch/")) or k in ("lr", "loss", "grad_norm")}
        records.append({
            "step": step,
            "lengths": lengths,
            "logged_mean": logged_mean,
            "metrics": keep,
            "optimizer_lr": engine.optimizer.param_groups[0]["lr"],
            "last_lr": engine.lr_scheduler.get_last_lr(),
            "scheduler_state": engine.lr_scheduler.state_dict(),
            "seconds": seconds,
        })
    return records


def describe(worker) -> dict:
    """Which engine, scheduler and wrappers this process ended up with."""
    from verl.workers import engine_workers
    from verl.workers.engine.fsdp import transformer_impl

    engine = worker.actor.engine
    sched = engine.lr_scheduler
    return {
        "engine_class": f"{type(engine).__module__}.{type(engine).__qualname__}",
        "is_fsdp_engine": isinstance(engine, transformer_impl.FSDPEngine),
        "strategy": engine.engine_config.strategy,
        "optimizer_config_class": type(engine.optimizer_config).__name__,
        "scheduler_class": f"{type(sched).__module__}.{type(sched).__qualname__}",
        "scheduler_mro": [f"{c.__module__}.{c.__qualname__}" for c in type(sched).__mro__],
        "loss_fn": getattr(getattr(worker.actor.loss_fn, "func", None), "__qualname__", None),
        "loss_fn_module": getattr(getattr(worker.actor.loss_fn, "func", None), "__module__", None),
        "plugin_loaded": "verl_lrstab.glue.registry" in sys.modules,
        "worker_wrapped": getattr(engine_workers.TrainingWorker.train_mini_batch, "_lrstab_original", None) is not None,
        "engine_wrapped": getattr(transformer_impl.FSDPEngine._build_lr_scheduler, "_lrstab_original", None) is not None,
        "dp_size": engine.get_data_parallel_size(),
        "dp_rank": engine.get_data_parallel_rank(),
        "initial_lr": engine.optimizer.param_groups[0]["lr"],
    }


def checkpoint_extra_state(ckpt_dir: str, rank: int, world_size: int) -> dict:
    """What ``FSDPCheckpointManager`` wrote for the scheduler, read back as verl reads it."""
    import io

    import torch

    path = Path(ckpt_dir) / f"extra_state_world_size_{world_size}_rank_{rank}.pt"
    extra = torch.load(path, weights_only=False)  # as FSDPCheckpointManager.load_checkpoint does
    buf = io.BytesIO()
    torch.save(extra["lr_scheduler"], buf)
    buf.seek(0)
    try:  # the scheduler's part alone must pass torch's safe loader
        torch.load(buf, weights_only=True)
        safe = True
    except Exception as exc:  # noqa: BLE001 - reported to the test
        safe = repr(exc)
    return {"file": path.name, "lr_scheduler": extra["lr_scheduler"], "weights_only_ok": safe,
            "files": sorted(p.name for p in Path(ckpt_dir).iterdir())}


def _fail_mismatch_at(updates: set, first: int) -> None:
    """Make this rank's mismatch computation raise at the given updates (one rank failing alone)."""
    from verl_lrstab import mismatch

    compute_stats, calls = mismatch.compute_stats, iter(range(first, 10**6))

    def failing(*args, **kwargs):
        if next(calls) in updates:
            raise FloatingPointError("simulated failure on this rank only")
        return compute_stats(*args, **kwargs)

    mismatch.compute_stats = failing


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="tiny model dir (built if missing)")
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--scheduler", default="length_surge", help="optim.lr_scheduler_type")
    parser.add_argument("--first", type=int, default=1, help="first update to run (1-based)")
    parser.add_argument("--steps", type=int, required=True, help="last update to run")
    parser.add_argument("--save-at", type=int, default=None, help="save a checkpoint after this update")
    parser.add_argument("--ckpt", default=None, help="checkpoint dir for --save-at")
    parser.add_argument("--resume-from", default=None, help="load this checkpoint before running")
    parser.add_argument("--no-plugin", action="store_true", help="VERL_USE_EXTERNAL_PLUGINS=none (stock verl)")
    parser.add_argument("--mismatch", action="store_true", help="rollout log-probs + MISMATCH_OPTIONS")
    parser.add_argument("--fail-mismatch-at", default="", help="updates (comma list) at which the LAST rank's "
                        "mismatch computation raises")
    parser.add_argument("--updates-per-step", type=int, default=1, help="actor updates per trainer step "
                        "(V1 separate_async's parameter_sync_step)")
    args = parser.parse_args(argv)

    # Before verl is imported: one rank by default, the CPU platform, or stock verl.
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("VERL_PLATFORM", "cpu")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
    if args.no_plugin:
        os.environ["VERL_USE_EXTERNAL_PLUGINS"] = "none"
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    import torch

    torch.set_num_threads(1)  # same arithmetic in every process (resume compares losses)
    import verl_lrstab_cpu.platform  # noqa: F401 - registers verl's "cpu" platform

    started = time.perf_counter()
    if not Path(args.model, "config.json").exists():
        build_tiny_model(args.model)
    worker = make_actor_worker(actor_rollout_ref_config(args.model, args.scheduler, world_size, args.mismatch))
    fail_at = {int(v) for v in args.fail_mismatch_at.split(",") if v}
    if fail_at and rank == world_size - 1:
        _fail_mismatch_at(fail_at, first=args.first)
    # the driver glue tags the actor batches of a length_surge run (with the plugin loaded)
    steps_kwargs = {"rollout_log_probs": args.mismatch, "updates_per_step": args.updates_per_step,
                    "tag_steps": args.scheduler == "length_surge" and not args.no_plugin}
    result = {"header": describe(worker), "rank": rank, "world_size": world_size,
              "build_seconds": time.perf_counter() - started}
    if args.resume_from:
        worker.load_checkpoint(args.resume_from)
        result["loaded_state"] = worker.actor.engine.lr_scheduler.state_dict()
        result["loaded_optimizer_lr"] = worker.actor.engine.optimizer.param_groups[0]["lr"]
    if args.save_at is None:
        result["records"] = run_steps(worker, args.first, args.steps, rank, world_size, **steps_kwargs)
    else:  # save as verl's trainer does (between two steps), then carry on
        result["records"] = run_steps(worker, args.first, args.save_at, rank, world_size, **steps_kwargs)
        worker.save_checkpoint(args.ckpt, global_step=args.save_at)
        result["saved_state"] = worker.actor.engine.lr_scheduler.state_dict()
        result["checkpoint"] = checkpoint_extra_state(args.ckpt, rank, world_size)
        result["records"] += run_steps(worker, args.save_at + 1, args.steps, rank, world_size, **steps_kwargs)
    result["seconds"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(result, indent=1))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
