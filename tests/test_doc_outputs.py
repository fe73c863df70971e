"""Every ``lrstab`` command the README and docs/cli.md show with its output is run here, and the
figures are read out of the doc text itself and compared with what the command prints: the docs
cannot drift from the code (a changed detector fails here, naming the figure to update).

Two forms are read: a code block whose first line is an ``lrstab`` command and whose other lines
are its output (compared line by line), and a sentence that quotes figures of a committed run
(each sentence's pattern is below; a sentence reworded so that its pattern no longer matches
fails too, so that it is not silently left unchecked).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pandas as pd
import pytest

from verl_lrstab.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CLI = ROOT / "docs" / "cli.md"


def text_of(path: Path) -> str:
    """The page with every run of whitespace as one space (a sentence wraps anywhere)."""
    return re.sub(r"\s+", " ", path.read_text(encoding="utf-8"))


def shown_blocks(path: Path) -> list[tuple[str, list[str]]]:
    """``(command, output lines)`` of each indented code block that starts with ``lrstab``."""
    lines, blocks, i = path.read_text(encoding="utf-8").splitlines(), [], 0
    while i < len(lines):
        if not lines[i].startswith("    lrstab "):
            i += 1
            continue
        command, i, output = lines[i][4:], i + 1, []
        while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
            output.append(lines[i][4:])
            i += 1
        while output and not output[-1]:
            output.pop()
        blocks.append((command, output))
    return blocks


def lrstab(capsys, monkeypatch, *argv) -> tuple[int, str, str]:
    monkeypatch.chdir(ROOT)  # the docs name the committed runs by their path in the checkout
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def replay_json(capsys, monkeypatch, run: str, *options) -> dict:
    import json

    code, out, err = lrstab(capsys, monkeypatch, "replay", run, "--json", *options)
    assert code == 0, err
    return json.loads(out)


def first_halving(replayed: dict):
    return next((s for s, scale in zip(replayed["steps"], replayed["lr_scale"]) if scale < 1), None)


def compare_row(capsys, monkeypatch, tmp_path, run: str) -> dict:
    code, _, err = lrstab(capsys, monkeypatch, "compare", run, "--out", tmp_path / "compare")
    assert code == 0, err
    (row,) = pd.read_csv(tmp_path / "compare" / "summary.csv").to_dict("records")
    return row


# -- the blocks: the command and its whole output -------------------------------------------------
BLOCKS = shown_blocks(CLI) + shown_blocks(README)


def test_the_docs_show_the_replay_and_the_calibrate_blocks():
    # the parametrised test below runs what is found: it must find what the docs are known to show
    assert {shlex.split(c)[1] for c, _ in BLOCKS} >= {"replay", "calibrate"}, BLOCKS


@pytest.mark.parametrize("command,shown", BLOCKS, ids=[c for c, _ in BLOCKS])
def test_a_shown_command_prints_what_the_doc_shows(command, shown, capsys, monkeypatch):
    argv = shlex.split(command)
    code, out, err = lrstab(capsys, monkeypatch, *argv[1:])
    assert code == 0, err
    assert out.rstrip("\n").splitlines() == shown, f"{command} prints (paste into the doc):\n{out}"


# -- the sentences that quote figures ------------------------------------------------------------
README_REPLAY = re.compile(r"`lrstab replay (\S+)` \(surge at (\d+), the first halving at (\d+), crash at (\d+); "
                           r"`--origin start` would halve at (\d+), after the run\)")
CLI_REPLAY = re.compile(r"`lrstab replay (\S+)` \(surge at (\d+), crash at (\d+)\)\. With the default `origin: surge` "
                        r"the replay halves from step (\d+), before the crash; with `--origin start` \(the paper's "
                        r"form\) the first halving comes at P = round\(([\d.]+) x (\d+)\) = (\d+), after the end of "
                        r"this (\d+)-step run, so the replay prints `(LR scale: [^`]+)`")
CLI_LEAD = re.compile(r"On `(\S+)` \(accuracy below 0\.5 from step (\d+)\): crash (\d+), surge (\d+), lead (-?\d+)\.")


def test_the_readme_replay_figures_are_what_replay_and_compare_print(capsys, monkeypatch, tmp_path):
    found = README_REPLAY.search(text_of(README))
    assert found, "the README's replay sentence no longer has the form this test reads: update README_REPLAY"
    run, surge, halving, crash, start_halving = found.group(1), *map(int, found.groups()[1:])
    surge_run = replay_json(capsys, monkeypatch, run)
    assert (surge_run["surge_step"], first_halving(surge_run)) == (surge, halving)
    start_run = replay_json(capsys, monkeypatch, run, "--origin", "start")
    assert start_run["decay_period"] == start_halving and first_halving(start_run) is None  # after the run
    assert start_halving > start_run["steps"][-1]
    assert compare_row(capsys, monkeypatch, tmp_path, run)["crash_step"] == crash


def test_the_cli_pages_replay_sentence_is_what_replay_prints(capsys, monkeypatch, tmp_path):
    found = CLI_REPLAY.search(text_of(CLI))
    assert found, "docs/cli.md's replay sentence no longer has the form this test reads: update CLI_REPLAY"
    run, surge, crash, halving, factor, p_surge, period, last, scale_line = found.groups()
    surge_run = replay_json(capsys, monkeypatch, run)
    assert (surge_run["surge_step"], first_halving(surge_run)) == (int(surge), int(halving))
    start_run = replay_json(capsys, monkeypatch, run, "--origin", "start")
    assert (start_run["surge_step"], start_run["decay_period"], start_run["steps"][-1]) == \
        (int(p_surge), int(period), int(last))
    assert int(period) == round(float(factor) * int(p_surge)) and first_halving(start_run) is None
    _, out, _ = lrstab(capsys, monkeypatch, "replay", run, "--origin", "start")
    assert scale_line in out.splitlines()
    assert compare_row(capsys, monkeypatch, tmp_path, run)["crash_step"] == int(crash)


def test_the_cli_pages_lead_is_what_compare_prints(capsys, monkeypatch, tmp_path):
    found = CLI_LEAD.search(text_of(CLI))
    assert found, "docs/cli.md's lead sentence no longer has the form this test reads: update CLI_LEAD"
    run, below, crash, surge, lead = found.group(1), *map(int, found.groups()[1:])
    header = re.search(r"^# crash: (\d+)$", (ROOT / run).read_text(), re.M)  # the synthetic run's own record
    assert header and int(header.group(1)) == below
    row = compare_row(capsys, monkeypatch, tmp_path, run)
    assert (row["crash_step"], row["surge_step"], row["lead"]) == (crash, surge, lead), row


INVALID = re.compile(r"`(lrstab: error: --([\w-]+)=(\S+) is invalid: [^`]+)`")


def test_each_quoted_error_is_what_replay_prints_for_that_value(capsys, monkeypatch):
    quoted = INVALID.findall(text_of(CLI))
    assert len(quoted) >= 3, quoted
    for line, option, value in quoted:
        code, out, err = lrstab(capsys, monkeypatch, "replay", "scripts/research/traces/classes/A_s0.csv",
                                f"--{option}", value)
        assert (code, out, err) == (1, "", line + "\n"), (line, err)
