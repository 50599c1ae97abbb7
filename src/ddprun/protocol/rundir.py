"""Every file of a run, named once: ``runs/<run id>/`` and what the agent, the workers, fit and the
report write there. Pure paths; nothing here creates or reads a file.

    plan.json            the rank table after rendezvous (rank 0)
    preflight.json       every node's preflight facts and the findings (rank 0)
    logs/rank-N.log      rank N's stdout+stderr; rank-N.attempt-A.log for an earlier attempt A (its
                         job-wide id: r<round>, c<restart>), rank-N.attempt-K.log (K = 0, 1, ...) for
                         one of an attempt the node that kept it did not run
    logs/rank-N.early.log  what rank N printed before joining stderr to stdout (usually removed)
    logs/rank-N.error.json torch's error file of rank N (its last error, written by the worker)
    logs/agent-HOST.log  torch's agent chatter and C++ warnings of the node HOST
    failures/rank-N.json the failure record of rank N (protocol/failure.py), by the worker or its agent
    stacks/rank-N.txt    every thread's stack of rank N at a stall; stacks/hang-report.txt the report
    stacks/rank-N-loader-PID.txt  every thread's stack of a DataLoader worker of rank N that waits in data loading
    stacks/fr-rank-N.json rank N's Flight Recorder trace at a stall (its collectives, worker/collectives.py)
    logs/nccl-trace-rank-N NCCL's own Flight Recorder dump when a collective times out
    result-N.pkl         ddprun.launch: rank N's return value that did not load in the launcher, kept
    metrics.csv · timings.csv · events.jsonl · checkpoints/ · report.html
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass


def new_run_id() -> str:
    """A fresh run id: ``YYYYmmdd-HHMMSS-<6 hex>`` (sortable, unique enough for one user's runs)."""
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


@dataclass(frozen=True)
class RunDir:
    """The run directory at ``path`` (absolute) and the name of every file in it."""

    path: str

    def join(self, *parts: str) -> str:
        return os.path.join(self.path, *parts)

    @property
    def logs(self) -> str:
        return self.join("logs")

    def rank_log(self, rank: int | str) -> str:
        return self.join("logs", f"rank-{rank}.log")

    def attempt_log(self, rank: int | str, attempt: int | str) -> str:
        return self.join("logs", f"rank-{rank}.attempt-{attempt}.log")


    def early_log(self, rank: int | str) -> str:
        return self.join("logs", f"rank-{rank}.early.log")

    def error_file(self, rank: int | str) -> str:
        return self.join("logs", f"rank-{rank}.error.json")

    def agent_log(self, host: str) -> str:
        return self.join("logs", f"agent-{host}.log")

    @property
    def failures(self) -> str:
        return self.join("failures")

    def failure_record(self, rank: int | str) -> str:
        return self.join("failures", f"rank-{rank}.json")

    @property
    def stacks(self) -> str:
        return self.join("stacks")

    def stack_file(self, rank: int | str) -> str:
        return self.join("stacks", f"rank-{rank}.txt")

    def loader_stack_prefix(self, rank: int | str) -> str:
        """``stacks/rank-N-loader``: rank N keeps what its DataLoader worker answered a hang report
        (every thread's stack) in ``<prefix>-<pid>.txt``."""
        return self.join("stacks", f"rank-{rank}-loader")

    def flight_recorder_file(self, rank: int | str) -> str:
        return self.join("stacks", f"fr-rank-{rank}.json")

    @property
    def hang_report(self) -> str:
        return self.join("stacks", "hang-report.txt")

    @property
    def plan_json(self) -> str:
        return self.join("plan.json")

    @property
    def preflight_json(self) -> str:
        return self.join("preflight.json")

    @property
    def metrics_csv(self) -> str:
        return self.join("metrics.csv")

    @property
    def timings_csv(self) -> str:
        return self.join("timings.csv")

    @property
    def events_jsonl(self) -> str:
        return self.join("events.jsonl")

    @property
    def checkpoints(self) -> str:
        return self.join("checkpoints")

    @property
    def report_html(self) -> str:
        return self.join("report.html")


def rank_log_name(rank: int | str, attempt: str = "") -> str:
    """Rank ``rank``'s log, as a console line names it (relative to the run dir): of ``attempt``, the
    name it has once its node's next start moved it aside (agent/logs.py keep_as_attempt); without an
    attempt, the live log."""
    return f"logs/rank-{rank}.attempt-{attempt}.log" if attempt else f"logs/rank-{rank}.log"
