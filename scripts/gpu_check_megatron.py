#!/usr/bin/env python
"""One-GPU check of ``LengthSurgeParamScheduler`` with megatron-core on cuda/nccl (no verl).

Run by ``scripts/gpu_check.sh`` (its check 1; ``scripts/gpu_check_megatron.sh`` runs that alone); prints one line per check (``ok`` / ``FAIL``) and
exits non-zero if any fails. A tiny GPTModel (megatron-core's local layer spec: no
TransformerEngine) in bf16, megatron-core's DDP and DistributedOptimizer (the optimizer verl's
Megatron engine builds), our scheduler stepped once per update with a response-length series
that surges at update 7, then a dist-checkpoint save after update 12 and a load into a fresh
model/optimizer/scheduler that must continue the LR and the weights exactly.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback

import torch

FAST = {"detector": "ratio", "skip_first_steps": 0, "fast_window": 1, "baseline_window": 2, "horizon": 3,
        "patience": 1, "origin": "start"}  # the paper's form, whose halvings at P, 2P the checks write out
LENGTHS = [100.0] * 6 + [300.0] * 14  # surge at update 7 -> P = round(1.8 * 7) = 13
LR, WD, SAVE_AT = 1e-3, 0.1, 12
results = []


def check(name, fn):
    start = time.time()
    try:
        detail = fn() or ""
        results.append(True)
        print(f"ok   {name} ({time.time() - start:.1f} s) {detail}", flush=True)
    except Exception as exc:  # noqa: BLE001 - report every check
        results.append(False)
        print(f"FAIL {name}: {exc!r}", flush=True)
        traceback.print_exc(limit=int(os.environ.get("TB_LIMIT", "4")))


def setup():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    import megatron.core

    return (f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, megatron-core "
            f"{megatron.core.__version__}, backend {torch.distributed.get_backend()}")


def build():
    """bf16 GPTModel + DDP + DistributedOptimizer + our scheduler, as verl's Megatron engine builds them."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    from verl_lrstab.megatron import LengthSurgeParamScheduler

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                               bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                               hidden_dropout=0.0, attention_dropout=0.0)  # no RNG: a resume must be bitwise
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128,
                     max_sequence_length=32)
    model = Float16Module(config, model).cuda()  # bf16 weights and activations, as Megatron-LM and verl wrap it
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    model = DistributedDataParallel(config=config, ddp_config=ddp, module=model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=LR, min_lr=0.0, weight_decay=WD, bf16=True,
                                                 use_distributed_optimizer=True, clip_grad=1.0), [model])
    sched = LengthSurgeParamScheduler(opt, FAST, init_lr=0.0, max_lr=LR, min_lr=0.0, lr_warmup_steps=2,
                                      lr_decay_steps=100, start_wd=WD, end_wd=WD, wd_incr_steps=100,
                                      wd_incr_style="constant")
    return model, opt, sched


def train_step(model, opt, sched, update):
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(update)).cuda()
    position_ids = torch.arange(32, device="cuda").unsqueeze(0).expand(2, -1)
    model.zero_grad_buffer()
    opt.zero_grad()
    loss = model(tokens, position_ids, None, labels=tokens).float().mean()
    loss.backward()
    ok, _, _ = opt.step()
    assert ok, "optimizer step failed"
    sched.step(1, response_length=LENGTHS[update - 1])
    return [(g["lr"], g["weight_decay"]) for g in opt.param_groups]


def weights(model):
    return [p.detach().float().clone() for p in model.parameters()]


state = {}


def run_uninterrupted():
    model, opt, sched = build()
    groups0 = [(g["lr"], g["weight_decay"]) for g in opt.param_groups]
    assert all(lr == 0.0 for lr, _ in groups0), f"warmup from lr_warmup_init 0: {groups0}"
    trace = [train_step(model, opt, sched, u) for u in range(1, len(LENGTHS) + 1)]
    assert sched.surge_step == 7 and sched.decay_period == 13, (sched.surge_step, sched.decay_period)
    lrs = [t[0][0] for t in trace]
    # after update u: the LR of update u + 1 (warmup 2, halving in force from update 13)
    assert lrs[0] == LR / 2 and lrs[1] == LR and lrs[10] == LR and lrs[11] == LR / 2, lrs
    wds = sorted({wd for t in trace for _, wd in t})
    assert wds == [0.0, WD], f"no-decay groups must keep weight decay 0 (wd_mult): {wds}"
    state.update(trace=trace, weights=weights(model))
    return f"surge 7, period 13, LR {lrs[10]:.0e} -> {lrs[11]:.0e}, {len(opt.param_groups)} param groups, " \
           f"weight decay {wds}"


def _fill_fresh_optimizer_state(opt):
    """megatron-core without TransformerEngine or Apex (torch's AdamW) cannot build the loading state
    dict of a fresh DistributedOptimizer (``state_dict`` asserts one 'step' over an empty state). Fill
    the state as megatron-core's own ``_init_optimizer_states_with_dummy_values`` does: one step with
    zero gradients, here at the fresh scheduler's LR 0 (warmup from 0), so nothing moves; the load
    then overwrites every value."""
    from megatron.core.optimizer import distrib_optimizer

    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        return
    assert all(g["lr"] == 0.0 for g in opt.param_groups)
    for inner in opt.chained_optimizers:
        inner._init_optimizer_states_with_dummy_values()


def _restore_adam_steps(opt):
    """With torch's AdamW (no TE/Apex), megatron-core's dp_reshardable load copies each parameter's
    Adam 'step' from the loading template (the filled state above), not from the checkpoint; the
    checkpoint's step is in the restored param groups. Put it back, so bias correction continues."""
    from megatron.core.optimizer import distrib_optimizer

    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        return
    for inner in opt.chained_optimizers:
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                inner.optimizer.state[param]["step"] = torch.tensor(float(group["step"]))


def run_save_load():
    from megatron.core import dist_checkpointing, parallel_state

    # verl's MegatronCheckpointManager metadata (DistributedOptimizer, verl's default layout)
    metadata = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                "chained_optim_avoid_prefix": True}
    model_metadata = {**metadata, "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    model, opt, sched = build()
    for u in range(1, SAVE_AT + 1):
        train_step(model, opt, sched, u)
    with tempfile.TemporaryDirectory() as ckpt:
        model_sd = model.sharded_state_dict(metadata=model_metadata)
        dist_checkpointing.save({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, metadata=metadata),
                                 "lr_scheduler": sched.state_dict()}, ckpt)
        del model, opt, sched
        model, opt, sched = build()
        _fill_fresh_optimizer_state(opt)
        model_sd = model.sharded_state_dict(metadata=model_metadata)
        loaded = dist_checkpointing.load({"model": model_sd, "lr_scheduler": sched.state_dict(), "optimizer":
                                          opt.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)}, ckpt)
        # Float16Module's sharded keys carry its "module." prefix; its load_state_dict forwards to GPTModel
        model.load_state_dict({k.removeprefix("module."): v for k, v in loaded["model"].items()})
        opt.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(opt)
        sched.load_state_dict(loaded["lr_scheduler"])
    resumed = [(g["lr"], g["weight_decay"]) for g in opt.param_groups]
    assert resumed == state["trace"][SAVE_AT - 1], (resumed, state["trace"][SAVE_AT - 1])
    assert sched.surge_step == 7 and sched.schedule.detector.last_step == SAVE_AT
    trace = [train_step(model, opt, sched, u) for u in range(SAVE_AT + 1, len(LENGTHS) + 1)]
    assert trace == state["trace"][SAVE_AT:], "LR trajectory after resume differs"
    diff = max((a - b).abs().max().item() for a, b in zip(weights(model), state["weights"]))
    assert diff == 0.0, f"weights after resume differ by {diff}"
    return f"saved after update {SAVE_AT}, resumed: LR trajectory and weights identical"


def main() -> int:
    start = time.time()
    if not torch.cuda.is_available():
        print("FAIL cuda: no GPU visible", flush=True)
        return 1
    check("cuda/nccl + megatron-core parallel state", setup)
    if results[-1]:
        check("bf16 GPTModel, DistributedOptimizer, length_surge: surge, decay, wd_mult", run_uninterrupted)
    if results[-1]:
        check("dist-checkpoint save/load: exact resume in fresh objects", run_save_load)
    torch.distributed.destroy_process_group() if torch.distributed.is_initialized() else None
    print(f"{'ok' if all(results) and len(results) == 3 else 'FAIL'}  {sum(results)}/3 checks in "
          f"{time.time() - start:.0f} s", flush=True)
    return 0 if all(results) and len(results) == 3 else 1


if __name__ == "__main__":
    sys.exit(main())
