"""The HTML report and diff pages, opened in a real headless browser (Debian's `chromium`).

Chromium's `--dump-dom` prints the document after the page's script ran; the tests read that DOM and count what
the script drew: one kernel-table row per kernel, one ledger row per round trip, one SVG node per kernel and one
arc per (round trip, consumer). Sorting is driven through the URL fragment (`#sort=bytes_read`), which the page
applies by clicking the column header, so a broken click handler fails the test.

CI installs the browser with `.ci/setup_browser.sh`; with CI=true a missing browser fails these tests, elsewhere
it skips them.
"""

from __future__ import annotations

import html.parser
import json
import os
import re
import shutil
import subprocess

import pytest

import hlo_inspect
from hlo_inspect.html import render_diff, render_report, write_html

DATA = os.path.join(os.path.dirname(__file__), "data")
_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
_CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                   "--disable-background-networking", "--disable-component-update", "--disable-sync",
                   "--disable-extensions", "--virtual-time-budget=5000")


# ---- a small DOM, from the serialized page ----------------------------------------------------------------

_VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track",
                   "wbr"})


class Element:
    def __init__(self, tag: str, attrs: dict[str, str], parent: "Element | None"):
        self.tag, self.attrs, self.parent, self.children, self.text_parts = tag, attrs, parent, [], []

    def iter(self):
        yield self
        for c in self.children:
            yield from c.iter()

    def find_all(self, tag: str | None = None, cls: str | None = None, **attrs: str) -> list["Element"]:
        out = []
        for e in self.iter():
            if tag and e.tag != tag:
                continue
            if cls and cls not in e.attrs.get("class", "").split():
                continue
            if any(e.attrs.get(k.replace("_", "-")) != v for k, v in attrs.items()):
                continue
            out.append(e)
        return out

    def by_id(self, id_: str) -> "Element":
        found = [e for e in self.iter() if e.attrs.get("id") == id_]
        assert found, f"no element with id {id_!r} in the rendered page"
        return found[0]

    @property
    def text(self) -> str:
        return "".join(self.text_parts) + "".join(c.text for c in self.children)

    def rows(self) -> list["Element"]:
        """The <tr> of this table's <tbody>, in document order."""
        bodies = [c for c in self.children if c.tag == "tbody"]
        assert bodies, f"table {self.attrs.get('id')} has no tbody"
        return [r for r in bodies[0].children if r.tag == "tr"]

    def cell(self, key: str) -> "Element":
        cells = [c for c in self.children if c.tag == "td" and f"c-{key}" in c.attrs.get("class", "").split()]
        assert cells, f"row has no cell for column {key!r}"
        return cells[0]


class _TreeBuilder(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {}, None)
        self.current = self.root

    def handle_starttag(self, tag, attrs):
        e = Element(tag, {k: v or "" for k, v in attrs}, self.current)
        self.current.children.append(e)
        if tag not in _VOID:
            self.current = e

    def handle_startendtag(self, tag, attrs):
        self.current.children.append(Element(tag, {k: v or "" for k, v in attrs}, self.current))

    def handle_endtag(self, tag):
        e = self.current
        while e is not None and e.tag != tag:
            e = e.parent
        if e is not None and e.parent is not None:
            self.current = e.parent

    def handle_data(self, data):
        self.current.text_parts.append(data)


def parse_dom(text: str) -> Element:
    builder = _TreeBuilder()
    builder.feed(text)
    builder.close()
    return builder.root


# ---- the browser ------------------------------------------------------------------------------------------

def _find_browser() -> str | None:
    explicit = os.environ.get("CHROMIUM")
    if explicit:
        return shutil.which(explicit) or (explicit if os.access(explicit, os.X_OK) else None)
    for name in _BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="session")
def browser() -> str:
    path = _find_browser()
    if path is None:
        message = ("headless chromium not found (looked for " + ", ".join(_BROWSERS) + " on PATH and $CHROMIUM); "
                   "install it with `bash .ci/setup_browser.sh` (apt-get install chromium)")
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message + " — CI must run the HTML report tests", pytrace=False)
        pytest.skip(message)
    return path


@pytest.fixture
def open_page(browser, tmp_path):
    """open_page(html, fragment="") -> the DOM after the page's script ran, parsed."""
    counter = iter(range(1000))

    def run(page: str, fragment: str = "") -> Element:
        n = next(counter)
        path = tmp_path / f"page{n}.html"
        write_html(path, page)
        url = path.resolve().as_uri() + (("#" + fragment) if fragment else "")
        cmd = [browser, *_CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / f'profile{n}'}", "--dump-dom", url]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0 and proc.stdout.strip(), (
            f"chromium failed (status {proc.returncode}): {proc.stderr[-2000:]}")
        dom = parse_dom(proc.stdout)
        body = dom.find_all("body")[0]
        errors = [e.text for e in dom.find_all(cls="render-error")]
        assert body.attrs.get("data-rendered") == "ok" and not errors, (
            f"the page's script did not finish cleanly: data-rendered={body.attrs.get('data-rendered')!r}, "
            f"errors {errors}")
        return dom

    return run


# ---- reports under test -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_report() -> dict:
    with open(os.path.join(DATA, "h100_block_grad.hlo.txt"), encoding="utf-8") as f:
        return hlo_inspect.from_text(f.read(), title="h100 block grad").to_dict()


@pytest.fixture(scope="module")
def cpu_report() -> dict:
    import jax
    import jax.numpy as jnp

    def mlp(x, w1, w2):
        h = jax.nn.gelu(x @ w1)  # (5, 24)
        return jnp.sum(jax.nn.softmax(h @ w2, axis=-1) * 2.0)

    keys = jax.random.split(jax.random.key(0), 3)
    args = (jax.random.normal(keys[0], (5, 12)), jax.random.normal(keys[1], (12, 24)),
            jax.random.normal(keys[2], (24, 7)))
    return hlo_inspect.inspect(jax.grad(mlp, argnums=(1, 2)), *args).to_dict()


def _edges(report: dict) -> list[tuple[str, str, str]]:
    return [(t["tensor"], t["producer"], c) for t in report["ledger"]["round_trips"] for c in t["consumers"]]


def _check_report_page(dom: Element, report: dict) -> None:
    kernels = report["kernels"]
    rows = dom.by_id("kernel-table").rows()
    assert [r.attrs["data-kernel"] for r in rows] == [k["name"] for k in kernels]  # program order by default
    assert [int(r.cell("bytes_read").attrs["data-value"]) for r in rows] == [k["bytes_read"] for k in kernels]

    trips = report["ledger"]["round_trips"]
    ledger_rows = dom.by_id("ledger-table").rows() if trips else []
    assert len(ledger_rows) == len(trips)
    assert sorted(r.attrs["data-tensor"] for r in ledger_rows) == sorted(t["tensor"] for t in trips)
    traffic = [int(r.cell("traffic_bytes").attrs["data-value"]) for r in ledger_rows]
    assert traffic == sorted(traffic, reverse=True)  # most traffic first

    svg = dom.by_id("kernel-graph")
    assert svg.tag == "svg"
    nodes = svg.find_all("g", cls="node")
    assert [n.attrs["data-kernel"] for n in nodes] == [k["name"] for k in kernels]
    fill = {}
    for node, k in zip(nodes, kernels):  # one colour per category
        stripe = node.find_all("rect", cls="node-stripe")[0].attrs["fill"]
        assert fill.setdefault(k["category"], stripe) == stripe
    assert len(set(fill.values())) == len(fill)

    edges = svg.find_all("path", cls="edge")
    assert sorted((e.attrs["data-tensor"], e.attrs["data-producer"], e.attrs["data-consumer"]) for e in edges) \
        == sorted(_edges(report))
    by_tensor = {t["tensor"]: t for t in trips}
    for e in edges:
        title = e.find_all("title")
        assert title and e.attrs["data-tensor"] in title[0].text and "B" in title[0].text
        assert by_tensor[e.attrs["data-tensor"]]["shape"].split("{")[0] in title[0].text
    if edges:  # width grows with the edge's traffic; the heaviest edge is the widest
        widths = [(float(e.attrs["data-traffic"]), float(e.attrs["stroke-width"])) for e in edges]
        assert [w for _, w in sorted(widths)] == sorted(w for _, w in widths)
        heaviest = max(t for t, _ in widths)
        for t, w in widths:  # proportional to traffic (10 px for the heaviest), never thinner than 0.75 px
            assert w == pytest.approx(max(0.75, 10 * t / heaviest), abs=0.02)


# ---- tests --------------------------------------------------------------------------------------------

def test_report_page_renders_tables_and_graph(open_page, gpu_report):
    assert len(gpu_report["kernels"]) > 50 and len(gpu_report["ledger"]["round_trips"]) > 50
    dom = open_page(render_report(gpu_report))
    _check_report_page(dom, gpu_report)
    assert dom.find_all("title")[0].text == "h100 block grad"
    totals = dom.by_id("totals").text
    assert str(gpu_report["totals"]["kernels"]) in totals and "round trips" in totals


def test_report_of_a_compiled_function_renders_the_xla_comparison(open_page, cpu_report):
    assert cpu_report["comparison"], "inspect() on CPU should give XLA's cost analysis"
    dom = open_page(render_report(cpu_report))
    _check_report_page(dom, cpu_report)
    rows = dom.by_id("comparison").rows()
    assert [r.children[0].text for r in rows] == [c["quantity"] for c in cpu_report["comparison"]]


@pytest.mark.parametrize("column", ["bytes_read", "flops", "bytes_total"])
def test_sort_by_clicking_a_numeric_header(open_page, gpu_report, column):
    dom = open_page(render_report(gpu_report), fragment=f"sort={column}")
    table = dom.by_id("kernel-table")
    values = [float(r.cell(column).attrs["data-value"]) for r in table.rows()]
    assert len(values) == len(gpu_report["kernels"])
    assert values == sorted(values, reverse=True)  # numerically, not as text ("832 KiB" > "2.1 MiB")
    key = {"bytes_total": lambda k: k["bytes_read"] + k["bytes_written"]}.get(column, lambda k: k[column])
    assert values[0] == max(key(k) for k in gpu_report["kernels"])
    header = [th for th in table.find_all("th") if th.attrs.get("data-key") == column][0]
    assert header.attrs["aria-sort"] == "descending"


def test_sort_ascending_and_by_text(open_page, gpu_report):
    dom = open_page(render_report(gpu_report), fragment="sort=bytes_written:asc&lsort=bytes:asc")
    written = [int(r.cell("bytes_written").attrs["data-value"]) for r in dom.by_id("kernel-table").rows()]
    assert written == sorted(written)
    sizes = [int(r.cell("bytes").attrs["data-value"]) for r in dom.by_id("ledger-table").rows()]
    assert sizes == sorted(sizes)

    dom = open_page(render_report(gpu_report), fragment="sort=name")
    names = [r.attrs["data-kernel"] for r in dom.by_id("kernel-table").rows()]
    assert sorted(names) == sorted(k["name"] for k in gpu_report["kernels"])
    initials = [n[0].lower() for n in names]
    assert initials == sorted(initials) and initials[0] < initials[-1]


def test_page_is_self_contained(gpu_report, cpu_report):
    for report in (gpu_report, cpu_report):
        page = render_report(report)
        assert not re.search(r"https?://", page, re.IGNORECASE)
        assert not re.search(r"<(link|img|iframe|object|embed)\b|\bsrc\s*=|@import|url\(\s*['\"]?(?!#)",
                             page, re.IGNORECASE)
        assert "Content-Security-Policy" in page and "default-src 'none'" in page
        data = re.search(r'<script type="application/json" id="jaxfuse-data">(.*?)</script>', page, re.S)
        assert json.loads(data.group(1))["report"] == json.loads(json.dumps(report))


def test_hostile_names_stay_data(open_page, gpu_report):
    """A name that closes the <script> element or carries markup renders as text, not as HTML or code."""
    report = json.loads(json.dumps(gpu_report))
    evil = "</script><script>document.body.setAttribute('data-pwned','1')</script><b id=pwned>x</b><!--"
    report["kernels"][0]["name"] = evil
    report["title"] = evil
    report["totals"]["flops"] = float("nan")  # JSON has no NaN; it must not break the page
    page = render_report(report)
    assert page.lower().count("</script") == 2  # the data block's end and the code block's end
    dom = open_page(page)
    body = dom.find_all("body")[0]
    assert "data-pwned" not in body.attrs and not [e for e in dom.iter() if e.attrs.get("id") == "pwned"]
    assert dom.by_id("kernel-table").rows()[0].attrs["data-kernel"] == evil
    assert dom.find_all("h1")[0].text == evil


def test_missing_keys_render_empty_sections(open_page):
    dom = open_page(render_report({}))
    assert [e for e in dom.iter() if e.attrs.get("id") == "kernels"]
    assert not [e for e in dom.iter() if e.attrs.get("id") in ("kernel-table", "ledger-table", "kernel-graph")]
    # kernels without a ledger, and a ledger naming a kernel that is not listed
    report = {"module": "m", "kernels": [{"name": "k0", "category": "loop", "bytes_read": 8, "bytes_written": 4},
                                         {"name": "k1"}],
              "ledger": {"round_trips": [{"tensor": "k0", "producer": "k0", "consumers": ["k1", "gone"]}]}}
    dom = open_page(render_report(report), fragment="sort=flops")
    assert len(dom.by_id("kernel-table").rows()) == 2
    assert len(dom.by_id("ledger-table").rows()) == 1
    assert len(dom.by_id("kernel-graph").find_all("path", cls="edge")) == 1


def _kernel(name: str, category: str, bytes_read: int, bytes_written: int, flops: int | None = 0) -> dict:
    return {"name": name, "category": category, "label": hlo_inspect.CATEGORIES.get(category, category),
            "bytes_read": bytes_read, "bytes_written": bytes_written, "flops": flops, "launches": 1, "loop": "",
            "scopes": ["mlp"], "ops": {"add": 1}}


def _diff_dict() -> dict:
    a = {"module": "jit_a", "title": "program A",
         "kernels": [_kernel("norm", "reduction", 1000, 500), _kernel("gemm", "triton_gemm", 3000, 2000, 10**6),
                     _kernel("act", "loop", 2000, 2000), _kernel("old", "copy", 64, 64)],
         "ledger": {"round_trips": [{"tensor": "norm", "producer": "norm", "consumers": ["gemm"], "bytes": 500,
                                     "traffic_bytes": 1000, "shape": "f32[125]"}]}}
    b = {"module": "jit_b", "title": "program B",
         "kernels": [_kernel("norm_gemm", "pallas", 1500, 2000, None), _kernel("act_1", "loop", 1000, 1000),
                     _kernel("act_2", "loop", 1000, 1000), _kernel("new", "transpose", 32, 32)],
         "ledger": {"round_trips": []}}
    matches = [{"a": ["norm", "gemm"], "b": ["norm_gemm"], "kind": "merged"},
               {"a": ["act"], "b": ["act_1", "act_2"], "kind": "split"},
               {"a": ["old"], "b": [], "kind": "only_a"},
               {"a": [], "b": ["new"], "kind": "only_b"}]
    summary = {"kernels": [4, 4], "bytes_total": [10628, 7564], "ledger_traffic_bytes": [1000, 0],
               "matches": {"same": 0, "merged": 1, "split": 1, "only_a": 1, "only_b": 1}}
    return {"a": a, "b": b, "matches": matches, "summary": summary}


def test_diff_page(open_page):
    d = _diff_dict()
    page = render_diff(d)
    assert not re.search(r"https?://", page)
    dom = open_page(page, fragment="msort=delta:asc")
    assert dom.find_all("title")[0].text == "diff: program A vs program B"
    summary = {r.attrs["data-key"]: r for r in dom.by_id("diff-summary").rows()}
    assert set(summary) == {"kernels", "bytes_total", "ledger_traffic_bytes"}
    assert "-28.8%" in summary["bytes_total"].text  # (7564 - 10628) / 10628
    assert {b.attrs["data-kind"] for b in dom.by_id("match-kinds").find_all(cls="badge")} == \
        {"merged", "split", "only_a", "only_b"}

    rows = dom.by_id("match-table").rows()
    assert len(rows) == len(d["matches"])
    deltas = [int(r.cell("delta").attrs["data-value"]) for r in rows]
    assert deltas == sorted(deltas)  # sorted by the fragment, through the header's click handler
    merged = [r for r in rows if r.attrs["data-kind"] == "merged"][0]
    assert "norm" in merged.cell("a").text and "norm_gemm" in merged.cell("b").text
    assert int(merged.cell("bytes_a").attrs["data-value"]) == 1500 + 5000  # summed from the kernels

    for side in ("a", "b"):
        table = dom.by_id(f"kernels-{side}")
        assert [r.attrs["data-kernel"] for r in table.rows()] == [k["name"] for k in d[side]["kernels"]]
        kinds = {r.attrs["data-kernel"]: r.cell("kind").attrs["data-value"] for r in table.rows()}
        assert kinds == {n: m["kind"] for m in d["matches"] for n in m[side]}


def test_diff_page_of_real_reports(open_page):
    with open(os.path.join(DATA, "h100_block_fwd.hlo.txt"), encoding="utf-8") as f:
        a = hlo_inspect.from_text(f.read(), title="fwd")
    with open(os.path.join(DATA, "h100_block_grad.hlo.txt"), encoding="utf-8") as f:
        b = hlo_inspect.from_text(f.read(), title="grad")
    d = hlo_inspect.diff(a, b).to_dict()
    dom = open_page(render_diff(d), fragment="sort=bytes_total")
    assert len(dom.by_id("match-table").rows()) == len(d["matches"])
    for side in ("a", "b"):
        totals = [float(r.cell("bytes_total").attrs["data-value"]) for r in dom.by_id(f"kernels-{side}").rows()]
        assert len(totals) == len(d[side]["kernels"]) and totals == sorted(totals, reverse=True)


def test_warnings_units_and_missing_scopes_read_as_in_the_text_table(open_page):
    """The page says what the table says: the report's warnings, '86.2 MFLOP' with its space, one word for a
    missing scope ('(no scope)', never '?' or blank), singular counts."""
    with open(os.path.join(DATA, "cpu_while_loop.hlo.txt"), encoding="utf-8") as f:
        text = f.read()
    rep = hlo_inspect.from_text(text + "\n" + text)
    report = rep.to_dict()
    assert report["warnings"] and not rep.kernels[0].scopes
    dom = open_page(render_report(report))
    warnings = [e.text for e in dom.find_all(cls="report-warning")]
    assert warnings == ["warning: " + w for w in report["warnings"]]
    totals = dom.by_id("totals").text
    assert re.search(r"\d \wFLOP|\d FLOP", totals) and not re.search(r"\d[KMGT]FLOP", totals)
    scopes = [r.cell("scopes").text for r in dom.by_id("kernel-table").rows()]
    assert scopes[0] == "(no scope)" and "" not in scopes and "?" not in scopes
    ledger_scopes = [r.cell("scopes").text for r in dom.by_id("ledger-table").rows()]
    assert ledger_scopes and not [s for s in ledger_scopes if s.startswith("?")]


def test_fusion_saving_cards_say_what_the_text_says(open_page):
    """Kernels and bytes unfused -> fused, as `Report.fusion_saving_text` prints them: a while loop's body counted
    once on both sides."""
    import jax
    import jax.numpy as jnp

    from hlo_inspect.formatting import format_bytes

    rep = hlo_inspect.inspect(lambda x: jax.lax.fori_loop(0, 50, lambda i, y: jnp.tanh(y * 1.5 + 0.5), x),
                              jax.random.normal(jax.random.key(0), (256, 512)))
    saving = rep.fusion_saving(1e11, 1e12, 1.0)
    text = rep.fusion_saving_text("cpu", 1e11, 1e12, 1.0)
    kernels = f"{saving['kernels'][0]:,} -> {saving['kernels'][1]:,}"
    moved = f"{format_bytes(saving['bytes'][0])} -> {format_bytes(saving['bytes'][1])}"
    assert kernels in text and moved in text and saving["loop_bodies_once"]
    cards = {c.find_all(cls="k")[0].text: c.find_all(cls="v")[0].text
             for c in open_page(render_report(rep.to_dict())).by_id("totals").find_all(cls="card")}
    assert cards["kernels unfused \u2192 fused (loop bodies once)"] == kernels.replace("->", "\u2192")
    assert cards["HBM bytes unfused \u2192 fused (loop bodies once)"] == moved.replace("->", "\u2192")


def test_diff_page_shows_each_sides_warnings(open_page):
    with open(os.path.join(DATA, "cpu_while_loop.hlo.txt"), encoding="utf-8") as f:
        text = f.read()
    d = hlo_inspect.diff(hlo_inspect.from_text(text), hlo_inspect.from_text(text + "\n" + text)).to_dict()
    warnings = [e.text for e in open_page(render_diff(d)).find_all(cls="report-warning")]
    assert warnings == ["warning (B): " + w for w in d["b"]["warnings"]] and warnings


def test_collectives_show_their_interconnect_bytes(open_page):
    """An SPMD program (4 virtual CPU devices, tests/data/capture_collectives.py): the sent / received columns
    and cards on the report page, the collective rows of the diff page. Bytes by hand: the all-reduce of
    f32[16,32] (2048 B) over 4 devices sends 2·3/4·2048 = 3072; psum of 512 B over 4 sends 768, over 2, 512."""
    def load(name):
        with open(os.path.join(DATA, name), encoding="utf-8") as f:
            return hlo_inspect.from_text(f.read(), title=name)

    report = load("cpu4_sharded_matmul.hlo.txt").to_dict()
    dom = open_page(render_report(report))
    _check_report_page(dom, report)
    rows = {r.attrs["data-kernel"]: r for r in dom.by_id("kernel-table").rows()}
    assert rows["all-reduce"].cell("bytes_sent").attrs["data-value"] == "3072"
    assert rows["all-reduce"].cell("bytes_received").text == "3.0 KiB"
    assert rows["ynn_fusion"].cell("bytes_sent").attrs["data-value"] == ""  # not a collective: blank
    totals = dom.by_id("totals").text
    assert "sent per device" in totals and "received per device" in totals

    d = hlo_inspect.diff(load("cpu4_psum.hlo.txt"), load("cpu4_psum_groups.hlo.txt")).to_dict()
    dom = open_page(render_diff(d))
    summary = {r.attrs["data-key"]: r for r in dom.by_id("diff-summary").rows()}
    assert {"collectives", "bytes_sent", "bytes_received"} <= set(summary)
    assert "768 B" in summary["bytes_sent"].text and "512 B" in summary["bytes_sent"].text
    (match,) = dom.by_id("match-table").rows()
    assert (match.cell("sent_a").attrs["data-value"], match.cell("sent_b").attrs["data-value"]) == ("768", "512")
    assert dom.by_id("kernels-a").rows()[0].cell("bytes_sent").attrs["data-value"] == "768"


def test_values_from_constants_are_named_under_the_ledger(open_page):
    """The H200 capture whose causal mask XLA made a kernel of its own: the page says what the text table says."""
    with open(os.path.join(DATA, "h200_attention_causal_arange_mask.hlo.txt"), encoding="utf-8") as f:
        rep = hlo_inspect.from_text(f.read())
    dom = open_page(render_report(rep.to_dict()))
    [note] = [e.text for e in dom.find_all(cls="from-constants")]
    assert note.startswith("loop_compare_fusion computes pred[4096,4096] from iotas and constants alone; fusion.10 "
                           "reads it broadcast to pred[4,16,4096,4096]. Its row counts its bytes only"), note
    assert " ".join(note.split()) in " ".join(rep.ledger_table(4.3e12).split())
