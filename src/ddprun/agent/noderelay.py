"""The node store: the agent's channel with its own workers, so that the job's store hears from each
node, not from each rank (keys: protocol/store.py, "node store").

The agent hosts a TCPStore on 127.0.0.1 and gives its address to its workers (DDPRUN_NODE_STORE).
A worker's monitor (worker/monitor.py) writes its progress count and timing windows there and reads
the job's alarm counter from there; the agent's failure thread (agent/failures.py) calls this relay:

* each half second :meth:`NodeRelay.mirror`: the job's alarm as the agent just read it, with a beat,
  and the failure records, the preemption request and the stall request it had read then (when
  they changed), so that a rank learns what the alarm announced on its node: no rank reads them
  in the job's store while its relay beats;
* each second :meth:`NodeRelay.progress`: every local rank's count, which goes into the agent's
  heartbeat record in the job store (one write a node);
* :meth:`NodeRelay.timings`: the local ranks' timing windows, one record a node, when they changed;
* :meth:`NodeRelay.mark_stopping`: the agent signals its workers now, not for a preemption;
* :meth:`NodeRelay.left`: the records of local ranks another rank's failure stopped, which the agent
  writes into the job store in one batch and acknowledges for them (4 calls a node, not 4 a rank).

A failing worker also hands its failure record over there (``own-failure/<rank>``), and the agent
reads it when that worker ends (:meth:`NodeRelay.own_record`): the copy that neither a full disk (the
error file) nor the job store's host ending first (the job's copy) can take away.

So a job of N nodes x P processes costs the job's store about 5 calls a node a second, where every
rank's own polling cost about 4.2 a rank (`benchmarks/control_plane.py --no-node-store`). A worker
whose relay stops beating talks to the job store itself (defaults.RELAY_STALE_S), as before: a
frozen agent never hides a node's progress.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from ddprun.protocol import failure as fr
from ddprun.protocol.store import Announced, Keys, announced_value, present, read_counter, relay_value, relayable, relayed_value

NODE_HOST = "127.0.0.1"


class NodeRelay:
    """One per agent, for the whole launch; only the agent's failure thread calls its reads and writes
    (:meth:`own_record`, a read of one key, and :meth:`mark_stopping`, a write of one, are called from
    torch's agent thread too, and :meth:`left` and :meth:`forwarded` from the main thread's linger,
    under the agent's forward lock)."""

    def __init__(self, server: Any = None):
        """``server``: a store to use instead of a new one on 127.0.0.1 (tests, benchmarks)."""
        if server is None:  # on loopback only: a TCPStore server of its own listens on every interface
            from ddprun.agent.endpoint import bound_server

            server = bound_server(NODE_HOST, 0, 10.0)
        self._store = server
        self.address = f"{NODE_HOST}:{getattr(server, 'port', 0)}"
        self._lock = threading.Lock()
        self._keys: Keys | None = None
        self._ranks: list[int] = []
        self._sent: dict[int, Any] = {}
        self._causes_sent: tuple[Keys | None, str] = (None, "")
        self._announced_sent: tuple[Keys | None, str] = (None, "")
        self._left_read = 0
        self._forwarded: set[int] = set()

    def begin(self, keys: Keys, ranks: list[int]) -> None:
        """A worker group (re)started: its attempt's keys and this node's global ranks."""
        with self._lock:
            self._keys, self._ranks, self._sent = keys, sorted(ranks), {}
            self._left_read, self._forwarded = 0, set()

    def _current(self) -> tuple[Keys | None, list[int]]:
        with self._lock:
            return self._keys, list(self._ranks)

    def mirror(self, beat: int, alarm: int, records: list[fr.FailureRecord] | None = None,
               keys: Keys | None = None, announced: Announced | None = None) -> None:
        """Tell the local workers the job's alarm, and that this relay is alive (one local write);
        before it, ``records`` (the failure records read with that alarm) and ``announced`` (the
        preemption and stall requests read with it), each when it changed. ``keys``: the attempt
        they were read in; when another attempt began since, nothing is written (an ended
        attempt's records must never stand under a new attempt's keys)."""
        current, _ = self._current()
        keys = keys or current
        if keys is None or keys is not current:
            return
        raw = relayed_value(relayable(records)) if records else ""
        if raw and (self._causes_sent[0] is not keys or self._causes_sent[1] != raw):
            self._store.set(keys.relayed_causes, raw)
            self._causes_sent = (keys, raw)
        said = announced_value(announced) if announced is not None else ""
        if said and (self._announced_sent[0] is not keys or self._announced_sent[1] != said):
            self._store.set(keys.relayed_announced, said)
            self._announced_sent = (keys, said)
        self._store.set(keys.relay, relay_value(beat, alarm))

    def progress(self) -> dict[int, int]:
        """rank -> progress count of the local ranks that published one (malformed values skipped)."""
        keys, ranks = self._current()
        if keys is None:
            return {}
        found = present(self._store, [keys.progress(r) for r in ranks])
        out = {}
        for key, raw in zip(found, self._store.multi_get(found) if found else []):
            try:
                out[int(key.rsplit("/", 1)[1])] = int(raw)
            except ValueError:
                continue
        return out

    def timings(self) -> dict[int, Any] | None:
        """rank -> latest timing window of the local ranks, when one changed since the last call that
        returned them; else None (nothing new to send)."""
        keys, ranks = self._current()
        if keys is None:
            return None
        found = present(self._store, [keys.timing(r) for r in ranks])
        got: dict[int, Any] = {}
        for key, raw in zip(found, self._store.multi_get(found) if found else []):
            try:
                got[int(key.rsplit("/", 1)[1])] = json.loads(raw)
            except ValueError:
                continue
        with self._lock:
            if not got or got == self._sent or keys is not self._keys:
                return None
            self._sent = got
        return got

    def left(self, keys: Keys, every: bool = False) -> tuple[int, list[fr.FailureRecord]]:
        """(count, records): the stopped records local ranks left for their agent to forward
        (worker/channel.py leave_to_agent) and not marked :meth:`forwarded` yet; one local read while
        the ``left`` counter has not moved, unless ``every`` (the agent's last chance, at its end:
        a rank whose count did not arrive, on a node too loaded to finish it within its bound, has
        its record here all the same). Malformed values and records that are not echoes are left
        out (the ranks that wrote them recorded nothing else: they still show in this node's
        summary, from their error files)."""
        with self._lock:
            if keys is not self._keys:
                return 0, []
            read, todo = self._left_read, [r for r in self._ranks if r not in self._forwarded]
        n = read_counter(self._store, keys.lefts)  # not add(.., 0): a value not a number would close the client
        if n is None:  # not a number: the count says nothing, the records are read
            n, every = read, True
        if (n == read and not every) or not todo:
            return n, []
        found = present(self._store, [keys.left(r) for r in todo])
        parsed = fr.parse_many(self._store.multi_get(found)) if found else []
        return n, [rec for rec in parsed if rec.is_echo and rec.rank in todo]

    def forwarded(self, keys: Keys, count: int, ranks: list[int]) -> None:
        """:meth:`left`'s records of ``ranks`` are in the job store, and the counter was ``count``."""
        with self._lock:
            if keys is self._keys:
                self._left_read = max(self._left_read, count)
                self._forwarded.update(ranks)

    def own_record(self, rank: int) -> fr.FailureRecord | None:
        """The failure record this node's rank ``rank`` (global) handed over as it failed
        (worker/channel.py record_failure), if any; a malformed one is None. Any thread may call this."""
        keys, _ = self._current()
        if keys is None or not self._store.check([keys.own_failure(rank)]):
            return None
        parsed = fr.parse_many([self._store.get(keys.own_failure(rank))])
        return parsed[0] if parsed else None

    def mark_stopping(self, node: int, why: str = "1") -> None:
        """This agent signals its workers now (a failure, a restart, a lost job store): a signal that
        reaches them is not a preemption request. Their signal thread reads this first (worker/signals.py),
        so a job store that stopped answering never delays their end. ``why``: the mark's value
        (FailureTracker.mark_stopping). Any thread; best effort."""
        keys, _ = self._current()
        if keys is None or self._store is None:
            return
        try:
            self._store.set(keys.stopping(node), why)
        except Exception:  # noqa: BLE001 - the workers then ask the job store, as without a node store
            pass

    def close(self) -> None:
        """Let the server go (ddprun.launch runs its agent in the caller's process)."""
        self._store = None
