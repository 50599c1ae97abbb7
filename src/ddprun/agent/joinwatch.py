"""Join progress while the rendezvous waits for nodes: who joined, how many are missing, how long.

A thread in the launcher reads the c10d rendezvous state torch keeps in the endpoint's TCP store
(key ``torch.rendezvous.<run id>``: base64 of torch's pickled ``_RendezvousState``, which torch's
own handler unpickles the same way) every few seconds and prints one line, e.g.
``ddprun: 1/2 nodes joined (node-a pid 4242); waiting up to 120 s (114 s left)``. It stops when this
node's workers start. It only reads, except for one key: as soon as the store answers, it claims
the endpoint for this job (guard.py) and ends this node's agent if another job holds it. The
rendezvous itself is torch's. If the state cannot be read
(another torch version, static rendezvous) the line says so and the launch goes on unchanged.
"""

from __future__ import annotations

import base64
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:  # annotations only: torch.distributed is imported where the store is made
    from torch.distributed import TCPStore


@dataclass
class JoinSnapshot:
    reachable: bool = False
    joined: list[str] = field(default_factory=list)
    """One ``host pid N`` per node that joined the current round."""
    complete: bool = False


def describe_state(state) -> JoinSnapshot:
    """The nodes in a torch ``_RendezvousState`` (participants, then the wait list)."""
    nodes = list(getattr(state, "participants", {}).keys()) + list(getattr(state, "wait_list", ()))
    return JoinSnapshot(reachable=True, joined=[f"{n.addr} pid {n.pid}" for n in nodes],
                        complete=bool(getattr(state, "complete", False)))


class JoinWatcher:
    """Prints join progress for a c10d rendezvous until :meth:`stop` (called when workers start)."""

    def __init__(self, host: str, port: int, run_id: str, token: str, nnodes: int, join_timeout: float,
                 out: TextIO, interval_s: float = 3.0):
        self._run_id, self._token = run_id, token
        self.refused: str | None = None
        self._host, self._port, self._key = host, port, "torch.rendezvous." + run_id
        self._nnodes, self._timeout, self._out, self._interval = nnodes, join_timeout, out, interval_s
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self.last = JoinSnapshot()
        self._store: TCPStore | None = None
        self._thread = threading.Thread(target=self._loop, name="ddprun-join-watch", daemon=True)

    def start(self) -> JoinWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _read(self) -> JoinSnapshot:
        from torch.distributed import TCPStore

        if self._store is None:
            self._store = TCPStore(self._host, self._port, is_master=False, wait_for_workers=False,
                                   timeout=timedelta(seconds=2))
        if not self._store.check([self._key]):
            return JoinSnapshot(reachable=True)
        raw = self._store.get(self._key)
        return describe_state(pickle.loads(base64.b64decode(raw)))  # noqa: S301 - torch's own format

    def line(self, snap: JoinSnapshot) -> str:
        left = max(0, int(self._timeout - (time.monotonic() - self._t0)))
        if not snap.reachable:
            return (f"ddprun: rendezvous host {self._host}:{self._port} not reachable yet (has the node that hosts it "
                    f"started?); waiting up to {self._timeout:.0f} s ({left} s left)")
        who = ", ".join(snap.joined) if snap.joined else "none"
        return (f"ddprun: {len(snap.joined)}/{self._nnodes} nodes joined ({who}); waiting up to "
                f"{self._timeout:.0f} s ({left} s left)")

    def _claim(self) -> bool:
        """Claim the endpoint's store for this job as soon as it answers; False when refused."""
        from ddprun.protocol.store import claim, refusal

        other = claim(self._store, self._run_id, self._token)
        if other is None:
            return True
        self.refused = refusal(f"{self._host}:{self._port}", other, self._run_id)
        self._out.write(self.refused + "\n")
        self._out.flush()
        # End this node's agent before its join completes: torch turns SIGTERM into SignalException.
        os.kill(os.getpid(), signal.SIGTERM)
        return False

    def _loop(self) -> None:
        claimed = False
        next_line = time.monotonic() + self._interval
        while not self._stop.wait(0.2 if not claimed else 0.5):
            try:
                snap = self._read()
                if not claimed:
                    if not self._claim():
                        return
                    claimed = True
            except Exception:  # noqa: BLE001 - unreachable, or a state this torch cannot read
                self._store = None
                # a read that fails after the store answered (a slow moment, the rendezvous closing at its
                # timeout) keeps what was seen: the store was reachable, its last state is the best word
                snap = self.last if self.last.reachable else JoinSnapshot(reachable=False)
            if self._stop.is_set() or snap.complete:
                return
            # at the join timeout torch withdraws this node from the state before it raises: an empty
            # state right after a non-empty one is that, not "no node joined"
            if snap.joined or not self.last.joined:
                self.last = snap
            if time.monotonic() >= next_line:
                next_line += self._interval
                self._out.write(self.line(snap) + "\n")
                self._out.flush()

    def timeout_message(self) -> str:
        snap = self.last
        if not snap.reachable:
            return f"the rendezvous host {self._host}:{self._port} was never reachable from this node"
        missing = self._nnodes - len(snap.joined)
        who = ", ".join(snap.joined) or "no node"
        return f"{len(snap.joined)}/{self._nnodes} nodes joined ({who}); {missing} missing"
