"""Citations resolve: what the code, the configs, the tests, the benches, README.md and docs/**/*.md cite
is in the repository.

- No file names a document kept outside the repository.
- Every `docs/....md` path cited anywhere exists, and every relative link of a page under docs/ resolves.
- A `§n.m` right after a doc path (`docs/X.md §2.4, §5.3`, `docs/X.md` §2.2-§2.5: a list or a range of
  them, the path in backticks or not) is a numbered section of that doc, whichever docs/*.md it is.
- A bare `§n.m` (no doc path just before it, as in "see §2.4") is read against the doc its file is about:
  in docs/X.md, X's own sections; in every other file, docs/numerics.md's.
- The scripts, modules and paths of the package that the current docs name exist. docs/archive/ is
  frozen history and may name what has since gone.
"""
from __future__ import annotations

import importlib.util
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DOC = "docs/numerics.md"
OUTSIDE = re.compile(r"\.\./shared|GPU\.md|DESIGN\.md|DSV4_SPEC|STYLE\.md|\bSTYLE §")
DOC = r"`?(docs/[\w/.-]+?\.md)`?"
REF = r"§\d+(?:\.\d+)*"
CITATION = re.compile(rf"{DOC}\s+((?:{REF})(?:(?:, | and | or |\s?[-–]\s?){REF})*)")
SECTION = re.compile(r"^#+ (\d+(?:\.\d+)*)\.? ", re.MULTILINE)


def citing_files() -> list[Path]:
    """Every file that may cite, but this one, which spells the forms it looks for."""
    files = {*ROOT.glob("dsv4/**/*.py"), *ROOT.glob("configs/**/*.yaml"), *ROOT.glob("tests/*.py"),
             *ROOT.glob("bench/*.py"), *ROOT.glob("bench/*.sh"), ROOT / "README.md", *ROOT.glob("docs/**/*.md")}
    return sorted(files - {Path(__file__).resolve()})


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@cache
def sections(doc: str) -> frozenset[str]:
    """The numbered sections of a doc: `## 2. ...` is 2, `### 2.4 ...` is 2.4."""
    return frozenset(SECTION.findall((ROOT / doc).read_text()))


def numbers(refs: str) -> list[str]:
    return re.findall(r"§(\d+(?:\.\d+)*)", refs)


def citations(text: str) -> tuple[list[tuple[str, str]], list[str]]:
    """([(doc, section)] of the sections cited after a doc path, [section] of the bare ones)."""
    after, spans = [], []
    for m in CITATION.finditer(text):
        after += [(m.group(1), n) for n in numbers(m.group(2))]
        spans.append(m.span(2))
    bare = [m.group(1) for m in re.finditer(r"§(\d+(?:\.\d+)*)", text)
            if not any(a <= m.start() < b for a, b in spans)]
    return after, bare


def own_doc(path: Path) -> str:
    """The doc a bare `§n.m` of this file points into."""
    name = rel(path)
    return name if name.startswith("docs/") else DEFAULT_DOC


def test_nothing_names_a_document_kept_outside_the_repository():
    spelling = {"tests/test_readme.py"}                 # its README check spells the names, as this file does
    assert [rel(p) for p in citing_files() if rel(p) not in spelling and OUTSIDE.search(p.read_text())] == []


def test_every_cited_doc_exists():
    cited, bad = 0, []
    for path in citing_files():
        for doc in re.findall(r"(?<![\w/.])(docs/[\w/.-]+?\.md)\b", path.read_text()):
            cited += 1
            bad += [] if (ROOT / doc).is_file() else [(rel(path), doc)]
    assert bad == []
    assert cited > 30            # the files do cite them


def test_the_relative_links_of_the_docs_resolve():
    linked, bad = 0, []
    for path in ROOT.glob("docs/**/*.md"):
        for target in re.findall(r"\]\(([\w./-]*[A-Za-z][\w./-]*)(?:#[^)\s]*)?\)", path.read_text()):
            if not re.match(r"\w+:", target):
                linked += 1
                bad += [] if (path.parent / target).exists() else [(rel(path), target)]
    assert bad == []
    assert linked > 5


def test_a_section_cited_after_a_doc_is_one_of_its_sections():
    cited, docs, bad = 0, set(), []
    for path in citing_files():
        after, _ = citations(path.read_text())
        for doc, n in after:
            cited += 1
            docs.add(doc)
            bad += [] if (ROOT / doc).is_file() and n in sections(doc) else [(rel(path), doc, f"§{n}")]
    assert bad == []
    assert cited > 40 and {"docs/numerics.md", "docs/design.md"} <= docs


def test_a_bare_section_is_one_of_its_files_doc():
    cited, bad = 0, []
    for path in citing_files():
        _, bare = citations(path.read_text())
        doc = own_doc(path)
        for n in bare:
            cited += 1
            bad += [] if n in sections(doc) else [(rel(path), doc, f"§{n}")]
    assert bad == []
    assert cited > 30


def test_the_current_docs_name_only_what_exists():
    """Paths of the package, its benches and docs, and dotted dsv4 modules, named in README.md and the
    docs outside docs/archive/."""
    import dsv4

    pages = [ROOT / "README.md", *(p for p in ROOT.glob("docs/**/*.md") if "archive" not in p.parts)]
    named, bad = 0, []
    for path in pages:
        text = path.read_text()
        for name in re.findall(r"(?<![\w/.-])((?:dsv4|bench|docs)/[\w/.-]*\w)", text):
            named += 1
            bad += [] if (ROOT / name).exists() else [(rel(path), name)]
        for name in re.findall(r"(?<![\w.])dsv4(?:\.\w+)+", text):
            parts = name.split(".")
            modules = [ROOT.joinpath(*parts[:i]) for i in range(2, len(parts) + 1)]
            found = hasattr(dsv4, parts[1]) or any(m.with_suffix(".py").is_file() or (m / "__init__.py").is_file()
                                                   for m in modules) \
                or importlib.util.find_spec(".".join(parts[:2])) is not None    # dsv4.configs: configs/, mapped
            bad += [] if found else [(rel(path), name)]
    assert bad == []
    assert named > 50
