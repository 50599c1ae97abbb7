"""The rank table: rendering (plan before launch, facts after rendezvous) and plan.json."""

from __future__ import annotations

import io
import os
import sys
import time
from collections.abc import Sequence

from ddprun.cluster.plan import RankPlan
from ddprun.protocol.atomic import write_json_atomic

COLUMNS = ("rank", "local_rank", "node_rank", "host", "pid", "device")


def render_table(rows: Sequence[dict], columns: Sequence[str], title: str) -> str:
    """A rich table as plain text (no colour codes, so it reads the same in a log file)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col.replace("_", " "), justify="right" if col != "host" and col != "device" else "left")
    for row in rows:
        table.add_row(*(str(row.get(c, "")) for c in columns))
    buf = io.StringIO()
    Console(file=buf, width=120, no_color=True, force_terminal=False).print(table)
    return buf.getvalue()


def render_plan(plan: RankPlan, title: str) -> str:
    rows = [{"rank": s.rank, "local_rank": s.local_rank, "node_rank": s.node_rank, "device": s.device}
            for s in plan.slots]
    return render_table(rows, ("node_rank", "local_rank", "rank", "device"), title)


def processes_per_node(rows: Sequence[dict]) -> dict[int, int]:
    """Node rank -> the ranks it runs, as gathered (under --allow-uneven-nodes they may differ)."""
    counts: dict[int, int] = {}
    for r in rows:
        counts[r["node_rank"]] = counts.get(r["node_rank"], 0) + 1
    return dict(sorted(counts.items()))


def uneven_note(rows: Sequence[dict]) -> str:
    """`` (uneven: node 0 runs 2, node 1 runs 1)`` when nodes run different counts, else ""."""
    counts = processes_per_node(rows)
    if len(set(counts.values())) <= 1:
        return ""
    return " (uneven: " + ", ".join(f"node {n} runs {c}" for n, c in counts.items()) + ")"


def print_rank_table(rows: Sequence[dict], world_size: int) -> None:
    missing = sorted(set(range(world_size)) - {r["rank"] for r in rows})
    title = f"ddprun: {len(rows)}/{world_size} ranks"
    nodes = sorted({(r["node_rank"], r["host"]) for r in rows})
    title += f" on {len(nodes)} node(s)" + uneven_note(rows)
    text = render_table(sorted(rows, key=lambda r: r["rank"]), COLUMNS, title)
    if missing:
        text += f"ddprun: ranks {missing} did not report within the join timeout\n"
    sys.stdout.write(text)
    sys.stdout.flush()


def write_plan_json(run_dir: str, rows: Sequence[dict], world_size: int) -> None:
    """The gathered table; ``started_at`` (Unix time, when every rank had reported) starts the
    report's run duration; ``nproc_per_node``: node rank (a string, JSON keys are) -> its ranks,
    ``uneven``: whether they differ (--allow-uneven-nodes)."""
    counts = processes_per_node(rows)
    write_json_atomic(os.path.join(run_dir, "plan.json"), {
        "world_size": world_size,
        "nnodes": len(counts),
        "nproc_per_node": {str(n): c for n, c in counts.items()},
        "uneven": len(set(counts.values())) > 1,
        "started_at": round(time.time(), 3),
        "ranks": sorted(rows, key=lambda r: r["rank"]),
    })
