"""The run report: ``runs/<id>/report.html``, self-contained (plots embedded as PNG, no network).

Built from what the run directory holds, so ``ddprun report RUN_DIR`` can regenerate it:
  plan.json      the rank table           metrics.csv   loss, validation metrics, throughput
  timings.csv    per-rank window medians of step time, data wait, compute, all-reduce, optimizer
  events.jsonl   straggler and hang events
The numbers behind every plot are embedded too (``<script id="ddprun-data" type="application/json">``).
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
TIMING_COLUMNS = ("t", "rank", "window", "n", "step", "data", "compute", "allreduce", "optim")


def _read_csv(path: str) -> list[dict[str, str]]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as fp:
        return list(csv.DictReader(fp))


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
    metrics = _read_csv(os.path.join(run_dir, "metrics.csv"))
    timings = _read_csv(os.path.join(run_dir, TIMINGS))
    events = []
    if os.path.exists(os.path.join(run_dir, EVENTS)):
        with open(os.path.join(run_dir, EVENTS)) as fp:
            events = [json.loads(line) for line in fp if line.strip()]
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


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _plots(data: dict, other: dict | None) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = []
    runs = [("this run", data)] + ([("compared run", other)] if other else [])
    if any(d["train"] or d["val"] for _, d in runs):
        fig, ax = plt.subplots(figsize=(7, 3.2))
        for label, d in runs:
            if d["train"]:
                ax.plot([p["step"] for p in d["train"]], [p["loss"] for p in d["train"]], label=f"train loss ({label})")
            for name in d["val_names"]:
                pts = [p for p in d["val"] if not math.isnan(p[name])]
                ax.plot([p["step"] for p in pts], [p[name] for p in pts], marker="o", ms=3, label=f"{name} ({label})")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        ax.set_title("loss and validation metrics")
        plots.append(("Loss and validation metrics", _png(fig)))
    if any(d["train"] for _, d in runs):
        fig, ax = plt.subplots(figsize=(7, 2.8))
        for label, d in runs:
            ax.plot([p["step"] for p in d["train"]], [p["samples_per_s"] for p in d["train"]], label=label)
        ax.set_xlabel("step")
        ax.set_ylabel("samples/s")
        ax.legend(fontsize=7)
        ax.set_title("throughput (all ranks)")
        plots.append(("Throughput", _png(fig)))
    timings = data["timings"]
    if timings:
        ranks = sorted(int(r) for r in timings)
        width = max(len(v) for v in timings.values())
        grid = [[math.nan] * width for _ in ranks]
        for i, r in enumerate(ranks):
            for j, row in enumerate(timings[str(r)]):
                grid[i][j] = row["step"] * 1e3
        fig, ax = plt.subplots(figsize=(7, 0.5 + 0.35 * len(ranks)))
        im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
        ax.set_xlabel("window")
        fig.colorbar(im, ax=ax, label="median step time (ms)")
        for e in data["events"]:
            if e.get("kind") == "straggler" and e.get("rank") in ranks:
                ax.plot(min(width - 1, max(0, e.get("window", 1) - 1)), ranks.index(e["rank"]), "r*", ms=12)
        ax.set_title("per-rank step time over time (red star: straggler named)")
        plots.append(("Per-rank step time", _png(fig)))
        parts = ("data", "compute", "allreduce", "optim")
        means = {p: [_mean([row[p] for row in timings[str(r)]]) for r in ranks] for p in parts}
        if any(not math.isnan(v) for p in parts for v in means[p]):
            fig, ax = plt.subplots(figsize=(7, 0.6 + 0.35 * len(ranks)))
            left = [0.0] * len(ranks)
            for p in parts:
                vals = [0.0 if math.isnan(v) else v * 1e3 for v in means[p]]
                ax.barh([f"rank {r}" for r in ranks], vals, left=left, label=p)
                left = [a + b for a, b in zip(left, vals)]
            ax.set_xlabel("ms per step (mean of window medians)")
            ax.legend(fontsize=7, ncol=4)
            ax.set_title("time split per rank")
            plots.append(("Time split per rank", _png(fig)))
    return plots


def _mean(values: list[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan


def _table(rows: list[dict], columns: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r.get(c, '')))}</td>" for c in columns) + "</tr>"
                   for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render(data: dict, other: dict | None = None) -> str:
    plots = _plots(data, other)
    ranks = data["plan"].get("ranks", [])
    events = data["events"]
    summary = ""
    if data["val"]:
        last = data["val"][-1]
        summary = ", ".join(f"{k} {last[k]:.4g}" for k in data["val_names"] if not math.isnan(last[k]))
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>ddprun report</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:60em}table{border-collapse:collapse;"
        "font-size:90%}td,th{border:1px solid #ccc;padding:2px 8px}img{max-width:100%}</style></head>",
        "<body data-rendered='0'>",
        f"<h1>ddprun run report</h1><p>{html.escape(data['run_dir'])}</p>",
        f"<p>{len(ranks)} ranks on {data['plan'].get('nnodes', '?')} node(s). {html.escape(summary)}</p>",
        "<h2>Rank table</h2>", _table(ranks, ["rank", "local_rank", "node_rank", "host", "pid", "device"]),
    ]
    for title, png in plots:
        parts.append(f"<h2>{html.escape(title)}</h2><img class='plot' alt='{html.escape(title)}' "
                     f"src='data:image/png;base64,{png}'>")
    parts.append("<h2>Events</h2>")
    parts.append(_table(events, ["kind", "message"]) if events else "<p>No straggler or hang events.</p>")
    payload = json.dumps({"this": data, "other": other}, allow_nan=True).replace("</", "<\\/")
    parts.append(f"<script id='ddprun-data' type='application/json'>{payload}</script>")
    parts.append("<script>window.addEventListener('load',function(){var n=0;"
                 "document.querySelectorAll('img.plot').forEach(function(i){if(i.complete&&i.naturalWidth>0)n++;});"
                 "document.body.dataset.rendered=String(n);});</script></body></html>")
    return "".join(parts)


def write_report(run_dir: str, compare: str | None = None, out: str | None = None) -> str:
    """Write the report (atomically) and return its path."""
    data = load_run(run_dir)
    other = load_run(compare) if compare else None
    path = out or os.path.join(run_dir, REPORT)
    write_text_atomic(path, render(data, other))
    return path
