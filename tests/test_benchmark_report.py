"""docs/benchmarks.md is what benchmarks/report.py renders from benchmarks/results/*.json."""
import importlib.util
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("benchmark_report",
                                                  ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_the_page_is_rendered_from_the_stored_results(report, tmp_path):
    output = tmp_path / "benchmarks.md"
    assert report.main(["--output", str(output), "--chart", "", "--readme", ""]) == 0
    committed = (ROOT / "docs" / "benchmarks.md").read_text()
    assert output.read_text() == committed, (
        "docs/benchmarks.md differs from what benchmarks/report.py renders: run "
        "`python benchmarks/report.py` and commit the result")


def test_the_page_stays_short(report):
    assert len((ROOT / "docs" / "benchmarks.md").read_text().splitlines()) <= 420


def test_readme_headline_table_is_the_rendered_one(report):
    readme = (ROOT / "README.md").read_text()
    block = readme.split(report.HEADLINE_START, 1)[1].split(report.HEADLINE_END, 1)[0]
    stored = report.load(report.RESULTS)
    assert block.strip() == "\n".join(report.headline_table(stored, "docs/benchmarks.md"))


def test_every_family_has_results_with_their_provenance(report):
    for family in report.FAMILIES:
        data = json.loads((report.RESULTS / f"{family.name}.json").read_text())
        assert data["family"] == family.name and data["runs"]
        for run in data["runs"]:
            for key in ("command", "commit", "commit_source", "date", "machine", "tables"):
                assert run[key], (family.name, key)
            for table in run["tables"]:
                assert all(len(row) == len(table["columns"]) for row in table["rows"]), family


def test_every_headline_figure_is_found(report):
    found = report.headline(report.load(report.RESULTS))
    assert [h.label for h, _, _ in found] == [h.label for h in report.HEADLINES]


def test_a_cell_ratio_is_read_with_or_without_a_time(report):
    assert report.ratio_of("7.5 ms (0.70x)") == 0.70
    assert report.ratio_of("1.02x") == 1.02
    assert report.ratio_of("-") is None and report.ratio_of("as eager") is None


def test_every_script_report_runs_takes_json_and_quick(report):
    for family in report.FAMILIES:
        for argv in family.runs:
            source = (ROOT / argv[0]).read_text()
            assert '"--json"' in source and '"--quick"' in source, argv[0]


def test_quick_figures_never_replace_the_stored_ones(report, monkeypatch, tmp_path):
    """--quick without --results/--output writes into a temporary folder."""
    measured = []
    monkeypatch.setattr(report, "measure", lambda family, quick: measured.append(quick) or {
        "family": family.name, "runs": []})
    monkeypatch.setattr(report.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    before = (ROOT / "docs" / "benchmarks.md").read_text()
    assert report.main(["--run", "--quick", "--families", "coverage"]) == 0
    assert measured == [True]
    assert (tmp_path / "results" / "coverage.json").exists()
    assert (ROOT / "docs" / "benchmarks.md").read_text() == before
