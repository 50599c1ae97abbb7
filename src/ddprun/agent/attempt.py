"""One id per attempt of the worker group, the same on every node, and a store namespace per attempt.

Why: torch's c10d rendezvous (with TCP store sharing, torch's default) keeps ONE store server for
the whole job, created by the first group-rank-0 agent and reused by every later round
(``DynamicRendezvousHandler._shared_tcp_store_server``). Workers reach it through
``init_process_group(init_method="env://")``, whose handler returns that store with no per-attempt
prefix (``torch/distributed/rendezvous.py::_create_c10d_store``: "We create a new TCPStore for
every retry", true only without sharing). So after a restart, the new workers' gloo/NCCL setup reads
the previous attempt's keys (``default_pg/0//cpu//0/<rank>``: the addresses of dead workers):
"Gloo connectFullMesh failed ... Connection refused", or a hang on stale counters. Measured with
plain torchrun 2.13, 2 nodes x 2, gloo, one worker SIGKILLed: ``--max-restarts`` never recovered.

The fix here keeps the shared store (ddprun's job channel lives in it: the rank table, preflight,
failures and stall reports must outlive any worker) and gives every attempt its own key space:
:func:`namespace_process_groups` wraps torch's registered ``env``/``tcp`` rendezvous handlers so the
store they return is a ``PrefixStore("ddprun/<run id>/<attempt>/pg", store)``. The alternative,
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, makes worker rank 0 host a new store per attempt: it
recovers too, but the store then dies with rank 0 (no failure report survives it), the job channel
would have to wait for user code to create it, and it made exit aborts more frequent (measured: 3 of
22 healthy 2 x 2 runs aborted at exit with it, 0 of 22 without).

The attempt id must be the same on every node. TORCHELASTIC_RESTART_COUNT is not: an agent that
restarts its workers because another node re-joined (a membership change) does not count it. The
c10d rendezvous round is: every new worker group is a new round, numbered in the rendezvous state
that all agents share. The launcher reads it (:class:`AttemptIds`) once per worker-group start,
while this agent is a participant of that round (so the round cannot move on), and passes it to
the workers as ``DDPRUN_ATTEMPT=r<round>``. Other rendezvous backends (static) have no membership
changes, so ``c<restart count>`` is the same everywhere there.
"""

from __future__ import annotations

import sys
from typing import Any


def handler_round(handler: Any) -> int | None:
    """The round of the rendezvous this agent just completed, from torch's c10d handler in this
    process (None where another backend or torch keeps no such state)."""
    try:
        return int(handler._state_holder.state.round)
    except (AttributeError, TypeError, ValueError):
        return None


class AttemptIds:
    """Launcher side: the attempt id to give the workers each time this agent starts them."""

    def __init__(self, backend: str):
        self._backend = backend
        self.round: int | None = None
        """Set by the agent after each rendezvous (:func:`handler_round`)."""

    def set_round(self, round_: int | None) -> None:
        self.round = round_

    def current(self, restart_count: int | str) -> str:
        """``r<round>`` under c10d; ``c<restart count>`` otherwise, or if the round is unknown (then a
        line in the agent log: nodes that disagree would not meet in init_process_group)."""
        if self._backend != "c10d":
            return f"c{restart_count}"
        if self.round is None:
            print(f"ddprun: the rendezvous round is unknown (another torch?); the attempt id falls back to the "
                  f"restart count c{restart_count}", file=sys.stderr, flush=True)
            return f"c{restart_count}"
        return f"r{self.round}"
