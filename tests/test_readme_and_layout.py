"""The README states the present and docs/layout.md maps the tree as it is.

The README is a front door: every line at most ``README_MAX_CHARS`` characters, and no measurement
history (dates, working-session "stop" numbers, CI seconds, commit hashes, version or issue labels):
those live in docs/testing.md or the page of their subject. docs/layout.md names every module of the
product, every path it names exists, and the wheel it describes holds the product only.
Stdlib + pytest only.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LAYOUT = ROOT / "docs" / "layout.md"
README_MAX_CHARS = 200

# What history looks like in prose; each pattern with a line it must catch and one it must let pass.
HISTORY = {
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "a stop number": re.compile(r"\bstops? \d+\b", re.I),
    "CI seconds": re.compile(r"\bCI\b[^;|]{0,60}?\b\d+(?:\.\d+)? ?s\b"),
    "a commit hash": re.compile(r"\b(?:at|since|commit) [0-9a-f]{7,40}\b"),
    "a version label": re.compile(r"(?<![\w.-])v\d+(?:\.\d+)*\b(?![\w-])"),
    "an issue label": re.compile(r"\bissues? \d+\b", re.I),
    "a pilot label": re.compile(r"\bpilot \d+\w?\b", re.I),
}
CAUGHT = {
    "a date": ("measured 2026-12-04: 31.9 min", "verl 0.9.1, 40 steps"),
    "a stop number": ("Again at stop 44, 5.9 min", "the surge stops the run"),
    "CI seconds": ("CI's own runs of `.ci/run`: 2830 s", "what `.ci/run` calls; 77 s a candidate"),
    "a commit hash": ("measured at 81f5eb2", "at 1e-3 on SmolLM2"),
    "a version label": ("fixed in v3.1", "V1 trainer, verl 0.9.x, `trainer.use_v1=true`"),
    "an issue label": ("(issue 33)", "issues a warning"),
    "a pilot label": ("LR 3e-5 (pilot 4)", "a 150-step pilot run"),
}


@pytest.mark.parametrize("kind", sorted(HISTORY))
def test_each_history_pattern_catches_history_and_lets_the_present_pass(kind):
    history, present = CAUGHT[kind]
    assert HISTORY[kind].search(history) and not HISTORY[kind].search(present)


def test_every_readme_line_is_short():
    long = [f"README.md:{n}: {len(line)} characters" for n, line in
            enumerate(README.read_text(encoding="utf-8").splitlines(), 1) if len(line) > README_MAX_CHARS]
    assert not long, f"lines over {README_MAX_CHARS} characters (move the detail into docs/):\n" + "\n".join(long)


def test_the_readme_holds_no_measurement_history():
    found = [f"README.md:{n}: {kind}: {m.group(0)!r}"
             for n, line in enumerate(README.read_text(encoding="utf-8").splitlines(), 1)
             for kind, pattern in HISTORY.items() for m in pattern.finditer(line)]
    assert not found, "history in the README (it belongs in docs/testing.md or the subject's page):\n" + "\n".join(found)


def test_the_readme_keeps_the_two_set_up_commands():
    text = README.read_text(encoding="utf-8")
    assert "`make demo`" in text and "`make test`" in text and "`docs/layout.md`" in text


_MD_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)")
_REPO_FILE = re.compile(r"`((?:docs|configs|tests|scripts|verl_lrstab)/[\w./-]*\.(?:md|yaml|py|png))`")


def test_the_readme_reads_the_same_on_a_package_index():
    """A package index renders the README without the repository: every link and image is absolute, and
    the files it names by path exist in the repository."""
    text = README.read_text(encoding="utf-8")
    relative = [target for target in _MD_LINK.findall(text) if not target.startswith(("https://", "http://"))]
    assert not relative, f"relative links in the README (they break on a package index): {relative}"
    named = set(_REPO_FILE.findall(text))
    assert len(named) >= 10, sorted(named)
    absent = sorted(p for p in named if not (ROOT / p).exists())
    assert not absent, f"the README names files that do not exist: {absent}"


def test_the_package_index_check_catches_a_relative_link():
    assert _MD_LINK.findall("see [guard](docs/guard.md) and ![x](docs/demo.png), [verl](https://x.y)") == [
        "docs/guard.md", "docs/demo.png", "https://x.y"]


_PATH = re.compile(r"`((?:verl_lrstab|cpu_backend|scripts|tests|configs|patches|docs)/[\w./-]*)`")


def test_the_layout_names_every_module_of_the_product():
    named = set(_PATH.findall(LAYOUT.read_text(encoding="utf-8")))
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "verl_lrstab").rglob("*.py")}
    missing = sorted(modules - named)
    assert not missing, f"docs/layout.md does not name these modules of the product: {missing}"


def test_every_path_the_layout_names_exists():
    named = set(_PATH.findall(LAYOUT.read_text(encoding="utf-8")))
    assert len(named) > 40, sorted(named)
    absent = sorted(p for p in named if not (ROOT / p).exists())
    assert not absent, f"docs/layout.md names paths that do not exist: {absent}"


def test_the_wheel_holds_the_product_only():
    # what setuptools packages is what [tool.setuptools.packages.find] includes: the product's package
    with open(ROOT / "pyproject.toml", "rb") as f:
        found = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]
    assert found["include"] == ["verl_lrstab", "verl_lrstab.*"]
    assert "where" not in found or found["where"] == ["."]
    assert "`verl_lrstab`" in LAYOUT.read_text(encoding="utf-8") and "wheel holds the product only" in LAYOUT.read_text(
        encoding="utf-8")


_CITED = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.(?:md|py|sh|yaml|toml))\b")


def test_the_makefile_cites_only_files_that_exist():
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    cited = set(_CITED.findall(text))
    assert {"docs/megatron.md", "scripts/vllm_cpu_shim.py", "pyproject.toml"} <= cited, sorted(cited)
    absent = sorted(c for c in cited if not any((ROOT / where / c).exists() for where in ("", "docs")))
    assert not absent, f"the Makefile cites files that do not exist: {absent}"
    assert _CITED.findall("(CPU_PATH.md); see docs/x.md") == ["CPU_PATH.md", "docs/x.md"]


#: Pages whose own rewrite removes their history (the detector's and the guard's pages, the options table);
#: the check covers every other page of the manual.
REWRITTEN_BESIDE = set()
#: Words about how the project is made, not about what it does.
DEVELOPMENT = re.compile(r"\b(?:working session|this session|no machine was lent|the task (?:set|was silent)|"
                         r"command not recorded|measured by the issue)\b", re.I)


def test_the_manual_holds_no_development_history():
    found = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name in REWRITTEN_BESIDE:
            continue
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            hits = [(kind, m.group(0)) for kind, pattern in HISTORY.items() if kind != "a pilot label"
                    for m in pattern.finditer(line)]
            hits += [("development", m.group(0)) for m in DEVELOPMENT.finditer(line)]
            found += [f"docs/{page.name}:{n}: {kind}: {text!r}" for kind, text in hits]
    assert not found, "history in the manual:\n" + "\n".join(found)
    assert DEVELOPMENT.search("GPU run pending: no machine was lent in this session")
