"""The docs hold together: every relative link of README.md, CONTRIBUTING.md
and docs/ resolves, the README stays short, and user-facing docs speak of
the product, not of its history. (Running every command in them is `make
doctest`, tests/docs/.)"""

import os
import re

import pytest

from conftest import REPO

README_MOST_LINES = 250
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _pages():
    pages = ["README.md", "CONTRIBUTING.md"]
    for root, _, files in os.walk(os.path.join(REPO, "docs")):
        pages += [os.path.relpath(os.path.join(root, f), REPO) for f in files
                  if f.endswith(".md")]
    return sorted(pages)


def _links(page):
    text = open(os.path.join(REPO, page), encoding="utf-8").read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)   # code is not a link
    return [target for target in LINK.findall(text)
            if not re.match(r"[a-z]+:", target) and not target.startswith("#")]


def test_every_page_exists():
    for page in ("README.md", "CONTRIBUTING.md", "docs/install.md", "docs/quickstart.md",
                 "docs/choosing-an-engine.md", "docs/troubleshooting.md",
                 "docs/limitations.md", "docs/benchmarks.md", "docs/design.md",
                 "docs/reference/flags.md"):
        assert os.path.exists(os.path.join(REPO, page)), page


@pytest.mark.parametrize("page", _pages())
def test_every_relative_link_resolves(page):
    broken = []
    for target in _links(page):
        path = target.split("#", 1)[0]
        if path and not os.path.exists(os.path.normpath(
                os.path.join(REPO, os.path.dirname(page), path))):
            broken.append(target)
    assert not broken, f"{page}: links to nothing: {broken}"


def test_the_link_check_finds_a_broken_link(tmp_path):
    """The control: the same check on a page with one good and one broken link."""
    page = tmp_path / "page.md"
    page.write_text("[good](page.md) [bad](missing.md) [web](https://example.com)\n"
                    "```sh\n[not a link](nowhere.md)\n```\n")
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    found = [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]
    assert [t for t in found if not (tmp_path / t).exists()] == ["missing.md"]


def test_the_readme_is_short():
    lines = open(os.path.join(REPO, "README.md"), encoding="utf-8").read().count("\n")
    assert lines <= README_MOST_LINES, f"README.md has {lines} lines; at most {README_MOST_LINES}"


@pytest.mark.parametrize("page", _pages())
def test_no_issue_numbers_in_user_docs(page):
    text = open(os.path.join(REPO, page), encoding="utf-8").read()
    assert not re.search(r"issue #?[0-9]", text, flags=re.I), page
