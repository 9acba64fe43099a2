"""The documents hold together: README.md stays a front door (at most 10 KiB),
every relative link in the Markdown files resolves to a file (and a link with
an anchor to a heading of that file), and the mkdocs site names every page of
docs/ and links nowhere outside it. Pure Python, no mkdocs: ``scripts/docs``
builds the site with ``mkdocs build --strict``."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_MAX_BYTES = 10_240

FENCE = re.compile(r"^(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def markdown_files() -> list[Path]:
    files = [
        ROOT / "README.md",
        ROOT / "ARCHITECTURE.md",
        ROOT / "CHANGELOG.md",
        ROOT / "bench" / "README.md",
    ]
    files += sorted((ROOT / "bench" / "results").glob("*.md"))
    files += sorted(DOCS.rglob("*.md"))
    return [f for f in files if f.exists()]


def prose_lines(text: str, blank_code: bool = True):
    """(line number, line) outside fenced code blocks, code spans blanked
    unless ``blank_code`` is false."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            yield n, CODE_SPAN.sub("", line) if blank_code else line


def links(path: Path) -> list[tuple[int, str]]:
    return [
        (n, m.group(1)) for n, line in prose_lines(path.read_text()) for m in LINK.finditer(line)
    ]


def is_relative(target: str) -> bool:
    scheme = re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE)
    return not scheme and not target.startswith("//")


def _heading_text(raw: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", raw)  # links keep their text
    return text.replace("`", "").replace("*", "")


def github_slug(text: str) -> str:
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def mkdocs_slug(text: str) -> str:
    """Python-Markdown's toc slugify, as mkdocs runs it."""
    value = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def anchors(path: Path) -> set[str]:
    """Every anchor a heading of ``path`` gets on GitHub or in mkdocs (with the
    ``-1``, ``-2`` suffixes of repeated headings)."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(path.read_text(), blank_code=False):
        m = HEADING.match(line)
        if not m:
            continue
        text = _heading_text(m.group(2))
        for slug in {github_slug(text), mkdocs_slug(text)}:
            k = seen.get(slug, 0)
            seen[slug] = k + 1
            out.add(slug if k == 0 else f"{slug}-{k}")
            out.add(f"{slug}_{k}")  # mkdocs' suffix for repeats
    return out


def problems(path: Path) -> list[str]:
    """Broken relative links of ``path``: a missing file, or a missing anchor."""
    out = []
    for n, target in links(path):
        if not is_relative(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{n}: {target}"
        if not dest.exists():
            out.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{where}: no heading with that anchor in {dest.relative_to(ROOT)}")
    return out


def test_readme_is_a_front_door():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes (at most {README_MAX_BYTES})"


def test_the_readme_states_the_test_command():
    """CI runs the README's test command (.ci/run)."""
    assert "scripts/test" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    found = problems(path)
    assert not found, "\n".join(found)


def test_docs_link_only_within_docs():
    """mkdocs --strict refuses a link out of docs/: name such files in code spans."""
    outside = []
    for path in sorted(DOCS.rglob("*.md")):
        for n, target in links(path):
            file_part = target.partition("#")[0]
            if is_relative(target) and file_part:
                dest = (path.parent / file_part).resolve()
                if DOCS.resolve() not in dest.parents:
                    outside.append(f"{path.relative_to(ROOT)}:{n}: {target}")
    assert not outside, "\n".join(outside)


def _nav_pages(nav) -> set[str]:
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, list):
        return set().union(*(_nav_pages(x) for x in nav)) if nav else set()
    if isinstance(nav, dict):
        return set().union(*(_nav_pages(x) for x in nav.values()))
    return set()


def test_the_site_names_every_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    nav = _nav_pages(config["nav"])
    assert pages == nav, (
        f"not in mkdocs.yml's nav: {sorted(pages - nav)}; "
        f"in the nav, no such page: {sorted(nav - pages)}"
    )
    assert config.get("site_dir", "site").startswith(".cache/")
