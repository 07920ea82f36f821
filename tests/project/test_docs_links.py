"""Every relative link and #anchor in README.md and docs/**/*.md resolves, and the README
stays short (issue 36: a README that fits on a screen or two, everything else in docs/).

Anchors are checked against GitHub's heading slugs: lower case, punctuation other than
hyphens and underscores dropped, spaces turned into hyphens, "-1", "-2", ... for repeats."""
import re
from pathlib import Path

# The repository root: the nearest folder above this file that holds pyproject.toml (so the
# test keeps working if it moves into a subfolder of tests/).
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
README_MAX_LINES = 250

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts as its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path):
    """(line number, target) of every inline link and image outside code."""
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for m in LINK.finditer(CODE_SPAN.sub("", line)):
            yield number, m.group(1)


def broken_links(root: Path, pages: list[Path], pending: set[str] = frozenset()) -> list[str]:
    """One message per link in `pages` that does not resolve inside `root`."""
    problems = []
    for page in pages:
        for number, target in links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                continue
            where = f"{page.relative_to(root)}:{number}: {target}"
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            rel = dest.relative_to(root).as_posix() if dest.is_relative_to(root) else None
            if rel in pending:
                continue
            if rel is None:
                problems.append(f"{where}: points outside the repository")
            elif not dest.exists():
                problems.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}: no heading with the anchor #{anchor}")
    return problems


def doc_pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def test_every_relative_link_and_anchor_resolves():
    assert broken_links(ROOT, doc_pages(ROOT)) == []


def test_the_readme_fits_on_a_screen_or_two():
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_the_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "# Top\n[ok](docs/a.md#the-server-kvpilot-serve) [gone](docs/nope.md)\n"
        "[bad anchor](docs/a.md#missing) [self](#top) `[in code](docs/x.md)`\n"
        "```\n[fenced](docs/y.md)\n```\n[web](https://example.com/x)\n")
    (tmp_path / "docs" / "a.md").write_text("# A\n## The server: `kvpilot serve`\n## A\n")
    problems = broken_links(tmp_path, doc_pages(tmp_path))
    assert len(problems) == 2, problems
    assert "docs/nope.md: no such file" in problems[0]
    assert "no heading with the anchor #missing" in problems[1]


def test_slugs_follow_github():
    assert slug("The local Kubernetes (e2e/)") == "the-local-kubernetes-e2e"
    assert slug("Soak: `kvpilot bench soak`") == "soak-kvpilot-bench-soak"
    assert slug("HA operator: leader election") == "ha-operator-leader-election"
    assert slug("The autotuner: `make autotune-bench`") == "the-autotuner-make-autotune-bench"
