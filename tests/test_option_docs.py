"""Each option is declared once, in ``LengthSurgeConfig`` (``option()``: default, allowed values, meaning,
what reads it, what training does not read), and everything else is generated from that declaration or
checked against it: the checks refuse what the allowed values exclude and accept what they include, the
``Args:`` section and the ``lrstab`` flags' help are the declared texts, and the manual's option tables are
the ones ``scripts/gen_config_docs.py`` writes, with no option described by hand elsewhere. Pure Python:
no verl, no torch."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import re

import pytest

from test_docs import ROOT, prose_lines
from verl_lrstab.config import OPTIONS_KEY, LengthSurgeConfig, Option, integer, number, one_of, option_docs, options

FIELDS = {f.name: f for f in dataclasses.fields(LengthSurgeConfig)}
DECLARED = options()
DOCS = option_docs()


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _generator()


def context(key: str) -> dict:
    """The other options ``key`` is read with (set away from its default without them, it is refused)."""
    ctx = {k: values[0] for k, values in DECLARED[key].read_with[:1]}
    return {**ctx, "decay_period": 10} if key == "decay_from_step" else ctx


def refused(key: str, value) -> bool:
    try:
        LengthSurgeConfig.from_dict({**context(key), key: value})
    except ValueError as err:
        assert f"{OPTIONS_KEY}.{key}=" in str(err) and "allowed values are" in str(err), str(err)
        return True
    return False


def test_every_field_is_declared_with_its_default_and_type():
    assert set(DECLARED) == set(FIELDS)
    for key, f in FIELDS.items():
        o = DECLARED[key]
        assert isinstance(o, Option) and o.default == f.default, key
        assert o.allowed.admits(o.default), f"{key}: its default {o.default!r} is outside {o.allowed.text}"
        annotated = f.type if isinstance(f.type, str) else f.type.__name__  # "Optional[int]" under __future__
        assert o.allowed.type.replace(" | None", "") == annotated.replace("Optional[", "").rstrip("]"), key
        assert o.allowed.nullable == annotated.startswith("Optional["), key
        # one line, no bound or default of its own (they are rendered from the declaration: no second copy)
        assert o.meaning and "\n" not in o.meaning and not o.meaning.endswith("."), key
        assert not re.search(r"\bDefault\b|\(>=? \d|\bin [(\[]\d", o.meaning), f"{key} restates a bound: {o.meaning}"
        # the installed package's texts name no path it does not ship (tests/test_install.py): a page is `see`
        assert "docs/" not in o.meaning and (not o.see or (ROOT / "docs" / o.see.split("#")[0]).is_file()), key
        for other, _ in o.read_with:
            assert other in FIELDS and DECLARED[other].allowed.kind == "choice", key


def test_the_allowed_values_are_said_as_the_errors_say_them():
    assert number(0.0, 1.0).text == "a number in (0, 1)"
    assert number(0.0, 1000.0, high_in=True).text == "a number in (0, 1000]"
    assert number(1.0).text == "a number > 1"
    assert number(0.0, nullable=True).text == "null or a number > 0"
    assert integer(0).text == "an integer >= 0"
    assert integer(1, 10_000_000, nullable=True).text == "null or an integer in [1, 10000000]"
    assert one_of("start", "surge").text == "one of ['start', 'surge']"
    with pytest.raises(ValueError, match=re.escape(f"{OPTIONS_KEY}.gamma=1.5 is invalid: allowed values are "
                                                   "a number in (0, 1)")):
        LengthSurgeConfig(gamma=1.5)


@pytest.mark.parametrize("key", sorted(k for k in FIELDS if DECLARED[k].allowed.kind in ("number", "integer")))
def test_the_declared_bound_is_the_one_enforced(key):
    allowed = DECLARED[key].allowed
    low, high, integral = allowed.low, allowed.high, allowed.kind == "integer"
    step = 1 if integral else 1e-6 * max(1.0, abs(low))
    num = int if integral else float
    assert refused(key, num(low - step) if allowed.low_in else num(low)), f"{key}: {low} is not refused"
    inside = low if allowed.low_in else low + (1 if integral else 0.5 * min(1.0, high - low))
    assert not refused(key, num(inside)), f"{key}: {inside} is refused"
    if math.isfinite(high):
        assert refused(key, num(high + step) if allowed.high_in else num(high)), f"{key}: {high} is not refused"
        assert not refused(key, num(high)) if allowed.high_in else True
    assert refused(key, True), f"{key}: a YAML true is not refused"  # bool is an int in Python
    assert refused(key, "3"), f"{key}: a text is not refused"
    assert refused(key, None) != allowed.nullable, key
    if not integral:
        assert refused(key, math.nan) and refused(key, math.inf), key


@pytest.mark.parametrize("key", sorted(k for k in FIELDS if DECLARED[k].allowed.kind == "choice"))
def test_the_declared_choices_are_the_ones_enforced(key):
    for choice in DECLARED[key].allowed.choices:
        assert not refused(key, choice), (key, choice)
    assert refused(key, "no-such-choice") and refused(key, None), key


@pytest.mark.parametrize("key", sorted(k for k in FIELDS if DECLARED[k].read_with))
def test_an_option_is_refused_away_from_its_default_where_nothing_reads_it(key):
    o = DECLARED[key]
    if o.allowed.kind == "choice":
        value = next(c for c in o.allowed.choices if c != o.default)
    else:
        value = {"number": 0.75 if math.isfinite(o.allowed.high) else o.allowed.low + 2.0,
                 "integer": o.allowed.low + 2}[o.allowed.kind]
    value = value if value != o.default else value + 1
    assert o.allowed.admits(value) and value != o.default
    read = {k: values[0] for k, values in o.read_with[:1]}
    unread = {k: next(c for c in DECLARED[k].allowed.choices if all(c not in v for kk, v in o.read_with if kk == k))
              for k, _ in o.read_with}
    LengthSurgeConfig.from_dict({**read, key: value})  # read: accepted
    with pytest.raises(ValueError, match=rf"length_surge\.{key}={re.escape(repr(value))} is invalid: allowed values "
                                         rf"are its default {re.escape(repr(o.default))} with .*it is read by"):
        LengthSurgeConfig.from_dict({**unread, key: value})
    LengthSurgeConfig.from_dict({**unread, key: o.default})  # its default: accepted, whoever reads it


def test_the_args_section_and_the_cli_help_are_the_declared_texts():
    doc = LengthSurgeConfig.__doc__
    args = re.sub(r"\s+", " ", doc.split("Args:", 1)[1])
    for key, (typ, text) in DOCS.items():
        o = DECLARED[key]
        assert typ == o.allowed.type and f"{key} ({typ}): {text}" in args, key
        assert text.startswith(o.meaning.replace("`", "``")), key
        assert f"Allowed: {o.allowed.text}. Default {GEN.yaml_text(o.default)}." in text, key
    from verl_lrstab.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub.choices["replay"]._actions}
    for key, (_, text) in DOCS.items():
        listed = DECLARED[key].set_by == "user" and DECLARED[key].replayed
        assert helps[key] == (text.replace("``", "").replace("%", "%%") if listed else "==SUPPRESS=="), key


def test_training_refuses_only_where_training_does_not_read():
    assert LengthSurgeConfig().check_training() == LengthSurgeConfig()
    for key, o in DECLARED.items():
        if o.training is None:
            continue
        assert o.training.why and (o.training.where or o.training.when(LengthSurgeConfig())), key
    with pytest.raises(ValueError, match=r"max_surges=2 is invalid in training: allowed values are its default 1 "
                                         r"\(not read: the schedule follows the first surge only\)"):
        LengthSurgeConfig(max_surges=2).check_training()
    LengthSurgeConfig(max_surges=2)  # replay reports every surge
    with pytest.raises(ValueError, match=r"period_factor=1\.2 is invalid in training.*not read: a fixed "
                                         r"decay_period=20 halves the LR every 20 steps"):
        LengthSurgeConfig.from_dict({"decay_period": 20, "period_factor": 1.2}).check_training()
    LengthSurgeConfig.from_dict({"decay_period": 20, "decay_from_step": 5, "period_factor": 1.2}).check_training()


# -- the manual's tables -----------------------------------------------------------------------------------
def test_every_generated_table_is_current():
    pages = GEN.pages()
    assert ROOT / "docs" / "configuration.md" in pages
    for page in pages:
        text = page.read_text(encoding="utf-8")
        assert GEN.rendered(text, page.name) == text, (
            f"{page.name}: its option table differs from the declarations: run python scripts/gen_config_docs.py")


def test_the_configuration_table_lists_every_option_a_user_sets():
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert "<!-- generated by scripts/gen_config_docs.py: options all -->" in text.splitlines()
    user = [k for k, o in DECLARED.items() if o.set_by == "user"]
    assert GEN.keys_of("all") == user and set(user) == set(FIELDS) - {"decay_from_step", "guard_rollbacks"}
    for key in user:
        assert re.search(rf"^\| `{key}` \| `{re.escape(GEN.yaml_text(DECLARED[key].default))}` \| "
                         rf"{re.escape(DECLARED[key].allowed.text)} \| ", text, re.M), key


def test_the_generator_rewrites_a_stale_table_and_keeps_the_rest():
    page = ("# P\n\nbefore\n<!-- generated by scripts/gen_config_docs.py: options gamma horizon -->\n"
            "| `gamma` | `0.7` | old | stale |\n<!-- end of generated options -->\nafter\n")
    new = GEN.rendered(page, "p.md")
    assert new.startswith("# P\n\nbefore\n") and new.endswith("<!-- end of generated options -->\nafter\n")
    assert "| `gamma` | `0.5` | a number in (0, 1) | the multiplier of the LR per period (0.5: halving). |" in new
    assert "Read only with `detector: ratio`." in new and "stale" not in new
    with pytest.raises(ValueError, match="not options"):
        GEN.rendered(page.replace("horizon", "horizn"), "p.md")


def test_no_option_is_described_by_hand_outside_a_generated_table():
    """An option table's row in the manual (``| `key` | `default` |``, the form ``test_docs`` reads) is a generated
    one: a second description would drift. (Tables of measurements per option value are not such rows.)"""
    problems = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        generated = False
        for number, line in prose_lines(page):
            if GEN.BEGIN.match(line):
                generated = True
            elif line == GEN.END:
                generated = False
            elif not generated and (m := re.match(r"^\| `(\w+)` \| `[^`]*` \|", line)) and m.group(1) in FIELDS:
                problems.append(f"{page.name}:{number}: `{m.group(1)}` described by hand")
    assert not problems, "\n".join(problems)
