"""What the package's docstrings and comments point a reader to exists: a section of the README, a
page of the docs (and its heading, for a ``page.md#anchor``), a benchmark or a module of the
package. A pointer to a section that moved is a dead end for the reader."""

import re
from pathlib import Path

import pytest
from locations import ROOT

SOURCES = sorted((ROOT / "src" / "unbroken").glob("**/*.py"))

# `the README's "Randomness" section`, `docs/guides/randomness.md#per-sample`,
# `benchmarks/RESULTS.md`, `unbroken/hf/internals.py`.
README_SECTION = re.compile(r"README(?:'s|\.md's)? \"([^\"]+)\"")
PATH = re.compile(
    r"(?<![\w/])((?:docs|benchmarks)/[\w/.-]+\.(?:md|py)|unbroken/[\w/]+\.py)(?:#([\w-]+))?"
)


def _slug(heading: str) -> str:
    """The anchor mkdocs (and GitHub) give a heading: lower case, punctuation dropped, spaces to
    hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return re.sub(r"\s", "-", text)


def _headings(page: Path) -> list[str]:
    """The page's Markdown headings, outside its code blocks (where ``#`` starts a comment)."""
    headings, fenced = [], False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        if line.startswith("#") and not fenced:
            headings.append(line.lstrip("#").strip())
    return headings


def _pointers() -> list[tuple[str, str, str | None]]:
    found = []
    for source in SOURCES:
        text = source.read_text()
        where = source.relative_to(ROOT).as_posix()
        for match in README_SECTION.finditer(text):
            found.append((where, "README.md", match.group(1)))
        for match in PATH.finditer(text):
            path, anchor = match.group(1).rstrip("."), match.group(2)
            if path.startswith("unbroken/"):
                path = "src/" + path
            found.append((where, path, anchor and "#" + anchor))
    return found


def _check(path: str, section: str | None) -> str | None:
    """None when ``path`` (and its ``section``: a heading's text, or ``#anchor``) exists, else
    what is missing."""
    target = ROOT / path
    if not target.exists():
        return f"{path} does not exist"
    if section is None:
        return None
    headings = _headings(target)
    if section.startswith("#"):
        if section[1:] not in {_slug(h) for h in headings}:
            return f"{path} has no heading with the anchor {section}"
    elif section not in headings:
        return f"{path} has no section {section!r} (its headings: {headings})"
    return None


def test_the_package_points_somewhere():
    pointers = _pointers()
    assert any(path == "benchmarks/RESULTS.md" for _, path, _ in pointers)
    assert len(pointers) >= 5


@pytest.mark.parametrize(("source", "path", "section"), _pointers())
def test_every_pointer_in_a_docstring_or_comment_exists(source, path, section):
    missing = _check(path, section)
    assert missing is None, f"{source} points to {path} {section or ''}: {missing}"


def test_the_check_catches_a_moved_section_and_a_missing_page():
    """The checker itself: a README section that is not there, a page that is not there and an
    anchor without its heading are each reported."""
    assert _check("README.md", "Randomness") is not None
    assert _check("README.md", "Quickstart: a training run that survives SIGKILL") is None
    assert _check("docs/guides/nowhere.md", None) is not None
    assert _check("docs/guides/randomness.md", "#no-such-heading") is not None
    assert _slug("Quickstart: a training run that survives SIGKILL") == (
        "quickstart-a-training-run-that-survives-sigkill"
    )
    assert _check("README.md", "#how-it-compares") is None


# "~2 us", "1.2 us", "85 us a step": a time measured on one machine, in a docstring or comment.
MEASURED = re.compile(r"\d(?:[\d.,]*\d)?(?:-\d+(?:\.\d+)?)?\s?(?:us|µs)\b")


def test_no_measured_microseconds_in_the_package():
    """Per-call figures belong on the benchmark pages, measured with their command; a docstring
    says what a call does (a copy, a collective, a host read), not how long it took once."""
    found = [
        f"{source.relative_to(ROOT)}:{number}: {line.strip()}"
        for source in SOURCES
        for number, line in enumerate(source.read_text().splitlines(), 1)
        if MEASURED.search(line)
    ]
    assert not found, "measured figures in the package:\n" + "\n".join(found)


SUBPACKAGES = sorted(
    path.parent
    for path in (ROOT / "src" / "unbroken").glob("**/__init__.py")
    if path.parent.name != "unbroken"
)


@pytest.mark.parametrize("package", SUBPACKAGES, ids=lambda path: path.name)
def test_a_package_docstring_names_each_of_its_modules(package):
    """A subpackage's docstring is its map: it names every module in it (``name``), so a reader
    finds each one from there, and names no module that is not there."""
    doc = (package / "__init__.py").read_text().split('"""')[1]
    modules = {path.stem for path in package.glob("*.py") if path.stem != "__init__"}
    modules |= {path.parent.name for path in package.glob("*/__init__.py")}
    named = set(re.findall(r"``(\w+)``", doc))
    missing = sorted(modules - named)
    assert not missing, f"{package.relative_to(ROOT)}/__init__.py does not name {missing}"
    listed = set(re.findall(r"^- ``(\w+)``:", doc, re.MULTILINE))
    exported = set(getattr(__import__(_dotted(package), fromlist=["__all__"]), "__all__", ()))
    gone = sorted(listed - modules - exported)
    assert not gone, f"{package.relative_to(ROOT)}/__init__.py lists {gone}, which it does not hold"


def _dotted(package: Path) -> str:
    return ".".join(package.relative_to(ROOT / "src").parts)


UNIT_COSTS = ROOT / "docs" / "benchmarks" / "unit-costs.md"
# "row ``a``", "rows ``a`` and ``b``", "rows ``a``, ``b`` and the per-item ``c``", across lines.
ROW = re.compile(r"\brows?[\s#]+``\w+``(?:(?:,|\s+and)[\s#]+(?:the [\w-]+\s+)?``\w+``)*")


def test_every_cost_row_a_docstring_names_is_measured():
    """A docstring that gives a cost by its row of the unit-costs page names a row that the page
    (and ``benchmarks/unit_costs.py``, which writes it) has."""
    rows = set(re.findall(r"^\| (\w+)\s+\|", UNIT_COSTS.read_text(), re.MULTILINE))
    named = {
        (source.relative_to(ROOT).as_posix(), name)
        for source in SOURCES
        for match in ROW.finditer(source.read_text())
        for name in re.findall(r"``(\w+)``", match.group(0))
    }
    assert len(named) >= 5
    unknown = sorted((where, name) for where, name in named if name not in rows)
    assert not unknown, f"rows not on {UNIT_COSTS.relative_to(ROOT)}: {unknown}"
