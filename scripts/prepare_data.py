#!/usr/bin/env python
"""Prepare the experiment kit's data as verl reads it (parquet, one chat prompt per row).

    python scripts/prepare_data.py gsm8k [--out data]   # starter: data/gsm8k/{train,test}.parquet
    python scripts/prepare_data.py dapo  [--out data]   # paper: data/dapo_math/train.parquet,
                                                        #        data/aime_2024/test.parquet

``--out`` defaults to ``$LRSTAB_DATA_DIR`` or ``./data``, where the configs look.

verl's preprocessing scripts (``examples/data_preprocess/gsm8k.py``, ``recipe/dapo/
prepare_dapo_data.sh``) live in verl's git repository, not in the ``verl`` wheel. This
reproduces their output: GSM8K rows exactly as ``gsm8k.py`` builds them (``data_source``
``openai/gsm8k``, scored by verl's ``gsm8k`` reward); for DAPO, the same two files the
recipe downloads (BytedTsinghua-SIA/DAPO-Math-17k and AIME-2024, already in verl's format,
``data_source`` ``math_dapo``, scored by verl's ``math_dapo`` reward). The released DAPO file
repeats each problem many times; we keep one copy of each. The paper's own filtering of the
DAPO set is not published: this is the closest public stand-in.

Needs network access to the Hugging Face Hub (``datasets`` / ``huggingface_hub``).
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pandas as pd

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
DAPO_TRAIN = ("BytedTsinghua-SIA/DAPO-Math-17k", "data/dapo-math-17k.parquet")
AIME_2024 = ("BytedTsinghua-SIA/AIME-2024", "data/aime-2024.parquet")


def gsm8k_record(example: dict, idx: int, split: str) -> dict:
    """One GSM8K example as verl's ``examples/data_preprocess/gsm8k.py`` writes it.

    Args:
        example: a row of ``openai/gsm8k`` (``question``, ``answer`` ending in ``#### <n>``).
        idx: its index in the split.
        split: ``train`` or ``test``.
    """
    match = re.search(r"#### (\-?[0-9\.\,]+)", example["answer"])
    if match is None:
        raise ValueError(f"gsm8k {split}[{idx}]: no '#### <answer>' in the answer")
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": example["question"] + " " + GSM8K_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": match.group(1).replace(",", "")},
        "extra_info": {"split": split, "index": idx, "answer": example["answer"], "question": example["question"]},
    }


def dedupe_prompts(df: pd.DataFrame) -> pd.DataFrame:
    """Keep the first row of each distinct prompt text (the DAPO file repeats its problems)."""
    text = df["prompt"].map(lambda msgs: "\n".join(m["content"] for m in msgs))
    return df[~text.duplicated()].reset_index(drop=True)


def prepare_gsm8k(out: Path) -> None:
    import datasets

    dest = out / "gsm8k"
    dest.mkdir(parents=True, exist_ok=True)
    data = datasets.load_dataset("openai/gsm8k", "main")
    for split in ("train", "test"):
        rows = [gsm8k_record(ex, i, split) for i, ex in enumerate(data[split])]
        pd.DataFrame(rows).to_parquet(dest / f"{split}.parquet")
        print(f"{dest / split}.parquet: {len(rows)} rows")


def prepare_dapo(out: Path) -> None:
    from huggingface_hub import hf_hub_download

    for (repo, filename), dest, dedupe in ((DAPO_TRAIN, out / "dapo_math" / "train.parquet", True),
                                          (AIME_2024, out / "aime_2024" / "test.parquet", False)):
        df = pd.read_parquet(hf_hub_download(repo_id=repo, filename=filename, repo_type="dataset"))
        n = len(df)
        if dedupe:
            df = dedupe_prompts(df)
        dest.parent.mkdir(parents=True, exist_ok=True)
        df.to_parquet(dest)
        print(f"{dest}: {len(df)} rows (of {n} in {repo})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", choices=["gsm8k", "dapo"])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("LRSTAB_DATA_DIR", "data")))
    args = parser.parse_args()
    {"gsm8k": prepare_gsm8k, "dapo": prepare_dapo}[args.dataset](args.out)


if __name__ == "__main__":
    main()
