"""The task family: multi-digit addition, answered directly or worked digit by digit.

A direct answer (``347+589`` -> ``936``) asks a tiny model to propagate every carry in
one pass, MSD first; the worked form writes one column per step, LSD first, with the
carry, then the result::

    7+9=16,4+8+1=13,3+5+1=9,=936

so each step is a one-digit sum: longer, and far more accurate for a tiny model. The
reward (:func:`compute_score`) checks only the final integer: length is never paid
directly, working longer pays only through accuracy.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any, Optional, Sequence

DATA_SOURCE = "lrstab_repro_add"
_ANSWER = re.compile(r"=(-?\d+)\s*$")
_MARKED_ANSWER = re.compile(r"(?:^|,)=(-?\d+)")  # the answer marker ",=N" (a bare "=" opening a step), anywhere


def make_problem(rng: random.Random, min_digits: int, max_digits: int) -> tuple[int, int]:
    """Two operands with ``min_digits..max_digits`` digits each (drawn independently).

    Args:
        rng: the random source.
        min_digits: fewest digits of an operand (>= 1).
        max_digits: most digits of an operand (>= min_digits).

    Returns:
        ``(a, b)``.
    """
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"digits must satisfy 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")

    def draw() -> int:
        d = rng.randint(min_digits, max_digits)
        return rng.randint(10 ** (d - 1) if d > 1 else 0, 10**d - 1)

    return draw(), draw()


def question(a: int, b: int) -> str:
    """The user turn: ``"347+589"``."""
    return f"{a}+{b}"


def direct_answer(a: int, b: int) -> str:
    """The short form: ``"=936"``."""
    return f"={a + b}"


def worked_answer(a: int, b: int) -> str:
    """The long form: one column per step, LSD first, with the carry, then ``=result``.

    Args:
        a: first operand (>= 0).
        b: second operand (>= 0).

    Returns:
        e.g. ``"7+9=16,4+8+1=13,3+5+1=9,=936"`` for 347+589.
    """
    da, db = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        steps.append(f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={s}")
        carry = s // 10
    return ",".join(steps) + f",={a + b}"


def parse_answer(text: str) -> Optional[int]:
    """The final answer: the integer after the LAST ``=``, at the end of the text; else None."""
    m = _ANSWER.search(text.strip())
    return int(m.group(1)) if m else None


def parse_marked_answer(text: str) -> Optional[int]:
    """The answer as a math grader finds a ``\\boxed{}``: the LAST ``,=N`` (or a leading ``=N``), wherever it is.

    Text after it is ignored, so a response that rambles on after its answer keeps its reward
    (as with graders that extract the last boxed answer), unlike :func:`parse_answer`.
    """
    found = _MARKED_ANSWER.findall(text.strip())
    return int(found[-1]) if found else None


def compute_score_marked(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None, **kwargs
) -> float:
    """verl ``custom_reward_function`` with the lenient grader: 1.0 if the last ``,=N`` is the sum (see
    :func:`parse_marked_answer`), else 0.0. Arguments as :func:`compute_score`.
    """
    answer = parse_marked_answer(solution_str)
    return 1.0 if answer is not None and answer == int(ground_truth) else 0.0


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None, **kwargs
) -> float:
    """verl ``custom_reward_function``: 1.0 if the final ``=N`` is the sum, else 0.0.

    Args:
        data_source: dataset tag (unused).
        solution_str: decoded response.
        ground_truth: the correct sum (str or int).
        extra_info: per-sample info (unused).
        **kwargs: unused.

    Returns:
        The accuracy reward, 0.0 or 1.0; the length of the answer is never rewarded.
    """
    answer = parse_answer(solution_str)
    return 1.0 if answer is not None and answer == int(ground_truth) else 0.0


def answer_mode(text: str) -> str:
    """``"worked"`` if the response shows column steps (a ``,``), else ``"direct"``."""
    return "worked" if "," in text else "direct"


def write_parquet(path: Path, problems: Sequence[tuple[int, int]], split: str) -> None:
    """verl's RL parquet layout (``data_source``, ``prompt``, ``ability``, ``reward_model``, ``extra_info``).

    Args:
        path: output file.
        problems: ``(a, b)`` pairs.
        split: ``"train"`` or ``"test"``, recorded in ``extra_info``.
    """
    import pandas as pd

    records = [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": question(a, b)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": i, "question": question(a, b)},
        }
        for i, (a, b) in enumerate(problems)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame.from_records(records).to_parquet(path)
