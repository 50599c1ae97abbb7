"""Join progress while the rendezvous waits for nodes: who joined, how many are missing, how long.

A thread in the launcher announces this node in the endpoint's store (``ddprun/joining/<k>``: JSON
host, pid and a beat it advances every poll; protocol/store.py) and reads every node's entry, then
prints one line every few seconds, e.g.
``ddprun: 1/2 nodes joined (node-a pid 4242); waiting up to 120 s (114 s left)``: the nodes whose
beat moved within the last 10 s (a node that started its workers, or died, stops beating). It stops
when this node's workers start. Nothing read here is a pickle (torch's rendezvous state is one).
When the job's round completes without this node (it started with the job and was not taken in:
two launches raced for one job's places), it says so and ends this node's agent (agent/admission.py
:func:`~ddprun.agent.admission.left_out`), unless the job is elastic with room for it.
The rendezvous itself is torch's.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TextIO

from ddprun.protocol.defaults import JOIN_PROGRESS_S

if TYPE_CHECKING:  # annotations only: torch.distributed is imported where the store is made
    from torch.distributed import TCPStore

    from ddprun.agent.admission import Newcomer


@dataclass
class JoinSnapshot:
    reachable: bool = False
    joined: list[str] = field(default_factory=list)
    """One ``host pid N`` per node that joined the current round."""


STALE_S = 10.0
"""A joining node whose beat has not moved for this long is not counted (gone, or started)."""


def joining_entries(store: TCPStore) -> dict[str, bytes]:
    """Every node's ``ddprun/joining/<k>`` entry (one batched read)."""
    from ddprun.protocol import store as keys

    n = int(store.add(keys.JOINING_COUNT_KEY, 0))
    names = [keys.joining_key(k) for k in range(1, n + 1)]
    present = [k for k in names if store.check([k])]
    return dict(zip(present, store.multi_get(present))) if present else {}


def describe_entry(raw: bytes) -> str | None:
    """``host pid N`` of one waiting node's entry; None for a node that started its workers, or a
    malformed value (skipped, never trusted)."""
    try:
        data = json.loads(raw)
        return None if data.get("started") else f"{str(data['host'])} pid {int(data['pid'])}"
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


class JoinWatcher:
    """Prints join progress for a c10d rendezvous until :meth:`stop` (called when workers start)."""

    def __init__(self, host: str, port: int, run_id: str, me: Newcomer, nnodes: int, join_timeout: float,
                 out: TextIO, agent: tuple[str, int], interval_s: float = JOIN_PROGRESS_S, stale_s: float = STALE_S,
                 hosted: bool = False):
        """``hosted``: this agent hosts the endpoint's store; left out, it keeps serving it (below)."""
        self._hosted = hosted
        self._run_id, self._me, self._agent = run_id, me, agent
        self.refused: str | None = None
        self._host, self._port = host, port
        self._entry: str | None = None
        self._beat = 0
        self._stale_s = stale_s
        self._seen: dict[str, tuple[bytes, float]] = {}
        """entry key -> (its last value, when it last changed), by this watcher's clock."""
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
        from ddprun.agent.admission import client
        from ddprun.protocol import store as keys

        if self._store is None:
            self._store = client(self._host, self._port, timeout_s=2.0)
        if self._entry is None:
            self._entry = keys.joining_key(int(self._store.add(keys.JOINING_COUNT_KEY, 1)))
        self._beat += 1
        self._store.set(self._entry, json.dumps({"host": self._agent[0], "pid": self._agent[1], "beat": self._beat}))
        now, joined = time.monotonic(), []
        for key, raw in joining_entries(self._store).items():
            value, since = self._seen.get(key, (b"", now))
            if raw != value:
                self._seen[key] = (raw, now)
            elif now - since > self._stale_s:
                continue
            who = describe_entry(raw)
            if who is not None:
                joined.append(who)
        return JoinSnapshot(reachable=True, joined=joined)

    def line(self, snap: JoinSnapshot) -> str:
        left = max(0, round(self._timeout - (time.monotonic() - self._t0)))  # nearest: 3.0 s into 8 is 5 s left
        if not snap.reachable:
            from ddprun.agent.admission import unreachable_line

            return unreachable_line(f"{self._host}:{self._port}", self._timeout, left)
        who = ", ".join(snap.joined) if snap.joined else "none"
        return (f"ddprun: {len(snap.joined)}/{self._nnodes} nodes joined ({who}); waiting up to "
                f"{self._timeout:.0f} s ({left} s left)")

    def _admitted(self) -> bool:
        """False (and this node's agent ended) when the job's round completed without this node and
        the job cannot take it in (agent/admission.py)."""
        from ddprun.agent.admission import job_alive, left_out, refusal_reason, refusal_text

        out = left_out(self._store, *self._agent)
        reason = refusal_reason(out[0], -1) if out is not None else None
        if out is None or reason is None or not job_alive(self._store, out[0]):
            return True  # a node of that round is gone: the job re-forms, with this node in it
        self.refused = "ddprun: error: " + refusal_text(out[0], reason, self._me.endpoint, out[1], time.time())
        if self._hosted:  # the job's store lives in this process: ending it would end the job it refuses
            self.refused += ("\nddprun: this node hosts the store of that job: it serves it until the job ends "
                             "(torch then closes the rendezvous and this launcher exits 1).")
        self._out.write(self.refused + "\n")
        self._out.flush()
        if not self._hosted:
            # End this node's agent: torch turns SIGTERM into SignalException (agent/run.py ending()).
            os.kill(os.getpid(), signal.SIGTERM)
        return False

    def _loop(self) -> None:
        next_line = time.monotonic() + self._interval
        while not self._stop.wait(0.5):
            try:
                snap = self._read()
            except Exception:  # noqa: BLE001 - unreachable, or a state this torch cannot read
                self._store = None
                # a read that fails after the store answered (a slow moment, the rendezvous closing at its
                # timeout) keeps what was seen: the store was reachable, its last state is the best word
                snap = self.last if self.last.reachable else JoinSnapshot(reachable=False)
            try:
                if self._store is not None and not self._stop.is_set() and not self._admitted():
                    return
            except Exception:  # noqa: BLE001 - the store went away: the next round asks again
                self._store = None
            if self._stop.is_set():
                break
            # at the join timeout torch withdraws this node from the state before it raises: an empty
            # state right after a non-empty one is that, not "no node joined"
            if snap.joined or not self.last.joined:
                self.last = snap
            if time.monotonic() >= next_line:
                next_line += self._interval
                self._out.write(self.line(snap) + "\n")
                self._out.flush()
        self._mark_started()

    def _mark_started(self) -> None:
        """This node's entry says it is no longer waiting (another node's watcher stops counting it)."""
        try:
            if self._store is not None and self._entry is not None:
                self._store.set(self._entry, json.dumps({"host": self._agent[0], "pid": self._agent[1],
                                                         "beat": self._beat, "started": True}))
        except Exception:  # noqa: BLE001 - the store went away: the entry goes stale by itself
            pass

    def timeout_message(self) -> str:
        snap = self.last
        if not snap.reachable:
            return f"the rendezvous host {self._host}:{self._port} was never reachable from this node"
        missing = self._nnodes - len(snap.joined)
        who = ", ".join(snap.joined) or "no node"
        return f"{len(snap.joined)}/{self._nnodes} nodes joined ({who}); {missing} missing"
