"""Self-contained HTML views of a report and of a diff: one file, inline CSS and JS, no network to open it.

    from hlo_inspect.html import render_report, render_diff, write_html
    write_html("report.html", render_report(report.to_dict()))
    write_html("diff.html", render_diff(diff.to_dict()))

The data travels as JSON in a `<script type="application/json">` tag; the page's own script renders it:
- a header with the totals, the unfused counterfactual and the rows comparing ours with XLA's cost analysis;
- the kernel table, sortable by clicking a header (numbers sort as numbers, missing values last); a program with
  collectives adds the interconnect bytes each device sends and receives (columns, cards and diff rows);
- the ledger of HBM round trips (sortable), grouped by producer scope, and the program's inputs and outputs;
- an SVG graph: kernels in program order, one arc per (round trip, consumer) from producer to consumer, its width
  proportional to that edge's share of the round trip's traffic (its read plus its share of the write), its
  tooltip naming the tensor and the bytes; nodes coloured by category.
The diff page shows the summary, the match table and both programs' kernel tables side by side.

The URL fragment selects a sort on load (and on change), by clicking the header as a reader would:
`#sort=bytes_read` (kernel tables; numbers descend, text ascends by default), `#sort=name:asc`,
`#lsort=traffic_bytes:asc` (ledger), `#msort=bytes_b` (diff matches). A Content-Security-Policy forbids every
fetch, so the page works offline and cannot leak the program it describes.
"""

from __future__ import annotations

import html as _html
import json
import math
import os
from typing import Any

__all__ = ["render_report", "render_diff", "write_html"]


def render_report(report_dict: dict, *, title: str | None = None) -> str:
    """One HTML page for `Report.to_dict()` (schema hlo_inspect.report/1); missing keys render empty sections."""
    report_dict = report_dict if isinstance(report_dict, dict) else {}
    page_title = title or report_dict.get("title") or (
        f"module {report_dict['module']}" if report_dict.get("module") else "hlo_inspect report")
    return _page(str(page_title), {"view": "report", "title": page_title, "report": report_dict})


def render_diff(diff_dict: dict, *, title: str | None = None) -> str:
    """One HTML page for `Diff.to_dict()`: {"a": report, "b": report, "matches": [...], "summary": {...}}."""
    diff_dict = diff_dict if isinstance(diff_dict, dict) else {}
    label_a = diff_dict.get("label_a") or _report_name(diff_dict.get("a"), "A")
    label_b = diff_dict.get("label_b") or _report_name(diff_dict.get("b"), "B")
    page_title = title or f"diff: {label_a} vs {label_b}"
    return _page(str(page_title), {"view": "diff", "title": page_title, "diff": diff_dict})


def write_html(path: str | os.PathLike, html: str) -> str:
    """Write `html` to `path` (UTF-8); returns the path as a string."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(html)
    return os.fspath(path)


def _report_name(report: Any, default: str) -> str:
    if isinstance(report, dict):
        return str(report.get("title") or report.get("module") or default)
    return default


def _finite(value: Any) -> Any:
    """JSON-safe copy: NaN/inf -> None (JSON.parse rejects them), tuples -> lists, keys -> str."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _script_json(payload: Any) -> str:
    """JSON that cannot end its <script> element: '<', '>' and '&' (only ever inside strings) become \\u escapes."""
    text = json.dumps(_finite(payload), separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=str)
    for char, escape in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"),
                         ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escape)
    return text


def _page(title: str, payload: dict) -> str:
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        f"<title>{_html.escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n"
        "<body data-rendered=\"pending\">\n"
        "<noscript>This report is drawn by JavaScript; the data is in the jaxfuse-data script element.</noscript>\n"
        "<main id=\"app\"></main>\n"
        f"<script type=\"application/json\" id=\"jaxfuse-data\">{_script_json(payload)}</script>\n"
        f"<script>{_JS}</script>\n</body>\n</html>\n")


_CSS = r"""
:root { --fg: #1d2330; --muted: #667085; --line: #d9dee7; --bg: #ffffff; --head: #f3f5f9; --hl: #fff3bf; }
* { box-sizing: border-box; }
body { margin: 0; padding: 16px 24px 48px; font: 13px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif;
       color: var(--fg); background: var(--bg); }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 28px 0 8px; }
h3 { font-size: 14px; margin: 16px 0 6px; }
.muted { color: var(--muted); } .mono, td.mono { font-family: ui-monospace, "SFMono-Regular", Menlo, monospace; }
.cards { display: flex; flex-wrap: wrap; gap: 8px; margin: 12px 0; }
.card { border: 1px solid var(--line); border-radius: 6px; padding: 6px 10px; min-width: 120px; }
.card .v { font-size: 16px; font-weight: 600; } .card .k { color: var(--muted); font-size: 11px; }
.scroll { overflow: auto; max-height: 75vh; margin-bottom: 4px; border: 1px solid var(--line); border-radius: 6px; }
table { border-collapse: collapse; width: 100%; }
th, td { padding: 3px 8px; border-bottom: 1px solid var(--line); text-align: left; vertical-align: top;
         white-space: nowrap; }
td.wrap { white-space: normal; min-width: 200px; }
thead th { position: sticky; top: 0; background: var(--head); z-index: 1; }
th.num, td.num { text-align: right; font-variant-numeric: tabular-nums; }
table.sortable thead th { cursor: pointer; user-select: none; }
table.sortable thead th:hover { background: #e6eaf2; }
th[aria-sort="ascending"]::after { content: " \25B2"; font-size: 9px; }
th[aria-sort="descending"]::after { content: " \25BC"; font-size: 9px; }
tbody tr:hover { background: #f7f9fc; } tr.flash { background: var(--hl) !important; }
.chip { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 5px;
        vertical-align: -1px; border: 1px solid rgba(0,0,0,.15); }
.badge { display: inline-block; padding: 0 6px; border-radius: 8px; font-size: 11px; background: #eef1f6; }
.legend { display: flex; flex-wrap: wrap; gap: 4px 14px; margin: 6px 0; }
.empty { color: var(--muted); font-style: italic; }
.render-error { color: #b42318; background: #fef3f2; border: 1px solid #fecdca; padding: 6px 10px;
                border-radius: 6px; white-space: pre-wrap; }
.notice { color: #93370d; }
svg.graph { display: block; font: 11px ui-monospace, Menlo, monospace; }
svg.graph .node { cursor: pointer; }
svg.graph .node-box { fill: #fff; stroke: #98a2b3; }
svg.graph .node:hover .node-box { stroke: #1d2330; stroke-width: 1.5; }
svg.graph .edge { fill: none; stroke-opacity: .55; }
svg.graph.focus .edge { stroke-opacity: .06; } svg.graph.focus .edge.hl { stroke-opacity: .95; }
svg.graph .idx { fill: var(--muted); text-anchor: end; }
svg.graph .node-bytes { fill: var(--muted); text-anchor: end; }
.sides { display: grid; grid-template-columns: 1fr 1fr; gap: 16px; }
.sides > div { min-width: 0; }
tr.kind-same td.c-kind { color: var(--muted); }
tr.kind-merged, tr.kind-split, tr.kind-regrouped { background: #eef4ff; }
tr.kind-changed_category { background: #fdf6e3; } tr.kind-only_a { background: #fef3f2; }
tr.kind-only_b { background: #ecfdf3; }
label.toggle { font-weight: normal; margin-left: 12px; font-size: 12px; }
table.hide-same tr.kind-same { display: none; }
"""

_JS = r"""
(function () {
  "use strict";
  var errors = [], notices = [];
  var DATA = {};
  try { DATA = JSON.parse(document.getElementById("jaxfuse-data").textContent || "{}") || {}; }
  catch (e) { errors.push("cannot read the embedded data: " + e); }
  // The SVG namespace, taken from the HTML parser rather than spelled out as a URL.
  var SVG_NS = (function () { var d = document.createElement("div"); d.innerHTML = "<svg></svg>";
                               return d.firstChild.namespaceURI; })();

  // ---- small helpers ------------------------------------------------------------------------------
  function arr(x) { return Array.isArray(x) ? x : []; }
  function obj(x) { return x && typeof x === "object" && !Array.isArray(x) ? x : {}; }
  function num(x) { return typeof x === "number" && isFinite(x) ? x : null; }
  function str(x) { return x === null || x === undefined ? "" : String(x); }
  function setAttrs(e, attrs) {
    Object.keys(attrs || {}).forEach(function (k) {
      var v = attrs[k];
      if (v === null || v === undefined || v === false) return;
      if (k === "text") e.textContent = str(v);
      else if (k.slice(0, 2) === "on" && typeof v === "function") e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, String(v));
    });
  }
  function append(e, c) {
    if (c === null || c === undefined || c === false) return e;
    if (Array.isArray(c)) c.forEach(function (x) { append(e, x); });
    else if (c instanceof Node) e.appendChild(c);
    else e.appendChild(document.createTextNode(String(c)));
    return e;
  }
  function el(tag, attrs, children) { var e = document.createElement(tag); setAttrs(e, attrs); return append(e, children); }
  function sv(tag, attrs, children) { var e = document.createElementNS(SVG_NS, tag); setAttrs(e, attrs); return append(e, children); }
  function fmtBytes(n) {
    n = num(n); if (n === null) return "";
    var units = ["B", "KiB", "MiB", "GiB", "TiB"];
    for (var i = 0; i < units.length; i++) {
      if (Math.abs(n) < 1024 || i === units.length - 1) return i === 0 ? n.toFixed(0) + " B" : n.toFixed(1) + " " + units[i];
      n /= 1024;
    }
  }
  function fmtFlops(n) {
    n = num(n); if (n === null) return "?";
    var scales = [["T", 1e12], ["G", 1e9], ["M", 1e6], ["K", 1e3]];
    for (var i = 0; i < scales.length; i++) if (n >= scales[i][1]) return (n / scales[i][1]).toFixed(1) + scales[i][0];
    return String(n);
  }
  function fmtInt(n) { n = num(n); return n === null ? "" : Math.round(n).toLocaleString("en-US"); }
  function fmtFlopUnit(n) { var s = fmtFlops(n); return /[KMGT]$/.test(s) ? s.slice(0, -1) + " " + s.slice(-1) + "FLOP" : s + " FLOP"; }
  function plural(n, word, many) { return fmtInt(n) + " " + (n === 1 ? word : (many || word + "s")); }
  var NO_SCOPE = "(no scope)";  // as the text tables name a missing scope
  function fmtPct(a, b) { a = num(a); b = num(b); return a === null || !b ? "" : ((a - b) / b * 100 >= 0 ? "+" : "") + ((a - b) / b * 100).toFixed(1) + "%"; }
  function clip(s, n) { s = str(s); return s.length <= n ? s : s.slice(0, n - 1) + "\u2026"; }
  function clipLeft(s, n) { s = str(s); return s.length <= n ? s : "\u2026" + s.slice(s.length - n + 1); }
  function stripLayout(s) { return str(s).split("{")[0]; }
  function kernelBytes(k) { k = obj(k); return (num(k.bytes_read) || 0) + (num(k.bytes_written) || 0); }

  var PALETTE = {
    loop: "#8ecae6", reduction: "#ffb703", output: "#fb8500", transpose: "#c77dff", scatter: "#e5989b",
    concatenate: "#b5838d", triton_gemm: "#e63946", triton_reduction: "#f4a261", triton_fusion: "#e9c46a",
    cublas: "#c1121f", cudnn: "#7b2cbf", pallas: "#2a9d8f", mosaic: "#52b788", cpu_fusion: "#90be6d",
    custom_fusion: "#43aa8b", custom_call: "#577590", dot: "#f94144", convolution: "#f3722c", copy: "#adb5bd",
    collective: "#6d597a", host: "#6c757d", unfused: "#ced4da"
  };
  function catColor(c) {
    c = str(c);
    if (PALETTE.hasOwnProperty(c)) return PALETTE[c];
    var h = 0; for (var i = 0; i < c.length; i++) h = (h * 31 + c.charCodeAt(i)) % 360;
    return "hsl(" + h + ",55%,62%)";
  }
  function chip(color) { return el("span", {"class": "chip", style: "background:" + color}); }

  function section(parent, name, fn) {
    try { fn(); }
    catch (e) {
      errors.push(name + ": " + e);
      parent.appendChild(el("div", {"class": "render-error"}, "could not render " + name + ": " + e));
    }
  }

  // ---- sortable tables ----------------------------------------------------------------------------
  // columns: [{key, label, num, value(row, i) -> sort value, cell(row, i) -> content, cls, title}]
  function sortableTable(id, columns, rows, opts) {
    opts = opts || {};
    var headRow = el("tr"), tbody = el("tbody");
    var table = el("table", {id: id, "class": "sortable"}, [el("thead", null, headRow), tbody]);
    var state = {key: null, dir: null};
    var items = rows.map(function (r, i) {
      var tr = el("tr", opts.rowAttrs ? opts.rowAttrs(r, i) : null), values = {};
      columns.forEach(function (c) {
        var v = c.value(r, i);
        if (typeof v === "number" && !isFinite(v)) v = null;
        values[c.key] = v;
        var td = el("td", {"class": "c-" + c.key + (c.num ? " num" : "") + (c.cls ? " " + c.cls : ""),
                           "data-value": v === null || v === undefined ? "" : v,
                           title: c.tip ? c.tip(r, i) : null});
        append(td, c.cell ? c.cell(r, i) : (v === null || v === undefined ? "" : v));
        tr.appendChild(td);
      });
      tbody.appendChild(tr);
      return {row: tr, values: values, index: i};
    });
    function defaultDir(c) { return c.num ? "desc" : "asc"; }
    function sortBy(key, dir) {
      var col = columns.filter(function (c) { return c.key === key; })[0];
      if (!col) return false;
      dir = dir === "asc" || dir === "desc" ? dir : defaultDir(col);
      var sign = dir === "asc" ? 1 : -1;
      items.slice().sort(function (a, b) {
        var x = a.values[key], y = b.values[key];
        var mx = x === null || x === undefined || x === "", my = y === null || y === undefined || y === "";
        if (mx || my) return mx && my ? a.index - b.index : (mx ? 1 : -1);  // missing values last, either way
        var c = col.num ? x - y : String(x).localeCompare(String(y), "en", {numeric: true});
        return c !== 0 ? sign * c : a.index - b.index;
      }).forEach(function (it) { tbody.appendChild(it.row); });
      state.key = key; state.dir = dir;
      Array.prototype.forEach.call(headRow.children, function (th) {
        th.setAttribute("aria-sort", th.getAttribute("data-key") === key ? (dir === "asc" ? "ascending" : "descending") : "none");
      });
      return true;
    }
    columns.forEach(function (c) {
      var th = el("th", {"class": "c-" + c.key + (c.num ? " num" : ""), "data-key": c.key, scope: "col",
                         "data-default-dir": defaultDir(c), tabindex: 0, "aria-sort": "none",
                         title: (c.title ? c.title + " \u2014 " : "") + "click to sort"}, c.label);
      th.addEventListener("click", function () {
        sortBy(c.key, state.key === c.key ? (state.dir === "asc" ? "desc" : "asc") : defaultDir(c));
      });
      th.addEventListener("keydown", function (ev) { if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); th.click(); } });
      headRow.appendChild(th);
    });
    if (opts.initial) sortBy(opts.initial[0], opts.initial[1]);
    return table;
  }
  function scrollBox(child) { return el("div", {"class": "scroll"}, child); }
  function empty(text) { return el("p", {"class": "empty"}, text); }
  function flashRow(row) {
    if (!row) return;
    row.scrollIntoView({block: "center"});
    row.classList.add("flash");
    setTimeout(function () { row.classList.remove("flash"); }, 1600);
  }

  // ---- report pieces ------------------------------------------------------------------------------
  function card(value, key, tip) { return el("div", {"class": "card", title: tip || null}, [el("div", {"class": "v"}, value), el("div", {"class": "k"}, key)]); }

  function renderHeader(root, rep, title) {
    var t = obj(rep.totals), led = obj(rep.ledger);
    root.appendChild(el("h1", null, str(title || rep.title || ("module " + str(rep.module)))));
    var meta = [];
    if (rep.module) meta.push("module " + rep.module);
    if (rep.platform) meta.push("on " + rep.platform);
    if (rep.schema) meta.push("schema " + rep.schema);
    root.appendChild(el("div", {"class": "muted"}, meta.join(" \u00b7 ")));
    arr(rep.warnings).forEach(function (w) { root.appendChild(el("div", {"class": "notice report-warning"}, "warning: " + str(w))); });
    var cards = el("div", {"class": "cards", id: "totals"});
    var kernels = arr(rep.kernels);
    var nk = num(t.kernels) !== null ? t.kernels : kernels.length;
    cards.appendChild(card(fmtInt(nk), "kernels"));
    if (num(t.launches) !== null) cards.appendChild(card(fmtInt(t.launches), "launches per run"));
    if (num(t.bytes_read) !== null) cards.appendChild(card(fmtBytes(t.bytes_read), "HBM read", fmtInt(t.bytes_read) + " B"));
    if (num(t.bytes_written) !== null) cards.appendChild(card(fmtBytes(t.bytes_written), "HBM written", fmtInt(t.bytes_written) + " B"));
    if (num(t.bytes_total) !== null) cards.appendChild(card(fmtBytes(t.bytes_total), "HBM total", fmtInt(t.bytes_total) + " B"));
    if (num(t.flops) !== null) cards.appendChild(card(fmtFlopUnit(t.flops), "FLOPs" + (t.flops_unknown_kernels ? " (+" + plural(t.flops_unknown_kernels, "kernel") + " unknown)" : ""), fmtInt(t.flops)));
    if (num(t.transcendentals) !== null) cards.appendChild(card(fmtFlops(t.transcendentals), "transcendentals", fmtInt(t.transcendentals)));
    if (num(t.collectives)) {
      cards.appendChild(card(fmtInt(t.collectives), "collectives"));
      cards.appendChild(card(fmtBytes(t.bytes_sent), "sent per device", fmtInt(t.bytes_sent) + " B over the interconnect (ring algorithm)"));
      cards.appendChild(card(fmtBytes(t.bytes_received), "received per device", fmtInt(t.bytes_received) + " B over the interconnect (ring algorithm)"));
    }
    if (num(led.traffic_bytes) !== null) {
      var share = num(t.bytes_total) ? " (" + (led.traffic_bytes / t.bytes_total * 100).toFixed(0) + "% of total)" : "";
      cards.appendChild(card(fmtBytes(led.traffic_bytes), plural(arr(led.round_trips).length, "HBM round trip") + share,
                             "traffic a fused program would not move: " + fmtInt(led.traffic_bytes) + " B"));
    }
    var unf = obj(rep.unfused);
    if (num(unf.kernels) !== null) {
      // Like with like, as Report.fusion_saving: the unfused program (the HLO before optimization) has no trip
      // counts and counts each while-loop body once, so the fused side does too.
      var looped = kernels.some(function (k) { k = obj(k); return num(k.launches) !== null && k.launches !== 1; });
      var onceBytes = 0;
      kernels.forEach(function (k) { k = obj(k); onceBytes += (num(k.bytes_read) || 0) + (num(k.bytes_written) || 0); });
      var fusedBytes = looped ? onceBytes : t.bytes_total;
      var onceNote = looped ? " (loop bodies once)" : "";
      cards.appendChild(card(fmtInt(unf.kernels) + " \u2192 " + fmtInt(nk), "kernels unfused \u2192 fused" + onceNote,
                             "unfused = one kernel per op of the pre-optimization HLO, as eager JAX runs it"));
      if (num(unf.bytes_total) !== null && num(fusedBytes) !== null)
        cards.appendChild(card(fmtBytes(unf.bytes_total) + " \u2192 " + fmtBytes(fusedBytes), "HBM bytes unfused \u2192 fused" + onceNote,
                               looped ? "while-loop bodies counted once on both sides (the unfused program has no trip counts)" : null));
    }
    root.appendChild(cards);

    // kernels by category, as a legend
    var counts = {}, order = [];
    kernels.forEach(function (k) { k = obj(k); var c = str(k.category); if (!(c in counts)) { counts[c] = {n: 0, label: k.label || c}; order.push(c); } counts[c].n++; });
    order.sort(function (a, b) { return counts[b].n - counts[a].n; });
    var legend = el("div", {"class": "legend", id: "categories"});
    order.forEach(function (c) { legend.appendChild(el("span", {"data-category": c}, [chip(catColor(c)), counts[c].n + " " + counts[c].label])); });
    if (order.length) root.appendChild(legend);

    var rows = arr(rep.comparison);
    var xla = obj(rep.xla_cost_analysis);
    root.appendChild(el("h3", null, "ours vs XLA's compiled.cost_analysis()"));
    if (!rows.length) {
      root.appendChild(empty(Object.keys(xla).length ? "no comparable quantities" : "no XLA cost analysis (a saved dump, or the backend has none)"));
      return;
    }
    var tbody = el("tbody");
    rows.forEach(function (r) {
      r = obj(r);
      var isBytes = /byte/.test(str(r.quantity));
      var f = isBytes ? fmtBytes : fmtInt;
      tbody.appendChild(el("tr", null, [
        el("td", {"class": "c-quantity"}, str(r.quantity)),
        el("td", {"class": "num", title: fmtInt(r.ours)}, f(r.ours)),
        el("td", {"class": "num", title: fmtInt(r.ours_compared)}, f(r.ours_compared)),
        el("td", {"class": "num", title: fmtInt(r.xla)}, f(r.xla)),
        el("td", {"class": "num"}, num(r.ratio) === null ? "n/a" : r.ratio.toFixed(3)),
        el("td", {"class": "wrap"}, str(r.reason))]));
    });
    root.appendChild(el("table", {id: "comparison"}, [
      el("thead", null, el("tr", null, [el("th", null, "quantity"), el("th", {"class": "num"}, "ours"),
        el("th", {"class": "num", title: "ours, counted as XLA counts (loop bodies once, without opaque custom calls)"}, "ours compared"),
        el("th", {"class": "num"}, "XLA"), el("th", {"class": "num"}, "compared / XLA"), el("th", null, "why they differ")])),
      tbody]));
  }

  function kernelColumns(opts) {
    opts = opts || {};
    var cols = [
      {key: "index", label: "#", num: true, value: function (k, i) { return i; }},
      {key: "name", label: "kernel", cls: "mono", value: function (k) { return str(k.name); },
       cell: function (k) { return [str(k.name), k.loop ? el("span", {"class": "badge", title: "runs " + str(k.launches) + "\u00d7 per run, in " + str(k.loop)}, str(k.launches) + "\u00d7 " + str(k.loop)) : null]; }},
      {key: "category", label: "category", value: function (k) { return str(k.label || k.category); },
       cell: function (k) { return [chip(catColor(k.category)), str(k.label || k.category), (k.category === "custom_call" || k.category === "custom_fusion") && k.target ? " (" + k.target + ")" : ""]; },
       tip: function (k) { return str(k.category) + (k.target ? " \u00b7 " + k.target : ""); }}
    ];
    if (opts.extra) cols = cols.concat(opts.extra);
    var bytesCol = function (key, label, get) {
      return {key: key, label: label, num: true, value: get, cell: function (k) { return fmtBytes(get(k)); },
              tip: function (k) { var v = get(k); return v === null ? null : fmtInt(v) + " B"; }};
    };
    cols.push(bytesCol("bytes_read", "read", function (k) { return num(k.bytes_read); }));
    cols.push(bytesCol("bytes_written", "written", function (k) { return num(k.bytes_written); }));
    cols.push(bytesCol("bytes_total", "total", function (k) { return num(k.bytes_read) === null && num(k.bytes_written) === null ? null : kernelBytes(k); }));
    if (opts.collectives) {
      var network = function (key) { return function (k) { return k.collective ? num(k[key]) : null; }; };
      var sent = bytesCol("bytes_sent", "sent", network("bytes_sent")), received = bytesCol("bytes_received", "received", network("bytes_received"));
      [sent, received].forEach(function (c) {
        var tip = c.tip;
        c.tip = function (k) { var cl = obj(k.collective); return k.collective ? tip(k) + " per device: " + str(cl.opcode) + " over " + str(cl.group_size) + " devices" + (cl.note ? "; " + str(cl.note) : "") : null; };
        cols.push(c);
      });
    }
    cols.push({key: "flops", label: "FLOP", num: true, value: function (k) { return num(k.flops); },
               cell: function (k) { return fmtFlops(k.flops); }, tip: function (k) { return fmtInt(k.flops); }});
    if (opts.compact) return cols;
    cols.push({key: "intensity", label: "FLOP/B", num: true,
               value: function (k) { var b = kernelBytes(k); return num(k.flops) === null || !b ? null : k.flops / b; },
               cell: function (k) { var b = kernelBytes(k); return num(k.flops) === null || !b ? "" : (k.flops / b).toFixed(1); }});
    cols.push({key: "launches", label: "launches", num: true, value: function (k) { return num(k.launches); }});
    cols.push({key: "ops", label: "fused ops", value: function (k) {
      var ops = obj(k.ops); return Object.keys(ops).sort(function (a, b) { return ops[b] - ops[a]; }).slice(0, 4)
        .map(function (o) { return o + (ops[o] > 1 ? "\u00d7" + ops[o] : ""); }).join(", "); },
      tip: function (k) { var ops = obj(k.ops); return Object.keys(ops).map(function (o) { return o + " " + ops[o]; }).join(", "); }});
    cols.push({key: "scopes", label: "scope", value: function (k) { return arr(k.scopes).slice(0, 2).join(", "); },
               cell: function (k) { return clip(arr(k.scopes).slice(0, 2).join(", ") || NO_SCOPE, 48); },
               tip: function (k) { return arr(k.scopes).join("\n"); }});
    cols.push({key: "source", label: "source", cls: "mono", value: function (k) { return str(arr(k.source_lines)[0]); },
               cell: function (k) { return clipLeft(arr(k.source_lines)[0], 44); },
               tip: function (k) { return arr(k.source_lines).join("\n"); }});
    return cols;
  }

  function kernelTable(id, rep, opts) {
    opts = opts || {};
    var kernels = arr(rep.kernels).map(obj);
    if (!kernels.length) return empty("no kernels");
    opts.collectives = kernels.some(function (k) { return !!k.collective; });
    return sortableTable(id, kernelColumns(opts), kernels, {
      initial: ["index", "asc"],
      rowAttrs: function (k, i) {
        var a = {"data-kernel": str(k.name), "data-index": i, "data-category": str(k.category)};
        if (opts.rowClass) a["class"] = opts.rowClass(k, i);
        return a;
      }});
  }

  function kernelRow(tableId, name) {
    var t = document.getElementById(tableId);
    if (!t) return null;
    var rows = t.tBodies[0] ? t.tBodies[0].rows : [];
    for (var i = 0; i < rows.length; i++) if (rows[i].getAttribute("data-kernel") === name) return rows[i];
    return null;
  }

  function ledgerSection(root, rep) {
    var led = obj(rep.ledger), trips = arr(led.round_trips).map(obj);
    root.appendChild(el("p", {"class": "muted"}, "Tensors one kernel writes to HBM and another reads back. Traffic = the write " +
      "(unless the tensor is a program output anyway) plus every read: what a fused program would not move."));
    if (!trips.length) { root.appendChild(empty("no round trips")); }
    else {
      var cols = [
        {key: "tensor", label: "tensor", cls: "mono", value: function (t) { return str(t.tensor); }},
        {key: "shape", label: "shape", cls: "mono", value: function (t) { return stripLayout(t.shape); }, tip: function (t) { return str(t.shape); }},
        {key: "bytes", label: "size", num: true, value: function (t) { return num(t.bytes); }, cell: function (t) { return fmtBytes(t.bytes); }, tip: function (t) { return fmtInt(t.bytes) + " B"; }},
        {key: "traffic_bytes", label: "traffic", num: true, value: function (t) { return num(t.traffic_bytes); }, cell: function (t) { return fmtBytes(t.traffic_bytes); }, tip: function (t) { return fmtInt(t.traffic_bytes) + " B"; }},
        {key: "reads", label: "reads", num: true, value: function (t) { return arr(t.consumers).length; }},
        {key: "flow", label: "producer \u2192 consumers", cls: "mono", value: function (t) { return str(t.producer) + " \u2192 " + arr(t.consumers).join(", "); },
         cell: function (t) { return clip(str(t.producer) + " \u2192 " + arr(t.consumers).join(", "), 70); }},
        {key: "scopes", label: "scope (producer \u2192 consumers)", value: function (t) {
          return (arr(t.producer_scopes)[0] || NO_SCOPE) + " \u2192 " + (arr(t.consumer_scopes).slice(0, 2).join(", ") || NO_SCOPE); },
         cell: function (t) { return clip((arr(t.producer_scopes)[0] || NO_SCOPE) + " \u2192 " + (arr(t.consumer_scopes).slice(0, 2).join(", ") || NO_SCOPE), 70); },
         tip: function (t) { return arr(t.producer_scopes).join(", ") + " \u2192 " + arr(t.consumer_scopes).join(", "); }},
        {key: "is_output", label: "output", value: function (t) { return t.is_output ? "yes" : ""; },
         tip: function (t) { return t.is_output ? "also a program output: only the reads are avoidable" : null; }}
      ];
      var table = sortableTable("ledger-table", cols, trips, {
        initial: ["traffic_bytes", "desc"],
        rowAttrs: function (t) { return {"data-tensor": str(t.tensor), "data-producer": str(t.producer)}; }});
      table.addEventListener("click", function (ev) {
        var tr = ev.target.closest("tbody tr"); if (!tr) return;
        var name = tr.getAttribute("data-tensor"), svg = document.getElementById("kernel-graph");
        if (!svg) return;
        var hit = null;
        Array.prototype.forEach.call(svg.querySelectorAll(".edge"), function (e) {
          var on = e.getAttribute("data-tensor") === name; e.classList.toggle("hl", on); if (on && !hit) hit = e; });
        svg.classList.add("focus");
        if (hit) hit.scrollIntoView({block: "center", inline: "nearest"});
      });
      root.appendChild(scrollBox(table));
    }
    // values computed from iotas and constants alone: their bytes understate what they cost (Ledger.from_constants)
    arr(led.from_constants).map(obj).forEach(function (c) { root.appendChild(el("p", {"class": "from-constants"}, str(c.note))); });
    // grouped by the producer's leading scope
    if (trips.length) {
      var groups = {}, order = [];
      trips.forEach(function (t) { var s = arr(t.producer_scopes)[0] || NO_SCOPE; if (!(s in groups)) { groups[s] = {n: 0, traffic: 0}; order.push(s); } groups[s].n++; groups[s].traffic += num(t.traffic_bytes) || 0; });
      order.sort(function (a, b) { return groups[b].traffic - groups[a].traffic; });
      root.appendChild(el("h3", null, "by producer scope"));
      var tb = el("tbody");
      order.forEach(function (s) { tb.appendChild(el("tr", null, [el("td", null, s), el("td", {"class": "num"}, String(groups[s].n)), el("td", {"class": "num", title: fmtInt(groups[s].traffic) + " B"}, fmtBytes(groups[s].traffic))])); });
      root.appendChild(el("table", {id: "ledger-by-scope"}, [el("thead", null, el("tr", null, [el("th", null, "scope"), el("th", {"class": "num"}, "tensors"), el("th", {"class": "num"}, "traffic")])), tb]));
    }
    var inputs = arr(led.inputs).map(obj), outputs = arr(led.outputs).map(obj);
    if (inputs.length || outputs.length) {
      var det = el("details", {id: "io"}, el("summary", null, "program inputs read: " + inputs.length + ", outputs written: " + outputs.length + " (they cross HBM whatever the fusion)"));
      var ti = el("tbody");
      inputs.forEach(function (x) { ti.appendChild(el("tr", null, [el("td", null, "input"), el("td", {"class": "mono"}, str(x.tensor)), el("td", {"class": "mono"}, stripLayout(x.shape)), el("td", {"class": "num"}, fmtBytes(x.bytes)), el("td", {"class": "mono"}, "read by " + arr(x.readers).join(", "))])); });
      outputs.forEach(function (x) { ti.appendChild(el("tr", null, [el("td", null, "output"), el("td", {"class": "mono"}, str(x.tensor)), el("td", {"class": "mono"}, stripLayout(x.shape)), el("td", {"class": "num"}, fmtBytes(x.bytes)), el("td", {"class": "mono"}, x.writer ? "written by " + x.writer : "(not written by a kernel)")])); });
      det.appendChild(el("table", null, [el("thead", null, el("tr", null, [el("th", null, ""), el("th", null, "tensor"), el("th", null, "shape"), el("th", {"class": "num"}, "size"), el("th", null, "kernels")])), ti]));
      root.appendChild(det);
    }
  }

  // ---- the graph: kernels in program order, arcs for HBM round trips ------------------------------
  function graphSection(root, rep, tableId) {
    var kernels = arr(rep.kernels).map(obj), trips = arr(obj(rep.ledger).round_trips).map(obj);
    if (!kernels.length) { root.appendChild(empty("no kernels")); return; }
    var index = {};
    kernels.forEach(function (k, i) { var n = str(k.name); if (!index.hasOwnProperty(n)) index[n] = i; });
    var edges = [], missing = 0;
    trips.forEach(function (t) {
      var p = index.hasOwnProperty(str(t.producer)) ? index[str(t.producer)] : undefined;
      var cs = arr(t.consumers), reads = arr(t.read_bytes), size = num(t.bytes) || 0;
      cs.forEach(function (c, ci) {
        var q = index.hasOwnProperty(str(c)) ? index[str(c)] : undefined;
        if (p === undefined || q === undefined) { missing++; return; }
        var read = num(reads[ci]) !== null ? reads[ci] : size;
        var traffic = read + (t.is_output ? 0 : size / Math.max(cs.length, 1));
        edges.push({t: t, p: p, q: q, consumer: str(c), read: read, traffic: traffic});
      });
    });
    if (missing) notices.push(missing + " ledger edge(s) name kernels that are not in the kernel list; not drawn");
    var PITCH = 24, H = 18, X0 = 40, W = 380, TOP = 8, MAXB = 460;
    var maxTraffic = edges.reduce(function (m, e) { return Math.max(m, e.traffic); }, 0);
    var maxBytes = kernels.reduce(function (m, k) { return Math.max(m, kernelBytes(k)); }, 0);
    function yOf(i) { return TOP + i * PITCH; }
    function bulge(e) { return Math.min(MAXB, 24 + 0.45 * Math.abs(e.q - e.p) * PITCH); }
    var maxBulge = edges.reduce(function (m, e) { return Math.max(m, bulge(e)); }, 0);
    var width = X0 + W + Math.ceil(0.75 * maxBulge) + 24, height = TOP + kernels.length * PITCH + 8;
    var svg = sv("svg", {id: "kernel-graph", "class": "graph", width: width, height: height,
                         viewBox: "0 0 " + width + " " + height, role: "img",
                         "aria-label": "kernels in program order and the HBM tensors between them"});
    var gEdges = sv("g", {"class": "edges"}), gNodes = sv("g", {"class": "nodes"});
    svg.appendChild(gEdges); svg.appendChild(gNodes);
    var x1 = X0 + W;
    // thick edges first, so thin ones stay visible on top
    edges.slice().sort(function (a, b) { return b.traffic - a.traffic; }).forEach(function (e) {
      var y1 = yOf(e.p) + H / 2, y2 = yOf(e.q) + H / 2, d = bulge(e);
      var path = e.p === e.q
        ? "M" + x1 + " " + (y1 - 4) + " C" + (x1 + 30) + " " + (y1 - 14) + " " + (x1 + 30) + " " + (y1 + 14) + " " + x1 + " " + (y1 + 4)
        : "M" + x1 + " " + y1 + " C" + (x1 + d) + " " + y1 + " " + (x1 + d) + " " + y2 + " " + x1 + " " + y2;
      var w = maxTraffic > 0 ? Math.max(0.75, 10 * e.traffic / maxTraffic) : 1;
      var t = e.t;
      gEdges.appendChild(sv("path", {"class": "edge", d: path, stroke: catColor(kernels[e.p].category),
        "stroke-width": w.toFixed(2), "data-tensor": str(t.tensor), "data-producer": str(t.producer),
        "data-consumer": e.consumer, "data-traffic": Math.round(e.traffic), "data-trip-traffic": num(t.traffic_bytes)},
        sv("title", null, str(t.tensor) + " " + stripLayout(t.shape) + " (" + fmtBytes(t.bytes) + ")\n" +
          str(t.producer) + " \u2192 " + e.consumer + ": reads " + fmtBytes(e.read) + "\n" +
          "edge traffic " + fmtBytes(e.traffic) + " (" + fmtInt(e.traffic) + " B); round trip traffic " +
          fmtBytes(t.traffic_bytes) + " over " + arr(t.consumers).length + " reader(s)" + (t.is_output ? "; also a program output" : ""))));
    });
    kernels.forEach(function (k, i) {
      var y = yOf(i), color = catColor(k.category), b = kernelBytes(k);
      var g = sv("g", {"class": "node", "data-kernel": str(k.name), "data-category": str(k.category), "data-index": i,
                       transform: "translate(" + X0 + "," + y + ")"}, [
        sv("title", null, "#" + i + " " + str(k.name) + "\n" + str(k.label || k.category) + (k.target ? " (" + k.target + ")" : "") +
           "\nread " + fmtBytes(k.bytes_read) + ", written " + fmtBytes(k.bytes_written) + ", " + fmtFlopUnit(k.flops) +
           (arr(k.scopes).length ? "\n" + arr(k.scopes).slice(0, 3).join(", ") : "")),
        sv("rect", {"class": "node-box", width: W, height: H, rx: 3}),
        sv("rect", {"class": "node-bar", width: maxBytes ? (W * b / maxBytes).toFixed(1) : 0, height: H, rx: 3, fill: color, "fill-opacity": 0.28}),
        sv("rect", {"class": "node-stripe", width: 6, height: H, rx: 2, fill: color}),
        sv("text", {x: 11, y: H - 5}, clip(str(k.name) + (k.loop ? "  [" + str(k.launches) + "\u00d7]" : ""), 40)),
        sv("text", {"class": "node-bytes", x: W - 5, y: H - 5}, fmtBytes(b))]);
      gNodes.appendChild(sv("text", {"class": "idx", x: X0 - 6, y: y + H - 5}, String(i)));
      g.addEventListener("mouseenter", function () {
        svg.classList.add("focus");
        Array.prototype.forEach.call(gEdges.children, function (e) {
          e.classList.toggle("hl", e.getAttribute("data-producer") === str(k.name) || e.getAttribute("data-consumer") === str(k.name)); });
      });
      g.addEventListener("mouseleave", function () { svg.classList.remove("focus"); });
      g.addEventListener("click", function () { flashRow(kernelRow(tableId, str(k.name))); });
      gNodes.appendChild(g);
    });
    root.appendChild(el("p", {"class": "muted"}, "One node per kernel in program order (bar: its HBM bytes); one arc per " +
      "(round trip, reader) from the producer down to the consumer, width \u221d that edge's traffic (its read plus its " +
      "share of the write). Hover a node or an arc for details; click a node to find its row; click a ledger row to find its arcs."));
    root.appendChild(el("div", {"class": "scroll", id: "graph-box"}, svg));
  }

  // ---- pages --------------------------------------------------------------------------------------
  var sortTargets = {sort: [], lsort: [], msort: []};

  function renderReport(app, rep, title) {
    rep = obj(rep);
    var head = el("header", {id: "summary"}); app.appendChild(head);
    section(head, "header", function () { renderHeader(head, rep, title); });
    var ks = el("section", {id: "kernels"}, el("h2", null, "Kernels (" + arr(rep.kernels).length + ")")); app.appendChild(ks);
    section(ks, "kernel table", function () { ks.appendChild(scrollBox(kernelTable("kernel-table", rep))); });
    sortTargets.sort.push("kernel-table");
    var ls = el("section", {id: "ledger"}, el("h2", null, "HBM round trips (" + arr(obj(rep.ledger).round_trips).length + ")")); app.appendChild(ls);
    section(ls, "ledger", function () { ledgerSection(ls, rep); });
    sortTargets.lsort.push("ledger-table");
    var gs = el("section", {id: "graph"}, el("h2", null, "Kernels and the HBM tensors between them")); app.appendChild(gs);
    section(gs, "graph", function () { graphSection(gs, rep, "kernel-table"); });
  }

  function renderDiff(app, d, title) {
    d = obj(d);
    var a = obj(d.a), b = obj(d.b), s = obj(d.summary), matches = arr(d.matches).map(obj);
    var la = str(d.label_a || a.title || a.module || "A"), lb = str(d.label_b || b.title || b.module || "B");
    var head = el("header", {id: "summary"}); app.appendChild(head);
    section(head, "summary", function () {
      head.appendChild(el("h1", null, str(title || "diff")));
      head.appendChild(el("div", null, [el("b", null, "A"), " = " + la]));
      head.appendChild(el("div", null, [el("b", null, "B"), " = " + lb]));
      [["A", a], ["B", b]].forEach(function (side) {
        arr(side[1].warnings).forEach(function (w) { head.appendChild(el("div", {"class": "notice report-warning"}, "warning (" + side[0] + "): " + str(w))); });
      });
      var tb = el("tbody");
      Object.keys(s).forEach(function (key) {
        var v = s[key];
        if (Array.isArray(v) && v.length === 2) {
          var f = /bytes/.test(key) ? fmtBytes : (/flops/.test(key) ? function (x) { return fmtFlops(x); } : fmtInt);
          tb.appendChild(el("tr", {"data-key": key}, [el("td", null, key), el("td", {"class": "num", title: fmtInt(v[0])}, f(v[0])),
            el("td", {"class": "num", title: fmtInt(v[1])}, f(v[1])), el("td", {"class": "num"}, fmtPct(v[1], v[0]))]));
        } else if (num(v) !== null) {
          tb.appendChild(el("tr", {"data-key": key}, [el("td", null, key), el("td", {"class": "num", colspan: 2}, fmtInt(v)), el("td")]));
        }
      });
      if (tb.children.length) head.appendChild(el("table", {id: "diff-summary", style: "width:auto;margin-top:8px"}, [
        el("thead", null, el("tr", null, [el("th", null, ""), el("th", {"class": "num"}, "A"), el("th", {"class": "num"}, "B"), el("th", {"class": "num"}, "B vs A")])), tb]));
      var counts = obj(s.matches);
      if (!Object.keys(counts).length) matches.forEach(function (m) { counts[str(m.kind)] = (counts[str(m.kind)] || 0) + 1; });
      var badges = el("div", {"class": "legend", id: "match-kinds"});
      Object.keys(counts).forEach(function (k) { if (counts[k]) badges.appendChild(el("span", {"class": "badge", "data-kind": k}, counts[k] + " " + k)); });
      head.appendChild(badges);
    });

    var kernelsA = {}, kernelsB = {}, kindA = {}, kindB = {};
    arr(a.kernels).forEach(function (k) { k = obj(k); kernelsA[str(k.name)] = k; });
    arr(b.kernels).forEach(function (k) { k = obj(k); kernelsB[str(k.name)] = k; });
    function sumBytes(names, table) { var tot = 0, any = false; names.forEach(function (n) { var k = table[str(n)]; if (k) { any = true; tot += kernelBytes(k) * (num(k.launches) || 1); } }); return any ? tot : (names.length ? null : 0); }
    matches.forEach(function (m) { arr(m.a).forEach(function (n) { kindA[str(n)] = str(m.kind); }); arr(m.b).forEach(function (n) { kindB[str(n)] = str(m.kind); }); });

    var ms = el("section", {id: "matches"}, el("h2", null, "Matches (" + matches.length + ")")); app.appendChild(ms);
    section(ms, "match table", function () {
      if (!matches.length) { ms.appendChild(empty("no matches")); return; }
      var ba = function (m) { return num(m.bytes_a) !== null ? m.bytes_a : sumBytes(arr(m.a), kernelsA); };
      var bb = function (m) { return num(m.bytes_b) !== null ? m.bytes_b : sumBytes(arr(m.b), kernelsB); };
      var names = function (list, table) { return arr(list).map(function (n) { var k = table[str(n)]; return str(n) + (k ? " (" + str(k.label || k.category) + ")" : ""); }).join(", "); };
      var lines = function (list, table) {
        if (!arr(list).length) return "\u2014";
        return arr(list).map(function (n) { var k = table[str(n)];
          return el("div", null, [k ? chip(catColor(k.category)) : null, str(n), k ? el("span", {"class": "muted"}, " " + str(k.label || k.category)) : null]); });
      };
      var cols = [
        {key: "index", label: "#", num: true, value: function (m, i) { return i; }},
        {key: "kind", label: "kind", value: function (m) { return str(m.kind); }, cell: function (m) { return el("span", {"class": "badge"}, str(m.kind)); }},
        {key: "a", label: "A kernels", cls: "mono wrap", value: function (m) { return names(m.a, kernelsA) || null; }, cell: function (m) { return lines(m.a, kernelsA); }},
        {key: "b", label: "B kernels", cls: "mono wrap", value: function (m) { return names(m.b, kernelsB) || null; }, cell: function (m) { return lines(m.b, kernelsB); }},
        {key: "bytes_a", label: "bytes A", num: true, value: ba, cell: function (m) { return fmtBytes(ba(m)); }},
        {key: "bytes_b", label: "bytes B", num: true, value: bb, cell: function (m) { return fmtBytes(bb(m)); }},
        {key: "delta", label: "\u0394 bytes", num: true, value: function (m) { var x = ba(m), y = bb(m); return x === null || y === null ? null : y - x; },
         cell: function (m) { var x = ba(m), y = bb(m); return x === null || y === null ? "" : (y - x >= 0 ? "+" : "\u2212") + fmtBytes(Math.abs(y - x)); }},
        {key: "scopes", label: "scopes", value: function (m) { return arr(m.scopes).slice(0, 2).join(", "); },
         cell: function (m) { return arr(m.scopes).slice(0, 2).join(", ") || NO_SCOPE; }}
      ];
      if (matches.some(function (m) { return num(m.sent_a) || num(m.sent_b); })) {
        var sentCol = function (key, label) { return {key: key, label: label, num: true, value: function (m) { return num(m[key]); },
          cell: function (m) { return num(m[key]) ? fmtBytes(m[key]) : ""; }, title: "interconnect bytes one device sends per run"}; };
        cols.splice(7, 0, sentCol("sent_a", "sent A"), sentCol("sent_b", "sent B"));
      }
      var table = sortableTable("match-table", cols, matches, {rowAttrs: function (m) { return {"class": "kind-" + str(m.kind), "data-kind": str(m.kind)}; }, initial: ["index", "asc"]});
      var toggle = el("input", {type: "checkbox", id: "hide-same"});
      toggle.addEventListener("change", function () { table.classList.toggle("hide-same", toggle.checked); });
      ms.firstChild.appendChild(el("label", {"class": "toggle"}, [toggle, " hide unchanged (\u201csame\u201d)"]));
      ms.appendChild(scrollBox(table));
      sortTargets.msort.push("match-table");
    });

    [["vanished", "Round trips that vanished (in A, not in B)"], ["appeared", "Round trips that appeared (in B, not in A)"]].forEach(function (pair) {
      var trips = arr(d[pair[0]]).map(obj);
      if (!trips.length) return;
      var sec = el("section", {id: pair[0]}, el("h3", null, pair[1] + ": " + trips.length)); app.appendChild(sec);
      section(sec, pair[0], function () {
        var tb = el("tbody");
        trips.forEach(function (t) { tb.appendChild(el("tr", null, [el("td", {"class": "mono"}, stripLayout(t.shape)), el("td", {"class": "num"}, fmtBytes(t.traffic_bytes)),
          el("td", {"class": "mono"}, str(t.producer) + " \u2192 " + arr(t.consumers).join(", ")), el("td", null, arr(t.producer_scopes).slice(0, 1).join("") || NO_SCOPE)])); });
        sec.appendChild(scrollBox(el("table", {id: pair[0] + "-table"}, [el("thead", null, el("tr", null, [el("th", null, "shape"), el("th", {"class": "num"}, "traffic"), el("th", null, "producer \u2192 consumers"), el("th", null, "scope")])), tb])));
      });
    });

    var sides = el("div", {"class": "sides"});
    var ss = el("section", {id: "sides"}, [el("h2", null, "Kernels side by side"), sides]); app.appendChild(ss);
    [["a", a, la, kindA], ["b", b, lb, kindB]].forEach(function (x) {
      var col = el("div", {id: "side-" + x[0]}); sides.appendChild(col);
      section(col, "kernels " + x[0].toUpperCase(), function () {
        col.appendChild(el("h3", null, x[0].toUpperCase() + ": " + x[2] + " (" + arr(x[1].kernels).length + " kernels)"));
        var kinds = x[3];
        col.appendChild(scrollBox(kernelTable("kernels-" + x[0], x[1], {compact: true,
          extra: [{key: "kind", label: "match", value: function (k) { return kinds[str(k.name)] || null; }}],
          rowClass: function (k) { return kinds[str(k.name)] ? "kind-" + kinds[str(k.name)] : null; }})));
        sortTargets.sort.push("kernels-" + x[0]);
      });
    });
  }

  // ---- sorting from the URL fragment: #sort=col[:asc|desc]&lsort=...&msort=... ------------------
  function applyHash() {
    var params = new URLSearchParams(location.hash.replace(/^#/, ""));
    Object.keys(sortTargets).forEach(function (param) {
      var spec = params.get(param);
      if (!spec) return;
      var parts = spec.split(":"), key = parts[0], dir = parts[1];
      sortTargets[param].forEach(function (id) {
        var table = document.getElementById(id);
        if (!table) return;
        var th = Array.prototype.filter.call(table.tHead.rows[0].cells, function (c) { return c.getAttribute("data-key") === key; })[0];
        if (!th) { notices.push("#" + param + "=" + spec + ": " + id + " has no column " + key); return; }
        var want = (dir === "asc" || dir === "desc" ? dir : th.getAttribute("data-default-dir")) === "asc" ? "ascending" : "descending";
        for (var tries = 0; tries < 2 && th.getAttribute("aria-sort") !== want; tries++) th.click();  // as a reader would
      });
    });
    showNotices();
  }

  function showNotices() {
    var box = document.getElementById("notices");
    if (!box) return;
    box.textContent = "";
    notices.forEach(function (n) { box.appendChild(el("div", {"class": "notice"}, n)); });
  }

  var app = document.getElementById("app");
  var view = str(obj(DATA).view);
  try {
    if (view === "diff") renderDiff(app, DATA.diff, DATA.title);
    else renderReport(app, DATA.report, DATA.title);
  } catch (e) {
    errors.push("page: " + e);
    app.appendChild(el("div", {"class": "render-error"}, "could not render the page: " + e));
  }
  app.appendChild(el("div", {id: "notices"}));
  try { applyHash(); } catch (e) { errors.push("sort from URL: " + e); }
  window.addEventListener("hashchange", function () { try { applyHash(); } catch (e) { errors.push("sort from URL: " + e); } });
  document.body.setAttribute("data-render-errors", String(errors.length));
  document.body.setAttribute("data-rendered", errors.length ? "error" : "ok");
})();
"""
