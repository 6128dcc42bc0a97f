"""The generated reference pages (`make reference`) are those of the code:
each console script's --help (docs/reference/cli.md) and the Python API's
signatures and docstrings (docs/reference/api.md)."""

import os

import pytest

from tfdist import reference

from conftest import REPO


@pytest.mark.parametrize("page,generate", [("cli.md", reference.markdown_cli),
                                           ("api.md", reference.markdown_api)])
def test_the_reference_page_is_the_one_generated(page, generate):
    with open(os.path.join(REPO, "docs", "reference", page)) as f:
        assert f.read() == generate(), f"docs/reference/{page} is out of date: run `make reference`"


def test_a_changed_docstring_changes_the_api_page(monkeypatch):
    """The control: the page follows the docstrings."""
    from tfdist import api
    monkeypatch.setattr(api.export, "__doc__", "Another text.")
    assert "Another text." in reference.markdown_api()


def test_every_public_name_is_in_the_api_page():
    import tfdist
    documented = set(reference.FUNCTIONS + reference.PARTS + reference.ERRORS)
    assert set(tfdist.__all__) == documented
