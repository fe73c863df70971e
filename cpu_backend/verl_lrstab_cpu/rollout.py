"""A transformers-based rollout backend for verl 0.9.x, registered as ``rollout.name=transformers``.

A test and demo backend for CPU-only machines, NOT a production rollout engine
(no paged KV cache, no continuous batching, no tensor parallelism). It plugs into
verl through verl's own registries:

* :class:`TransformersReplica` (``RolloutReplicaRegistry``): launched by verl's
  ``LLMServerManager`` in hybrid mode; starts one :class:`TransformersServer` Ray
  actor per replica, named ``transformers_server_<replica>_0``.
* :class:`TransformersServer`: verl's token-in/token-out ``generate`` API, called by
  verl's agent loop through verl's load balancer. Requests arriving together are
  sampled as one batch (:mod:`.generation`).
* :class:`TransformersServerAdapter` (``_ROLLOUT_REGISTRY``): lives in the FSDP
  worker; verl calls its ``update_weights`` with the trained weights after every
  step (checkpoint engine ``naive``) and it ships them to the server.

Options (``actor_rollout_ref.rollout.*``):
  * ``dtype``: the generation dtype (``float32`` or ``bfloat16``); with the trainer in
    float32, ``bfloat16`` creates a real training-inference mismatch.
  * ``calculate_log_probs``: return per-token log-probs (see :mod:`.generation`).
  * ``full_determinism``: verl then sends stable request ids; each request is sampled
    from a seed of (``seed``, weight version, request id, prompt), so a resumed run
    samples exactly what an uninterrupted one does.
  * ``engine_kwargs.transformers.weight_noise`` (float, default 0): after each weight
    sync add ``weight_noise * std(param) * N(0, 1)`` to every generation weight.
  * ``engine_kwargs.transformers.weight_noise_growth`` (float, default 1): the noise of the
    k-th sync is ``weight_noise * weight_noise_growth ** (k - 1)``: a sampler that drifts away
    from the trainer even at LR 0 (a system mismatch, for ``lrstab admit``'s drift test).
  * ``engine_kwargs.transformers.batch_wait_ms`` (default 20): how long a request
    waits for others to join its batch.
  * ``engine_kwargs.transformers.batch_invariant`` (default: true with ``dtype=float32``):
    float64 forward, logits rounded to float32, so which requests happened to share a
    batch (timing) does not change a request's log-probs or samples (:mod:`.generation`).
    ``false``: the plain float32 forward (batch-dependent rounding; 1.2x the tokens/s on the
    demo's tiny model, 1.6x on a 6.4M-parameter one: ``scripts/research/bench_generation.py``).
  * ``engine_kwargs.transformers.num_threads`` (default: unchanged): torch threads.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Generator, Optional

import ray
import torch

from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from .generation import GenRequest, TransformersGenerator, request_seed, resolve_dtype

logger = logging.getLogger(__name__)

ROLLOUT_NAME = "transformers"
_KWARGS_KEY = f"actor_rollout_ref.rollout.engine_kwargs.{ROLLOUT_NAME}"
_KNOWN_KWARGS = {"weight_noise", "weight_noise_growth", "batch_wait_ms", "num_threads", "batch_invariant"}


def backend_options(config) -> dict[str, Any]:
    """The backend's own options from ``rollout.engine_kwargs.transformers``, validated.

    Args:
        config: verl's ``RolloutConfig`` (or a dict-like with ``engine_kwargs``).

    Returns:
        ``{"weight_noise": float, "weight_noise_growth": float, "batch_wait_ms": float,
        "num_threads": int | None, "batch_invariant": bool | None}`` (None: on for float32 generation).

    Raises:
        ValueError: unknown key or out-of-range value (the message names the key).
    """
    raw = dict((getattr(config, "engine_kwargs", None) or {}).get(ROLLOUT_NAME) or {})
    unknown = set(raw) - _KNOWN_KWARGS
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)} under {_KWARGS_KEY}; allowed: {sorted(_KNOWN_KWARGS)}")
    opts = {
        "weight_noise": float(raw.get("weight_noise", 0.0) or 0.0),
        "weight_noise_growth": float(raw.get("weight_noise_growth", 1.0)),
        "batch_wait_ms": float(raw.get("batch_wait_ms", 20.0)),
        "num_threads": raw.get("num_threads"),
        "batch_invariant": raw.get("batch_invariant"),
    }
    if opts["batch_invariant"] not in (None, True, False):
        raise ValueError(f"{_KWARGS_KEY}.batch_invariant must be true, false or null, got {opts['batch_invariant']!r}")
    if opts["weight_noise"] < 0:
        raise ValueError(f"{_KWARGS_KEY}.weight_noise must be >= 0, got {opts['weight_noise']}")
    if not opts["weight_noise_growth"] > 0:
        raise ValueError(f"{_KWARGS_KEY}.weight_noise_growth must be > 0, got {opts['weight_noise_growth']}")
    if opts["batch_wait_ms"] < 0:
        raise ValueError(f"{_KWARGS_KEY}.batch_wait_ms must be >= 0, got {opts['batch_wait_ms']}")
    return opts


def server_actor_name(replica_rank: int, node_rank: int = 0) -> str:
    """Ray actor name of a replica's server (same scheme as verl's vLLM servers)."""
    return f"{ROLLOUT_NAME}_server_{replica_rank}_{node_rank}"


def _stop_token_ids(model_config) -> list[int]:
    """eos ids of the model config, the generation config and the chat end token."""
    ids: list[int] = []
    for source in (model_config.hf_config, getattr(model_config, "generation_config", None)):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            ids.extend(eos if isinstance(eos, (list, tuple)) else [eos])
    tokenizer = getattr(model_config, "tokenizer", None)
    if tokenizer is not None:
        im_end = tokenizer.get_added_vocab().get("<|im_end|>")
        if im_end is not None:
            ids.append(im_end)
    return sorted(set(int(i) for i in ids))


class TransformersServer:
    """Ray actor serving verl's token-in/token-out ``generate`` with a transformers model.

    Args:
        config: verl ``RolloutConfig``.
        model_config: verl ``HFModelConfig`` (``local_path`` holds the HF checkpoint).
        replica_rank: rank of the replica this server belongs to.
    """

    def __init__(self, config, model_config, replica_rank: int = 0, **_unused):
        from transformers import AutoModelForCausalLM

        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig, RolloutConfig

        self.config: RolloutConfig = omega_conf_to_dataclass(config)
        self.model_config: HFModelConfig = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.replica_rank = replica_rank
        self.options = backend_options(self.config)
        if self.options["num_threads"]:
            torch.set_num_threads(int(self.options["num_threads"]))

        dtype = resolve_dtype(self.config.dtype)
        batch_invariant = self.options["batch_invariant"]
        if batch_invariant and dtype != torch.float32:
            raise ValueError(
                f"{_KWARGS_KEY}.batch_invariant=true needs actor_rollout_ref.rollout.dtype=float32, "
                f"got {self.config.dtype!r} (set batch_invariant: false or null)"
            )
        model = AutoModelForCausalLM.from_pretrained(
            self.model_config.local_path,
            dtype=torch.float32,
            attn_implementation="sdpa",
            trust_remote_code=self.model_config.trust_remote_code,
        )
        pad = getattr(self.model_config.hf_config, "pad_token_id", None)
        self.generator = TransformersGenerator(
            model,
            stop_token_ids=_stop_token_ids(self.model_config),
            pad_token_id=pad if pad is not None else 0,
            dtype=dtype,
            seed=self.config.seed + replica_rank,
            batch_invariant=(dtype == torch.float32) if batch_invariant is None else batch_invariant,
        )
        self.max_model_len = self.config.max_model_len or self.model_config.hf_config.max_position_embeddings
        self.global_steps: Optional[int] = None
        self._pending: list[tuple[GenRequest, asyncio.Future]] = []
        self._batch_task: Optional[asyncio.Task] = None
        self._model_lock = asyncio.Lock()  # generation and weight loading never overlap
        self._gate = asyncio.Event()
        self._gate.set()
        self._rejecting = False
        self.num_batches = 0
        self._seen_version: Optional[int] = None
        self._seen: dict[tuple, int] = {}
        self.num_requests = 0

    # --------------------------------------------------------------- generate
    def _max_tokens(self, prompt_len: int, sampling_params: dict[str, Any]) -> int:
        """Same rule as verl's vLLM server: explicit max_tokens, else response_length within the budget."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ValueError(f"prompt of {prompt_len} tokens leaves no room within max_model_len={self.max_model_len}")
        requested = sampling_params.get("max_tokens", sampling_params.get("max_new_tokens"))
        if requested is None:
            requested = min(
                self.config.response_length, self.config.prompt_length + self.config.response_length - prompt_len
            )
        return max(1, min(int(requested), room))

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Optional[list[Any]] = None,
        video_data: Optional[list[Any]] = None,
        audio_data: Optional[list[Any]] = None,
        mm_processor_kwargs: Optional[dict[str, Any]] = None,
        **_unused,
    ) -> TokenOutput:
        """Generate one response (token-in/token-out), batched with concurrent requests.

        Args:
            prompt_ids: prompt token ids.
            sampling_params: verl's dict (``temperature``, ``top_p``, ``top_k``, ``logprobs``,
                optional ``max_tokens``); other keys are ignored.
            request_id: verl's request id (stable ``det-<i>`` under ``full_determinism``).
            image_data, video_data, audio_data, mm_processor_kwargs: must be empty (text only).

        Returns:
            verl's ``TokenOutput`` (``log_probs`` only when ``sampling_params["logprobs"]``).
        """
        if image_data or video_data or audio_data:
            raise NotImplementedError("the transformers rollout backend is text-only")
        if self._rejecting:
            return TokenOutput(token_ids=[], stop_reason="aborted", extra_fields={"global_steps": self.global_steps})
        await self._gate.wait()
        prompt_ids = [int(t) for t in prompt_ids]
        seed = None
        if self.config.full_determinism:
            seed = self._deterministic_seed(request_id, prompt_ids)
        req = GenRequest(
            prompt_ids=prompt_ids,
            max_tokens=self._max_tokens(len(prompt_ids), sampling_params),
            temperature=float(sampling_params.get("temperature", 1.0)),
            top_p=float(sampling_params.get("top_p", 1.0)),
            top_k=int(sampling_params.get("top_k", -1)),
            logprobs=bool(sampling_params.get("logprobs", False)),
            seed=seed,
        )
        future = asyncio.get_running_loop().create_future()
        self._pending.append((req, future))
        if self._batch_task is None or self._batch_task.done():
            self._batch_task = asyncio.create_task(self._run_batches())
        result = await future
        return TokenOutput(
            token_ids=result.token_ids,
            log_probs=result.log_probs,
            stop_reason="completed",
            extra_fields={"global_steps": self.global_steps},
        )

    def _deterministic_seed(self, request_id: str, prompt_ids: list[int]) -> int:
        """Seed from (seed, weight version, request id, prompt, repeat index).

        verl gives the ``n`` samples of one prompt the same ``det-<i>`` id; the repeat index
        (how often this id and prompt were already seen for these weights) keeps them distinct.
        """
        if self._seen_version != self.global_steps:
            self._seen_version, self._seen = self.global_steps, {}
        key = (request_id, tuple(prompt_ids))
        repeat = self._seen.get(key, 0)
        self._seen[key] = repeat + 1
        return request_seed(self.config.seed, self.global_steps, request_id, prompt_ids, repeat)

    async def _run_batches(self) -> None:
        """Drain the queue: wait briefly for stragglers, then sample everything queued at once."""
        wait_s = self.options["batch_wait_ms"] / 1000.0
        while self._pending:
            seen = -1
            while seen != len(self._pending):  # keep waiting while requests keep arriving
                seen = len(self._pending)
                await asyncio.sleep(wait_s)
            batch = self._pending[: self.config.max_num_seqs]
            del self._pending[: len(batch)]
            try:
                async with self._model_lock:
                    results = await asyncio.to_thread(self.generator.generate, [r for r, _ in batch])
            except Exception as exc:  # hand the error to every waiting request
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            self.num_batches += 1
            self.num_requests += len(batch)
            for (_, fut), res in zip(batch, results, strict=True):
                if not fut.done():
                    fut.set_result(res)

    # ----------------------------------------------------------------- weights
    async def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Load the trained weights (HF names) into the generation model, then add the optional noise.

        Args:
            named_tensors: ``(name, tensor)`` pairs from the FSDP worker.

        Returns:
            How many tensors were loaded.
        """
        async with self._model_lock:
            loaded = self.generator.load_weights(named_tensors)
            sigma = self.options["weight_noise"] * self.options["weight_noise_growth"] ** max(
                self.generator.num_weight_syncs - 1, 0)
            if sigma > 0:
                seed = request_seed(self.config.seed, "noise", self.generator.num_weight_syncs)
                self.generator.add_weight_noise(sigma, seed)
        return loaded

    async def set_global_steps(self, global_steps: int) -> None:
        """Record the weight version (verl reports it per sample as ``global_steps``)."""
        self.global_steps = global_steps

    async def stats(self) -> dict[str, Any]:
        """Counters for tests: batches run, requests served, weight syncs, generation dtype."""
        return {
            "num_batches": self.num_batches,
            "num_requests": self.num_requests,
            "num_weight_syncs": self.generator.num_weight_syncs,
            "dtype": str(self.generator.dtype),
            "global_steps": self.global_steps,
        }

    # ---------------------------------------------- lifecycle (CPU: nothing to free)
    async def wake_up(self, tags: Optional[list[str]] = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None  # the KV cache lives only for the duration of one batch

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def wait_for_requests_to_drain(self) -> None:
        while self._pending or (self._batch_task is not None and not self._batch_task.done()):
            await asyncio.sleep(0.01)

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        """Hold (or, with ``reject_request``, refuse) new requests until :meth:`resume_generation`.

        Requests already queued or running complete normally; none is cut short.
        """
        self._gate.clear()
        self._rejecting = reject_request
        return {"aborted_count": 0, "request_ids": []}

    async def abort_request(self, request_id: str) -> dict[str, Any]:
        return {"aborted": False, "request_id": request_id, "error": "not supported by the transformers backend"}

    async def resume_generation(self) -> None:
        self._rejecting = False
        self._gate.set()

    async def start_profile(self, **kwargs) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


class TransformersReplica(RolloutReplica):
    """verl rollout replica that runs one :class:`TransformersServer` (hybrid mode, text only)."""

    async def launch_servers(self):
        """Start the server actor and give verl its handle and a unique address."""
        if self.nnodes != 1:
            raise ValueError(
                "the transformers rollout runs one server per replica on one node; set "
                "actor_rollout_ref.rollout.tensor_model_parallel_size=1 (got a replica of "
                f"{self.world_size} ranks over {self.nnodes} nodes)"
            )
        server = (
            ray.remote(TransformersServer)
            .options(
                name=server_actor_name(self.replica_rank) + self.name_suffix,
                num_cpus=0,  # the CPU slots are declared for the trainer's workers
                max_concurrency=self.max_concurrency,
            )
            .remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)
        )
        await server.__ray_ready__.remote()
        self.servers = [server]
        self._server_handle = server
        # No HTTP endpoint: the address is only an id for verl's load balancer.
        self._server_address = f"{ROLLOUT_NAME}-replica-{self.replica_rank}:0"


class TransformersServerAdapter(BaseRollout):
    """The rollout side inside verl's FSDP worker: forwards trained weights to the server.

    Every FSDP rank must run through the weight generator (FSDP2 gathers each full
    tensor collectively); only the first rank of each replica sends.
    """

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1, **kwargs):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", 0))
        rollout_world_size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // rollout_world_size if replica_rank == -1 else replica_rank
        self._has_server = rank % rollout_world_size == 0
        self._server = None

    def _server_handle(self):
        if self._server is None:
            self._server = ray.get_actor(server_actor_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    @torch.no_grad()
    async def update_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None],
        wire_format: str = "named_tensors",
        global_steps: Optional[int] = None,
        **kwargs,
    ):
        """Send verl's ``(name, tensor)`` stream to the server and stamp the weight version.

        Args:
            weights: full tensors with HF names (``engine.get_per_tensor_param()``).
            wire_format: only ``named_tensors`` (full tensors) is supported.
            global_steps: the trainer step these weights come from.
        """
        if wire_format != "named_tensors":
            raise NotImplementedError(
                f"the transformers rollout accepts wire_format='named_tensors' only, got {wire_format!r} "
                "(use actor_rollout_ref.rollout.checkpoint_engine.backend=naive)"
            )
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("LoRA adapters are not supported by the transformers rollout (merge them)")
        named = [(name, t.detach().to("cpu").contiguous()) for name, t in weights]
        if not self._has_server:
            return
        server = self._server_handle()
        await server.update_weights.remote(named)
        if global_steps is not None:
            await server.set_global_steps.remote(global_steps)


def register() -> None:
    """Add ``transformers`` to verl's rollout registries (idempotent)."""
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    _ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__name__}.TransformersServerAdapter"
    RolloutReplicaRegistry.register(ROLLOUT_NAME, lambda: TransformersReplica)
