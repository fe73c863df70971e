"""Each option's default, bound and documentation live in one place, ``LengthSurgeConfig``: its docstring
(``Args:``) states the default the field has and the bound its ``__post_init__`` enforces, the CLI's help
is that docstring, and docs/configuration.md's option table states the same defaults and bounds, one
row per option a user sets. Pure Python: no verl, no torch."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from test_docs import ROOT, prose_lines
from verl_lrstab.config import OPTIONS_KEY, RATIO_ONLY, LengthSurgeConfig, option_docs

FIELDS = {f.name: f for f in dataclasses.fields(LengthSurgeConfig)}
DOCS = option_docs()
TABLE = ROOT / "docs" / "configuration.md"
_ROW = re.compile(r"^\| `(\w+)` \| `([^`]*)` \| (.*) \|$")
# set by ``lrstab guard`` on each relaunch, not by a user: in the docstring, not in the table
GUARD_ONLY = {"decay_from_step", "guard_rollbacks"}
# "(> 0)", "(>= 1)", "(...; >= 1)", "(> 0; ...)" and "in (0, 1)", "in (0, 1000]", "in [1, 10000000]"
_SIDE = re.compile(r"(?:\(|; )(>=?) (\d+(?:\.\d+)?)(?=[);])")
_RANGE = re.compile(r"\bin ([(\[])(\d+(?:\.\d+)?), (\d+(?:\.\d+)?)([)\]])")


def bound(text: str):
    """The bound ``text`` states: ``(low, low_included, high, high_included)``, or None."""
    m = _RANGE.search(text)
    if m:
        return float(m.group(2)), m.group(1) == "[", float(m.group(3)), m.group(4) == "]"
    m = _SIDE.search(text)
    if m:
        return float(m.group(2)), m.group(1) == ">=", math.inf, False
    return None


def test_the_bound_reader_reads_each_form():
    assert bound("cusum: x (> 1). Default 1.2.") == (1.0, False, math.inf, False)
    assert bound("(> 0; 0.05 = 5 %). Default") == (0.0, False, math.inf, False)
    assert bound("(ratio detector and mismatch trigger; >= 1). Default 3.") == (1.0, True, math.inf, False)
    assert bound("the floor, in (0, 1]. Default 0.1.") == (0.0, False, 1.0, True)
    assert bound("a period, in [1, 10000000]. When set") == (1.0, True, 1e7, True)
    assert bound("Default 10.") is None


def context(key: str) -> dict:
    """The other options a value of ``key`` is read with (an option the chosen detector or trigger does not
    read is refused whatever its value)."""
    if key in RATIO_ONLY:
        return {"detector": "ratio"}
    if key.startswith("mismatch_") or key == "patience":
        return {"trigger": "mismatch"}
    return {"decay_period": 10} if key == "decay_from_step" else {}


def refused(key: str, value) -> bool:
    try:
        LengthSurgeConfig.from_dict({**context(key), key: value})
    except ValueError as err:
        assert f"{OPTIONS_KEY}.{key}=" in str(err) and "allowed values are" in str(err), str(err)
        return True
    return False


def _numeric(key: str) -> bool:
    return DOCS[key][0].split(" ")[0] in ("int", "float")


def test_every_option_is_documented_once_with_its_type():
    assert set(DOCS) == set(FIELDS)
    for key, f in FIELDS.items():
        annotated = f.type if isinstance(f.type, str) else f.type.__name__  # "Optional[int]" under __future__
        assert DOCS[key][0].replace(" | None", "") == annotated.replace("Optional[", "").rstrip("]"), key


@pytest.mark.parametrize("key", sorted(FIELDS))
def test_the_docstrings_default_is_the_fields(key):
    default, text = FIELDS[key].default, DOCS[key][1]
    if isinstance(default, str):
        assert f'``"{default}"`` (default' in text, (key, text)
        return
    stated = re.findall(r"Default (\S+?)[.,;:]?(?:\s|$)", text)
    assert stated, f"{key}: no 'Default ...' in its docstring: {text}"
    if isinstance(default, float):
        assert float(stated[0]) == default, (key, stated)
    else:
        assert stated[0] == str(default), (key, stated)


@pytest.mark.parametrize("key", sorted(k for k in FIELDS if _numeric(k)))
def test_the_docstrings_bound_is_the_one_enforced(key):
    stated = bound(DOCS[key][1])
    assert stated is not None, f"{key}: its docstring states no bound: {DOCS[key][1]}"
    low, low_in, high, high_in = stated
    integer = DOCS[key][0].startswith("int")
    step = 1 if integer else 1e-6 * max(1.0, abs(low))
    num = int if integer else float
    assert refused(key, num(low - step) if low_in else num(low)), f"{key}: {low} is not refused"
    assert not refused(key, num(low) if low_in else num(low + (1 if integer else 0.5 * min(1.0, high - low)))), key
    if math.isfinite(high):
        assert refused(key, num(high + step) if high_in else num(high)), f"{key}: {high} is not refused"
        assert not refused(key, num(high)) if high_in else True
    assert refused(key, True), f"{key}: a YAML true is not refused"  # bool is an int in Python
    if not integer:
        assert refused(key, math.nan) and refused(key, math.inf), key


def table():
    rows = {}
    for number, line in prose_lines(TABLE):
        m = _ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"configuration.md:{number}: `{m.group(1)}` has two rows"
            rows[m.group(1)] = (number, m.group(2), m.group(3))
    return rows


def test_the_table_has_a_row_per_option_a_user_sets():
    assert set(table()) == set(FIELDS) - GUARD_ONLY


@pytest.mark.parametrize("key", sorted(set(FIELDS) - GUARD_ONLY))
def test_the_tables_bound_is_the_docstrings(key):
    number, _, meaning = table()[key]
    stated = bound(meaning)
    assert stated is not None or not _numeric(key), f"configuration.md:{number}: `{key}` states no bound"
    assert stated == bound(DOCS[key][1]), (
        f"configuration.md:{number}: `{key}` states {stated}, the config {bound(DOCS[key][1])}")
