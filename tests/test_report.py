"""keraunos.report: one self-contained HTML page, checked as data and rendered in headless Chromium.

The browser tests load the page in Debian's ``chromium`` (installed by scripts/setup.sh) and skip,
saying why, when it is not there. ``KERAUNOS_UPDATE_DOCS=1`` makes them rewrite docs/report.png,
the screenshot docs/guide.md shows (it is also written when missing).
"""
from __future__ import annotations

import copy
import html
import json
import os
import re
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_grads_match
import keraunos
from keraunos import debug
from keraunos.examples.gpt import GPT, GPTConfig
from keraunos.runtime.call import state_of
from keraunos.report.highlight import highlight_lines

CHROMIUM = "/usr/bin/chromium"
DOCS_SCREENSHOT = os.path.join(os.path.dirname(__file__), "..", "docs", "report.png")


def _strip_tags(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment))


@pytest.fixture(scope="module")
def gpt_report(tmp_path_factory):
    """A GPT compiled three times (two shapes without grad, then a training step), its report."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4))
    reference = copy.deepcopy(model)
    jmodel = keraunos.jit(model)
    idx, short = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        for x in (idx, idx, short):
            torch.testing.assert_close(jmodel(x), reference(x))
    loss = F.cross_entropy(jmodel(idx).flatten(0, 1), idx.flatten())
    expected = F.cross_entropy(reference(idx).flatten(0, 1), idx.flatten())
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    assert_grads_match(model, reference)
    path = tmp_path_factory.mktemp("report") / "report.html"
    with torch.no_grad():
        keraunos.report(jmodel, path, args=(idx,), calls=5)
    return jmodel, path, path.read_text()


def _as_shown(text: str) -> str:
    """A trace as the page shows it: user-source comments name the file without its folder (the
    full path is the comment's tooltip)."""
    return re.sub(r"# (?:/|<)[^:\n]*?([^/:\n]+):(\d+): ", r"# \1:\2 ", text)


def _payload(page: str) -> dict:
    raw = re.search(r'<script type="application/json" id="keraunos-traces">(.*?)</script>', page,
                    flags=re.S).group(1)
    return json.loads(raw.replace("<\\/", "</"))


# ---------------------------------------------------------------------------- the page as data
def test_highlighting_keeps_every_character_of_the_trace(gpt_report):
    jmodel, _, _ = gpt_report
    training = debug.compilations(state_of(jmodel))[2].entry
    for trace in (training.computation_traces[-1], training.prologue_traces[-1],
                  training.backward_traces[-1]):
        text = str(trace)
        highlighted = highlight_lines(text)
        assert [_strip_tags(line) for line in highlighted] == _as_shown(text).splitlines()
    assert '<span class="k">def</span>' in highlight_lines("def f(x):\n  return x\n")[0]


def test_source_comments_point_at_the_user_line():
    (line,) = highlight_lines("  # /home/me/model.py:12: y = torch.relu(x)")
    assert 'class="src"' in line and "model.py:12" in line and 'title="/home/me/model.py:12"' in line
    assert _strip_tags(line) == "  # model.py:12 y = torch.relu(x)"


def test_report_holds_every_trace_of_every_compilation(gpt_report):
    jmodel, _, page = gpt_report
    data = _payload(page)
    records = debug.compilations(state_of(jmodel))
    assert len(records) == 3 and len(data) == 3
    for i, record in enumerate(records):
        for kind, traces in debug.trace_histories(record.entry).items():
            shown = data[f"entry{i}"][kind]
            assert len(shown) == len(traces), (i, kind)
            for item, trace in zip(shown, traces):
                lines = re.findall(r'<div class="l[^"]*"><span class="ln">\d+</span>(.*?)</div>',
                                   item["html"])
                assert [_strip_tags(x) for x in lines] == _as_shown(str(trace)).splitlines()
    assert data["entry2"]["backward"]  # the training compilation has its backward traces
    assert not data["entry0"]["backward"]


def test_report_says_why_each_entry_was_compiled(gpt_report):
    jmodel, _, page = gpt_report
    for record in debug.compilations(state_of(jmodel))[1:]:
        assert record.miss_reasons
        for reason in record.miss_reasons:
            assert html.escape(reason) in page
    assert "first call: the cache was empty" in page
    assert re.search(r'<div class="stage-chart">.*capture', page, flags=re.S)
    assert page.count('class="entry"') == 3


def test_report_shows_per_call_step_timings(gpt_report):
    _, _, page = gpt_report
    section = page.split('<section id="timings">')[1].split("</section>")[0]
    for step in ("get_computation_and_inputs", "computation_fn", "maybe_call_epilogue"):
        assert step in section
    assert "eager (the original program)" in section


def test_report_needs_no_network_and_no_other_file(gpt_report):
    _, _, page = gpt_report
    assert not re.search(r"""(src|href)\s*=\s*["'](?!#)""", page)
    assert "@import" not in page and "url(" not in page
    assert "http://" not in page and "https://" not in page


def test_report_of_a_function_without_example_inputs(tmp_path):
    jf = keraunos.jit(lambda x: torch.nn.functional.gelu(x) * 2)
    x = torch.randn(4, 8)
    torch.testing.assert_close(jf(x), torch.nn.functional.gelu(x) * 2)
    path = keraunos.report(jf, tmp_path / "f.html")
    page = open(path).read()
    assert "Not measured" in page and len(_payload(page)) == 1


def test_report_lists_evicted_entries_without_keeping_them_alive(tmp_path):
    import gc
    jf = keraunos.jit(lambda x: x.sin() * 2, max_cache_entries=1, dynamic=False)
    for n in (2, 3, 4):
        x = torch.randn(n)
        torch.testing.assert_close(jf(x), x.sin() * 2)
    gc.collect()
    records = debug.compilations(state_of(jf))
    assert [r.entry is None for r in records] == [True, True, False]  # only the cached one lives
    page = open(keraunos.report(jf, tmp_path / "evicted.html")).read()
    assert page.count("evicted") >= 2 and "traces were freed with it" in page
    assert "3 compilations" in page or "of 3 compiled" in page


def test_report_of_an_uncalled_callable_says_so(tmp_path):
    jf = keraunos.jit(lambda x: x + 1)
    page = open(keraunos.report(jf, tmp_path / "empty.html")).read()
    assert "0 compilations" in page and _payload(page) == {}


def test_cli_run_writes_the_report(tmp_path, capsys):
    from keraunos import cli
    path = tmp_path / "cli.html"
    assert cli.main(["run", "--layers", "1", "--width", "32", "--calls", "3",
                     "--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"report written to {path}" in out
    assert "keraunos/examples/gpt.py:" in out  # the main job shows the model's source lines
    assert "# it checks, per tensor:" in out     # and what the final prologue checks
    page = path.read_text()
    assert '<section id="timings">' in page and len(_payload(page)) == 1


# ---------------------------------------------------------------------------- in a real browser
def _chromium(tmp_path, *arguments) -> subprocess.CompletedProcess:
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"headless Chromium is not installed ({CHROMIUM}): scripts/setup.sh installs "
                    f"Debian's chromium package, and could not here (no apt-get, no root, or no "
                    f"package archive reachable)")
    profile = tmp_path / "chromium-profile"
    profile.mkdir(exist_ok=True)
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--no-first-run", "--disable-background-networking", "--disable-component-update",
               "--disable-sync", f"--user-data-dir={profile}", "--hide-scrollbars",
               "--virtual-time-budget=5000", *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def _rendered_trace(dom: str, entry: str) -> tuple[str, str]:
    """The trace the viewer of ``entry`` shows after the page's script ran: (which, text)."""
    viewer = dom.split(f'id="{entry}-viewer"')[1]
    m = re.search(r'<pre class="code[^"]*" data-trace="([^"]+)">(.*?)</pre>', viewer, flags=re.S)
    assert m, "the page's script did not render the trace viewer"
    lines = re.findall(r'<div class="l[^"]*"><span class="ln">\d+</span>(.*?)</div>', m.group(2))
    return m.group(1), "\n".join(_strip_tags(line) for line in lines)


def test_report_renders_in_headless_chromium(gpt_report, tmp_path):
    jmodel, path, _ = gpt_report
    records = debug.compilations(state_of(jmodel))
    computation = records[0].entry.computation_traces
    done = _chromium(tmp_path, "--dump-dom", path.as_uri())
    dom = done.stdout
    assert done.returncode == 0 and "</html>" in dom, done.stderr[-2000:]
    for element in ('id="summary"', 'id="cache"', 'id="timings"', 'class="stage-chart"'):
        assert element in dom, element
    assert dom.count('class="entry"') == 3
    # Without a hash each viewer shows its entry's final computation trace.
    which, text = _rendered_trace(dom, "entry0")
    assert which == f"entry0-computation-{len(computation) - 1}"
    assert text.strip() == _as_shown(str(computation[-1])).strip()
    # One button per pass of the selected history.
    viewer = dom.split('id="entry0-viewer"')[1].split("</pre>")[0]
    assert len(re.findall(r'class="pass(?: active)?"', viewer)) == len(computation)


def test_switching_passes_in_chromium_shows_another_trace(gpt_report, tmp_path):
    jmodel, path, _ = gpt_report
    entry = debug.compilations(state_of(jmodel))[2].entry
    shown = {}
    for kind, index in (("computation", 0), ("computation", 3), ("backward", 0)):
        done = _chromium(tmp_path, "--dump-dom", f"{path.as_uri()}#entry2-{kind}-{index}")
        assert done.returncode == 0, done.stderr[-2000:]
        which, text = _rendered_trace(done.stdout, "entry2")
        assert which == f"entry2-{kind}-{index}"
        shown[kind, index] = text
        expected = debug.trace_histories(entry)[kind][index]
        assert text.strip() == _as_shown(str(expected)).strip()
    assert shown["computation", 0] != shown["computation", 3]
    assert "Constructed by Dead Code Elimination" not in shown["computation", 0]
    assert "Constructed by Dead Code Elimination" in shown["computation", 3]


def test_chromium_screenshot_of_the_report(gpt_report, tmp_path):
    _, path, _ = gpt_report
    shot = tmp_path / "report.png"
    done = _chromium(tmp_path, "--window-size=1440,1500", f"--screenshot={shot}",
                     path.as_uri())
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 50_000  # a painted page, not a blank one
    if os.environ.get("KERAUNOS_UPDATE_DOCS") or not os.path.exists(DOCS_SCREENSHOT):
        shutil.copyfile(shot, DOCS_SCREENSHOT)


# ------------------------------------------------------------------- figures: units and labels
def test_report_figures_say_what_they_measure_and_when(gpt_report):
    jmodel, _, page = gpt_report
    summary = _strip_tags(page.split('<section id="summary">')[1].split("</section>")[0])
    # The cache figures were taken before the report's own calls, and say so.
    assert "cache hits (calls that reused an entry) before the report's timed calls" in summary
    assert "per call, median of the report's 5 timed calls" in summary
    # The last call before the report (the training step) compiled: the card says the lookup is
    # the failed checks' alone.
    assert "last call's cache lookup: a miss (the checks that failed, before it compiled)" in summary
    timings = page.split('<section id="timings">')[1].split("</section>")[0]
    assert "none of these calls is counted in the cache figures above" in timings
    # One unit per column, named in its header; no cell carries a unit of its own.
    for header in re.findall(r'<th class="num">([^<]*(?:per call)[^<]*)</th>', timings):
        if "calls per call" not in header:
            assert re.search(r"\((s|ms|&micro;s)\)$", header), header
    cells = re.findall(r'<td class="num">(?:<b>)?([^<]*)', timings)
    assert cells and not any(re.search(r"[a-z]", c) for c in cells if not c.endswith("%")), cells
    # Stage labels are shown whole (they wrap), never cut with an ellipsis.
    assert "text-overflow:ellipsis" not in page.split(".bar-label")[1].split("}")[0]
    assert ">Common Subexpression Elimination</span>" in page


def test_report_of_a_training_entry_explains_the_autograd_function(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=4))
    reference = copy.deepcopy(model)
    jmodel = keraunos.jit(model)
    idx = torch.randint(0, 256, (2, 8))
    torch.testing.assert_close(jmodel(idx), reference(idx))  # grad mode on: a backward trace
    page = open(keraunos.report(jmodel, tmp_path / "train.html", args=(idx,), calls=3)).read()
    ops = page.split("Where a call spends its time")[1].split("</table>")[0]
    assert "<code>KeraunosFunction</code>" in ops
    assert "its self time is the Python that runs the program's lines" in ops


def test_report_after_a_miss_shows_the_lookup_without_the_compilation(tmp_path):
    jf = keraunos.jit(lambda x: x.cos() * 3)
    x = torch.randn(4)
    torch.testing.assert_close(jf(x), x.cos() * 3)
    stats = keraunos.compile_stats(jf)
    assert stats.last_call_compiled and stats.last_cache_lookup < stats.compile_time
    page = open(keraunos.report(jf, tmp_path / "miss.html")).read()
    assert "last call's cache lookup: a miss (the checks that failed, before it compiled)" in page
    assert "0 hits" in page and "1 miss<" in page
