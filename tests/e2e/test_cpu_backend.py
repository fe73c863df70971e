"""Unit tests of the CPU stand-ins (no Ray, seconds): platform, generation, weight sync, rewards, registries."""

from __future__ import annotations

import os

import pytest
import torch

from verl_lrstab_cpu import rewards
from verl_lrstab_cpu.generation import GenRequest, TransformersGenerator, resolve_dtype
from verl_lrstab_cpu.platform import PlatformCPU, cpu_device_module, dedup_backend
from verl_lrstab_cpu.rollout import ROLLOUT_NAME, backend_options


@pytest.fixture(scope="module")
def tiny(assets_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = assets_dir / "model"
    tok = AutoTokenizer.from_pretrained(path)
    load = lambda: AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")  # noqa: E731
    prompts = [
        tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False))[
            "input_ids"
        ]
        for q in ("3 + 4 =", "12 - 30 =", "7 + 17 =")
    ]
    return tok, load, prompts


def make_generator(tok, model, dtype=torch.float32, batch_invariant=False):
    return TransformersGenerator(
        model, [tok.convert_tokens_to_ids("<|im_end|>")], tok.pad_token_id, dtype=dtype, batch_invariant=batch_invariant
    )


# -- generation -----------------------------------------------------------------------------------
def test_log_probs_are_the_models_at_the_sampling_temperature(tiny):
    tok, load, prompts = tiny
    model = load()
    gen = make_generator(tok, model)
    temperature = 0.7
    reqs = [GenRequest(p, max_tokens=12, temperature=temperature, logprobs=True, seed=i) for i, p in enumerate(prompts)]
    for req, res in zip(reqs, gen.generate(reqs)):
        ids = torch.tensor([req.prompt_ids + res.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(req.prompt_ids) - 1 : -1].float()
        ref = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(res.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(res.log_probs), ref, atol=1e-5)


def test_sampling_is_per_request_and_batch_independent(tiny):
    tok, load, prompts = tiny
    gen = make_generator(tok, load())
    req = GenRequest(prompts[1], max_tokens=20, temperature=1.0, logprobs=True, seed=123)
    alone = gen.generate([req])[0]
    batched = gen.generate([GenRequest(prompts[0], 20, seed=5), req, GenRequest(prompts[2], 20, seed=6)])[1]
    assert alone.token_ids == batched.token_ids
    assert alone.log_probs == pytest.approx(batched.log_probs, abs=1e-5)
    other = [gen.generate([GenRequest(prompts[1], 20, seed=s)])[0].token_ids for s in range(8)]
    assert len({tuple(t) for t in other}) > 1, "different seeds should give different samples"


def test_batch_invariant_generation_does_not_depend_on_batch_mates(tiny):
    """What the V1 server meets: the same requests batched as they happen to arrive (alone,
    split in two, in another row order) give bit-identical log-probs and tokens."""
    tok, load, prompts = tiny
    more = [
        tok(tok.apply_chat_template([{"role": "user", "content": f"{a} + {b} ="}], add_generation_prompt=True,
                                    tokenize=False))["input_ids"]
        for a, b in ((1, 2), (13, 5), (28, 30), (4, 19), (22, 7))
    ]
    reqs = [GenRequest(p, 24, 1.0, logprobs=True, seed=100 + i) for i, p in enumerate(prompts + more)]
    gen = make_generator(tok, load(), batch_invariant=True)
    assert gen.compute_dtype == torch.float64 and gen.dtype == torch.float32
    together = gen.generate(reqs)
    order = [5, 2, 7, 0, 3, 6, 1, 4]
    layouts = {
        "alone": [gen.generate([r])[0] for r in reqs],
        "split": gen.generate(reqs[:3]) + gen.generate(reqs[3:]),
        "reordered": [dict(zip(order, gen.generate([reqs[i] for i in order])))[i] for i in range(len(reqs))],
    }
    for name, results in layouts.items():
        for a, b in zip(together, results):
            assert a.token_ids == b.token_ids and a.log_probs == b.log_probs, name  # bit-identical
    # the float32 weights are held exactly, and the log-probs are still the float32 model's
    ref = make_generator(tok, load()).generate(reqs[:1])[0]
    assert together[0].token_ids == ref.token_ids
    assert together[0].log_probs == pytest.approx(ref.log_probs, abs=1e-5)
    with pytest.raises(ValueError, match="batch_invariant.*float32"):
        make_generator(tok, load(), dtype=torch.bfloat16, batch_invariant=True)


def test_stop_token_top_k_and_max_tokens(tiny):
    tok, load, prompts = tiny
    gen = make_generator(tok, load())
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    greedy = gen.generate([GenRequest(prompts[0], 30, temperature=0.0)])[0]
    top1 = gen.generate([GenRequest(prompts[0], 30, temperature=1.0, top_k=1, seed=9)])[0]
    assert greedy.token_ids == top1.token_ids
    assert greedy.finish_reason == "stop" and greedy.token_ids[-1] == im_end
    assert im_end not in greedy.token_ids[:-1]
    capped = gen.generate([GenRequest(prompts[0], 1, temperature=1.0, seed=1)])[0]
    assert len(capped.token_ids) == 1


def test_bfloat16_generation_creates_a_mismatch(tiny):
    tok, load, prompts = tiny
    req = GenRequest(prompts[0], max_tokens=1, temperature=1.0, logprobs=True, seed=3)
    fp32 = make_generator(tok, load()).generate([req])[0]
    bf16 = make_generator(tok, load(), dtype=resolve_dtype("bfloat16")).generate([req])[0]
    assert fp32.token_ids == bf16.token_ids
    gap = abs(fp32.log_probs[0] - bf16.log_probs[0])
    assert 0 < gap < 0.5
    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.dtype"):
        resolve_dtype("float16")


def test_weight_sync_and_noise(tiny):
    tok, load, prompts = tiny
    trained = load()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.05 * torch.randn_like(p))
    gen = make_generator(tok, load())
    loaded = gen.load_weights(trained.state_dict().items())
    assert loaded == len(trained.state_dict())
    for (name, a), b in zip(gen.model.state_dict().items(), trained.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(KeyError, match="not_a_weight"):
        gen.load_weights([("not_a_weight", torch.zeros(1))])

    before = {n: p.detach().clone() for n, p in gen.model.named_parameters()}
    gen.add_weight_noise(0.01, seed=0)
    name, param = next((n, p) for n, p in gen.model.named_parameters() if p.dim() == 2)
    rel = ((param - before[name]).std() / before[name].std()).item()
    assert 0.005 < rel < 0.02
    # the float64 model of batch_invariant gets the same float32 values (weights and noise)
    wide = make_generator(tok, load(), batch_invariant=True)
    wide.load_weights(trained.state_dict().items())
    wide.add_weight_noise(0.01, seed=0)
    for (n, a), b in zip(gen.model.state_dict().items(), wide.model.state_dict().values()):
        assert b.dtype == torch.float64 and torch.equal(a, b.float()) and torch.equal(b, b.float().double()), n


# -- platform -------------------------------------------------------------------------------------
def test_cpu_platform_is_strictly_opt_in(monkeypatch):
    from verl.plugin.platform.platform_manager import PlatformRegistry, _detect_platform_name

    assert PlatformRegistry.get("cpu") is PlatformCPU
    assert PlatformCPU().is_platform_available(use_smi_check=True) is False
    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    for var in ("VERL_ENGINE_DEVICE", "VERL_ENGINE_VENDOR"):
        monkeypatch.delenv(var, raising=False)
    assert _detect_platform_name() != "cpu"
    # probing (verl instantiates every registered platform) must leave the process untouched
    assert "VERL_ENGINE_DEVICE" not in os.environ and "VERL_ENGINE_VENDOR" not in os.environ
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    assert _detect_platform_name() == "cpu"


def test_backend_string_and_device_shim(tmp_path, monkeypatch):
    assert dedup_backend("cpu:gloo,cpu:gloo") == "cpu:gloo"
    assert dedup_backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    with pytest.raises(ValueError, match="conflicting"):
        dedup_backend("cpu:gloo,cpu:mpi")
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    monkeypatch.delenv("VERL_ENGINE_DEVICE", raising=False)
    platform = PlatformCPU()  # selected: installs the de-duplication, as in every CPU process
    backend = f"cpu:gloo,{platform.device_name}:{platform.communication_backend_name()}"  # verl's string
    torch.distributed.init_process_group(backend=backend, init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        t = torch.ones(2)
        torch.distributed.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
    finally:
        torch.distributed.destroy_process_group()
    shim = platform.device_module
    assert shim is cpu_device_module and shim.current_device() == "cpu"
    assert shim.memory_allocated() == 0 and shim.empty_cache() is None and shim.synchronize() is None
    assert torch.equal(shim.get_rng_state(), torch.get_rng_state())
    with pytest.raises(AttributeError):
        shim.no_such_call  # noqa: B018
    assert os.environ["VERL_ENGINE_DEVICE"] == "cuda"  # verl's FSDP engine is handed out on CPU


# -- registries, options, rewards -----------------------------------------------------------------
def test_rollout_is_registered_with_verl():
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    from verl_lrstab_cpu.rollout import TransformersReplica, TransformersServerAdapter

    assert get_rollout_class(ROLLOUT_NAME, "async") is TransformersServerAdapter
    assert get_rollout_replica_class(ROLLOUT_NAME) is TransformersReplica


def test_backend_options_are_validated():
    class Cfg:
        engine_kwargs = {"transformers": {"weight_noise": 0.01}}

    assert backend_options(Cfg())["weight_noise"] == 0.01
    assert backend_options(Cfg())["batch_invariant"] is None  # on for float32 generation
    assert backend_options(Cfg())["weight_noise_growth"] == 1.0  # constant noise unless asked
    Cfg.engine_kwargs = {"transformers": {"weight_nosie": 0.01}}
    with pytest.raises(ValueError, match=r"weight_nosie.*engine_kwargs\.transformers.*allowed"):
        backend_options(Cfg())
    Cfg.engine_kwargs = {"transformers": {"weight_noise_growth": 0}}
    with pytest.raises(ValueError, match=r"engine_kwargs\.transformers\.weight_noise_growth must be > 0"):
        backend_options(Cfg())
    Cfg.engine_kwargs = {"transformers": {"batch_invariant": "yes"}}
    with pytest.raises(ValueError, match=r"engine_kwargs\.transformers\.batch_invariant must be true, false or null"):
        backend_options(Cfg())


def test_v1_batches_in_content_order():
    """The V1 replay buffer's order and group split depend on the samples' content only."""
    from verl_lrstab_cpu.sampler import content_order, regroup

    # two groups of prompt (1,) (a duplicated prompt) and one of prompt (2,); responses as 1-tuples
    uids = ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    prompts = [(1,)] * 8 + [(2,)] * 4
    responses = [(r,) for r in (5, 3, 3, 1, 9, 2, 2, 7, 4, 4, 1, 0)]
    assert content_order(uids, prompts, responses) == [3, 1, 2, 0, 5, 6, 7, 4, 11, 10, 8, 9]
    new = regroup(uids, prompts, responses)
    assert new == ["b", "a", "a", "b", "a", "a", "b", "b", "c", "c", "c", "c"]
    # the same samples arriving in another order (and with their groups split otherwise) end up
    # in the same batch: same rows in the same order, same groups
    perm = [7, 0, 11, 4, 2, 9, 5, 1, 10, 3, 8, 6]
    other_uids = [("b" if i == 0 else "a") if i in (0, 4) else uids[i] for i in perm]  # rows 0 and 4 swap groups
    p2, r2 = [prompts[i] for i in perm], [responses[i] for i in perm]
    g2 = regroup(other_uids, p2, r2)
    order2 = content_order(g2, p2, r2)
    batch = lambda g, p, r, order: [(p[i], r[i], tuple(sorted(r[j] for j in range(len(g)) if g[j] == g[i]))) for i in order]  # noqa: E731
    assert batch(g2, p2, r2, order2) == batch(new, prompts, responses, content_order(new, prompts, responses))


def test_rewards():
    assert rewards.arithmetic_dense("x", "the answer is 7", "7") == pytest.approx(1.0)
    assert rewards.arithmetic_dense("x", "no number", "7") == 0.0
    assert 0.2 < rewards.arithmetic_dense("x", "9", "7") < 1.0
    assert rewards.longer_is_better("x", "a" * 60, "7") == pytest.approx(0.5)
    assert rewards.longer_is_better("x", "a" * 500, "7") == 1.0
    assert rewards.longer_is_better("x", "ab", "7", target_chars=4) == 0.5
