"""Every ```python block of README.md and docs/getting_started.md runs, in order, and prints what
the page shows after it (tests/doc_examples.py has the rule)."""
import pathlib

import pytest

from doc_examples import fences, run_page

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "docs" / "getting_started.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_block_runs_and_prints_what_the_page_shows(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files a block writes (report.html) land here
    # A reader's defaults, not the suite's (tests/conftest.py turns fusion off); the fused
    # program is compiled on a thread of this process rather than in helper processes.
    for name in ("KERAUNOS_FUSE", "KERAUNOS_PROGRAM_STORE"):
        monkeypatch.delenv(name, raising=False)
    assert run_page(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_fence_says_whether_it_runs(page):
    """A bare fence would be neither run nor marked as not meant to run."""
    assert "" not in fences(page.read_text())


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
