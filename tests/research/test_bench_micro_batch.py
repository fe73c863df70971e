"""scripts/research/repro/bench_micro_batch.py times the same update at every micro-batch size: the gradient must not depend
on how the batch is cut and padded (right padding under the attention mask), or the ratios compare different work."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "research"))
from repro import bench_micro_batch as bench  # noqa: E402


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).train()


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()


def test_the_gradient_is_the_same_at_every_micro_batch_size():
    model = tiny_llama()
    g = torch.Generator().manual_seed(1)
    seqs = [(torch.randint(5, 1000, (n,), generator=g), r) for n, r in ((20, 5), (33, 12), (27, 9), (41, 3))]
    bench.update_seconds(model, seqs, 1)
    one = grads(model)
    for size in (2, 4):
        bench.update_seconds(model, seqs, size)
        assert torch.allclose(grads(model), one, rtol=1e-4, atol=1e-6), size
    assert one.abs().sum() > 0


@pytest.mark.parametrize("argv", [["--sizes", "0"], ["--rounds", "0"], ["--assets", "/nonexistent"]])
def test_bad_arguments_are_refused_before_any_work(argv, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert "error" in capsys.readouterr().err
