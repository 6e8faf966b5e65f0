"""`gradlab view RUN`: one self-contained HTML page of a run (no server, no network).

The page holds the training curves as inline SVG (drawn by `training_curves`) and every traced
step's token strips (gradlab.load_traces) as JSON read by a small inline script: pick an
objective, a step and a group; each token is coloured by its hook-measured W (blue < 0 < red,
scaled to the largest |W| of that objective and step) and hovering shows W measured and in closed
form, A, r, s, the prefix/trie node and the clip flag. Nothing is fetched: no CDN, no fonts.

On a run that is being written the page shows a consistent prefix: the steps whose metrics
lines and trace files are complete. `gradlab view RUN --watch SECONDS` re-writes the page every
SECONDS (the page reloads itself at that period) until every configured step is checkpointed,
or Ctrl-C; without --watch, run `gradlab view RUN` again for newer steps.
"""

from __future__ import annotations

import html
import io
import math
from pathlib import Path

import pandas as pd

from .. import jsonio
from ..atomic import write_file
from ..instruments.manifest import Manifest
from .curves import plt, training_curves
from .runs import run_title

FIELDS = ["row", "position", "text", "W", "W_closed", "A", "r", "s", "prefix_node",
          "trie_node", "trie_size", "clip", "opt_step", "parent", "branch_at"]


def curves_svg(tidy: pd.DataFrame, manifest: Manifest) -> str:
    """The run's training curves (x = rollout step) as an inline <svg> element: the curves its
    manifest (`instruments.json`) declares, each titled with its unit, where undefined with
    the reason (the tidy table's `undefined` column, from the run's records and manifest)."""
    d = tidy[~tidy["metric"].astype(str).str.startswith("time_")]
    have = [(m, f"{t} [{manifest.unit(m)}]" if manifest.unit(m) else t)
            for m, t in manifest.curves if m in set(d["metric"])]
    if not have:
        return "<p>no curves in this run</p>"
    fig = training_curves(d, have, x="step", log=tuple(manifest.log & {m for m, _ in have}),
                          explain=tuple(m for m, _ in have))
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    svg = buf.getvalue()
    return svg[svg.index("<svg"):]


def trace_payload(traces: pd.DataFrame) -> dict:
    """{objective: {step: {group: {field: [values]}}}}, token rows in (row, position) order."""
    out: dict = {}
    t = traces.sort_values(["objective", "step", "group", "row", "position"], kind="stable")
    for (obj, step, g), d in t.groupby(["objective", "step", "group"], sort=False):
        cols = {}
        for f in FIELDS:
            col = d[f] if f in d else pd.Series(-1, index=d.index)  # traces without a layout
            vals = [x.item() if hasattr(x, "item") else x for x in col.tolist()]
            cols[f] = [None if isinstance(x, float) and not math.isfinite(x) else x for x in vals]
        out.setdefault(str(obj), {}).setdefault(str(int(step)), {})[str(int(g))] = cols
    return out


def summary_html(tidy: pd.DataFrame) -> str:
    """The end-of-run table (`gradlab.viz.summary.run_rows`) as an HTML <table>: an undefined
    ρ or tax share is "—" with a footnote marker (its reason also on hover), the reasons
    listed under the table; never a 0 or "nan" for an undefined value."""
    from .summary import LAST, NOTE, RATIOS, run_rows
    from .undefined import NOT_MEASURED, Footnotes

    notes = Footnotes()
    head = ["objective", f"reward (last {LAST} steps)", "held-out accuracy (%)", "ρ trie",
            "ρ full-group", "tax share"]
    rows = []
    for r in run_rows(tidy).to_dict("records"):
        whys = [NOT_MEASURED, NOT_MEASURED, *(r[f"why_{m}"] for m in RATIOS)]
        vals = [r["reward"], 100 * r["heldout"], *(r[m] for m in RATIOS)]
        cells = [f"<td>{html.escape(str(r['objective']))}</td>"]
        for v, why in zip(vals, whys):
            text = notes.cell(v, why)
            tip = f' title="{html.escape(why)}"' if text.startswith("—") else ""
            cells.append(f"<td{tip}>{html.escape(text)}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    legend = "".join(f"<br>{html.escape(line)}" for line in notes.legend().splitlines())
    return ("<table id=\"summary\"><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) +
            "</tr>" + "".join(rows) + f"</table><p class=\"note\">{html.escape(NOTE)}{legend}</p>")


def render(title: str, svg: str, payload: dict, summary: str = "") -> str:
    """The page: title, summary table, curves, navigation, strips and hover details, all inline."""
    data = jsonio.dumps(payload, separators=(",", ":")).replace("</", "<\\/")
    return PAGE.format(title=html.escape(title), svg=svg, data=data, script=SCRIPT, style=STYLE,
                       summary=summary)


def view(run: str | Path, out: str | Path | None = None, refresh: float | None = None) -> Path:
    """Write the page of run folder `run` (default RUN/view.html); returns its path.
    refresh: seconds after which the browser reloads the page (a run being watched)."""
    from ..loop.runs.store import load_run
    from ..loop.runs.traces import load_traces

    run = Path(run)
    if not (run / "config.json").exists():
        raise FileNotFoundError(f"{run} is not a run folder (no config.json)")
    tidy = load_run(run) if (run / "metrics.jsonl").exists() else None
    # names, units, curves and reasons: the run's manifest (a run without one: a one-line error)
    svg = curves_svg(tidy, Manifest.read(run)) if tidy is not None else "<p>no metrics</p>"
    summary = summary_html(tidy) if tidy is not None and len(tidy) else ""
    try:
        payload = trace_payload(load_traces(run))
    except FileNotFoundError:
        payload = {}
    out = Path(out) if out is not None else run / "view.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    page = render(run_title(run), svg, payload, summary)
    if refresh:
        page = page.replace("<head>", f'<head><meta http-equiv="refresh" content="{refresh:g}">', 1)
    write_file(out, page)  # whole or absent: a browser never reads half a page
    return out


def watch(run: str | Path, out: str | Path | None = None, every: float = 30.0,
          rounds: int | None = None, say=print) -> Path:
    """Re-write the page of `run` every `every` seconds until all its configured steps are
    checkpointed (then one last page without the reload) or after `rounds` pages."""
    import time

    from ..loop.runs.resume import run_status

    n = 0
    while True:
        status = run_status(run)  # (steps checkpointed, steps configured) or None
        done = status is not None and status[0] >= status[1]
        n += 1
        last = done or (rounds is not None and n >= rounds)
        path = view(run, out, refresh=None if last else every)
        say(f"wrote {path} ({status[0] if status else 0} of {status[1] if status else '?'} "
            "steps checkpointed)" + ("" if last else f"; again in {every:g} s (Ctrl-C stops)"))
        if last:
            return path
        time.sleep(every)


STYLE = """
body{font:14px system-ui,sans-serif;margin:16px;color:#222}
h1{font-size:18px} #curves svg{max-width:100%;height:auto}
#nav label{margin-right:14px} .row{display:flex;align-items:center;margin:3px 0}
.lab{width:120px;font-size:12px;color:#555} .tok{display:inline-block;min-width:18px;
padding:3px 2px;margin:1px;text-align:center;font-family:monospace;border:1px solid #ddd;
cursor:default} .tok.full{border-bottom:3px solid #4C72B0} .tok.subset{border-bottom:3px solid #A6C8E8}
.tok.branch{border-left:3px solid #000}
.tok:hover{outline:2px solid #000} .sum{font-size:11px;margin:1px 3px;color:#4C72B0} .tok.clip{outline:2px dashed #000} #detail{font-family:monospace;white-space:pre;background:#f6f6f6;
padding:8px;min-height:3em;margin-top:8px}
#summary{border-collapse:collapse} #summary td,#summary th{border:1px solid #ddd;padding:3px 8px}
.note{font-size:12px;color:#555}
"""

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>{style}</style></head><body>
<h1>gradlab run {title}</h1>
{summary}
<h2>Training curves</h2><div id="curves">{svg}</div>
<h2>Token strips (hook-measured W, or the advantage A, per token)</h2>
<p>Colour: W or, with "colour by A", the token's advantage A_{{i,t}} (per token under IBPO) — blue
&lt; 0 &lt; red, scaled to the largest magnitude of the objective at that step;
underline: dark blue = shared by the whole group, light blue = by a subset; dashed box = clipped.
Tree and repair groups: &#8627;k after a row's label = it branched from (or repairs) row k, and a
black left edge marks the position it was re-sampled from. Hover a token for its numbers.
Last row: Σ_i W at each full-group shared position.</p>
<div id="nav"><label>objective <select id="objective"></select></label>
<label>step <select id="step"></select></label><label>group <select id="group"></select></label>
<label>colour by <select id="colourby"><option value="W">W</option><option value="A">A</option></select></label>
<span id="count"></span></div>
<div id="strips"></div><div id="detail">hover a token</div>
<script type="application/json" id="data">{data}</script>
<script>{script}</script></body></html>
"""

SCRIPT = """
"use strict";
const DATA = JSON.parse(document.getElementById("data").textContent);
const $ = (id) => document.getElementById(id);
function fill(sel, keys) {
  const old = sel.value; sel.innerHTML = "";
  keys.forEach((k) => { const o = document.createElement("option"); o.value = k; o.textContent = k; sel.appendChild(o); });
  if (keys.includes(old)) sel.value = old;
}
function colour(w, m) {
  const a = m > 0 ? Math.min(1, Math.abs(w) / m) : 0;
  return w >= 0 ? `rgba(214,39,40,${a.toFixed(3)})` : `rgba(31,119,180,${a.toFixed(3)})`;
}
const fmt = (x) => (x === null ? "n/a" : Number(x).toPrecision(6));
function show(d, i) {
  $("detail").textContent =
    `row ${d.row[i]}  position ${d.position[i]}  token ${JSON.stringify(d.text[i])}  optimizer step ${d.opt_step[i]}\\n` +
    `W = ${fmt(d.W[i])}   W closed form = ${fmt(d.W_closed[i])}\\n` +
    `A = ${fmt(d.A[i])}   r = ${fmt(d.r[i])}   s = ${fmt(d.s[i])}\\n` +
    `prefix node ${d.prefix_node[i]}   trie node ${d.trie_node[i]} (size ${d.trie_size[i]})   clip ${d.clip[i]}` +
    (d.parent[i] >= 0 ? `\nre-sampled from position ${d.branch_at[i]} of row ${d.parent[i]} (a tree branch, or a repair of that row)` : "");
}
function draw() {
  const obj = $("objective").value, step = $("step").value, grp = $("group").value;
  const strips = $("strips"); strips.innerHTML = "";
  if (!obj || !DATA[obj][step] || !DATA[obj][step][grp]) { $("count").textContent = "no traces"; return; }
  const by = $("colourby").value;  // "W" or "A"
  let m = 0;
  Object.values(DATA[obj][step]).forEach((g) => g[by].forEach((v) => { m = Math.max(m, Math.abs(v)); }));
  const d = DATA[obj][step][grp];
  let rowDiv = null, cur = -1;
  d.W.forEach((w, i) => {
    if (d.row[i] !== cur) {
      cur = d.row[i]; rowDiv = document.createElement("div"); rowDiv.className = "row";
      const lab = document.createElement("span"); lab.className = "lab";
      lab.textContent = `row ${cur}  A=${Number(d.A[i]).toFixed(2)}` + (d.parent[i] >= 0 ? `  \u21b3${d.parent[i]}` : "");
      rowDiv.appendChild(lab);
      strips.appendChild(rowDiv);
    }
    const t = document.createElement("span");
    t.className = "tok" + (d.prefix_node[i] >= 0 ? " full" : d.trie_node[i] >= 0 ? " subset" : "") + (d.clip[i] ? " clip" : "") + (d.position[i] === d.branch_at[i] ? " branch" : "");
    t.textContent = d.text[i] === " " ? "\\u2423" : d.text[i];
    t.style.background = colour(d[by][i], m);
    t.dataset.i = i;
    t.addEventListener("mouseenter", () => show(d, i));
    rowDiv.appendChild(t);
  });
  // Σ_i W over the group at each full-group shared position (0 up to round-off = cancels)
  const sums = {};
  d.W.forEach((w, i) => { if (d.prefix_node[i] >= 0) sums[d.position[i]] = (sums[d.position[i]] || 0) + w; });
  const sumDiv = document.createElement("div"); sumDiv.className = "row";
  const lab = document.createElement("span"); lab.className = "lab"; lab.textContent = "\u03a3_i W (full-group)";
  sumDiv.appendChild(lab);
  Object.keys(sums).forEach((p) => {
    const c = document.createElement("span"); c.className = "sum"; c.textContent = Number(sums[p]).toExponential(1);
    sumDiv.appendChild(c);
  });
  strips.appendChild(sumDiv);
  $("count").textContent = `${d.W.length} tokens`;
}
function steps() { fill($("step"), Object.keys(DATA[$("objective").value] || {}).sort((a, b) => a - b)); groups(); }
function groups() {
  const s = (DATA[$("objective").value] || {})[$("step").value] || {};
  fill($("group"), Object.keys(s).sort((a, b) => a - b)); draw();
}
fill($("objective"), Object.keys(DATA));
$("objective").addEventListener("change", steps);
$("step").addEventListener("change", groups);
$("group").addEventListener("change", draw);
$("colourby").addEventListener("change", draw);
steps();
"""
