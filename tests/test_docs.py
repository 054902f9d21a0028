"""The documentation: every relative link of the README and of ``docs/`` leads to a file that exists, and to a
heading that exists when it names one; the Sphinx site (guide, API reference from the docstrings, format,
guarantees, performance, architecture) builds with warnings as errors, so a broken docstring or reference fails."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md"), *sorted(
    os.path.join(ROOT, "docs", name) for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub and MyST make it: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: str) -> set[str]:
    with open(path) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)  # headings inside code blocks are not headings
    return {_slug(m.group(1)) for m in re.finditer(r"(?m)^#{1,6} (.+)$", text)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_leads_somewhere(page: str) -> None:
    with open(page) as f:
        links = LINK.findall(re.sub(r"```.*?```", "", f.read(), flags=re.S))
    if page.endswith("README.md"):
        assert len(links) >= 10, "the front page links to the documentation"
    broken = []
    for link in links:
        if re.match(r"^[a-z]+://", link):
            continue  # no network here; external links are not checked
        target, _, anchor = link.partition("#")
        path = os.path.normpath(os.path.join(os.path.dirname(page), target)) if target else page
        if not os.path.exists(path):
            broken.append(f"{link}: no file {os.path.relpath(path, ROOT)}")
        elif anchor and path.endswith(".md") and anchor not in _anchors(path):
            broken.append(f"{link}: no heading '#{anchor}' in {os.path.relpath(path, ROOT)}")
    assert not broken, f"{os.path.relpath(page, ROOT)}: " + "; ".join(broken)


# A test named in backticks, with its file or without: `test_x.py::test_y`, `test_y`, `test_y[param]`.
TEST_NAME = re.compile(r"`(?:(?:tests/)?(test_\w+\.py)::)?(test_\w+)(?:\[[^\]`]*\])?`")


def test_every_test_the_documentation_names_exists() -> None:
    # docs/guarantees.md names the test behind each guarantee: one named a test merged into another two stops before.
    defined: dict[str, set[str]] = {}
    for name in os.listdir(os.path.join(ROOT, "tests")):
        if name.startswith("test_") and name.endswith(".py"):
            with open(os.path.join(ROOT, "tests", name)) as f:
                for test in re.findall(r"(?m)^def (test_\w+)\(", f.read()):
                    defined.setdefault(test, set()).add(name)
    named, missing = 0, []
    for page in PAGES:
        with open(page) as f:
            for file, test in TEST_NAME.findall(f.read()):
                named += 1
                if test not in defined or (file and file not in defined[test]):
                    missing.append(f"{os.path.relpath(page, ROOT)}: {file + '::' if file else ''}{test}")
    assert named >= 50, "the guarantees name their tests"
    assert not missing, "named tests that do not exist: " + "; ".join(missing)


def test_the_documentation_builds_without_a_warning(tmp_path: Any) -> None:
    done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                           os.path.join(ROOT, "docs"), str(tmp_path / "html")], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(tmp_path / "html" / "api.html") as f:
        api = f.read()
    # autodoc rendered the docstrings (an import that failed would leave the page without them)
    for name in ("MmapCachedDataset", "load_state_dict", "missing_indices", "PadCollate", "CacheFormatError"):
        assert name in api, name
