"""The README and docs/ hold together: every relative link resolves, and the front page stays short.

- Every relative link (``[text](path)``, ``[text](path#anchor)``, ``[text](#anchor)``) in
  README.md and docs/*.md names a file that exists and, with an anchor, a heading of that
  file, by GitHub's rule for heading anchors.
- The README's first code block holds the two set-up commands, the README is under 300
  lines, and "Train your own model" is a heading within its first 100 lines.
- Each docs page says in its first lines where the README is.

Pure text, no imports of grouprl: it runs in well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

SETUP_COMMANDS = (
    "pip install -e . && grouprl demo",
    'pip install -e ".[test]" && python -m pytest -q',
)

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target) or ![alt](target), target without spaces, optional "title"
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: the rendered text lower-cased, punctuation other than
    '-' and '_' dropped, each space a '-' (so ``a -- b`` keeps its hyphens: ``a----b``)."""
    text = _INLINE_CODE.sub(lambda m: m.group(2), heading)  # code spans keep their text
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links keep their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        base = github_anchor(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link in the file's prose (not in code blocks or code spans)."""
    out = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        line = _INLINE_CODE.sub("", line)
        out.extend((number, m.group(1)) for m in _LINK.finditer(line))
    return out


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken_links(path: Path) -> list[str]:
    """Each relative link of ``path`` that names a missing file or anchor, as 'file:line: target (why)'."""
    problems = []
    cache: dict[Path, set[str]] = {}
    for number, target in links(path):
        if _EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        where = f"{_shown(path)}:{number}: {target}"
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{where} (no file {dest})")
            continue
        if anchor:
            if dest.suffix.lower() != ".md":
                problems.append(f"{where} (an anchor into a file that is not Markdown)")
                continue
            if dest not in cache:
                cache[dest] = anchors(dest)
            if anchor not in cache[dest]:
                problems.append(f"{where} (no heading with anchor #{anchor} in {dest.name})")
    return problems


def test_the_pages_exist():
    assert README.is_file()
    assert DOCS, "docs/*.md holds the reference pages"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


def test_the_checker_finds_a_broken_link_and_a_broken_anchor(tmp_path):
    # the check itself: good links pass, a missing file and a missing anchor are caught,
    # code and external links are left alone
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## The `--flow` demo: x\n", encoding="utf-8")
    page = tmp_path / "README.md"
    page.write_text(
        "# T\n\n[ok](docs/a.md#the---flow-demo-x) [ok too](#t) `[not a link](nowhere.md)`\n"
        "```\n[in a code block](nowhere.md)\n```\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#the-flow-demo) [web](https://example.com/x#y)\n",
        encoding="utf-8",
    )
    problems = broken_links(page)
    assert len(problems) == 2, problems
    assert "docs/b.md" in problems[0] and "no file" in problems[0]
    assert "#the-flow-demo" in problems[1] and "no heading" in problems[1]


def test_github_anchors():
    assert github_anchor("Train your own model") == "train-your-own-model"
    assert github_anchor("vLLM, for real") == "vllm-for-real"
    assert github_anchor("EditGRPO, CheXPO-v2 and the seeds' recipes") == "editgrpo-chexpo-v2-and-the-seeds-recipes"
    assert github_anchor("The guided demo: `grouprl demo --guided`") == "the-guided-demo-grouprl-demo---guided"
    assert github_anchor("TRL's `GRPOConfig` names") == "trls-grpoconfig-names"


def test_readme_first_code_block_holds_the_setup_commands():
    lines = README.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if _FENCE.match(line))
    end = next(i for i in range(start + 1, len(lines)) if _FENCE.match(lines[i]))
    block = lines[start + 1:end]
    assert len(block) == 2, block
    for line, command in zip(block, SETUP_COMMANDS):
        assert line.startswith(command), (line, command)
        assert "#" in line[len(command):], f"the command keeps its comment: {line!r}"


def test_readme_front_page_is_short_and_training_comes_early():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < 300, f"README.md has {len(lines)} lines; move detail to docs/"
    headings = [i for i, line in prose_lines("\n".join(lines[:100]))
                if _HEADING.match(line) and _HEADING.match(line).group(2).lower() == "train your own model"]
    assert headings, "a 'Train your own model' heading within the README's first 100 lines"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_each_docs_page_links_back_to_the_readme(path):
    head = "\n".join(path.read_text(encoding="utf-8").splitlines()[:5])
    assert head.startswith("# "), f"{path.name} starts with its title"
    assert "](../README.md)" in head, f"{path.name}: a link back to the README in its first lines"
