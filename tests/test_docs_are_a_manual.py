"""The docs are a manual a clone can follow: no development history, no machine's paths, no file outside it.

Read: every markdown file of the checkout (README.md, docs/, the READMEs beside the code) but the
archived research notes of ``scripts/research/repro/real_results/`` (records of their day), and the
docstrings and comments of the code (``verl_lrstab/``, ``scripts/``, ``cpu_backend/``, and the
harnesses and tests of ``tests/``). What fails:

- a commit or tree id: a hex word of 7 to 40 characters after "commit", "tree", "since", "at",
  "revision", "main", "HEAD" or "id" (with at most one word between), or alone in a code span if it
  holds both a digit and a letter. A number (digits only) is not an id, nor is a hash that is data
  (written after ``sha256``, ``sha1``, ``md5`` or ``digest``; a sha256 has 64 characters anyway);
- a path of a developer's machine: ``/work/``, ``/root/``, ``/home/``, ``/Users/``, ``/tmp/`` (an
  example shows a placeholder such as ``RUN_DIR`` instead). A ``/tmp/...`` path that a script of the
  repository itself sets as its default is that script's behaviour, stated, and passes;
- "Tried:" notes, and ``../shared`` (a folder beside the checkout, which a clone does not have);
- a file cited (a name ending in ``.md``, ``.py``, ``.sh``, ``.yaml``, ``.toml``) that the repository
  does not hold: the name, with the folders written before it, must be the end of a path of the
  repository (``glue/steps.py`` is ``verl_lrstab/glue/steps.py``; ``METHOD.md`` is nothing) or exist
  from the citing file's folder. Pass: names in fenced code blocks (a user's files in an example),
  placeholders (``tests/test_x.py``, ``my_reward.py``), what a script writes (``WRITTEN``, each name
  spelled out in its writer; anything under ``outputs/``), and other projects' files (``OTHERS``,
  verl's checked against the installed verl).

Stdlib + pytest only.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PAGES = ["*.md", ":(exclude)scripts/research/repro/real_results/*"]
CODE = ["verl_lrstab/*.py", "scripts/*.py", "cpu_backend/*.py", "tests/*.py"]  # git's * crosses folders
#: This file states the patterns it checks; it is read by the tests of the patterns instead.
NOT_READ = {"tests/test_docs_are_a_manual.py"}

_HEX = r"(?<![\w./:-])([0-9a-f]{7,40})(?![\w/-])"
COMMIT = re.compile(r"(?:\b(?:commits?|trees?|since|at|revision|rev|main|HEAD|ids?)\b(?:\W+\w+)?\W+)" + _HEX, re.I)
CODE_SPAN_HEX = re.compile(r"`([0-9a-f]{7,40})`")
DATA_HASH = re.compile(r"(?:sha\d*|md5|digest)\W*$", re.I)
MACHINE_PATH = re.compile(r"(?<![\w.~-])(?:/work|/root|/home|/Users|/tmp)/(?:[\w.-]|$)")
HISTORY = re.compile(r"Tried:|\.\./shared\b")
CITED = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-][\w.-]*\.(?:md|py|sh|yaml|toml))(?![\w/])")
#: Files of other projects that the manual and the code point at, and whose they are.
OTHERS = {
    "verl/experimental/agent_loop/tool_agent_loop.py": "verl", "trainer_base.py": "verl", "ray_trainer.py": "verl",
    "fsdp_checkpoint_manager.py": "verl", "trainer/config/optim/fsdp.yaml": "verl",
    "trainer/config/optim/megatron.yaml": "verl", "optim/fsdp.yaml": "verl", "optim/megatron.yaml": "verl",
    "one_step_off_ppo_trainer.yaml": "verl", "fully_async_ppo_trainer.yaml": "verl",
    "verl/third_party/vllm/__init__.py": "verl", "verl/workers/rollout/vllm_rollout/__init__.py": "verl",
    "examples/data_preprocess/gsm8k.py": "verl's git repository", "gsm8k.py": "verl's git repository",
    "prepare_dapo_data.sh": "verl's git repository",
    "vllm/__init__.py": "vLLM", "megatron/__init__.py": "megatron-core", "transformers/optimization.py": "transformers",
    "sitecustomize.py": "Python (the site module imports it from the path)",
}
#: Files a script of the repository writes, named by what it writes; each writer spells the name out.
WRITTEN = {
    "summary.md": "verl_lrstab/cli/compare.py", "dose.md": "scripts/research/repro/real_dose.py",
    "controls.md": "scripts/research/repro/real_controls.py", "stage0.md": "scripts/research/repro/real_stage0.py",
    "timing.md": "scripts/research/repro/real_report.py", "pilots.md": "scripts/research/repro/real_report.py",
    "blocks.md": "scripts/research/repro/real_report.py",
}
#: A placeholder, not a file: ``tests/test_x.py``, ``my_reward.py``.
PLACEHOLDER = re.compile(r"(?:^|/)(?:test_)?(?:x|X|my_\w+|your_\w+)\.\w+$")
#: What the scripts write goes under ``outputs/`` (ignored by git).
OUTPUTS = "outputs/"


def commit_ids(text: str) -> list[str]:
    """The commit or tree ids a line of prose states (see the module docstring).

    After a word that introduces one, any hex word but a number is an id (``dcafdfa`` is one); a code
    span alone must hold a digit and a letter, so that ``deadbeef`` or ``1234567`` is not taken for one.
    """
    found = []
    for m in COMMIT.finditer(text):
        if re.search(r"[a-f]", m.group(1), re.I) and not DATA_HASH.search(text[:m.start(1)]):
            found.append(m.group(1))
    for m in CODE_SPAN_HEX.finditer(text):
        if re.search(r"\d", m.group(1)) and re.search(r"[a-f]", m.group(1)) and not DATA_HASH.search(text[:m.start(1)]):
            found.append(m.group(1))
    return sorted(set(found))


def machine_paths(text: str) -> list[str]:
    """The paths of a machine ``text`` names; a ``/tmp/...`` path that a script of the repository sets
    (``scripts/gpu_check.sh``'s ``STASH=${STASH:-/tmp/lrstab-gguf}``) is that script's default, not a
    developer's path, and passes."""
    found = []
    for m in MACHINE_PATH.finditer(text):
        whole = re.match(r"[\w./-]*", text[m.start():]).group(0).rstrip(".")
        if not (whole.startswith("/tmp/") and whole in code_defaults()):
            found.append(whole)
    return found


_DEFAULTS: set = set()


def code_defaults() -> set[str]:
    """The ``/tmp/...`` paths the scripts and the code of the repository set (outside comments and docstrings)."""
    if not _DEFAULTS:
        for path in _tracked(["verl_lrstab/*.py", "cpu_backend/*.py", "scripts/*.py", "scripts/*.sh"]):
            text = path.read_text(encoding="utf-8")
            _DEFAULTS.update(m.group(0) for m in re.finditer(r"(?<=[\"'=:-])/tmp/[\w.-]+", text))
    return _DEFAULTS


def history(text: str) -> list[str]:
    return [m.group(0) for m in HISTORY.finditer(text)]


# --- what is read ---------------------------------------------------------------------------------

def _tracked(patterns) -> list[Path]:
    """The checkout's files (committed or not, git's ignored ones left out) that match git's ``patterns``."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *patterns],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\0")
    return sorted(ROOT / f for f in files if f and (ROOT / f).is_file())


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def page_lines(path: Path):
    """(line number, text, inside a fenced code block) of a markdown page."""
    fence = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = re.match(r"^ {0,3}(`{3,}|~{3,})", line)
        if fence is None and m:
            fence = m.group(1)
            continue
        if fence is not None and m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
            fence = None
            continue
        yield number, line, fence is not None


def code_prose(path: Path):
    """(line number, text, False) of every docstring line and comment of a Python file."""
    source = path.read_text(encoding="utf-8")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                for offset, line in enumerate(ast.get_source_segment(source, first).splitlines()):
                    yield first.lineno + offset, line, False
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string, False


def prose():
    """(file, line number, text, in a code block) of everything this module reads."""
    for page in _tracked(PAGES):
        for number, line, fenced in page_lines(page):
            yield page, number, line, fenced
    for source in _tracked(CODE):
        if _rel(source) in NOT_READ:
            continue
        for number, line, fenced in code_prose(source):
            yield source, number, line, fenced


_ENDINGS: set = set()


def repository_endings() -> set[str]:
    """Every tail of every path of the repository: ``verl_lrstab/glue/steps.py``, ``glue/steps.py``, ``steps.py``."""
    if not _ENDINGS:
        for path in _tracked(["*"]):
            parts = path.relative_to(ROOT).parts
            _ENDINGS.update("/".join(parts[i:]) for i in range(len(parts)))
            _ENDINGS.update("/".join(parts[:i]) for i in range(1, len(parts)))  # the folders
    return _ENDINGS


def missing_files(path: Path, text: str) -> list[str]:
    """The files ``text`` (a line of ``path``) cites that the repository does not hold."""
    out = []
    for m in CITED.finditer(text):
        cited = m.group(1).rstrip(".")
        if (cited in OTHERS or Path(cited).name in WRITTEN or cited.startswith(OUTPUTS) or PLACEHOLDER.search(cited)
                or re.match(r"^[\d.]+\.\w+$", cited)):
            continue
        if cited not in repository_endings() and not (path.parent / cited).exists():
            out.append(cited)
    return out


# --- the patterns -----------------------------------------------------------------------------------

@pytest.mark.parametrize("line, ids", [
    ("measured at 81f5eb2 on the CPU", ["81f5eb2"]),
    ("Since dcafdfa the rollout is verl's", ["dcafdfa"]),
    ("the tree `f04e00d`", ["f04e00d"]),
    ("main 9a7478e, read with", ["9a7478e"]),
    ("at 1e-3 on SmolLM2, 2602.01826", []),
    ("the checkpoint's sha256 `3f1c9a0b2e`", []),
    ("a decade of deadbeef", []),  # letters only: a word, not an id
    ("the step 1234567 at 5e-7", []),  # digits only: a number
])
def test_the_commit_pattern_catches_ids_and_lets_numbers_and_data_pass(line, ids):
    assert commit_ids(line) == ids


@pytest.mark.parametrize("line, paths", [
    ("git clone /work/main /work/ci_e2e; cd /work/ci_e2e", ["/work/main", "/work/ci_e2e", "/work/ci_e2e"]),
    ("python x.py --out /tmp/run.", ["/tmp/run"]),
    ("(keeps the first half in `/tmp/lrstab-gguf`)", []),  # scripts/gpu_check.sh's default
    ("logs under ~/runs, `trainer.default_local_dir=RUN_DIR/ckpt`, docs/x.md", []),
    ("verl_lrstab/tmp/x, /root", []),
])
def test_the_path_pattern_catches_a_machines_paths(line, paths):
    assert machine_paths(line) == paths


def test_the_citation_check_finds_files_the_repository_lacks():
    here = ROOT / "docs" / "x.md"
    assert missing_files(here, "see METHOD.md and (CPU_PATH.md); `cusum.py`, docs/testing.md, [a](agentic.md)") == [
        "METHOD.md", "CPU_PATH.md"]
    assert missing_files(here, "verl_lrstab/nothing.py, scripts/none.sh, glue/cusum.py; verl 0.9.1") == [
        "verl_lrstab/nothing.py", "scripts/none.sh", "glue/cusum.py"]
    assert missing_files(here, "glue/steps.py, verl_lrstab_cpu/agentic.py, `tests/test_x.py`, summary.md") == []
    assert missing_files(ROOT / "verl_lrstab" / "guard" / "x.py", "(plan.py), ../config.py") == []


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_each_written_file_is_spelled_out_by_its_writer(name):
    assert name in (ROOT / WRITTEN[name]).read_text(encoding="utf-8"), f"{WRITTEN[name]} does not write {name}"


def test_verls_files_the_docs_cite_are_verls():
    import importlib.util

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("verl is not installed")
    package = Path(list(spec.submodule_search_locations)[0])
    endings = set()
    for path in package.rglob("*"):
        parts = ("verl", *path.relative_to(package).parts)
        endings.update("/".join(parts[i:]) for i in range(len(parts)))
    absent = sorted(name for name, owner in OTHERS.items() if owner == "verl" and name not in endings)
    assert not absent, f"not files of the installed verl: {absent}"


def test_history_pattern():
    assert history("Tried: a window of 20") == ["Tried:"] and history("(`../shared/traces`)") == ["../shared"]
    assert history("what was tried: nothing") == []


# --- the manual -------------------------------------------------------------------------------------

def _findings():
    found = {"a commit or tree id": [], "a path of a machine": [], "history": [], "a file the repository lacks": []}
    for path, number, text, fenced in prose():
        where = f"{_rel(path)}:{number}"
        found["a commit or tree id"] += [f"{where}: {x}" for x in commit_ids(text)]
        found["a path of a machine"] += [f"{where}: {x}" for x in machine_paths(text)]
        found["history"] += [f"{where}: {x}" for x in history(text)]
        if not fenced:
            found["a file the repository lacks"] += [f"{where}: {x}" for x in missing_files(path, text)]
    return found


@pytest.fixture(scope="module")
def findings():
    return _findings()


def test_something_is_read():
    read = {_rel(p) for p in _tracked(PAGES + CODE)}
    assert {"README.md", "docs/testing.md", "verl_lrstab/cusum.py", "scripts/demo.py",
            "cpu_backend/verl_lrstab_cpu/agentic.py"} <= read


@pytest.mark.parametrize("kind", ["a commit or tree id", "a path of a machine", "history", "a file the repository lacks"])
def test_the_manual_and_the_code_hold_none(findings, kind):
    assert not findings[kind], f"{kind}:\n" + "\n".join(findings[kind])


if __name__ == "__main__":
    for kind, lines in _findings().items():
        print(f"== {kind} ({len(lines)})")
        print("\n".join(lines))
