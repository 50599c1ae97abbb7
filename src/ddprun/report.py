"""The run report: ``runs/<id>/report.html``, self-contained (plots embedded as PNG, no network).

Built from what the run directory holds, so ``ddprun report RUN_DIR`` can regenerate it:
  plan.json      the rank table           metrics.csv   loss, validation metrics, throughput
  timings.csv    per-rank window medians of step time, data wait, compute, all-reduce, optimizer
  events.jsonl   straggler, hang and preemption events
The page opens with a summary card (world, steps, duration, samples/s, step time, final loss and
metrics, events); then the rank table, loss (train and validation on one axes), each other metric on
its own axes, throughput, per-rank step time over time and the per-rank time split, with stragglers
starred and hang/preemption events as dashed lines; a section without data says so, so every run's
report has the same layout. The numbers behind every plot are embedded too
(``<script id="ddprun-data" type="application/json">``).
A small inline script marks ``<body data-rendered="N">`` once N plot images have decoded, which
the browser test reads.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
import os
from collections import defaultdict

from ddprun.protocol.atomic import write_text_atomic

REPORT = "report.html"
TIMINGS = "timings.csv"
EVENTS = "events.jsonl"
RUN_FILES = ("plan.json", "metrics.csv", TIMINGS, EVENTS)
"""What a report is made of: a directory with none of them is not a run directory."""
TIMING_COLUMNS = ("t", "rank", "window", "n", "step", "data", "compute", "allreduce", "optim")


def _read_csv(path: str) -> list[dict[str, str]]:
    """The rows of ``path`` that have as many fields as its header (a NUL, a block a crash left
    unwritten, is read as nothing): a failed run's report is written too, and a full disk or a
    SIGKILL mid-append leaves its last row short. Their readers leave out a row whose number does
    not parse (:func:`_int`)."""
    if not os.path.exists(path):
        return []
    with open(path, newline="", errors="replace") as fp:
        rows = csv.DictReader(io.StringIO(fp.read().replace("\0", "")))
        return [r for r in rows if None not in r and None not in r.values()]


def _int(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def _read_events(path: str) -> list[dict]:
    """The events of ``path`` (JSON lines); a line that does not parse (torn by a crash) is skipped."""
    if not os.path.exists(path):
        return []
    events = []
    with open(path, errors="replace") as fp:
        for line in fp:
            try:
                event = json.loads(line) if line.strip() else None
            except ValueError:
                continue
            if isinstance(event, dict):
                events.append(event)
    return events


def _num(v: str | None) -> float:
    try:
        return float(v) if v not in (None, "") else math.nan
    except ValueError:
        return math.nan


def load_run(run_dir: str) -> dict:
    """Everything the report shows, as plain data (also embedded in the page)."""
    plan = {}
    if os.path.exists(os.path.join(run_dir, "plan.json")):
        with open(os.path.join(run_dir, "plan.json")) as fp:
            plan = json.load(fp)
    metrics = [r for r in _read_csv(os.path.join(run_dir, "metrics.csv")) if _int(r.get("step")) is not None]
    timings = [r for r in _read_csv(os.path.join(run_dir, TIMINGS)) if _int(r.get("rank")) is not None]
    events = _read_events(os.path.join(run_dir, EVENTS))
    train = [{"step": int(r["step"]), "loss": _num(r.get("loss")), "samples_per_s": _num(r.get("samples_per_s"))}
             for r in metrics if r.get("loss")]
    val_names = [c for c in (metrics[0].keys() if metrics else []) if c.startswith("val_")]
    val = [{"step": int(r["step"]), **{k: _num(r.get(k)) for k in val_names}} for r in metrics
           if any(r.get(k) for k in val_names)]
    per_rank: dict[int, list[dict]] = defaultdict(list)
    for r in timings:
        per_rank[int(r["rank"])].append({k: _num(r.get(k)) for k in TIMING_COLUMNS})
    return {"run_dir": os.path.abspath(run_dir), "plan": plan, "train": train, "val": val,
            "val_names": val_names, "timings": {str(k): v for k, v in sorted(per_rank.items())}, "events": events}


def summarize_run(data: dict) -> dict:
    """The summary card's numbers (None where the run directory does not say): world, nodes, steps,
    duration, samples/s, step time, final loss and metrics, events by kind."""
    plan, train, val, timings = data["plan"], data["train"], data["val"], data["timings"]
    steps = max([p["step"] for p in train + val], default=None)
    times = [row["t"] for rows in timings.values() for row in rows if not math.isnan(row["t"])]
    times += [e["t"] for e in data["events"] if isinstance(e.get("t"), (int, float))]
    start = plan.get("started_at")
    duration = max(times) - start if start and times and max(times) > start else None
    rates = sorted(p["samples_per_s"] for p in train if not math.isnan(p["samples_per_s"]))
    step_ms = {r: _median([row["step"] for row in rows]) * 1e3 for r, rows in timings.items()}
    step_ms = {r: v for r, v in step_ms.items() if not math.isnan(v)}
    events: dict[str, int] = defaultdict(int)
    for e in data["events"]:
        events[str(e.get("kind", "event"))] += 1
    last_val = val[-1] if val else {}
    return {
        "world_size": plan.get("world_size"), "nnodes": plan.get("nnodes"),
        "nproc_per_node": plan.get("nproc_per_node") if plan.get("uneven") else None,
        "hosts": len({r.get("host") for r in plan.get("ranks", [])}) or None,
        "steps": steps, "duration_s": duration,
        "samples_per_s": rates[len(rates) // 2] if rates else None,
        "step_ms_median": _median(list(step_ms.values())) if step_ms else None,
        "slowest_rank": int(max(step_ms, key=lambda r: step_ms[r])) if step_ms else None,
        "final_loss": next((p["loss"] for p in reversed(train) if not math.isnan(p["loss"])), None),
        "final_val": {k: last_val[k] for k in data["val_names"] if k in last_val and not math.isnan(last_val[k])},
        "events": dict(events),
    }


def _median(values: list[float]) -> float:
    vals = sorted(v for v in values if not math.isnan(v))
    return vals[len(vals) // 2] if vals else math.nan


def _figure(height: float):
    """A figure 7 inches wide and its axes, outside pyplot: no global figure list or backend, so a
    report written in a notebook's process (``ddprun.launch``) leaves its plots and backend alone."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, height))
    return fig, fig.subplots()


def warm_up() -> None:
    """Import and exercise what :func:`write_report` draws with (matplotlib's figure, its Agg canvas,
    the default font): about 0.4 s of CPU that a report written later in this process no longer pays.
    Safe on any thread (Python's import locks make a concurrent import wait for this one); raises what
    the import raises."""
    fig, ax = _figure(1.0)
    ax.set_title("ddprun")
    _png(fig)


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _line_plot(runs: list[tuple[str, dict]], series: str, key: str, title: str, ylabel: str) -> str:
    """One quantity against the step, one line per run; ``series``: ``train`` or ``val``."""
    fig, ax = _figure(2.8)
    for label, d in runs:
        pts = [p for p in d[series] if key in p and not math.isnan(p[key])]
        ax.plot([p["step"] for p in pts], [p[key] for p in pts], marker="o" if series == "val" else None,
                ms=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(runs) > 1:
        ax.legend(fontsize=7)
    return _png(fig)


def _loss_plot(runs: list[tuple[str, dict]]) -> str:
    """Training and validation loss: the same quantity, so one axes."""
    fig, ax = _figure(3.0)
    for label, d in runs:
        pts = [p for p in d["train"] if not math.isnan(p["loss"])]
        ax.plot([p["step"] for p in pts], [p["loss"] for p in pts], label=f"train loss ({label})")
        val = [p for p in d["val"] if not math.isnan(p.get("val_loss", math.nan))]
        if val:
            ax.plot([p["step"] for p in val], [p["val_loss"] for p in val], marker="o", ms=3,
                    label=f"val_loss ({label})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(fontsize=7)
    ax.set_title("loss")
    return _png(fig)


def _step_time_plot(data: dict) -> str:
    """Each rank's median step time per window against time; stragglers starred, other events lined."""
    timings, t0 = data["timings"], _t0(data)
    fig, ax = _figure(3.2)
    for rank, rows in timings.items():
        ax.plot([row["t"] - t0 for row in rows], [row["step"] * 1e3 for row in rows], marker=".", label=f"rank {rank}")
    for e in data["events"]:
        rows = timings.get(str(e.get("rank")), [])
        if e.get("kind") == "straggler":
            row = next((r for r in rows if r["window"] == e.get("window")), rows[-1] if rows else None)
            if row is not None:
                ax.plot(row["t"] - t0, row["step"] * 1e3, "r*", ms=14)
        elif isinstance(e.get("t"), (int, float)):
            ax.axvline(e["t"] - t0, color="red", ls="--", lw=1)
            ax.annotate(str(e.get("kind", "event")), (e["t"] - t0, ax.get_ylim()[1]), color="red", fontsize=8,
                        ha="right", va="top", rotation=90)
    ax.set_xlabel("seconds since the rank table")
    ax.set_ylabel("median step time (ms)")
    ax.legend(fontsize=7, ncol=4)
    ax.set_title("per-rank step time over time (red star: straggler named; dashed: hang / preemption)")
    return _png(fig)


def _t0(data: dict) -> float:
    times = [row["t"] for rows in data["timings"].values() for row in rows if not math.isnan(row["t"])]
    return data["plan"].get("started_at") or (min(times) if times else 0.0)


SPLIT = ("data", "compute", "allreduce", "optim")


def _split_plot(data: dict) -> str | None:
    """Mean of window medians per part, stacked per rank; None when no part was timed (plain scripts)."""
    timings = data["timings"]
    ranks = sorted(int(r) for r in timings)
    means = {p: [_mean([row[p] for row in timings[str(r)]]) for r in ranks] for p in SPLIT}
    if all(math.isnan(v) for p in SPLIT for v in means[p]):
        return None
    named = {e.get("rank") for e in data["events"] if e.get("kind") == "straggler"}
    labels = [f"rank {r}" + (" (straggler)" if r in named else "") for r in ranks]
    fig, ax = _figure(0.8 + 0.35 * len(ranks))
    left = [0.0] * len(ranks)
    for p in SPLIT:
        vals = [0.0 if math.isnan(v) else v * 1e3 for v in means[p]]
        ax.barh(labels, vals, left=left, label=p)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_xlabel("ms per step (mean of window medians)")
    ax.legend(fontsize=7, ncol=4)
    ax.set_title("time split per rank")
    return _png(fig)


def _plots(data: dict, other: dict | None) -> list[tuple[str, str | None]]:
    """(title, PNG or None) in page order; None: the section is shown with what is missing."""
    runs = [("this run", data)] + ([("compared run", other)] if other else [])
    has_train = any(d["train"] for _, d in runs)
    plots: list[tuple[str, str | None]] = [("Loss", _loss_plot(runs) if has_train or data["val"] else None)]
    for name in [n for n in data["val_names"] if n != "val_loss"]:
        plots.append((name, _line_plot(runs, "val", name, name, name)))
    plots.append(("Throughput", _line_plot(runs, "train", "samples_per_s", "throughput (all ranks)", "samples/s")
                  if has_train else None))
    timed = bool(data["timings"])
    plots.append(("Per-rank step time", _step_time_plot(data) if timed else None))
    plots.append(("Time split per rank", _split_plot(data) if timed else None))
    return plots


def _mean(values: list[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def _table(rows: list[dict], columns: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r.get(c, '')))}</td>" for c in columns) + "</tr>"
                   for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _fmt(value, unit: str = "", digits: str = ".4g") -> str:
    return "?" if value is None else f"{value:{digits}}{unit}"


def _summary_card(s: dict) -> str:
    events = ", ".join(f"{n} {k}" for k, n in sorted(s["events"].items())) or "none"
    items = [
        ("world", f"{_fmt(s['world_size'], digits='')} ranks on {_fmt(s['nnodes'], digits='')} node(s)"
                  + (f" ({' + '.join(map(str, s['nproc_per_node'].values()))})" if s["nproc_per_node"] else "")),
        ("steps", _fmt(s["steps"], digits="")),
        ("duration", _fmt(s["duration_s"], " s", ".1f")),
        ("samples/s", _fmt(s["samples_per_s"], digits=".0f")),
        ("step time", _fmt(s["step_ms_median"], " ms median", ".1f")
         + ("" if s["slowest_rank"] is None else f", slowest rank {s['slowest_rank']}")),
        ("final loss", _fmt(s["final_loss"])),
        *((k, _fmt(v)) for k, v in s["final_val"].items()),
        ("events", events),
    ]
    cells = "".join(f"<div><dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd></div>" for k, v in items)
    return f"<section class='card' id='summary'><h2>Summary</h2><dl>{cells}</dl></section>"


MISSING = {
    "Per-rank step time": "No step timing was recorded (no optimizer step reached the job channel).",
    "Time split per rank": "No step timing was recorded.",
}

STYLE = ("body{font-family:sans-serif;margin:2em;max-width:62em}table{border-collapse:collapse;font-size:90%}"
         "td,th{border:1px solid #ccc;padding:2px 8px}img{max-width:100%}.card{border:1px solid #bbb;"
         "border-radius:8px;padding:0 1em 1em;background:#f6f8fa}.card dl{display:flex;flex-wrap:wrap;gap:.5em 2em;"
         "margin:0}.card dt{font-size:80%;color:#555}.card dd{margin:0;font-size:120%;font-weight:bold}"
         "tr.event-straggler td{background:#fff4e0}tr.event-hang td,tr.event-preemption td{background:#ffe6e6}")


def _events_table(events: list[dict], t0: float) -> str:
    if not events:
        return "<p>No straggler, hang or preemption events.</p>"
    rows = []
    for e in events:
        when = f"+{e['t'] - t0:.1f} s" if isinstance(e.get("t"), (int, float)) and t0 else ""
        cells = [str(e.get(k, "")) for k in ("kind", "when", "rank", "host", "message")]
        cells[1] = when
        rows.append(f"<tr class='event-{html.escape(cells[0])}'>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells)
                    + "</tr>")
    head = "".join(f"<th>{c}</th>" for c in ("kind", "when", "rank", "host", "message"))
    return f"<table id='events'><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def render(data: dict, other: dict | None = None) -> str:
    """The page: summary card, rank table, the plots (a note where data is missing), events, data."""
    data = {**data, "summary": summarize_run(data)}
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>ddprun report</title>",
        f"<style>{STYLE}</style></head><body data-rendered='0'>",
        f"<h1>ddprun run report</h1><p>{html.escape(data['run_dir'])}</p>",
        _summary_card(data["summary"]),
        "<h2>Rank table</h2>", _table(data["plan"].get("ranks", []), ["rank", "local_rank", "node_rank", "host",
                                                                     "pid", "device"]),
    ]
    for title, png in _plots(data, other):
        parts.append(f"<h2>{html.escape(title)}</h2>")
        parts.append(f"<img class='plot' alt='{html.escape(title)}' src='data:image/png;base64,{png}'>" if png
                     else f"<p class='missing'>{html.escape(MISSING.get(title, 'Nothing was logged.'))}</p>")
    parts.append("<h2>Events</h2>")
    parts.append(_events_table(data["events"], _t0(data)))
    # strict JSON (JSON.parse rejects NaN): a number that is not one (a NaN loss, a missing value) is null
    payload = json.dumps(_finite({"this": data, "other": other}), allow_nan=False).replace("</", "<\\/")
    parts.append(f"<script id='ddprun-data' type='application/json'>{payload}</script>")
    parts.append("<script>window.addEventListener('load',function(){var n=0;"
                 "document.querySelectorAll('img.plot').forEach(function(i){if(i.complete&&i.naturalWidth>0)n++;});"
                 "document.body.dataset.rendered=String(n);});</script></body></html>")
    return "".join(parts)


def _finite(value: object) -> object:
    """``value`` with every float that is NaN or infinite, at any depth, as None (JSON's null)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_report(run_dir: str, compare: str | None = None, out: str | None = None) -> str:
    """Write the report (atomically) and return its path."""
    data = load_run(run_dir)
    other = load_run(compare) if compare else None
    path = out or os.path.join(run_dir, REPORT)
    write_text_atomic(path, render(data, other))
    return path
