"""The README's commands do what their comments say: each single-run `python run.py` line of "Using it"
is composed and judged with `mode=check` (refused exactly where the comment says so), its Quick start
block has the two commands CI runs, and it points at nothing outside the repository."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import run_py

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


def commands(title: str) -> list[tuple[list[str], str]]:
    """(arguments after `python run.py`, the comment) of each single-run line in the section's code."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", section(title), re.S):
        for line in block.splitlines():
            code, _, comment = line.partition("#")
            if code.startswith("python run.py") and " -m " not in f" {code} ":
                out.append((shlex.split(code)[2:], comment.strip()))
    return out


USING_IT = commands("Using it")


def test_the_sections_have_commands():
    assert len(USING_IT) >= 5


@pytest.mark.parametrize("args,comment", USING_IT, ids=[" ".join(a) or "plain" for a, _ in USING_IT])
def test_a_using_it_command_is_judged_as_its_comment_says(tmp_path, args, comment):
    mode = [] if any(a.startswith("mode=") for a in args) else ["mode=check"]
    r = run_py(*args, *mode, run_dir=tmp_path)
    refused = "refused" in comment
    assert r.returncode == (1 if refused else 0), r.stdout + r.stderr
    if refused:
        assert "fix:" in r.stderr and "Traceback" not in r.stderr


def test_quick_start_has_the_install_and_test_commands():
    block = re.search(r"```bash\n(.*?)```", section("Quick start"), re.S).group(1).strip().splitlines()
    assert len(block) == 2 and block[0].endswith("python run.py") and "pytest" in block[1]


def test_the_readme_points_at_nothing_outside_the_repository():
    assert not re.search(r"\.\./shared|GPU\.md|DESIGN\.md|DSV4_SPEC|STYLE\.md", README)
    for path in re.findall(r"`((?:dsv4|docs|bench|tests)/[\w/.-]+\.(?:py|md|yaml|json|sh))`", README):
        assert (Path(__file__).resolve().parents[1] / path).exists(), path

