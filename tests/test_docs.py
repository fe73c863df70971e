"""The README stays a front door and every relative link of the docs resolves.

Checks README.md, docs/*.md and scripts/research/repro/README.md: the README's length, every relative
markdown link (file and ``#anchor``, anchors by GitHub's heading slugs), the back link each
docs page starts with, and every ``make <target>`` the README names against the Makefile.
Links and headings inside fenced code blocks are ignored, and so are http(s)/mailto links.
Claims the code can contradict: every "(N tests)" against its test file (counted with ``ast``),
the step counts and CLI defaults registered in ``STEP_CLAIMS``, the option tables against
``LengthSurgeConfig``'s defaults, and every ``--option`` shown after a script against its source.
Stdlib + pytest only, no network.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 300
DOCS = sorted((ROOT / "docs").glob("*.md"))
CHECKED = [README, *DOCS, ROOT / "scripts" / "research" / "repro" / "README.md"]
# written by a script (scripts/research/bench_detector.py --out writes the same header)
GENERATED: set = set()

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.I)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading (before the -1, -2 of duplicates).

    The rendered text (links by their text, code without backticks, inline HTML dropped),
    lowercased; every character that is not a letter, digit, ``_``, ``-`` or space dropped;
    each space a ``-``.
    """
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _classified_lines(path: Path):
    """(line number, line, inside a fenced code block) of every line but the fences themselves."""
    fence = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None:
            if m:
                fence = m.group(1)
                continue
            yield number, line, False
        elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip()[len(m.group(1)):]:
            fence = None
        else:
            yield number, line, True


def prose_lines(path: Path):
    """(line number, line) outside fenced code blocks."""
    return ((number, line) for number, line, fenced in _classified_lines(path) if not fenced)


def code_texts(path: Path):
    """(line number, text) of what the file shows as code: fenced blocks and inline code spans."""
    for number, line, fenced in _classified_lines(path):
        if fenced:
            yield number, line
        else:
            for span in _CODE_SPAN.finditer(line):
                yield number, span.group(2)


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, duplicates numbered as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path):
        m = _HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2) or "")
        if slug in seen:
            seen[slug] += 1
            out.add(f"{slug}-{seen[slug]}")
        else:
            seen[slug] = 0
            out.add(slug)
    return out


def links(path: Path):
    """(line number, target) of every relative link or image, code spans and fences left out."""
    for number, line in prose_lines(path):
        plain = _CODE_SPAN.sub(lambda m: "x" * len(m.group(0)), line)
        # spans blanked out, not removed: a link's text may be code, and the columns stay put
        for m in _LINK.finditer(plain):
            yield number, line[slice(*m.span(2))]
        if (m := _REF_DEF.match(plain)):
            yield number, m.group(1)


def make_targets() -> set[str]:
    """The Makefile's rules (``name:`` at the start of a line; ``.PHONY`` and ``:=`` assignments left out)."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_-][A-Za-z0-9_.-]*)[ \t]*:(?!=)", text, re.M)}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --- the slug function itself -------------------------------------------------------------

@pytest.mark.parametrize("heading, slug", [
    ("verl's own vLLM rollout on CPU (vLLM-CPU)", "verls-own-vllm-rollout-on-cpu-vllm-cpu"),
    ("Training-inference mismatch (`actor/mismatch/*`)", "training-inference-mismatch-actormismatch"),
    ("In bypass mode (`algorithm.rollout_correction.bypass_mode=true`)",
     "in-bypass-mode-algorithmrollout_correctionbypass_modetrue"),
    ("Supported / refused", "supported--refused"),
    ("A real pretrained model on CPU: SmolLM2-135M-Instruct (`make demo-real`)",
     "a-real-pretrained-model-on-cpu-smollm2-135m-instruct-make-demo-real"),
    ("`lrstab compare RUN [RUN ...] [--out DIR]`", "lrstab-compare-run-run----out-dir"),
    ("The setting (arXiv 2602.01826, see METHOD.md) — `_paper_base.yaml`",
     "the-setting-arxiv-260201826-see-methodmd--_paper_baseyaml"),
    ("See [the docs](docs/cli.md) **now**", "see-the-docs-now"),
])
def test_github_slug(heading, slug):
    assert github_slug(heading) == slug


def test_duplicate_headings_are_numbered_as_github_does(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Measured\n\n## Measured\n\n```\n# Measured\n```\n\n### Measured\n")
    assert anchors(page) == {"measured", "measured-1", "measured-2"}


def test_links_in_code_are_ignored(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("[a](a.md) `[b](b.md)` [`c`](c.md#x)\n```\n[d](d.md)\n```\n[e](https://x.y/e.md)\n")
    assert [t for _, t in links(page)] == ["a.md", "c.md#x", "https://x.y/e.md"]


# --- the docs -----------------------------------------------------------------------------

def test_readme_is_a_front_door():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, (
        f"README.md has {n} lines, more than {README_MAX_LINES}: move detail into a page of docs/ and link it")


def test_the_detector_manual_fits_its_page_budget():
    # the rule on one page, its tables of numbers and measurements; the full report is detector_benchmark.md
    n = len((ROOT / "docs" / "detector.md").read_text(encoding="utf-8").splitlines())
    assert n <= 250, f"docs/detector.md has {n} lines, more than 250: the full tables go to docs/detector_benchmark.md"


@pytest.mark.parametrize("path", CHECKED, ids=_rel)
def test_every_relative_link_resolves(path):
    problems = []
    for number, target in links(path):
        if not target or _EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        where = f"{_rel(path)}:{number}: link ({target})"
        if not dest.exists():
            problems.append(f"{where}: no file {dest.relative_to(ROOT) if ROOT in dest.parents else dest}")
            continue
        if anchor:
            if dest.suffix.lower() != ".md" or dest.is_dir():
                problems.append(f"{where}: #{anchor} points into {_rel(dest)}, which is not a markdown file")
            elif unquote(anchor) not in anchors(dest):
                problems.append(f"{where}: no heading of {_rel(dest)} has the anchor #{anchor}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", [p for p in DOCS if p.name not in GENERATED], ids=_rel)
def test_each_docs_page_starts_with_a_title_and_a_link_back_to_the_readme(path):
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert lines and re.match(r"# \S", lines[0]), f"{_rel(path)}: the first line is not a '# Title'"
    assert len(lines) > 1 and "](../README.md" in lines[1], (
        f"{_rel(path)}: the line after the title is not a link back to ../README.md")


def test_every_make_target_the_readme_names_exists():
    targets = make_targets()
    assert {"demo", "test", "install"} <= targets, f"Makefile rules not parsed: {sorted(targets)}"
    missing = [f"README.md:{number}: `make {name}` is not a target of the Makefile (targets: {', '.join(sorted(targets))})"
               for number, text in code_texts(README)
               for name in re.findall(r"(?<![\w./-])make[ \t]+([A-Za-z0-9_.-]+)", text)
               if not name.startswith("-") and name not in targets]
    assert not missing, "\n".join(missing)


# --- claims the code can contradict: test counts, step counts, defaults, script options ------------
#
# Test counts. A docs page states one as "(N tests)" (or "(1 test)") on the line of the test file it
# counts, after that file's name in backticks: "`tests/test_x.py` | ... (19 tests)". The count is the
# file's as pytest collects it: its ``test*`` functions (and ``Test*`` classes' methods), each times
# its ``parametrize`` cases, read from the source with ``ast`` (exact for the literal, dict,
# comprehension and module-level-name argument lists this project uses; every test file of the tree
# is counted exactly so at the time of writing, compared with ``pytest --collect-only``). A file the
# ``ast`` reader cannot count is collected by pytest in a subprocess instead.

_TEST_FILE = re.compile(r"`((?:tests/)(?:[\w]+/)*test_\w+\.py)`")
_TEST_COUNT = re.compile(r"\((\d+) tests?\)")


def _cases(node, names):
    """How many cases a parametrize argument list holds, or None where ``ast`` alone cannot tell."""
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return None if any(isinstance(e, ast.Starred) for e in node.elts) else len(node.elts)
    if isinstance(node, ast.Dict):
        return None if any(k is None for k in node.keys) else len(node.keys)
    if isinstance(node, ast.Name) and node.id in names:
        return _cases(names[node.id], names)
    if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp)) and not any(g.ifs for g in node.generators):
        n = 1
        for g in node.generators:
            k = _cases(g.iter, names)
            if k is None:
                return None
            n *= k
        return n
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("list", "tuple", "sorted")
            and len(node.args) == 1 and not node.keywords):
        return _cases(node.args[0], names)
    return None


def count_tests_ast(path: Path):
    """The tests pytest collects from ``path``, counted from its source; None if a case list is not literal."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = {t.id: st.value for st in tree.body if isinstance(st, ast.Assign)
             for t in st.targets if isinstance(t, ast.Name)}
    functions = []
    for st in tree.body:
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)) and st.name.startswith("test"):
            functions.append((st, []))
        elif isinstance(st, ast.ClassDef) and st.name.startswith("Test"):
            functions += [(f, st.decorator_list) for f in st.body
                          if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name.startswith("test")]
    total = 0
    for function, outer in functions:
        n = 1
        for d in [*function.decorator_list, *outer]:
            if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "parametrize":
                values = d.args[1] if len(d.args) > 1 else next((k.value for k in d.keywords if k.arg == "argvalues"), None)
                k = _cases(values, names) if values is not None else None
                if k is None:
                    return None
                n *= k
        total += n
    return total


def count_tests(path: Path) -> int:
    """``count_tests_ast``, else ``pytest --collect-only`` in a subprocess (skips the check if pytest skips the file)."""
    n = count_tests_ast(path)
    if n is not None:
        return n
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    n = sum(1 for line in proc.stdout.splitlines() if "::" in line)
    if n == 0:
        pytest.skip(f"{_rel(path)}: pytest collects nothing here (a module-level skip?): {proc.stdout[-300:]}")
    return n


def test_count_tests_ast_follows_parametrize(tmp_path):
    page = tmp_path / "test_x.py"
    page.write_text(
        "import pytest\nA = {'a': 1, 'b': 2}\nC = [(x, y) for x in (1, 2, 3) for y in A]\n"
        "def test_one(): pass\n"
        "@pytest.mark.parametrize('v', [1, pytest.param(2, marks=pytest.mark.slow), 3])\n"
        "@pytest.mark.parametrize('w', A)\ndef test_grid(v, w): pass\n"
        "@pytest.mark.parametrize('x,y', C)\ndef test_comp(x, y): pass\n"
        "class TestK:\n    def test_a(self): pass\n    def helper(self): pass\n"
        "def helper_test(): pass\n")
    assert count_tests_ast(page) == 1 + 3 * 2 + 6 + 1
    page.write_text("import pytest\n@pytest.mark.parametrize('v', make())\ndef test_a(v): pass\n")
    assert count_tests_ast(page) is None


def test_count_claims(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("| `tests/test_a.py` | x (3 tests) | `tests/megatron_cpu.py` (1 test) |\n"
                    "`tests/e2e/test_b.py` (1 test) and `tests/test_c.py`\n(2 tests) without a file\n")
    assert list(count_claims(page)) == [(1, "tests/test_a.py", 3), (1, "tests/test_a.py", 1),
                                        (2, "tests/e2e/test_b.py", 1), (3, None, 2)]


def count_claims(path: Path):
    """(line number, test file or None, N) of every "(N tests)" in the prose: the file named last before it on its line."""
    for number, line in prose_lines(path):
        for m in _TEST_COUNT.finditer(line):
            files = _TEST_FILE.findall(line[:m.start()])
            yield number, files[-1] if files else None, int(m.group(1))


@pytest.mark.parametrize("path", CHECKED, ids=_rel)
def test_every_stated_test_count_is_the_files(path):
    problems = []
    for number, name, n in count_claims(path):
        where = f"{_rel(path)}:{number}: ({n} test{'s' if n != 1 else ''})"
        if name is None:
            problems.append(f"{where} names no test file before it on its line (write `tests/test_x.py` ... (N tests))")
        elif not (ROOT / name).is_file():
            problems.append(f"{where}: no file {name}")
        elif (actual := count_tests(ROOT / name)) != n:
            problems.append(f"{where}: {name} holds {actual} tests")
    assert not problems, "\n".join(problems)


# Step counts (and a few other numbers) that a docs page states and the code defines. Each claim is
# (page, a regular expression whose one group is the number as the page states it, where the code
# defines it). The expression is matched against the page's whole text (whitespace runs, line
# breaks included, match ``\s+``); it must match exactly once, so a reworded sentence fails here
# too and its claim is moved along with it. Where the code defines it:
#   ("const", file, NAME[, key]): a module-level constant (``N = 26``, ``A, B = 20, 4``, a dict's key);
#   ("argparse", file, "--flag"): the ``default=`` of that ``add_argument``;
#   ("argv", file, "--flag"): the value after ``"--flag"`` in a command list the file builds;
#   ("regex", file, pattern): the pattern's one group in the file (a YAML value, say).
E2E = "tests/e2e/"
STEP_CLAIMS = [
    ("docs/testing.md", r"surge tests give it room \((\d+) steps, resume at \d+", ("const", E2E + "test_main_ppo_cpu.py", "N_STEPS")),
    ("docs/testing.md", r"surge tests give it room \(\d+ steps, resume at (\d+)", ("const", E2E + "test_main_ppo_cpu.py", "RESUME_AT")),
    ("docs/testing.md", r"the\s+run has (\d+) steps and a detection", ("const", E2E + "test_main_ppo_cpu.py", "N_STEPS")),
    ("docs/testing.md", r"a run checkpointed at step (\d+), after the surge", ("const", E2E + "test_main_ppo_cpu.py", "RESUME_AT")),
    ("docs/testing.md", r"compare\s+(\d+)\s+V1\s+steps", ("const", E2E + "test_main_ppo_cpu.py", "N_STEPS")),
    ("docs/testing.md", r"around a V1 run \((\d+) steps,", ("const", E2E + "test_guard_e2e.py", "STEPS")),
    ("docs/testing.md", r"`save_freq=(\d+)`, the run only monitoring", ("const", E2E + "test_guard_e2e.py", "SAVE_FREQ")),
    ("docs/testing.md", r"`--only fp32 bf16\s+--steps (\d+)`", ("argv", E2E + "test_demo_admit.py", "--steps")),
    ("docs/testing.md", r"the same order over (\d+) steps", ("const", E2E + "test_mismatch_e2e.py", "BF16_STEPS")),
    ("docs/testing.md", r"alone after a (\d+)-step warm start", ("argv", "tests/research/test_repro_ci.py", "--sft-steps")),
    ("docs/testing.md", r"small form \((\d+)-step warm start", ("const", "scripts/research/repro/all.py", "CI_SFT_STEPS")),
    ("docs/testing.md", r"for (\d+) steps each with verl's vLLM", ("const", "scripts/research/repro/all.py", "CI_STEPS")),
    ("docs/testing.md", r"with bf16 sampling and a provoked surge \((\d+) steps", ("const", E2E + "test_vllm_e2e.py", "N_STEPS")),
    ("docs/testing.md", r"stopped with a checkpoint at step (\d+) and resumed to \d+", ("const", E2E + "test_vllm_e2e.py", "RESUME_AT")),
    ("docs/testing.md", r"stopped with a checkpoint at step \d+ and resumed to (\d+)", ("const", E2E + "test_vllm_e2e.py", "N_STEPS")),
    ("docs/testing.md", r"`tests/e2e/test_demo_script.py`: V1, (\d+) steps", ("const", E2E + "test_demo_script.py", "STEPS")),
    ("docs/mismatch.md", r"over (\d+) steps k3 stays", ("const", E2E + "test_mismatch_e2e.py", "BF16_STEPS")),
    ("docs/real_model.md", r"which installs the model\): (\d+) V1 steps", ("const", E2E + "test_real_model_e2e.py", "STEPS")),
    ("docs/admit.md", r"\[--steps (\d+)\]", ("argparse", "verl_lrstab/cli/admit.py", "--steps")),
    ("docs/admit.md", r"\[--budget-factor (\d+)\]|--budget-factor`, default (\d+)", ("argparse", "verl_lrstab/cli/admit.py", "--budget-factor")),
    ("docs/admit.md", r"\[--timeout (\d+)\]", ("argparse", "verl_lrstab/cli/admit.py", "--timeout")),
    ("docs/admit.md", r"V1, (\d+) steps a candidate", ("argparse", "scripts/demo_admit.py", "--steps")),
    ("docs/admit.md", r"the CPU transformers rollout, (\d+) steps", ("argv", E2E + "test_admit_e2e.py", "--steps")),
    ("docs/guard.md", r"`onset - --margin` \(default (\d+) steps\)", ("argparse", "verl_lrstab/cli/guard.py", "--margin")),
    ("docs/guard.md", r"\[--max-rollbacks (\d+)\]", ("argparse", "verl_lrstab/cli/guard.py", "--max-rollbacks")),
    ("docs/guard.md", r"\[--non-finite-steps (\d+)\]", ("argparse", "verl_lrstab/cli/guard.py", "--non-finite-steps")),
    ("docs/cpu_backend.md", r"`lr_scheduler_type=length_surge`, for (\d+) steps", ("regex", "configs/cpu_demo.yaml", r"total_training_steps: (\d+)")),
    ("docs/reproductions.md", r"`recompute`\) x 3 seeds x (\d+) steps", ("const", "scripts/research/repro/all.py", "STEPS", "bypass")),
    ("docs/reproductions.md", r"`make repro` \(6 arms x 3 seeds x (\d+) steps", ("const", "scripts/research/repro/all.py", "STEPS", "bypass")),
    ("docs/reproductions.md", r"--recipe noise`\)\s+ran 6 arms x 3 seeds x (\d+) steps", ("const", "scripts/research/repro/all.py", "STEPS", "noise")),
    ("scripts/research/repro/README.md", r"6 bypass-recipe arms x 3 seeds x (\d+) steps", ("const", "scripts/research/repro/all.py", "STEPS", "bypass")),
    ("scripts/research/repro/README.md", r"issue 6's table \(6 arms x 3 seeds x (\d+) steps\)", ("const", "scripts/research/repro/all.py", "STEPS", "noise")),
    ("scripts/research/repro/README.md", r"the small form \((\d+)-step warm start", ("const", "scripts/research/repro/all.py", "CI_SFT_STEPS")),
    ("scripts/research/repro/README.md", r"bp_ls_surge x (\d+) steps\)", ("const", "scripts/research/repro/all.py", "CI_STEPS")),
    ("scripts/research/repro/README.md", r"--ci --arms bp_ls_surge\s+--sft-steps (\d+)", ("argv", "tests/research/test_repro_ci.py", "--sft-steps")),
]


def _literal(node):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return None


def code_value(source):
    """The number the code defines, as ``STEP_CLAIMS`` points at it (None if not found)."""
    kind, name, what, *key = source
    text = (ROOT / name).read_text(encoding="utf-8")
    if kind == "regex":
        m = re.search(what, text)
        return m and m.group(1)
    tree = ast.parse(text)
    if kind == "const":
        for st in tree.body:
            if isinstance(st, ast.Assign) and len(st.targets) == 1:
                target, value = st.targets[0], st.value
                if isinstance(target, ast.Name) and target.id == what:
                    found = _literal(value)
                    return found[key[0]] if key and isinstance(found, dict) else found
                if (isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
                        and len(target.elts) == len(value.elts)):
                    for t, v in zip(target.elts, value.elts):
                        if isinstance(t, ast.Name) and t.id == what:
                            return _literal(v)
        return None
    for node in ast.walk(tree):
        if kind == "argparse" and isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" \
                and any(_literal(a) == what for a in node.args):
            return next((_literal(k.value) for k in node.keywords if k.arg == "default"), None)
        if kind == "argv" and isinstance(node, (ast.List, ast.Tuple)):
            for a, b in zip(node.elts, node.elts[1:]):
                if _literal(a) == what:
                    return _literal(b)
    return None


def _same(stated: str, defined) -> bool:
    try:
        return defined is not None and float(stated) == float(defined)
    except (TypeError, ValueError):
        return False


@pytest.mark.parametrize("page, pattern, source", STEP_CLAIMS, ids=[f"{p}:{s[2]}" for p, _, s in STEP_CLAIMS])
def test_every_registered_step_count_is_the_codes(page, pattern, source):
    text = (ROOT / page).read_text(encoding="utf-8")
    found = list(re.finditer(pattern, text))
    assert len(found) == 1, (
        f"{page}: /{pattern}/ matches {len(found)} times, not once: reworded? update STEP_CLAIMS in tests/test_docs.py")
    stated = next(g for g in found[0].groups() if g is not None)
    defined = code_value(source)
    line = text.count("\n", 0, found[0].start()) + 1
    assert _same(stated, defined), (
        f"{page}:{line}: states {stated} where {source[1]} defines {source[2]}"
        f"{'[' + repr(source[3]) + ']' if len(source) > 3 else ''} = {defined!r}")


def test_step_claims_read_the_code(tmp_path):
    assert code_value(("const", "tests/e2e/test_guard_e2e.py", "SAVE_FREQ")) == 4  # tuple unpacking
    assert code_value(("argparse", "verl_lrstab/cli/admit.py", "--budget-factor")) == 4.0
    assert code_value(("argv", "tests/e2e/test_demo_admit.py", "--only")) == "fp32"
    assert code_value(("const", "scripts/research/repro/all.py", "NO_SUCH_NAME")) is None


# The option tables of configuration.md and mismatch.md ("| `key` | `default` | meaning |") against the
# defaults of verl_lrstab.config.LengthSurgeConfig (which imports neither verl nor torch).
OPTION_TABLES = ["docs/configuration.md", "docs/mismatch.md"]
_OPTION_ROW = re.compile(r"^\| `(\w+)` \| `([^`]*)` \|")


@pytest.mark.parametrize("page", OPTION_TABLES)
def test_option_defaults_are_the_configs(page):
    from verl_lrstab.config import LengthSurgeConfig

    defaults = {f.name: f.default for f in dataclasses.fields(LengthSurgeConfig)}
    rows = [(n, *m.groups()) for n, line in prose_lines(ROOT / page) if (m := _OPTION_ROW.match(line))]
    assert rows, f"{page}: no option table found"
    problems = []
    for number, key, stated in rows:
        if key not in defaults:
            problems.append(f"{page}:{number}: `{key}` is not an option of LengthSurgeConfig")
            continue
        value = defaults[key]
        text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        if stated != text and not _same(stated, value if not isinstance(value, (bool, str)) else None):
            problems.append(f"{page}:{number}: `{key}` default stated `{stated}`, the config's is {value!r}")
    assert not problems, "\n".join(problems)


# Every ``--option`` a page shows after a script of the repository (in code: fenced or inline) is
# one that script's source spells out (as "--option" or '--option').
_SCRIPT = re.compile(r"(scripts/[\w/]+\.py)")


@pytest.mark.parametrize("path", CHECKED, ids=_rel)
def test_every_script_option_shown_exists(path):
    problems = []
    for number, text in code_texts(path):
        spans = list(_SCRIPT.finditer(text))
        for m, after in zip(spans, [*spans[1:], None]):
            script = ROOT / m.group(1)
            if not script.is_file():
                problems.append(f"{_rel(path)}:{number}: no script {m.group(1)}")
                continue
            source = script.read_text(encoding="utf-8")
            rest = text[m.end():after.start() if after else None]
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
                if f'"{flag}"' not in source and f"'{flag}'" not in source:
                    problems.append(f"{_rel(path)}:{number}: {m.group(1)} has no option {flag}")
    assert not problems, "\n".join(problems)
