"""The report page's look and behaviour: inline CSS and JavaScript (no network, no files)."""

CSS = r"""
:root { --bg:#f4f5fa; --card:#fff; --ink:#1c2233; --dim:#6b7388; --line:#e3e6ef;
  --accent:#5b4bdb; --bolt:#f5a524; --good:#16a34a; --bad:#dc2626; --code:#0e1424; }
* { box-sizing:border-box; }
body { margin:0; background:var(--bg); color:var(--ink);
  font:14px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif; }
header { background:linear-gradient(120deg,#1b1740 0%,#3b2f9e 55%,#5b4bdb 100%); color:#fff;
  padding:22px 36px 26px; }
header h1 { margin:0; font-size:24px; letter-spacing:.3px; font-weight:650; }
header h1 .bolt { color:var(--bolt); margin-right:6px; }
header .sub { opacity:.8; margin-top:4px; font-size:13px; }
header code { background:rgba(255,255,255,.14); padding:1px 6px; border-radius:5px; }
main { padding:22px 36px 60px; max-width:1800px; margin:0 auto; }
section { background:var(--card); border:1px solid var(--line); border-radius:12px;
  padding:18px 22px; margin:0 0 20px; box-shadow:0 1px 2px rgba(20,24,60,.04); }
h2 { margin:0 0 12px; font-size:17px; font-weight:650; }
h2 .tag, .tag { display:inline-block; font-size:11px; font-weight:600; padding:2px 8px;
  border-radius:99px; background:#eef0fb; color:var(--accent); margin-left:6px;
  vertical-align:2px; }
.tag.good { background:#e8f7ee; color:var(--good); } .tag.bad { background:#fdecec; color:var(--bad); }
.tag.warn { background:#fff4e0; color:#b26b00; }
h3 { margin:16px 0 8px; font-size:13px; text-transform:uppercase; letter-spacing:.6px; color:var(--dim); }
.cards { display:grid; grid-template-columns:repeat(auto-fit,minmax(170px,1fr)); gap:12px; }
.card { border:1px solid var(--line); border-radius:10px; padding:12px 14px; background:#fbfbfe; }
.card .v { font-size:22px; font-weight:680; } .card .k { color:var(--dim); font-size:12px; }
.card .v small { font-size:13px; color:var(--dim); font-weight:500; }
table { border-collapse:collapse; width:100%; }
th, td { text-align:left; padding:6px 10px; border-bottom:1px solid var(--line); vertical-align:top; }
th { font-size:12px; color:var(--dim); font-weight:600; }
td.num, th.num { text-align:right; font-variant-numeric:tabular-nums; white-space:nowrap; }
td code, li code { font:12px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;
  background:#f1f2f8; padding:1px 5px; border-radius:4px; }
ul.reasons { margin:0; padding-left:18px; } ul.reasons li { margin:2px 0; }
.entry-grid { display:grid; grid-template-columns:minmax(320px,400px) minmax(0,1fr); gap:22px; }
details.inputs { margin-top:12px; } details.inputs summary { cursor:pointer; color:var(--accent); font-weight:600; }
details.inputs table { margin-top:8px; } details.inputs td { padding:3px 10px; }
@media (max-width:1000px) { .entry-grid { grid-template-columns:1fr; } }
.bar-row { display:grid; grid-template-columns:190px 1fr 84px; align-items:center; gap:8px;
  margin:3px 0; font-size:12.5px; }
.bar-label { line-height:1.25; overflow-wrap:anywhere; }
.bar-track { background:#f0f1f7; border-radius:5px; height:14px; overflow:hidden; }
.bar { display:block; height:100%; border-radius:5px; min-width:2px; }
.bar-value { white-space:nowrap; text-align:right; font-variant-numeric:tabular-nums; color:var(--dim); }
.stacked { display:flex; height:26px; border-radius:7px; overflow:hidden; margin:8px 0 6px; }
.stacked span { display:block; height:100%; }
.legend { display:flex; flex-wrap:wrap; gap:6px 16px; font-size:12.5px; }
.legend i { display:inline-block; width:10px; height:10px; border-radius:3px; margin-right:5px; }
.viewer { border:1px solid var(--line); border-radius:10px; overflow:hidden; background:var(--code); }
.kinds { display:flex; gap:2px; background:#171e33; padding:6px 8px 0; }
.kind { border:0; background:transparent; color:#9aa4bf; padding:8px 14px; font:inherit;
  font-weight:600; border-radius:8px 8px 0 0; cursor:pointer; }
.kind.active { background:var(--code); color:#fff; } .kind:disabled { opacity:.35; cursor:default; }
.kind .count { font-size:11px; opacity:.7; margin-left:4px; }
.passes { display:flex; flex-wrap:wrap; gap:6px; padding:10px 12px; border-bottom:1px solid #222b45; }
.pass { border:1px solid #2c365a; background:#151c31; color:#c9d1e8; border-radius:7px;
  padding:4px 10px; font:12px system-ui,sans-serif; cursor:pointer; }
.pass:hover { border-color:#5b4bdb; } .pass.active { background:#5b4bdb; border-color:#5b4bdb; color:#fff; }
.pass .num { opacity:.6; margin-right:3px; } .pass .ms { opacity:.65; margin-left:4px; }
.meta { color:#8d97b3; font-size:12px; padding:8px 14px 0; }
.meta b { color:#d7ddf0; font-weight:600; } .meta .plus { color:#4ade80; } .meta .minus { color:#f87171; }
pre.code { margin:0; padding:10px 0 14px; color:#d6deeb; overflow:auto; max-height:760px;
  font:12.5px/1.5 ui-monospace,SFMono-Regular,Menlo,Consolas,"Liberation Mono",monospace; }
pre.code.wrap .l { white-space:pre-wrap; word-break:break-all; }
.l { display:block; min-height:1.5em; padding-right:16px; white-space:pre; }
.l.add { background:rgba(74,222,128,.09); box-shadow:inset 3px 0 0 #4ade80; }
.ln { display:inline-block; width:44px; padding-right:12px; text-align:right; color:#4b5675;
  user-select:none; }
.k { color:#c792ea; } .f { color:#82aaff; font-weight:600; } .b { color:#82aaff; }
.m { color:#f78c6c; } .n { color:#f78c6c; } .s { color:#c3e88d; } .o { color:#89ddff; }
.c { color:#7d8aa8; font-style:italic; } .h { color:#ffcb6b; }
.src { color:#e6edf7; background:rgba(255,203,107,.08); border-radius:4px; padding:0 4px; }
.src .where { color:#ffcb6b; font-style:normal; }
.tools { display:flex; gap:8px; align-items:center; padding:8px 12px 0; color:#8d97b3; font-size:12px; }
.tools button { border:1px solid #2c365a; background:#151c31; color:#c9d1e8; border-radius:6px;
  padding:2px 9px; cursor:pointer; font:12px system-ui,sans-serif; }
.note { color:var(--dim); font-size:13px; }
td .note { font-size:12px; margin-top:2px; }
.empty { color:#8d97b3; font-style:italic; padding:0 16px; }
footer { color:var(--dim); font-size:12px; text-align:center; padding-bottom:30px; }
"""

JS = r"""
(function () {
  var data = JSON.parse(document.getElementById('keraunos-traces').textContent);
  var selected = {};
  function esc(s) { return String(s).replace(/[&<>"]/g, function (c) {
    return {'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;'}[c]; }); }
  function render(id) {
    var s = selected[id], traces = data[id][s.kind], viewer = document.getElementById(id + '-viewer');
    viewer.querySelectorAll('.kind').forEach(function (b) {
      b.classList.toggle('active', b.dataset.kind === s.kind); });
    var passes = viewer.querySelector('.passes');
    passes.innerHTML = '';
    traces.forEach(function (t, i) {
      var b = document.createElement('button');
      b.className = 'pass' + (i === s.index ? ' active' : '');
      b.title = t.header;
      b.innerHTML = '<span class="num">' + i + '</span>' + esc(t.label) +
        (t.ms ? '<span class="ms">' + esc(t.ms) + '</span>' : '');
      b.addEventListener('click', function () { select(id, s.kind, i, false); });
      passes.appendChild(b);
    });
    var t = traces[s.index], code = viewer.querySelector('pre.code'), meta = viewer.querySelector('.meta');
    code.innerHTML = t ? t.html : '<div class="empty">' + esc(data[id].empty[s.kind]) + '</div>';
    code.dataset.trace = id + '-' + s.kind + '-' + s.index;
    meta.innerHTML = t ? ('<b>' + esc(s.kind) + '</b> after pass ' + s.index + ' of ' +
      (traces.length - 1) + ': <b>' + esc(t.label) + '</b>' + (t.ms ? ' (' + esc(t.ms) + ')' : '') +
      ' &middot; ' + t.lines + ' lines' + (t.diff ? ' &middot; vs previous pass: <span class="plus">+' +
      t.added + '</span> <span class="minus">&minus;' + t.removed + '</span>' : '')) : '';
  }
  function select(id, kind, index, fromHash) {
    var n = data[id][kind].length;
    selected[id] = {kind: kind, index: Math.max(0, Math.min(index, n - 1))};
    if (!fromHash) {
      try { history.replaceState(null, '', '#' + id + '-' + kind + '-' + selected[id].index); }
      catch (e) { /* file:// pages that refuse it still work */ }
    }
    render(id);
  }
  function fromHash() {
    var m = location.hash.match(/^#(entry\d+)-(prologue|computation|epilogue|backward)-(\d+)$/);
    if (m && data[m[1]] && data[m[1]][m[2]].length) {
      select(m[1], m[2], parseInt(m[3], 10), true);
      var section = document.getElementById(m[1]);
      if (section && section.scrollIntoView) section.scrollIntoView();
    }
  }
  Object.keys(data).forEach(function (id) {
    var viewer = document.getElementById(id + '-viewer');
    viewer.querySelectorAll('.kind').forEach(function (b) {
      b.addEventListener('click', function () {
        select(id, b.dataset.kind, data[id][b.dataset.kind].length - 1, false); });
    });
    viewer.querySelector('.prev').addEventListener('click', function () {
      select(id, selected[id].kind, selected[id].index - 1, false); });
    viewer.querySelector('.next').addEventListener('click', function () {
      select(id, selected[id].kind, selected[id].index + 1, false); });
    viewer.querySelector('.wrap').addEventListener('click', function () {
      viewer.querySelector('pre.code').classList.toggle('wrap'); });
    selected[id] = {kind: 'computation', index: data[id].computation.length - 1};
    render(id);
  });
  fromHash();
  window.addEventListener('hashchange', fromHash);
})();
"""
