"""Stacks and the hang report: where each rank's main thread is at a stall, every thread's stack
in ``stacks/rank-N.txt``, and the report naming the rank(s) whose place differs from the rest.

Progress counting is worker/progress.py; who observes a stall and when, worker/monitor.py.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
from collections import defaultdict
from collections.abc import Mapping, Sequence

from ddprun import loaderworkers
from ddprun._util import ranks_text
from ddprun.protocol.failure import FINISHED_FIRST_HINT, CleanEnd

DATA_LOADING = "in data loading (DataLoader)"


def _frame_kind(filename: str, func: str) -> str:
    f = filename.replace("\\", "/")
    if "/torch/autograd/" in f or f.endswith("torch/_tensor.py"):
        return "in backward (DDP's gradient all-reduce)"
    if "/torch/distributed/" in f:
        return f"in torch.distributed.{func}"
    if "/torch/utils/data/" in f:
        return DATA_LOADING
    return ""


def main_thread_place() -> dict:
    """Where the main thread is: a one-line summary for grouping, and its innermost frames."""
    ident = threading.main_thread().ident  # None only before a thread starts; the main thread has one
    frames = loaderworkers.frames_of(sys._current_frames().get(ident) if ident is not None else None)
    where = ""
    for filename, _, func in reversed(frames):
        where = _frame_kind(filename, func)
        if where:
            break
    user = loaderworkers.user_frame(frames)
    at = loaderworkers.frame_text(user) if user else "?"
    if not where:
        where = f"at {loaderworkers.frame_text(frames[-1] if frames else ('?', 0, '?'))}"
    return {"where": where, "user_frame": at,
            "frames": loaderworkers.frame_lines(frames[-12:])}


def loader_places(place: dict, prefix: str | None) -> list[dict]:
    """Where this rank's DataLoader workers are (ddprun/loaderworkers.py) when ``place``
    (:func:`main_thread_place`) waits for one of them; each answer's stacks go to ``<prefix>-<pid>.txt``
    (RunDir.loader_stack_prefix). None asked outside ``ddprun run`` (``prefix`` None)."""
    if prefix is None or place.get("where") != DATA_LOADING:
        return []
    places = loaderworkers.ask(loaderworkers.children())
    for p in places:
        stack = p.pop("stack", "")
        if stack:
            try:
                with open(f"{prefix}-{p['pid']}.txt", "w") as fp:
                    fp.write(stack)
            except OSError:
                pass
    return places


def dump_stacks(path: str) -> None:
    """Every thread's Python stack into ``path`` (faulthandler: no extra privileges needed)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fp:
        faulthandler.dump_traceback(file=fp, all_threads=True)


def _where_at(place: dict) -> str:
    """``in backward (...) (train.py:63 in main)``; the user frame once when it is the place itself."""
    where, user = place["where"], place["user_frame"]
    return where if where == f"at {user}" else f"{where} ({user})"


def hang_report(places: Mapping[int, dict], world_size: int, stalled_s: float, steps: Mapping[int, int],
                collectives: Sequence[str] = (), ended: CleanEnd | None = None) -> tuple[str, str]:
    """(one-line summary, full report) from each rank's place; the odd ranks are the minority.
    ``collectives``: worker/collectives.py attribution lines, a section of the report. ``ended``: the
    job's first clean end: a rank that did not answer because its script had ended is said so."""
    groups: dict[str, list[int]] = defaultdict(list)
    for rank, place in places.items():
        groups[place["where"]].append(rank)
    silent = sorted(set(range(world_size)) - set(places))
    gone = ended if ended is not None and ended.rank in silent else None
    if gone is not None:
        silent.remove(gone.rank)
    ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1]))
    parts = []
    if len(ordered) > 1 or silent or gone is not None:
        odd = ordered[:-1] if len(ordered) > 1 else []
        majority_where, majority_ranks = ordered[-1]
        for _, ranks in odd:
            r0 = places[ranks[0]]
            parts.append(f"rank {ranks_text(ranks)} ({r0.get('host', '?')}) {_where_at(r0)}")
        if gone is not None:
            parts.append(f"rank {gone.rank} ({gone.host}) ended its script (exit 0) after {gone.steps} optimizer steps")
        if silent:
            parts.append(f"rank {ranks_text(silent)} did not answer (frozen, or holding the GIL)")
        many = len(majority_ranks) > 1
        summary = (f"no rank advanced for {stalled_s:.0f} s: " + "; ".join(parts)
                   + f" while rank{'s' if many else ''} {ranks_text(majority_ranks)} {'are' if many else 'is'} "
                   + majority_where)
    else:
        where, ranks = ordered[0]
        summary = f"no rank advanced for {stalled_s:.0f} s: every rank is {_where_at(places[ranks[0]])}"
    summary += _loaders_summary(places)
    lines = [f"ddprun hang report: {summary}", ""]
    if collectives:
        lines += ["Collectives (torch's Flight Recorder):", *(f"  {line}" for line in collectives), ""]
    for rank in sorted(places):
        p = places[rank]
        lines.append(f"rank {rank} ({p.get('host', '?')}), step {steps.get(rank, 0)}: {_where_at(p)}")
        lines.extend(f"    {fr}" for fr in _strings(p.get("frames"))[-6:])
        for w in _loaders(p):
            lines.append(f"  its {_loader_name(w)} {_loader_state(w)}")
            lines.extend(f"      {fr}" for fr in _strings(w.get("frames"))[-6:])
    for rank in silent:
        lines.append(f"rank {rank}: no answer")
    if gone is not None:
        lines.append(f"rank {gone.rank}: its script ended (exit 0) after {gone.steps} optimizer steps. {FINISHED_FIRST_HINT}.")
    lines.append("Full stacks of every thread: stacks/rank-N.txt (of a DataLoader worker: stacks/rank-N-loader-PID.txt)"
                 " in the run directory of each node.")
    return summary, "\n".join(lines)


def _strings(value: object) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []


def _loaders(place: Mapping) -> list[dict]:
    """The DataLoader workers' places a rank gave (:func:`loader_places`); malformed entries dropped."""
    got = place.get("loaders")
    return [w for w in got if isinstance(w, dict) and isinstance(w.get("at"), str)
            and isinstance(w.get("pid"), int)] if isinstance(got, list) else []


def _loader_name(w: Mapping) -> str:
    worker = w.get("worker")
    if isinstance(worker, int) and not isinstance(worker, bool):
        return f"DataLoader worker {worker} (pid {w['pid']})"
    return f"{'DataLoader worker' if w.get('loader') is True else 'child process'} (pid {w['pid']})"


def _loader_state(w: Mapping) -> str:
    silent = w.get("silent")
    return silent if isinstance(silent, str) and silent else f"is {w['at']}"


def _loaders_summary(places: Mapping[int, dict], most: int = 3) -> str:
    """``; rank 1's DataLoader worker 0 (pid 4242) is at data.py:15 in __getitem__``: the workers
    that are not waiting for work, which is what their rank waits for."""
    parts = []
    for rank in sorted(places):
        workers = _loaders(places[rank])
        busy = [w for w in workers if not w["at"].startswith("waiting for work")]
        parts += [f"rank {rank}'s {_loader_name(w)} {_loader_state(w)}" for w in busy]
        if workers and not busy:
            parts.append(f"rank {rank}'s DataLoader workers are all waiting for work")
    more = f"; and {len(parts) - most} more DataLoader workers" if len(parts) > most else ""
    return "".join(f"; {p}" for p in parts[:most]) + more
