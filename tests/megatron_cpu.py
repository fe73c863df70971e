"""Test-only: run megatron-core's CUDA code paths on a CPU (gloo, one process).

megatron-core has no CPU mode (docs/megatron.md): it calls
``torch.cuda.current_device()``, allocates with ``device='cuda'``, checks
``tensor.type() == 'torch.cuda.FloatTensor'`` and keeps a CUDA RNG tracker. :func:`cuda_on_cpu`
maps these to the CPU for the duration of a test: a ``TorchFunctionMode`` rewrites every CUDA
device argument to ``cpu`` and makes ``.cuda()`` a no-op, a few ``torch.cuda`` functions get
CPU stand-ins, and gloo's missing ``reduce_scatter_tensor`` is done as all-reduce + slice.
Nothing here is used outside ``tests/``.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

CPU = torch.device("cpu")


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = CPU
        if func in (torch.Tensor.to,) and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], CPU, *args[2:])
        return func(*args, **kwargs)


def _reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    reduced = input.clone()
    dist.all_reduce(reduced, op=op, group=group)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    output.copy_(reduced.view(size, -1)[rank].view_as(output))
    return _Done() if async_op else None


class _Done:
    def wait(self):
        return None


@contextlib.contextmanager
def cuda_on_cpu(port: int = 29631, init: bool = True):
    """One gloo process whose megatron-core believes it runs on ``cuda:0``.

    ``init=False``: the caller (verl's worker) creates the process group and parallel state.
    """
    patches = {
        (torch.cuda, "current_device"): lambda: 0,
        (torch.cuda, "set_device"): lambda device: None,
        (torch.cuda, "synchronize"): lambda *a, **k: None,
        (torch.cuda, "get_rng_state"): lambda *a, **k: torch.get_rng_state(),
        (torch.cuda, "set_rng_state"): lambda state, *a, **k: torch.set_rng_state(state),
        (torch.cuda, "manual_seed"): lambda seed: None,
        (torch.cuda, "device_count"): lambda: 1,
        (dist, "reduce_scatter_tensor"): _reduce_scatter_tensor,
    }
    from megatron.core.tensor_parallel import random as mcore_random

    patches[(mcore_random, "_set_cuda_rng_state")] = lambda state, *a, **k: torch.set_rng_state(state)
    patches[(mcore_random, "_get_cuda_rng_state")] = lambda *a, **k: torch.get_rng_state()
    saved = {key: getattr(*key) for key in patches}
    for (owner, name), value in patches.items():
        setattr(owner, name, value)
    if init:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with _CudaToCpu():
            yield
    finally:
        if init:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


@contextlib.contextmanager
def verl_megatron_on_cpu():
    """:func:`cuda_on_cpu` for verl's Megatron worker (verl creates the process group), plus what
    its model path needs without TransformerEngine: mbridge builds megatron-core's local layer
    spec (it hard-codes TE's) and maps the local spec's separate norm weights, and the local
    attention gets verl's ``[b, s]`` keep-mask as the 4-D causal+padding mask it expects."""
    import mbridge.core.llm_bridge as llm_bridge
    from mbridge.models.qwen2 import Qwen2Bridge
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from verl.workers.engine.megatron import transformer_impl

    block_spec, mlp_mapping, attention = (llm_bridge.get_gpt_decoder_block_spec, Qwen2Bridge._MLP_MAPPING,
                                          DotProductAttention.forward)
    module_device = transformer_impl.get_megatron_module_device

    def local_block_spec(config, use_transformer_engine, **kwargs):
        return block_spec(config, False, **kwargs)

    def forward(self, query, key, value, attention_mask, *args, **kwargs):
        if attention_mask is not None and attention_mask.dim() == 2:  # [b, s], True = token
            s = attention_mask.shape[1]
            causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=attention_mask.device), diagonal=1)
            attention_mask = (~attention_mask.bool())[:, None, None, :] | causal  # True = masked out
        return attention(self, query, key, value, attention_mask, *args, **kwargs)

    llm_bridge.get_gpt_decoder_block_spec = local_block_spec
    Qwen2Bridge._MLP_MAPPING = {  # "mlp" in the name routes these to the MLP table
        "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"], **mlp_mapping}
    other = dict(Qwen2Bridge._OTHER_MAPPING)
    Qwen2Bridge._OTHER_MAPPING = {**other, "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]}
    DotProductAttention.forward = forward
    # The model "is" on cuda:0: a CPU model would be taken for an offloaded one and "reloaded".
    transformer_impl.get_megatron_module_device = lambda module: "cuda"
    try:
        with cuda_on_cpu(init=False):
            yield
    finally:
        llm_bridge.get_gpt_decoder_block_spec = block_spec
        Qwen2Bridge._MLP_MAPPING, Qwen2Bridge._OTHER_MAPPING = mlp_mapping, other
        DotProductAttention.forward = attention
        transformer_impl.get_megatron_module_device = module_device


def run_gpu_check_on_cpu() -> int:
    """``scripts/gpu_check_megatron.py``'s checks, on CPU under :func:`cuda_on_cpu` (gloo for nccl)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check_megatron.py"
    spec = importlib.util.spec_from_file_location("gpu_check_megatron", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    with cuda_on_cpu():
        import megatron.core
        from megatron.core import parallel_state, tensor_parallel

        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        print(f"megatron-core {megatron.core.__version__}, torch {torch.__version__}, gloo on CPU", flush=True)
        check.check("bf16 GPTModel, DistributedOptimizer, length_surge: surge, decay, wd_mult", check.run_uninterrupted)
        if check.results[-1]:
            check.check("dist-checkpoint save/load: exact resume in fresh objects", check.run_save_load)
    return 0 if len(check.results) == 2 and all(check.results) else 1


if __name__ == "__main__":  # spawned helpers of dist_checkpointing re-import the main module: keep this guard
    import sys
    import warnings

    warnings.simplefilter("ignore")
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
    sys.exit(run_gpu_check_on_cpu())
