"""Easy multi-step arithmetic word problems and their grader, for runs on a real pretrained model.

A seeded local generator (no data set download): 2-3 step problems with small numbers, e.g.
"Tom has 3 boxes with 4 apples in each box. He gives away 2 apples. How many apples does he
have left?", each with a worked, step-by-step reference answer that ends in a marked final
answer::

    Step 1: 3 boxes of 4 apples: 3 x 4 = 12 apples.
    Step 2: He gives away 2: 12 - 2 = 10 apples.
    #### 10

**The final-answer marker is GSM8K's ``#### N``** (not ``\\boxed{N}``): it is what verl's own
GSM8K scorer (``verl.utils.reward_score.gsm8k``) and the starter configs of this package grade,
it is plain text (no LaTeX braces for a 135M model to balance), and the grader's rule is
unambiguous (the number right after the last ``####``). The prompt (:meth:`Problem.messages`)
asks for step-by-step reasoning and that marked last line (:data:`INSTRUCTION`, the system
message), after two worked examples of the same template as earlier chat turns (without them the
model scores too rarely to learn from: :data:`DEFAULT_SHOTS`).

:func:`compute_score` has verl's custom-reward signature; use it with
``reward.custom_reward_function.path=pkg://verl_lrstab_cpu.word_problems`` and
``reward.custom_reward_function.name=compute_score``.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

DATA_SOURCE = "lrstab_word_problems"
MARKER = "####"
# Changing the templates, the names or the instruction changes the data: bump it (the asset
# builder of verl_lrstab_cpu.real_model rebuilds the parquet files when it changes).
VERSION = 2
# The system message of every prompt.
INSTRUCTION = ("You are a helpful assistant. Solve each math problem step by step. On the last line, write the "
               f"final answer in the form: {MARKER} <number>")
# Worked examples of the same template (other numbers) before the question, as earlier chat turns.
# Measured on SmolLM2-135M-Instruct (vLLM-CPU bf16, temperature 1, 48 problems x 4 samples): with a
# generic example the model scores 3 %, with 1 of the same template 8 %, with 2 of them 22 % (and
# ends 96 % of its answers with a marked number).
DEFAULT_SHOTS = 2

_PEOPLE = [("Tom", "he"), ("Anna", "she"), ("Sam", "he"), ("Mia", "she"), ("Leo", "he"), ("Lily", "she"),
           ("Ben", "he"), ("Emma", "she"), ("Max", "he"), ("Zoe", "she")]
_ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "cards", "stamps", "oranges"]
_CONTAINERS = ["boxes", "bags", "baskets", "jars"]


@dataclass(frozen=True)
class Problem:
    """One word problem.

    Attributes:
        question: the problem text.
        steps: the worked solution, one line per step (each with its arithmetic).
        answer: the correct final answer.
        kind: the template's name.
        examples: worked problems of the same template shown before it in the prompt.
    """

    question: str
    steps: tuple[str, ...]
    answer: int
    kind: str
    examples: tuple["Problem", ...] = ()

    @property
    def reference(self) -> str:
        """The step-by-step reference answer with the marked final answer as its last line."""
        return "\n".join([*self.steps, f"{MARKER} {self.answer}"])

    def messages(self) -> list[dict[str, str]]:
        """The prompt as chat messages (verl applies the model's own chat template to them).

        The system message :data:`INSTRUCTION`, each example as a user turn (its question) and an
        assistant turn (its reference answer), then the question.
        """
        turns = [{"role": "system", "content": INSTRUCTION}]
        for ex in self.examples:
            turns += [{"role": "user", "content": ex.question}, {"role": "assistant", "content": ex.reference}]
        return [*turns, {"role": "user", "content": self.question}]


def _person(rng: random.Random, exclude: str = "") -> tuple[str, str]:
    return rng.choice([p for p in _PEOPLE if p[0] != exclude])


# Every template draws its numbers, writes the question and the steps. The numbers are small (one
# digit mostly, answers below 40): SmolLM2-135M's arithmetic is weak and a task it never solves
# gives GRPO no signal.
def _gets_then_gives(rng: random.Random) -> Problem:
    (name, he), item = _person(rng), rng.choice(_ITEMS)
    friend = _person(rng, exclude=name)[0]
    a, b = rng.randint(2, 9), rng.randint(1, 9)
    c = rng.randint(1, a + b - 1)
    return Problem(
        f"{name} has {a} {item}. {he.capitalize()} gets {b} more {item}. Then {he} gives {c} {item} to {friend}. "
        f"How many {item} does {name} have now?",
        (f"Step 1: after getting {b}: {a} + {b} = {a + b} {item}.",
         f"Step 2: after giving {c} away: {a + b} - {c} = {a + b - c} {item}."),
        a + b - c, "gets_then_gives")


def _loses_then_finds(rng: random.Random) -> Problem:
    (name, he), item = _person(rng), rng.choice(_ITEMS)
    a = rng.randint(3, 12)
    b, c = rng.randint(1, a - 1), rng.randint(1, 9)
    return Problem(
        f"{name} has {a} {item}. {he.capitalize()} loses {b} {item}. Then {he} finds {c} {item}. "
        f"How many {item} does {he} have now?",
        (f"Step 1: after losing {b}: {a} - {b} = {a - b} {item}.",
         f"Step 2: after finding {c}: {a - b} + {c} = {a - b + c} {item}."),
        a - b + c, "loses_then_finds")


def _boxes_give_away(rng: random.Random) -> Problem:
    (name, he), item, box = _person(rng), rng.choice(_ITEMS), rng.choice(_CONTAINERS)
    a, b = rng.randint(2, 4), rng.randint(2, 5)
    c = rng.randint(1, a * b - 1)
    return Problem(
        f"{name} has {a} {box} with {b} {item} in each. {he.capitalize()} gives away {c} {item}. "
        f"How many {item} does {he} have left?",
        (f"Step 1: {a} {box} of {b} {item}: {a} x {b} = {a * b} {item}.",
         f"Step 2: {he} gives away {c}: {a * b} - {c} = {a * b - c} {item}."),
        a * b - c, "boxes_give_away")


def _buy_packs(rng: random.Random) -> Problem:
    (name, he), item = _person(rng), rng.choice(_ITEMS)
    a, b, c = rng.randint(1, 9), rng.randint(2, 3), rng.randint(2, 5)
    return Problem(
        f"{name} has {a} {item}. {he.capitalize()} buys {b} packs with {c} {item} in each pack. "
        f"How many {item} does {he} have now?",
        (f"Step 1: {b} packs of {c}: {b} x {c} = {b * c} {item}.",
         f"Step 2: {a} + {b * c} = {a + b * c} {item}."),
        a + b * c, "buy_packs")


def _change(rng: random.Random) -> Problem:
    (name, he) = _person(rng)
    thing = rng.choice([("notebook", "notebooks"), ("pen", "pens"), ("ball", "balls"), ("cup", "cups")])
    price, count = rng.randint(1, 4), rng.randint(2, 3)
    bill = 10 if price * count < 10 else 20
    return Problem(
        f"A {thing[0]} costs {price} dollars. {name} buys {count} {thing[1]} and pays with a {bill} dollar bill. "
        f"How many dollars of change does {he} get?",
        (f"Step 1: {count} {thing[1]} cost {count} x {price} = {count * price} dollars.",
         f"Step 2: the change is {bill} - {count * price} = {bill - count * price} dollars."),
        bill - count * price, "change")


def _share_then_eat(rng: random.Random) -> Problem:
    (name, _), item = _person(rng), rng.choice(["cookies", "candies", "grapes", "crackers"])
    friends, each = rng.randint(2, 3), rng.randint(2, 5)
    eat = rng.randint(1, each - 1)
    total = friends * each
    return Problem(
        f"{name} has {total} {item} and shares them equally among {friends} friends. "
        f"Each friend eats {eat} of them. How many {item} does each friend have left?",
        (f"Step 1: each friend gets {total} / {friends} = {each} {item}.",
         f"Step 2: each friend eats {eat}: {each} - {eat} = {each - eat} {item}."),
        each - eat, "share_then_eat")


def _three_changes(rng: random.Random) -> Problem:
    (name, he), item = _person(rng), rng.choice(_ITEMS)
    friend = _person(rng, exclude=name)[0]
    a, b = rng.randint(2, 9), rng.randint(1, 5)
    c = rng.randint(1, a + b - 1)
    d = rng.randint(1, 5)
    return Problem(
        f"{name} had {a} {item}. {he.capitalize()} bought {b} more, then gave {c} to {friend}, "
        f"and then found {d} more. How many {item} does {name} have now?",
        (f"Step 1: after buying: {a} + {b} = {a + b} {item}.",
         f"Step 2: after giving {c} away: {a + b} - {c} = {a + b - c} {item}.",
         f"Step 3: after finding {d}: {a + b - c} + {d} = {a + b - c + d} {item}."),
        a + b - c + d, "three_changes")


def _rows_of_chairs(rng: random.Random) -> Problem:
    rows, per_row = rng.randint(2, 3), rng.randint(2, 5)
    broken = rng.randint(1, rows * per_row - 1)
    added = rng.randint(1, 5)
    return Problem(
        f"A room has {rows} rows of chairs with {per_row} chairs in each row. {broken} chairs are broken "
        f"and taken away, and {added} new chairs are brought in. How many chairs are in the room now?",
        (f"Step 1: {rows} rows of {per_row}: {rows} x {per_row} = {rows * per_row} chairs.",
         f"Step 2: without the broken ones: {rows * per_row} - {broken} = {rows * per_row - broken} chairs.",
         f"Step 3: with the new ones: {rows * per_row - broken} + {added} = {rows * per_row - broken + added} chairs."),
        rows * per_row - broken + added, "rows_of_chairs")


def _more_than(rng: random.Random) -> Problem:
    (name, _), item = _person(rng), rng.choice(_ITEMS)
    friend = _person(rng, exclude=name)[0]
    a, more = rng.randint(1, 9), rng.randint(1, 5)
    return Problem(
        f"{name} has {a} {item}. {friend} has {more} more {item} than {name}. "
        f"How many {item} do they have together?",
        (f"Step 1: {friend} has {a} + {more} = {a + more} {item}.",
         f"Step 2: together: {a} + {a + more} = {2 * a + more} {item}."),
        2 * a + more, "more_than")


def _twice_as_many(rng: random.Random) -> Problem:
    (name, _), item = _person(rng), rng.choice(_ITEMS)
    friend = _person(rng, exclude=name)[0]
    a = rng.randint(1, 6)
    c = rng.randint(1, 2 * a - 1)
    return Problem(
        f"{name} has {a} {item}. {friend} has twice as many {item} as {name}. Then {friend} gives away {c} {item}. "
        f"How many {item} does {friend} have now?",
        (f"Step 1: {friend} has 2 x {a} = {2 * a} {item}.",
         f"Step 2: after giving {c} away: {2 * a} - {c} = {2 * a - c} {item}."),
        2 * a - c, "twice_as_many")


def _pages_per_day(rng: random.Random) -> Problem:
    (name, he) = _person(rng)
    per_day, days, extra = rng.randint(2, 5), rng.randint(2, 3), rng.randint(1, 5)
    return Problem(
        f"{name} reads {per_day} pages every day for {days} days. On the next day {he} reads {extra} pages. "
        f"How many pages does {he} read in total?",
        (f"Step 1: {days} days of {per_day} pages: {days} x {per_day} = {days * per_day} pages.",
         f"Step 2: plus the last day: {days * per_day} + {extra} = {days * per_day + extra} pages."),
        days * per_day + extra, "pages_per_day")


TEMPLATES: dict[str, Callable[[random.Random], Problem]] = {
    f.__name__.lstrip("_"): f
    for f in (_gets_then_gives, _loses_then_finds, _boxes_give_away, _buy_packs, _change, _share_then_eat, _three_changes, _rows_of_chairs,
              _more_than, _twice_as_many, _pages_per_day)
}


def generate(n: int, seed: int, shots: int = DEFAULT_SHOTS) -> list[Problem]:
    """``n`` problems, the templates drawn uniformly; the same arguments give the same list.

    Args:
        n: how many problems (>= 0).
        seed: the random seed.
        shots: worked examples of the same template attached to each problem (:attr:`Problem.examples`),
            each with another question.

    Returns:
        The problems.
    """
    if n < 0 or shots < 0:
        raise ValueError(f"n and shots must be >= 0, got n={n}, shots={shots}")
    rng = random.Random(seed)
    names = sorted(TEMPLATES)
    out = []
    for _ in range(n):
        make = TEMPLATES[rng.choice(names)]
        problem = make(rng)
        examples: list[Problem] = []
        while len(examples) < shots:
            ex = make(rng)
            if ex.question != problem.question and all(ex.question != e.question for e in examples):
                examples.append(ex)
        out.append(replace(problem, examples=tuple(examples)))
    return out


# ---------------------------------------------------------------- the grader
# `#### N` with N an integer or decimal, optionally negative or with a `$`, thousands groups with
# a comma or a space ("1,000", "1 000"); whitespace between the marker and the number.
_MARKED = re.compile(re.escape(MARKER) + r"[ \t]*\$?[ \t]*(-?(?:\d{1,3}(?:[, ]\d{3})+|\d+)(?:\.\d+)?)")


def extract_answer(solution_str: str) -> Optional[float]:
    """The number after the LAST ``####`` of a response, or None when there is no marked number."""
    found = _MARKED.findall(solution_str)
    if not found:
        return None
    return float(found[-1].replace(",", "").replace(" ", ""))


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None, **kwargs
) -> float:
    """1.0 when the response's marked final answer equals the ground truth, else 0.0.

    The answer is the number after the last ``####`` (an earlier marked answer is overridden by a
    later one); commas, spaces between thousands groups and between the marker and the number, a
    ``$`` and a trailing ``.0`` are tolerated. A response without a marked answer scores 0.

    Args:
        data_source: dataset tag (unused).
        solution_str: the decoded response.
        ground_truth: the correct answer (int or its string form).
        extra_info: per-sample info (unused).
        **kwargs: what verl adds for some reward set-ups (``reward_router_address``, ...); ignored.

    Returns:
        1.0 or 0.0.
    """
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    try:
        truth = float(str(ground_truth).replace(",", "").strip())
    except ValueError as e:
        raise ValueError(f"ground_truth must be a number, got {ground_truth!r}") from e
    return 1.0 if abs(answer - truth) < 1e-9 else 0.0
