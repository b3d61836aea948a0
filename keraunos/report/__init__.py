"""``keraunos.report``: one self-contained HTML page about a jitted callable.

The page holds every cache entry (and every compilation still remembered) with its prologue,
computation, epilogue and backward traces after each pass, selectable and syntax highlighted;
the compile stages as bar charts; the cache hits, misses and each miss's reasons; per-call step
timings when example inputs are given; fusion regions once a fusion executor makes them. No
network and no other files: the CSS and JavaScript are inline.

    >>> import torch, keraunos
    >>> jf = keraunos.jit(lambda x: torch.nn.functional.gelu(x) * 2)
    >>> x = torch.randn(4, 8)
    >>> _ = jf(x)
    >>> keraunos.report(jf, "report.html", args=(x,))  # doctest: +SKIP
    'report.html'

A trace can be linked to: ``report.html#entry0-computation-3`` opens entry 0's computation as it
was after pass 3.
"""
from __future__ import annotations

import datetime
import difflib
import html
import json
import os

import torch

from .. import debug
from ..inspection import compile_stats
from ..runtime.call import state_of
from ..version import __version__
from ..debug import format_duration
from .highlight import highlight_lines
from .page import CSS, JS
from .timing import STEPS, CallTimings, time_calls

KINDS = ("prologue", "computation", "epilogue", "backward")
_NO_TRACE = {
    "prologue": "no prologue trace",
    "computation": "no computation trace",
    "epilogue": "no epilogue trace",
    "backward": "no backward trace: this entry was compiled with grad mode off or with no input "
                "requiring grad, so nothing is differentiated",
}
# Bar colours, one per stage in order (cycled).
_PALETTE = ("#5b4bdb", "#f5a524", "#0ea5a4", "#e0457b", "#3b82f6", "#84cc16", "#a855f7",
            "#f97316", "#14b8a6", "#64748b")


def report(jitted, path: str | os.PathLike = "report.html", *, args: tuple | None = None,
           kwargs: dict | None = None, calls: int = 50, title: str | None = None) -> str:
    """Write the HTML report of ``jitted`` (a callable returned by ``keraunos.jit`` that has been
    called at least once) to ``path``; returns the path.

    With ``args``/``kwargs`` the page also shows per-call step timings: the jitted callable is
    called ``calls`` times on them (with whatever side effects the program has), then the original
    program as often, then a few calls under ``torch.profiler`` for the ops that dominate. The
    cache figures (hits, misses, the last lookup) are taken before those calls, and the page says
    so.
    """
    state = state_of(jitted)
    stats = compile_stats(jitted)
    snapshot = dict(hits=state.hits, misses=state.misses, lookup=state.last_lookup,
                    compiled=stats.last_call_compiled, entries=list(state.entries),
                    last=state.last_entry)
    timings = None
    if args is not None or kwargs is not None:
        timings = time_calls(jitted, tuple(args or ()), dict(kwargs or {}), calls)
    page = render(state, snapshot, timings, title)
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return os.fspath(path)


# ------------------------------------------------------------------------------ collection
def _compilations(state, snapshot) -> list[debug.Compilation]:
    """Every remembered compilation, plus cached entries compiled before the history began."""
    records = debug.compilations(state)
    known = {id(r.entry) for r in records if r.entry is not None}
    extra = [debug.Compilation.of(0, e, [], 0.0) for e in snapshot["entries"]
             if id(e) not in known]
    return extra + records


def _trace_items(traces) -> list[dict]:
    items = []
    for i, trace in enumerate(traces):
        text = str(trace)
        lines = text.splitlines()
        previous = next((t for t in reversed(traces[:i]) if t.name == trace.name), None)
        added = set()
        removed = 0
        if previous is not None:
            matcher = difflib.SequenceMatcher(None, str(previous).splitlines(), lines,
                                              autojunk=False)
            for op, a0, a1, b0, b1 in matcher.get_opcodes():
                if op != "equal":
                    added.update(range(b0, b1))
                    removed += a1 - a0
        rows = [f'<div class="l{" add" if n in added else ""}"><span class="ln">{n + 1}</span>'
                f"{code}</div>" for n, code in enumerate(highlight_lines(text))]
        label = debug.trace_label(trace).split(":")[0]
        items.append({"label": label, "header": "\n".join(trace.header),
                      "ms": f"{trace.seconds * 1e3:.2f} ms" if trace.seconds else "",
                      "lines": len(lines), "html": "".join(rows), "diff": previous is not None,
                      "added": len(added), "removed": removed})
    return items


# ------------------------------------------------------------------------------- rendering
def render(state, snapshot, timings: CallTimings | None, title: str | None) -> str:
    records = _compilations(state, snapshot)
    name = title or state.name
    data = {}
    sections = []
    for i, record in enumerate(records):
        entry_id = f"entry{i}"
        histories = (debug.trace_histories(record.entry) if record.entry is not None
                     else {k: [] for k in KINDS})
        data[entry_id] = {k: _trace_items(histories[k]) for k in KINDS}
        data[entry_id]["empty"] = _NO_TRACE
        sections.append(_entry_section(entry_id, i, record, snapshot, histories))
    payload = json.dumps(data).replace("</", "<\\/")
    generated = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>keraunos report: {html.escape(name)}</title>
<style>{CSS}</style></head>
<body>
<header><h1><span class="bolt">&#9889;</span>keraunos report: <code>{html.escape(name)}</code></h1>
<div class="sub">generated {generated} &middot; keraunos {__version__} &middot; torch {torch.__version__}
&middot; {len(records)} compilation{"s" if len(records) != 1 else ""}</div></header>
<main>
{_summary(records, snapshot, timings)}
{_cache_section(records, snapshot)}
{"".join(sections)}
{_timings_section(timings)}
</main>
<footer>keraunos.report &middot; one self-contained page: no network, no other files.
Link to a trace with <code>#entryN-kind-pass</code>.</footer>
<script type="application/json" id="keraunos-traces">{payload}</script>
<script>{JS}</script>
</body></html>
"""


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _us(seconds: float) -> str:
    """One duration in the unit that reads best (call-path times are microseconds)."""
    return format_duration(seconds, ascii_only=False)


def _column_unit(values) -> tuple[float, str]:
    """One unit for a table column (its largest value decides), so that its rows compare at a
    glance: (seconds per unit, the unit's name)."""
    largest = max(values, default=0.0)
    if largest >= 1.0:
        return 1.0, "s"
    if largest >= 1e-3:
        return 1e-3, "ms"
    return 1e-6, "&micro;s"


def _in(seconds: float, unit: tuple[float, str]) -> str:
    scale, name = unit
    return f"{seconds / scale:.{1 if name == '&micro;s' else 2}f}"


def _card(value: str, key: str) -> str:
    return f'<div class="card"><div class="v">{value}</div><div class="k">{key}</div></div>'


def _summary(records, snapshot, timings) -> str:
    compile_total = sum(sum(r.stages.values()) for r in records)
    before = " before the report's timed calls" if timings is not None else ""
    if snapshot["compiled"]:
        lookup = _card(_us(snapshot["lookup"]), "last call's cache lookup: a miss (the checks "
                       "that failed, before it compiled)")
    else:
        lookup = _card(_us(snapshot["lookup"]), "last call's cache lookup: a hit (prologue "
                       "checks)")
    cards = [_card(f"{len(snapshot['entries'])} <small>of {len(records)} compiled</small>",
                   "cache entries held"),
             _card(str(snapshot["hits"]), f"cache hits (calls that reused an entry){before}"),
             _card(str(snapshot["misses"]), f"cache misses (calls that compiled){before}"),
             _card(_ms(compile_total), "compile time, all compilations"),
             lookup]
    if timings is not None:
        cards.append(_card(_us(timings.total), f"per call, median of the report's "
                           f"{timings.calls} timed calls"))
        if timings.eager:
            cards.append(_card(f"{timings.total / timings.eager:.2f}&times;",
                               f"of eager's per call ({_us(timings.eager)}, median of "
                               f"{timings.calls})"))
    return f'<section id="summary"><h2>Summary</h2><div class="cards">{"".join(cards)}</div></section>'


def _reasons(record) -> str:
    if record.number == 0:
        return '<span class="note">compiled before this report\'s history began</span>'
    if not record.miss_reasons:
        return '<span class="note">first call: the cache was empty</span>'
    per_entry, symbolic = debug.split_reasons(record.miss_reasons)
    items = "".join(f"<li>entry {i}: <code>{html.escape(r)}</code></li>"
                    for i, r in enumerate(per_entry))
    items += "".join(f"<li>so: <code>{html.escape(r)}</code></li>" for r in symbolic)
    return f'<ul class="reasons">{items}</ul>'


def _status_tags(record, snapshot) -> str:
    held = record.entry is not None and any(e is record.entry for e in snapshot["entries"])
    tags = ['<span class="tag good">in cache</span>' if held else
            '<span class="tag warn">evicted</span>']
    if record.entry is not None and record.entry is snapshot["last"]:
        tags.append('<span class="tag">ran last</span>')
    return "".join(tags)


def _cache_section(records, snapshot) -> str:
    rows = []
    for i, record in enumerate(records):
        when = (datetime.datetime.fromtimestamp(record.wall_time).strftime("%H:%M:%S")
                if record.wall_time else "")
        rows.append(f'<tr><td><a href="#entry{i}-computation-0">entry {i}</a></td>'
                    f'<td class="num">{record.number or ""}</td><td>{when}</td>'
                    f'<td>{_status_tags(record, snapshot)}</td>'
                    f'<td class="num">{_ms(sum(record.stages.values()))}</td>'
                    f"<td>{_reasons(record)}</td></tr>")
    hits, misses = snapshot["hits"], snapshot["misses"]
    return (f'<section id="cache"><h2>Cache: hits and misses<span class="tag">{hits} '
            f'hit{"" if hits == 1 else "s"}</span><span class="tag bad">{misses} '
            f'miss{"" if misses == 1 else "es"}</span></h2>'
            f'<p class="note">Counted over the program\'s own calls, up to this report (the '
            f"report's timed calls are not among them). Each miss compiled a new entry; its "
            f"reasons say why every entry cached at that moment did not fit the call (the first "
            f"failing prologue check).</p>"
            f'<table><tr><th>entry</th><th class="num">compilation</th><th>at</th><th>status</th>'
            f'<th class="num">compile time</th><th>why it was compiled</th></tr>{"".join(rows)}'
            f"</table></section>")


_OP_NOTES = {
    "KeraunosFunction": "keraunos's <code>torch.autograd.Function</code> around this entry's "
                        "forward program (the entry has a backward): its self time is the Python "
                        "that runs the program's lines and autograd's bookkeeping, not a kernel; "
                        "the ops it runs are the other rows",
}


def _timings_section(timings: CallTimings | None) -> str:
    if timings is None:
        return ('<section id="timings"><h2>Per-call timings</h2><p class="note">Not measured: '
                "pass example inputs, <code>keraunos.report(jitted, path, args=(x,))</code>, or run "
                "<code>python -m keraunos.cli run --report report.html</code>.</p></section>")
    total = sum(timings.steps.values()) or 1.0
    unit = _column_unit([*timings.steps.values(), timings.total, timings.eager or 0.0])
    segments, legend, rows = [], [], []
    for i, step in enumerate(STEPS):
        seconds = timings.steps[step]
        color = _PALETTE[i % len(_PALETTE)]
        segments.append(f'<span style="width:{100 * seconds / total:.2f}%;background:{color}" '
                        f'title="{step}: {seconds * 1e6:.1f} us"></span>')
        legend.append(f'<span><i style="background:{color}"></i>{step} {_us(seconds)}</span>')
        rows.append(f"<tr><td><code>{step}</code></td><td class=\"num\">{_in(seconds, unit)}</td>"
                    f'<td class="num">{100 * seconds / total:.1f}%</td></tr>')
    eager = (f"<tr><td>eager (the original program)</td><td class=\"num\">"
             f"{_in(timings.eager, unit)}</td><td></td></tr>") if timings.eager else ""
    return (f'<section id="timings"><h2>Per-call timings<span class="tag">median of '
            f"{timings.calls} calls</span></h2>"
            f'<p class="note">Measured by the report itself: {timings.calls} timed calls of the '
            f"jitted program after 3 warm-up calls, then the original program as often, then "
            f"{timings.profiled + 1} under torch.profiler; none of these calls is counted in the "
            f"cache figures above.</p>"
            f'<div class="stacked">{"".join(segments)}</div><div class="legend">{"".join(legend)}'
            f'</div><h3>The call path, step by step</h3><table><tr><th>step</th>'
            f'<th class="num">median per call ({unit[1]})</th><th class="num">share</th></tr>'
            f'{"".join(rows)}<tr><td><b>whole call</b></td><td class="num"><b>'
            f'{_in(timings.total, unit)}</b></td><td></td></tr>{eager}</table>'
            f"{_ops_table(timings)}</section>")


def _ops_table(timings: CallTimings) -> str:
    if not timings.top_ops:
        return ""
    unit = _column_unit([s for _, _, s in timings.top_ops])
    rows = []
    for name, count, seconds in timings.top_ops:
        note = _OP_NOTES.get(name)
        note = f'<div class="note">{note}</div>' if note else ""
        rows.append(f'<tr><td><code>{html.escape(name)}</code>{note}</td><td class="num">'
                    f'{count}</td><td class="num">{_in(seconds, unit)}</td></tr>')
    return (f"<h3>Where a call spends its time (torch.profiler)</h3>"
            f'<p class="note">Self CPU time: the time inside each op itself, not in the ops it '
            f"calls, per call of the jitted program (the mean over {timings.profiled} profiled "
            f"calls).</p>"
            f'<table><tr><th>op</th><th class="num">calls per call</th>'
            f'<th class="num">self CPU time per call ({unit[1]})</th></tr>{"".join(rows)}'
            f"</table>")


def _stage_chart(stages: dict[str, float]) -> str:
    if not stages:
        return '<p class="note">no compile stages recorded</p>'
    longest = max(stages.values()) or 1.0
    rows = [f'<div class="bar-row"><span class="bar-label" title="{html.escape(s)}">'
            f'{html.escape(s)}</span><span class="bar-track"><span class="bar" style="width:'
            f'{100 * seconds / longest:.2f}%;background:{_PALETTE[i % len(_PALETTE)]}"></span>'
            f'</span><span class="bar-value">{_ms(seconds)}</span></div>'
            for i, (s, seconds) in enumerate(stages.items())]  # ms throughout: they compare
    return (f'<div class="stage-chart">{"".join(rows)}<div class="bar-row"><b>total</b><span>'
            f'</span><span class="bar-value"><b>{_ms(sum(stages.values()))}</b></span></div></div>')


def _inputs_table(entry) -> str:
    traces = entry.computation_traces
    if not traces:
        return ""
    params = [p for p in traces[0].params if hasattr(p, "describe")]
    rows = "".join(f"<tr><td><code>{html.escape(p.name)}</code></td><td><code>"
                   f"{html.escape((p.describe() or '').strip(chr(34)))}</code></td><td><code>"
                   f"{html.escape(str(p.provenance or ''))}</code></td></tr>" for p in params)
    return (f'<details class="inputs"><summary>{len(params)} inputs of the computation, with '
            f'where each comes from</summary><table><tr><th>name</th><th>value</th><th>from</th>'
            f"</tr>{rows}</table></details>")


def _fusion(entry) -> str:
    regions = getattr(entry, "fusion_regions", None) or ()
    if not regions:
        return ('<h3>Fusion regions</h3><p class="note">None: this entry was compiled without '
                "the inductor executor (jit(..., executors=['inductor', 'torch'])), or nothing in "
                "it could be fused, so every op runs through its operator executor (see the "
                "claims pass).</p>")
    blocks = []
    for i, region in enumerate(regions):
        source = str(getattr(region, "source", region))
        code = "".join(f'<div class="l"><span class="ln">{n + 1}</span>{line}</div>'
                       for n, line in enumerate(highlight_lines(source)))
        blocks.append(f'<p><b>{html.escape(str(getattr(region, "name", f"region {i}")))}</b></p>'
                      f'<div class="viewer"><pre class="code">{code}</pre></div>')
    return f'<h3>Fusion regions</h3>{"".join(blocks)}'


def _entry_section(entry_id, i, record, snapshot, histories) -> str:
    kinds = "".join(
        f'<button class="kind" data-kind="{k}"{" disabled" if not histories[k] else ""}>{k}'
        f'<span class="count">{len(histories[k])}</span></button>' for k in KINDS)
    number = f" &middot; compilation {record.number}" if record.number else ""
    if record.entry is None:  # evicted and freed: its traces went with it
        return f"""<section class="entry" id="{entry_id}">
<h2>Entry {i}{number}{_status_tags(record, snapshot)}</h2>
<div class="entry-grid"><div>
<h3>Why it was compiled</h3>{_reasons(record)}
<h3>Compile stages</h3>{_stage_chart(record.stages)}
</div><div><p class="note">The cache evicted this entry and its traces were freed with it
(keraunos keeps no evicted program alive). <code>KERAUNOS_DEBUG=2</code> writes every trace to a
folder as it is compiled.</p></div></div></section>
"""
    return f"""<section class="entry" id="{entry_id}">
<h2>Entry {i}{number}{_status_tags(record, snapshot)}</h2>
<div class="entry-grid"><div>
<h3>Why it was compiled</h3>{_reasons(record)}
<h3>Compile stages</h3>{_stage_chart(record.stages)}
{_fusion(record.entry) if record.entry is not None else ""}
</div><div>
<div class="viewer" id="{entry_id}-viewer"><div class="kinds">{kinds}</div>
<div class="passes"></div>
<div class="tools"><button class="prev">&larr; previous pass</button>
<button class="next">next pass &rarr;</button><button class="wrap">wrap lines</button>
<span>lines changed by the selected pass are marked green</span></div>
<div class="meta"></div><pre class="code"></pre></div>
<noscript><p class="note">The trace viewer needs JavaScript.</p></noscript>
{_inputs_table(record.entry)}
</div></div></section>
"""
