"""Batched token-in/token-out sampling with transformers (no Ray, no verl).

The core of the CPU rollout backend: one forward pass per new token for a whole
batch of requests (left padding, KV cache), per-request sampling parameters, and
the log-probability of each sampled token under the generation model.

Log-probs follow vLLM's ``logprobs_mode="processed_logprobs"`` (verl's default):
``log_softmax(logits / temperature)`` of the sampled token, before top-k/top-p
filtering, in float32. verl's actor computes its ``old_log_probs`` the same way
(``logits / temperature``), so with ``dtype=float32`` and no weight noise the two
agree to float rounding; ``dtype=bfloat16`` creates a real training-inference
mismatch. A temperature of 0 means greedy decoding, with log-probs at temperature 1.

Sampling is reproducible per request when a ``seed`` is given: each request draws
its own uniforms from its own generator, so its random draws do not depend on which
other requests share the batch or in which order they arrived.

Batch invariance: a CPU matmul's rounding depends on the batch's shape and on a row's
place in it (measured with the tiny model: the same request alone, in another batch or
at another row gets float32 log-probs that differ by up to ~1e-6), so a server that
batches whatever arrives together samples from timing-dependent logits (a token flips
when its uniform falls that close to a boundary). With ``batch_invariant`` (float32
only) the forward runs in float64 and the logits are rounded to float32: a float64
value's batch-dependent error (~1e-16 relative) changes its float32 rounding only when
it lies that close to a rounding boundary (odds ~1e-16/6e-8, ~2e-9 per logit), so
log-probs and samples are bit-identical however the requests were batched (tested:
alone, split, reordered). Its cost against the float32 forward and against sampling one
request at a time: ``scripts/research/bench_generation.py`` (docs/cpu_backend.md).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(name: str) -> torch.dtype:
    """Map a dtype name to torch.

    Args:
        name: ``float32``/``fp32`` or ``bfloat16``/``bf16``.

    Returns:
        The torch dtype.

    Raises:
        ValueError: for any other name (``actor_rollout_ref.rollout.dtype``).
    """
    key = str(name).lower().replace("torch.", "")
    if key not in _DTYPES:
        raise ValueError(
            f"actor_rollout_ref.rollout.dtype={name!r} is not supported by the transformers rollout; "
            f"allowed: {sorted(_DTYPES)}"
        )
    return _DTYPES[key]


def request_seed(*parts: object) -> int:
    """A stable 63-bit seed from any printable parts (Python's ``hash`` is salted per process)."""
    digest = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass
class GenRequest:
    """One generation request.

    Args:
        prompt_ids: prompt token ids.
        max_tokens: most new tokens to produce (>= 1).
        temperature: 0 for greedy, else the softmax temperature.
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; <= 0 keeps all.
        logprobs: also return the log-prob of each sampled token.
        seed: per-request RNG seed; None draws from the generator's shared RNG.
    """

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    logprobs: bool = False
    seed: Optional[int] = None


@dataclass
class GenResult:
    """Output of one request: sampled ids (stop token included), their log-probs, and why it ended."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: Optional[list[float]] = None
    finish_reason: str = "length"  # "stop" (a stop token) or "length" (max_tokens)


def _filtered_probs(scaled_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """Sorted, renormalised sampling distribution after per-row top-k and top-p.

    Returns:
        (probs_sorted, sorted_token_ids), both ``[B, V]``.
    """
    sorted_logits, sorted_ids = scaled_logits.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    ranks = torch.arange(probs.shape[-1]).unsqueeze(0)
    keep = (top_k.unsqueeze(1) <= 0) | (ranks < top_k.unsqueeze(1))
    # keep a token while the mass before it is below top_p (the first one always stays)
    mass_before = probs.cumsum(dim=-1) - probs
    keep &= mass_before < top_p.unsqueeze(1)
    probs = probs * keep
    return probs / probs.sum(dim=-1, keepdim=True), sorted_ids


class TransformersGenerator:
    """Holds a causal LM in the generation dtype and samples batches of requests.

    Args:
        model: a transformers causal LM (its weights are replaced by :meth:`load_weights`).
        stop_token_ids: ids that end a response (kept as its last token).
        pad_token_id: id used for left padding (masked out, any valid id works).
        dtype: generation dtype (float32 or bfloat16).
        seed: seed of the shared RNG used by requests without their own seed.
        batch_invariant: compute in float64 and round the logits to float32, so a request's
            logits do not depend on its batch mates (``dtype=float32`` only).

    Raises:
        ValueError: ``batch_invariant`` with a dtype other than float32.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        stop_token_ids: Iterable[int],
        pad_token_id: int = 0,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        batch_invariant: bool = False,
    ):
        if batch_invariant and dtype != torch.float32:
            raise ValueError(f"batch_invariant generation needs dtype float32 (its float64 forward), got {dtype}")
        self.dtype = dtype
        self.batch_invariant = bool(batch_invariant)
        self.compute_dtype = torch.float64 if self.batch_invariant else dtype
        self.model = model.to(dtype=self.compute_dtype).eval()
        self.stop_token_ids = sorted({int(t) for t in stop_token_ids})
        if not self.stop_token_ids:
            raise ValueError("the generation model needs at least one stop token id (eos)")
        self.pad_token_id = int(pad_token_id)
        self._rng = torch.Generator().manual_seed(int(seed))
        self.num_weight_syncs = 0

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy trained weights (HF names) into the generation model, casting to its dtype
        (float32 weights are held exactly in the float64 model of ``batch_invariant``).

        Args:
            named_tensors: ``(name, tensor)`` pairs, e.g. from verl's ``get_per_tensor_param``.

        Returns:
            How many tensors were loaded.

        Raises:
            KeyError: a name the model does not have.
        """
        state = self.model.state_dict(keep_vars=True)  # tied weights appear under both names
        loaded = 0
        for name, tensor in named_tensors:
            if name not in state:
                raise KeyError(f"weight {name!r} is not in the generation model (known: {len(state)} names)")
            target = state[name]
            target.data.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))
            loaded += 1
        self.num_weight_syncs += 1
        return loaded

    @torch.no_grad()
    def add_weight_noise(self, sigma: float, seed: int) -> None:
        """Perturb every floating parameter by ``sigma * std(param) * N(0, 1)`` (generation copy only).

        Args:
            sigma: relative noise scale (0 disables).
            seed: RNG seed, so a run is reproducible.
        """
        if sigma <= 0:
            return
        gen = torch.Generator().manual_seed(int(seed))
        for param in self.model.parameters():
            if param.is_floating_point() and param.numel() > 1:
                noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
                std = param.detach().float().std()
                # in the generation dtype, so the float64 model of batch_invariant holds float32 values
                param.copy_(param.to(self.dtype) + (sigma * std * noise).to(self.dtype))

    # --------------------------------------------------------------- sampling
    @torch.no_grad()
    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """Sample all requests together, one forward pass per new token.

        Args:
            requests: the batch; each keeps its own sampling parameters and seed.

        Returns:
            One :class:`GenResult` per request, in order.
        """
        if not requests:
            return []
        bsz = len(requests)
        lengths = [len(r.prompt_ids) for r in requests]
        if min(lengths) == 0:
            raise ValueError("empty prompt")
        width = max(lengths)
        input_ids = torch.full((bsz, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((bsz, width), dtype=torch.long)
        for i, req in enumerate(requests):
            input_ids[i, width - lengths[i] :] = torch.tensor(req.prompt_ids, dtype=torch.long)
            mask[i, width - lengths[i] :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)

        temps = torch.tensor([max(float(r.temperature), 0.0) for r in requests])
        greedy = temps <= 0
        temps = torch.where(greedy, torch.ones_like(temps), temps)
        top_k = torch.tensor([int(r.top_k) for r in requests])
        top_p = torch.tensor([float(r.top_p) if 0 < r.top_p <= 1 else 1.0 for r in requests])
        gens = [torch.Generator().manual_seed(r.seed) if r.seed is not None else self._rng for r in requests]
        max_new = torch.tensor([max(1, int(r.max_tokens)) for r in requests])
        stop = torch.tensor(self.stop_token_ids)

        results = [GenResult(log_probs=[] if r.logprobs else None) for r in requests]
        done = torch.zeros(bsz, dtype=torch.bool)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
        cache, last_pos = out.past_key_values, positions[:, -1]
        logits = out.logits[:, -1, :].float()  # float64 -> float32 under batch_invariant: the rounding step

        for step in range(int(max_new.max())):
            scaled = logits / temps.unsqueeze(1)
            logp = torch.log_softmax(scaled, dim=-1)
            probs, sorted_ids = _filtered_probs(scaled, top_k, top_p)
            # one uniform per live row from its own generator: batch-independent sampling
            u = torch.stack([torch.rand((), generator=g) for g in gens])
            idx = torch.searchsorted(probs.cumsum(-1), u.unsqueeze(1))
            idx = torch.minimum(idx, (probs > 0).sum(-1, keepdim=True) - 1)  # rounding: stay on a kept token
            sampled = sorted_ids.gather(1, idx).squeeze(1)
            tokens = torch.where(greedy, logits.argmax(-1), sampled)
            token_logp = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)

            for i in torch.nonzero(~done).flatten().tolist():
                res = results[i]
                res.token_ids.append(int(tokens[i]))
                if res.log_probs is not None:
                    res.log_probs.append(float(token_logp[i]))
            hit_stop = torch.isin(tokens, stop) & ~done
            for i in torch.nonzero(hit_stop).flatten().tolist():
                results[i].finish_reason = "stop"
            done |= hit_stop | (max_new <= step + 1)
            if bool(done.all()):
                break

            mask = torch.cat([mask, torch.ones((bsz, 1), dtype=torch.long)], dim=1)
            last_pos = last_pos + 1
            out = self.model(
                input_ids=tokens.unsqueeze(1),
                attention_mask=mask,
                position_ids=last_pos.unsqueeze(1),
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float()
        return results
