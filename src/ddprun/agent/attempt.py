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
import time
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: torch.distributed is imported where the store is made
    from torch.distributed import TCPStore


def rendezvous_round(store, run_id: str) -> int:
    """The round in torch's c10d rendezvous state (key ``torch.rendezvous.<run id>``, base64 of a
    pickled ``_RendezvousState``; torch's own backend reads it the same way, see joinwatch.py)."""
    import base64
    import pickle

    key = "torch.rendezvous." + run_id
    if not store.check([key]):  # get() would wait for it until the store's timeout
        raise KeyError(f"no rendezvous state under {key}")
    state = pickle.loads(base64.b64decode(store.get(key)))  # noqa: S301 - torch's format
    return int(state.round)


class AttemptIds:
    """Launcher side: the attempt id to give the workers each time this agent starts them."""

    def __init__(self, backend: str, host: str, port: int, run_id: str, wait_s: float = 10.0):
        self._backend, self._host, self._port, self._run_id = backend, host, port, run_id
        self._wait_s = wait_s
        self._store: TCPStore | None = None

    def _read_round(self) -> int:
        from torch.distributed import TCPStore

        if self._store is None:
            self._store = TCPStore(self._host, self._port, is_master=False, wait_for_workers=False,
                                   timeout=timedelta(seconds=5))
        return rendezvous_round(self._store, self._run_id)

    def current(self, restart_count: int | str) -> str:
        """``r<round>`` under c10d; ``c<restart count>`` otherwise, or if the state cannot be read (then
        a line in the agent log: nodes that disagree would not meet in init_process_group)."""
        if self._backend != "c10d":
            return f"c{restart_count}"
        deadline = time.monotonic() + self._wait_s
        while True:
            try:
                return f"r{self._read_round()}"
            except Exception as e:  # noqa: BLE001 - another torch's state, or the store briefly away
                self._store = None
                if time.monotonic() >= deadline:
                    print(f"ddprun: could not read the rendezvous round ({type(e).__name__}: {e}); the attempt id "
                          f"falls back to the restart count c{restart_count}", file=sys.stderr, flush=True)
                    return f"c{restart_count}"
                time.sleep(0.2)
