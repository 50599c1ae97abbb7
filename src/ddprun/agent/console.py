"""What a node's console says when its part of the job ends badly: the root cause of the job (the same
line on every node), this node's other failed ranks, and the ranks that were only stopped.

Pure text from failure records (protocol/failure.py) and log tails; the launcher prints it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

from ddprun._util import tail_lines
from ddprun.protocol import failure as fr
from ddprun.protocol.rundir import RunDir


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def local_records(failures: Mapping[int, object], recorded: Mapping[int, fr.FailureRecord | None],
                  host: str, node_rank: int, cause: fr.FailureRecord | None) -> dict[int, fr.FailureRecord]:
    """This node's failed ranks as records: their own (or their agent's), else what torch's failure says.

    ``failures``: global rank -> torch's ProcessFailure (local_rank, exitcode); a rank torch stopped
    with SIGTERM after another failed, and that left no record, was only stopped."""
    out = {}
    for rank, f in failures.items():
        rec = recorded.get(rank)
        code = int(getattr(f, "exitcode", 1))
        local_rank = int(getattr(f, "local_rank", -1))
        if rec is None and code == -15 and cause is not None and cause.rank != rank:
            rec = fr.stopped_by(cause, rank=rank, node_rank=node_rank, host=host, local_rank=local_rank, t=0.0)
        if rec is None:
            rec = fr.from_exit(rank, code, node_rank=node_rank, host=host, local_rank=local_rank, t=0.0)
        out[rank] = rec
    return out


_CPP_NOISE = re.compile(r"\s*(\[rank\d+\]:?\s*)?(frame #\d+|<omitting python frames>|Exception raised from |"
                        r"\[W\d{4} \d\d:\d\d:\d\d\.\d+ [^\]]*\] )")
"""Lines of a C++ warning's stack trace (``frame #22: __libc_start_main``; torch logs one when a store
call fails as the process ends, after its Python traceback): noise on a console."""


def log_tail(path: str, n: int) -> list[str]:
    """The last ``n`` lines of a log without C++ stack traces (of its last 60 lines)."""
    return [t for t in tail_lines(path, 60) if not _CPP_NOISE.match(t)][-n:]


def _tail(rundir: RunDir, rank: int, summary: str) -> list[str]:
    """The last lines of rank's log without C++ stack traces, unless it ends with the one line already
    shown."""
    lines = []
    for log in (rundir.early_log(rank), rundir.rank_log(rank)):
        tail = log_tail(log, 8)
        if tail and tail[-1].strip() != f"ddprun: {summary}":
            lines.append(f"  last lines of {os.path.relpath(log)}:")
            lines.extend(f"    [rank{rank}] {line}" for line in tail)
    return lines


def summary(local: Mapping[int, fr.FailureRecord], known: Iterable[fr.FailureRecord], rundir: RunDir,
            host: str, followed: Iterable[int] = (0,)) -> str:
    """The console's account of a failed job on this node (module docstring).

    ``known``: every record this agent read (other nodes' too); ``followed``: ranks whose output the
    console already showed (their log tail is not repeated)."""
    cause = fr.root_cause([*known, *local.values()])
    lines: list[str] = []
    if cause is not None:
        lines.append(f"ddprun: the job failed: {cause.headline()}")
        if cause.hint:
            lines.append(f"HINT: {cause.hint}")
        if cause.rank in local and cause.rank not in followed and cause.kind != fr.MISMATCH:
            lines.extend(_tail(rundir, cause.rank, cause.summary))
    groups: dict[tuple[str, str], list[fr.FailureRecord]] = {}
    stopped: list[int] = []
    for rank, rec in sorted(local.items()):
        if cause is not None and rank == cause.rank:
            continue
        if rec.is_echo:
            stopped.append(rank)
        else:
            groups.setdefault((rec.how(), rec.summary), []).append(rec)
    for (how, text), members in groups.items():
        pl = "s" if len(members) > 1 else ""
        local_ranks = _ranks([m.local_rank for m in members])
        same = cause is not None and text == cause.summary and how == cause.how()
        lines.append(f"ddprun: rank{pl} {_ranks([m.rank for m in members])} (local rank{pl} {local_ranks} on {host}) "
                     f"{how}" + (" alike" if same else (f": {text}" if text else "")))
    if stopped:
        because = "because of it" if cause is not None else "because of the failure above"
        lines.append(f"ddprun: rank(s) {_ranks(stopped)} on {host} were stopped {because}.")
    lines.append("ddprun: the job failed.")
    return "\n".join(lines)
