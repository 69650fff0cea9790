"""The README's commands do what their comments say: each single-run `python run.py` line of "Using it"
is composed and judged with `mode=check` (refused exactly where the comment says so), its Quick start
block has the two commands CI runs, its support matrix says what the golden compatibility matrix says, and
it points at nothing outside the repository. Its reading of ```bash blocks and its judgement of a checked
command also serve tests/test_docs_commands.py."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from dsv4.checks import catalogue
from tests.conftest import run_py

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


def bash_commands(text: str) -> list[tuple[str, str]]:
    """(command, comment) of each command in the text's ```bash blocks: a line continued by a backslash joined
    to the next, runs of blanks made one, the comment after `#` apart."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            code, _, comment = line.partition("#")
            if code.strip():
                out.append((" ".join(code.split()), comment.strip()))
    return out


def commands(title: str) -> list[tuple[list[str], str]]:
    """(arguments after `python run.py`, the comment) of each single-run line in the section's code."""
    return [(shlex.split(code)[2:], comment) for code, comment in bash_commands(section(title))
            if code.startswith("python run.py") and " -m " not in f" {code} "]


def assert_judged_as_commented(r, comment: str) -> None:
    """A command judged by `mode=check` (or `info`) is refused -- exit status 1, an `error:` line with the
    fix, no traceback -- exactly where its comment says `refused`, else accepted (exit status 0)."""
    refused = "refused" in comment
    assert r.returncode == (1 if refused else 0), r.stdout + r.stderr
    if refused:
        assert re.search(r"^error: ", r.stderr, re.M) and "fix:" in r.stderr and "Traceback" not in r.stderr, r.stderr


USING_IT = commands("Using it")


def test_the_sections_have_commands():
    assert len(USING_IT) >= 5


@pytest.mark.parametrize("args,comment", USING_IT, ids=[" ".join(a) or "plain" for a, _ in USING_IT])
def test_a_using_it_command_is_judged_as_its_comment_says(tmp_path, args, comment):
    mode = [] if any(a.startswith("mode=") for a in args) else ["mode=check"]
    assert_judged_as_commented(run_py(*args, *mode, run_dir=tmp_path), comment)


# the support matrix's platforms (golden matrix device keys), and whether the tests and benches run there
PLATFORMS = {"cpu": True, "sm90": True, "sm100": False, "sm120": False, "gfx942": False, "gfx950": False}


def golden_support() -> dict[str, dict[str, str]]:
    """{group=option: {platform: runs | checked only | refused}} from tests/golden/compat_matrix.json: an option
    is accepted on a platform where some case that includes it (a backend preset as shipped, or with one
    option swapped) is judged ok."""
    golden = json.loads((Path(__file__).resolve().parent / "golden" / "compat_matrix.json").read_text())
    presets = catalogue.backend_presets()
    cells: dict[str, dict[str, str]] = {}
    for case, verdicts in golden["verdicts"].items():
        swapped = dict(part.split("=", 1) for part in case.split())
        chosen = {**presets[swapped.pop("backend")], **swapped}
        chosen.setdefault("indexer.top_k", catalogue.option("indexer", chosen["indexer"]).top_k.name)
        for group, name in chosen.items():
            row = cells.setdefault(f"{group}={name}", dict.fromkeys(PLATFORMS, "refused"))
            for platform, run_here in PLATFORMS.items():
                if verdicts[platform] == "ok":
                    row[platform] = "runs" if run_here else "checked only"
    return cells


def readme_support() -> tuple[list[str], dict[str, dict[str, str]]]:
    """(the platform keys of the header, {group=option: {platform: cell}}) of the README's support matrix."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in section("Support matrix").splitlines() if line.startswith("| ")]
    platforms = [cell.split()[0] for cell in rows[0][1:]]
    return platforms, {r[0].strip("`"): dict(zip(platforms, r[1:])) for r in rows[1:] if r[0].startswith("`")}


def test_the_support_matrix_says_what_the_golden_matrix_says():
    platforms, readme = readme_support()
    golden = golden_support()
    shipped = {f"{g}={o}" for g in (*catalogue.GROUPS, *catalogue.NESTED_GROUPS) for o in catalogue.options(g)}
    assert platforms == list(PLATFORMS)
    assert set(golden) == shipped and set(readme) == shipped, sorted(set(readme) ^ shipped)
    wrong = [f"| `{key}` | " + " | ".join(golden[key].values()) + " |" for key in sorted(shipped)
             if readme[key] != golden[key]]
    assert not wrong, "README rows that differ from the golden matrix; they should read:\n" + "\n".join(wrong)


def test_quick_start_has_the_install_and_test_commands():
    block = re.search(r"```bash\n(.*?)```", section("Quick start"), re.S).group(1).strip().splitlines()
    assert len(block) == 2 and block[0].endswith("python run.py") and "pytest" in block[1]


def test_the_readme_points_at_nothing_outside_the_repository():
    assert not re.search(r"\.\./shared|GPU\.md|DESIGN\.md|DSV4_SPEC|STYLE\.md", README)
    for path in re.findall(r"`((?:dsv4|docs|bench|tests)/[\w/.-]+\.(?:py|md|yaml|json|sh))`", README):
        assert (Path(__file__).resolve().parents[1] / path).exists(), path

