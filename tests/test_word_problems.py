"""The word-problem generator and its grader (verl_lrstab_cpu.word_problems): fast, no model."""

from __future__ import annotations

import inspect
import re

import pytest

from verl_lrstab_cpu import word_problems as wp


def _evaluate_step(line: str) -> tuple[int, int]:
    """The arithmetic ``a op b = c`` of a reference step, evaluated: (computed, written)."""
    m = re.search(r"(\d+) ([x+\-/]) (\d+) = (\d+)", line)
    assert m, f"no arithmetic in step {line!r}"
    a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
    value = {"x": a * b, "+": a + b, "-": a - b, "/": a // b}[op]
    if op == "/":
        assert a % b == 0, line
    return value, c


def test_generator_is_deterministic_by_seed():
    assert wp.generate(50, seed=3) == wp.generate(50, seed=3)
    assert wp.generate(50, seed=3) != wp.generate(50, seed=4)
    assert wp.generate(0, seed=1) == []
    with pytest.raises(ValueError, match="n and shots"):
        wp.generate(-1, seed=1)


def test_every_template_is_drawn_and_has_2_to_3_steps():
    problems = wp.generate(400, seed=1)
    assert {p.kind for p in problems} == set(wp.TEMPLATES)
    assert all(2 <= len(p.steps) <= 3 for p in problems)
    assert all(0 <= p.answer < 100 for p in problems)


def test_reference_answers_are_correct():
    for p in wp.generate(500, seed=7):
        for line in p.steps:
            computed, written = _evaluate_step(line)
            assert computed == written, (p.question, line)
        # the last step's result is the answer, and the reference ends with the marked answer
        assert _evaluate_step(p.steps[-1])[1] == p.answer
        assert p.reference.splitlines()[-1] == f"#### {p.answer}"
        assert wp.compute_score(wp.DATA_SOURCE, p.reference, str(p.answer)) == 1.0
        for ex in p.examples:
            assert wp.compute_score(wp.DATA_SOURCE, ex.reference, ex.answer) == 1.0


def test_numbers_in_question_lead_to_answer_chain():
    """Each step's operands come from the question or from an earlier step's result."""
    for p in wp.generate(200, seed=11):
        known = {int(n) for n in re.findall(r"\d+", p.question)} | {2}  # "twice" is 2 x
        for line in p.steps:
            m = re.search(r"(\d+) [x+\-/] (\d+) = (\d+)", line)
            assert int(m[1]) in known and int(m[2]) in known, (p.question, line)
            known.add(int(m[3]))


def test_prompt_messages_shots_of_the_same_template():
    p = wp.generate(1, seed=5, shots=2)[0]
    msgs = p.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert msgs[0]["content"] == wp.INSTRUCTION and "####" in wp.INSTRUCTION
    assert msgs[-1]["content"] == p.question
    assert all(ex.kind == p.kind and ex.question != p.question for ex in p.examples)
    assert msgs[2]["content"] == p.examples[0].reference
    assert [m["role"] for m in wp.generate(1, seed=5, shots=0)[0].messages()] == ["system", "user"]


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("Step 1: 3 x 4 = 12.\nStep 2: 12 - 2 = 10.\n#### 10", "10", 1.0),
        ("#### 10", 10, 1.0),
        ("####10", "10", 1.0),
        ("####   10 apples.", "10", 1.0),
        ("#### $10", "10", 1.0),
        ("#### 10.0", "10", 1.0),
        ("#### 1,000", "1000", 1.0),
        ("#### 1 000", "1000", 1.0),
        ("#### -3", "-3", 1.0),
        ("#### 11", "10", 0.0),  # wrong
        ("the answer is 10", "10", 0.0),  # no marked answer
        ("10", "10", 0.0),
        ("", "10", 0.0),
        ("#### ten", "10", 0.0),
        ("#### 7\nno wait\n#### 10", "10", 1.0),  # the last marked answer wins
        ("#### 10\nno wait\n#### 7", "10", 0.0),
        ("#### 10\n#### x", "10", 1.0),  # a marker without a number is not an answer
    ],
)
def test_compute_score(response, truth, score):
    assert wp.compute_score(wp.DATA_SOURCE, response, truth) == score


def test_extract_answer():
    assert wp.extract_answer("#### 4\n#### 5") == 5.0
    assert wp.extract_answer("no answer") is None


def test_compute_score_has_verls_custom_reward_signature():
    """verl calls compute_score(data_source=, solution_str=, ground_truth=, extra_info=, **reward_kwargs)."""
    params = inspect.signature(wp.compute_score).parameters
    assert list(params)[:4] == ["data_source", "solution_str", "ground_truth", "extra_info"]
    assert params["extra_info"].default is None
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    # what verl's reward loop passes (keyword arguments, extra ones included)
    assert wp.compute_score(data_source=wp.DATA_SOURCE, solution_str="#### 3", ground_truth="3",
                            extra_info={"index": 0}, reward_router_address=None) == 1.0
    with pytest.raises(ValueError, match="ground_truth"):
        wp.compute_score(wp.DATA_SOURCE, "#### 3", "three")


def test_loadable_the_way_verl_loads_it():
    """reward.custom_reward_function.path=pkg://verl_lrstab_cpu.word_problems, name=compute_score."""
    from verl.utils.import_utils import load_extern_object

    fn = load_extern_object(module_path="pkg://verl_lrstab_cpu.word_problems", object_name="compute_score")
    assert fn("x", "#### 2", "2") == 1.0
