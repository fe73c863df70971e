"""`scripts/demo.py`'s defaults: `make demo` samples with verl's vLLM rollout; the transformers form is its own target."""

from __future__ import annotations

import importlib.util
import re

import pytest

from verl_lrstab_cpu.launch import REPO_ROOT

_spec = importlib.util.spec_from_file_location("lrstab_demo", REPO_ROOT / "scripts" / "demo.py")
demo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(demo)


def test_the_default_demo_is_verls_vllm_rollout_with_its_own_assets_and_output():
    args = demo.parse_args([])
    assert (args.rollout, args.steps, args.model) == ("vllm", 40, "tiny")
    assert args.assets == REPO_ROOT / ".assets-vllm" and args.out == REPO_ROOT / "outputs" / "demo"


def test_the_transformers_form_keeps_apart_from_the_vllm_demo():
    args = demo.parse_args(["--rollout", "transformers"])
    assert args.assets == REPO_ROOT / ".assets" and args.out == REPO_ROOT / "outputs" / "demo-transformers"


def test_the_real_model_refuses_the_transformers_rollout(capsys):
    with pytest.raises(SystemExit):
        demo.parse_args(["--model", "real", "--rollout", "transformers"])
    assert "--rollout vllm" in capsys.readouterr().err


def _recipe(target: str) -> list[str]:
    """The command lines of a Makefile target (its prerequisites on the first line)."""
    lines = (REPO_ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"^{re.escape(target)}:", line))
    body = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        body.append(line)
    return body


def test_make_demo_installs_vllm_and_runs_the_default_the_other_targets_name_their_rollout():
    demo_rule = _recipe("demo")
    assert "install-vllm" in demo_rule[0].split(":", 1)[1]
    assert demo_rule[1].strip() == "$(PY) scripts/demo.py"
    assert _recipe("demo-vllm")[0].split(":", 1)[1].split() == ["demo"]
    transformers = _recipe("demo-transformers")
    assert transformers[0].split(":", 1)[1].split() == ["install"]
    assert "--rollout transformers" in transformers[1]
