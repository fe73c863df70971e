"""Tiny local assets for CPU runs of verl's trainer, built in seconds without any hub access.

* a byte-level BPE tokenizer trained with ``tokenizers`` on the task's own text,
  with a ChatML chat template (``<|im_start|>``/``<|im_end|>``);
* a Qwen2-architecture causal LM (hidden 64, 2 layers, ~60k parameters), randomly
  initialised, then warm-started for a few seconds on "question -> answer<|im_end|>"
  so that it answers SHORT (a random model never emits its stop token and hits
  the length cap every time: no length can then rise);
* an arithmetic dataset (``a + b`` / ``a - b``) in verl's RL parquet format
  (``data_source``, ``prompt``, ``ability``, ``reward_model``, ``extra_info``).

Everything lands in one directory; a stamp file makes rebuilding a no-op unless
the recipe (:data:`RECIPE`) changed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Optional

DATA_SOURCE = "lrstab_arith"
ENV_VAR = "LRSTAB_ASSETS"

# Changing any value rebuilds the assets (the stamp file records it).
RECIPE = {
    "version": 6,
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "n_train": 512,
    "n_val": 32,
    "max_operand": 30,
    "warmup_steps": 150,
    "warmup_lr": 3e-3,
    "long_answer_fraction": 0.4,
    "seed": 7,
}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_WORDS = (
    "the answer is so we add take away result sum difference first second number then gives "
    "let me think step carefully check again because equals plus minus total count left right"
).split()


def default_assets_dir() -> Path:
    """``$LRSTAB_ASSETS`` if set, else ``~/.cache/verl_lrstab/assets``."""
    env = os.environ.get(ENV_VAR)
    return Path(env).expanduser().resolve() if env else Path.home() / ".cache" / "verl_lrstab" / "assets"


def asset_paths(root: Optional[os.PathLike] = None) -> dict[str, str]:
    """Absolute paths of the assets under ``root`` (default :func:`default_assets_dir`)."""
    root = Path(root).expanduser().resolve() if root else default_assets_dir()
    return {
        "root": str(root),
        "model": str(root / "model"),
        "train": str(root / "data" / "train.parquet"),
        "val": str(root / "data" / "val.parquet"),
    }


def _problems(n: int, rng: random.Random, max_operand: int) -> list[tuple[str, str]]:
    out = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if rng.random() < 0.5:
            out.append((f"{a} + {b} =", str(a + b)))
        else:
            out.append((f"{a} - {b} =", str(a - b)))
    return out


def _build_tokenizer(out_dir: Path, corpus: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=RECIPE["vocab_size"],
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(out_dir)
    return hf_tok


def _warm_start(model, tokenizer, problems: list[tuple[str, str]], seed: int) -> float:
    """A few seconds of supervised steps on ``answer<|im_end|>`` so the policy answers briefly."""
    import torch

    torch.manual_seed(seed)
    rng = random.Random(seed)
    rows = []
    for question, answer in problems:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if rng.random() < RECIPE["long_answer_fraction"]:
            # a minority of "thinking" answers: the long mode a length reward can amplify
            answer = " ".join(rng.sample(_WORDS, rng.randint(2, 8))) + " " + answer
        a_ids = tokenizer(answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
        rows.append((p_ids, a_ids))
    width = max(len(p) + len(a) for p, a in rows)
    pad = tokenizer.pad_token_id
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, a) in enumerate(rows):
        seq = p + a
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = torch.tensor(a)
        mask[i, : len(seq)] = 1
    opt = torch.optim.AdamW(model.parameters(), lr=RECIPE["warmup_lr"], weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    loss = torch.tensor(float("nan"))
    model.train()
    for _ in range(RECIPE["warmup_steps"]):
        idx = torch.randint(0, len(rows), (32,), generator=gen)
        loss = model(input_ids=ids[idx], attention_mask=mask[idx], labels=labels[idx]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


def _write_parquet(path: Path, problems: list[tuple[str, str]], split: str) -> None:
    import pandas as pd

    records = [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": q}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": a},
            "extra_info": {"split": split, "index": i, "question": q},
        }
        for i, (q, a) in enumerate(problems)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame.from_records(records).to_parquet(path)


def build_assets(root: Optional[os.PathLike] = None, force: bool = False) -> dict[str, str]:
    """Build (or reuse) the tokenizer, model and dataset.

    Args:
        root: output directory (default :func:`default_assets_dir`).
        force: rebuild even if the stamp says the assets are current.

    Returns:
        :func:`asset_paths` of ``root``.
    """
    paths = asset_paths(root)
    root_dir = Path(paths["root"])
    stamp = root_dir / "lrstab_assets.json"
    if not force and stamp.exists() and json.loads(stamp.read_text()).get("recipe") == RECIPE:
        return paths

    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    rng = random.Random(RECIPE["seed"])
    train = _problems(RECIPE["n_train"], rng, RECIPE["max_operand"])
    val = _problems(RECIPE["n_val"], rng, RECIPE["max_operand"])
    corpus = [f"{q} {a}" for q, a in train] + [" ".join(rng.sample(_WORDS, 6)) for _ in range(400)]
    corpus += ["user", "assistant", "\n"]

    # Build in a temp dir next to the target, then swap: concurrent readers never see half a model.
    root_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".lrstab_assets_", dir=root_dir.parent))
    try:
        tokenizer = _build_tokenizer(tmp / "model", corpus)
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        config = Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=RECIPE["hidden_size"],
            intermediate_size=RECIPE["intermediate_size"],
            num_hidden_layers=RECIPE["num_hidden_layers"],
            num_attention_heads=RECIPE["num_attention_heads"],
            num_key_value_heads=RECIPE["num_key_value_heads"],
            max_position_embeddings=RECIPE["max_position_embeddings"],
            tie_word_embeddings=True,
            bos_token_id=None,
            eos_token_id=im_end,
            pad_token_id=tokenizer.pad_token_id,
        )
        torch.manual_seed(RECIPE["seed"])
        model = Qwen2ForCausalLM(config)
        final_loss = _warm_start(model, tokenizer, train, RECIPE["seed"])
        model.generation_config = GenerationConfig(eos_token_id=[im_end], pad_token_id=tokenizer.pad_token_id)
        model.save_pretrained(tmp / "model")
        _write_parquet(tmp / "data" / "train.parquet", train, "train")
        _write_parquet(tmp / "data" / "val.parquet", val, "test")
        n_params = sum(p.numel() for p in model.parameters())
        (tmp / "lrstab_assets.json").write_text(
            json.dumps({"recipe": RECIPE, "n_params": n_params, "warmup_loss": final_loss}, indent=1)
        )
        if root_dir.exists():
            shutil.rmtree(root_dir)
        tmp.rename(root_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return paths
