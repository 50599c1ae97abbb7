"""Join progress while the rendezvous waits for nodes: who joined, how many are missing, how long.

A thread in the launcher announces this node in the endpoint's store (``ddprun/joining/<k>``: JSON
host, pid and a beat it advances every second; protocol/store.py) and, for each line it prints every
few seconds, reads every waiting node's entry, e.g.
``ddprun: 1/2 nodes joined (node-a pid 4242); waiting up to 120 s (114 s left)``: the nodes whose
beat moved within the last 10 s (a node that started its workers, or died, stops beating). It stops
when this node's workers start. Nothing read here is a pickle (torch's rendezvous state is one).

The endpoint's store also serves torch's rendezvous, and at 1,000 nodes every node waits at once: a
node's calls per second stay the same whatever the job's size (a beat and the refusal check each
second; every few seconds one batched read of the entries, none of a node that has started, and one
check for a node refused for its ``--nnodes``, which a line then names), and a line names at most
:data:`NAMES_SHOWN` nodes. ``benchmarks/join_watch.py`` measures it.
When the job's round completes without this node (it started with the job and was not taken in:
two launches raced for one job's places), it says so and ends this node's agent (agent/admission.py
:func:`~ddprun.agent.admission.left_out`), unless the job is elastic with room for it. Where the job's
record cannot tell, a node still waiting well past its join timeout (:func:`stranded_after`) is ended
the same way: torch would keep it in its redundancy list, which has no deadline.
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

from ddprun.protocol.defaults import JOIN_PROGRESS_S, TORCH_KEEP_ALIVE_INTERVAL_S, TORCH_KEEP_ALIVE_MAX_ATTEMPT

if TYPE_CHECKING:  # annotations only: torch.distributed is imported where the store is made
    from torch.distributed import TCPStore

    from ddprun.agent.admission import Newcomer


@dataclass
class JoinSnapshot:
    reachable: bool = False
    joined: list[str] = field(default_factory=list)
    """One ``host pid N`` per node that joined the current round (the first NAMES_SHOWN, from a summary)."""
    count: int | None = None
    """The nodes that joined, where ``joined`` names only some of them; None: ``len(joined)``."""

    @property
    def nodes(self) -> int:
        return len(self.joined) if self.count is None else self.count


STALE_S = 10.0
"""A joining node whose beat has not moved for this long is not counted (gone, or started)."""
POLL_S = 1.0
"""Seconds between this node's beats (and checks that the job's round left it out)."""
NAMES_SHOWN = 8
"""Nodes a line names; the rest are counted (``... and 992 more``)."""
TORCH_ROLLBACK_S = 5.0
"""torch's join goes on this long past its deadline (withdrawing the node), then raises."""
STRANDED_SLACK_S = 15.0
"""This watcher starts before torch's join does (torch's agent connects to the store first): the gap."""
SUMMARY_STALE_INTERVALS = 2
"""A summary whose number has not moved for this many line intervals (and a poll) is not used: its
writer has started its workers, or stopped."""


@dataclass
class Entries:
    """What a watcher knows of the ``ddprun/joining/<k>`` keys between its reads."""

    counted: int = 0
    """Entries the counter had given out at the last read."""
    present: list[str] = field(default_factory=list)
    """Keys set whose node had not started its workers (a started node's entry never changes again)."""
    pending: list[str] = field(default_factory=list)
    """Keys counted but not set yet: a node between its counter and its first write, or dead there."""


def joining_entries(store: TCPStore, known: Entries | None = None) -> dict[str, bytes]:
    """Every waiting node's ``ddprun/joining/<k>`` entry, in a few calls whatever the count of nodes:
    the counter, whether the keys counted since the last read are set (one call when they all are:
    protocol/store.py ``present``), one batched read. ``known`` carries what earlier reads learnt
    (None: a first read)."""
    from ddprun.protocol import store as keys

    known = known if known is not None else Entries()
    # not add(.., 0): a value that is not a number would close the client (another program's key)
    n = keys.read_counter(store, keys.JOINING_COUNT_KEY)
    n = known.counted if n is None else n
    counted = known.pending + [keys.joining_key(k) for k in range(known.counted + 1, n + 1)]
    known.counted = max(n, known.counted)
    ready = set(keys.present(store, counted))
    known.present += [k for k in counted if k in ready]
    known.pending = [k for k in counted if k not in ready]
    out = dict(zip(known.present, store.multi_get(known.present))) if known.present else {}
    # a started node's entry never changes again (nor does a malformed one count): not read again
    known.present = [k for k in known.present if describe_entry(out[k]) is not None]
    return out


def parse_summary(raw: bytes) -> tuple[int, int, list[str]] | None:
    """(seq, count, names) of the store's host's summary; None once its watcher ended, or for a
    malformed one (never trusted)."""
    try:
        data = json.loads(raw)
        if data.get("ended"):
            return None
        names = [str(x) for x in data["joined"]][:NAMES_SHOWN]
        return int(data["seq"]), max(int(data["count"]), len(names)), names
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def describe_entry(raw: bytes) -> str | None:
    """``host pid N`` of one waiting node's entry; None for a node that started its workers, or a
    malformed value (skipped, never trusted)."""
    try:
        data = json.loads(raw)
        return None if data.get("started") else f"{str(data['host'])} pid {int(data['pid'])}"
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def names(joined: list[str], count: int) -> str:
    """The first :data:`NAMES_SHOWN` of ``joined``, and how many more of ``count``."""
    shown = joined[:NAMES_SHOWN]
    return ", ".join(shown) + (f", ... and {count - len(shown)} more" if count > len(shown) else "")


def stranded_after(join_timeout: float, keep_alive_s: float) -> float:
    """Seconds after which a node whose workers have not started was not taken in: torch's join has
    passed its deadline and rollback, and waits on only in its redundancy list (a round full without
    this node), which has no deadline. ``keep_alive_s`` (interval x attempts) is added: a full round's
    dead node is dropped that long after its last keep-alive, and the node waiting then (its relaunch)
    gets a new deadline."""
    return join_timeout + TORCH_ROLLBACK_S + keep_alive_s + STRANDED_SLACK_S


REFUSAL_NEWS_S = 30.0
"""A --nnodes refusal written this long before a watcher started (by the hosts' clocks, which may
differ by seconds) is not said: that node came and went before this one."""


def _written_at(raw: bytes) -> float:
    """When a refusal record says it was written (wall clock); +inf when it does not say."""
    try:
        t = json.loads(raw).get("t")
        return float(t) if isinstance(t, (int, float)) else float("inf")
    except (ValueError, AttributeError):
        return float("inf")


class JoinWatcher:
    """Prints join progress for a c10d rendezvous until :meth:`stop` (called when workers start)."""

    def __init__(self, host: str, port: int, run_id: str, me: Newcomer, nnodes: int, join_timeout: float,
                 out: TextIO, agent: tuple[str, int], interval_s: float = JOIN_PROGRESS_S, stale_s: float = STALE_S,
                 hosted: bool = False, min_nodes: int | None = None, stranded_s: float | None = None):
        """``nnodes``: the job's most nodes, ``min_nodes`` its fewest (None: ``nnodes``, not elastic);
        ``hosted``: this agent hosts the endpoint's store; left out, it keeps serving it (below);
        ``stranded_s``: after it this node, still waiting, was not taken in (:func:`stranded_after`;
        None: with torch's default keep-alive)."""
        self._hosted = hosted
        keep_alive_s = TORCH_KEEP_ALIVE_INTERVAL_S * TORCH_KEEP_ALIVE_MAX_ATTEMPT
        self._stranded_s = stranded_after(join_timeout, keep_alive_s) if stranded_s is None else stranded_s
        self._min = nnodes if min_nodes is None else min_nodes
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
        self._wall0 = time.time()
        self.last = JoinSnapshot()
        self._store: TCPStore | None = None
        self._known = Entries()
        self._seq = 0
        self._summary_seen: tuple[int, float] = (-1, float("-inf"))
        """The summary's last number, and when it moved (this watcher's clock)."""
        self._refused_raw: bytes | None = None
        self.mismatch = ""
        """The latest node refused for its --nnodes, said (agent/admission.py agree_nnodes); "": none."""
        self._thread = threading.Thread(target=self._loop, name="ddprun-join-watch", daemon=True)

    def start(self) -> JoinWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _beat_once(self) -> TCPStore:
        """Connect (a new client forgets what the last one read), announce this node once, beat; the client."""
        from ddprun.agent.admission import client
        from ddprun.protocol import store as keys

        if self._store is None:
            self._store, self._known = client(self._host, self._port, timeout_s=2.0), Entries()
        if self._entry is None:
            self._entry = keys.joining_key(int(self._store.add(keys.JOINING_COUNT_KEY, 1)))
        self._beat += 1
        self._store.set(self._entry, json.dumps({"host": self._agent[0], "pid": self._agent[1], "beat": self._beat}))
        return self._store

    def _entries(self, store: TCPStore) -> JoinSnapshot:
        """The nodes whose beat moved within ``stale_s`` (this watcher's clock, between its reads)."""
        now, joined = time.monotonic(), []
        for key, raw in joining_entries(store, self._known).items():
            value, since = self._seen.get(key, (b"", now))
            if raw != value:
                self._seen[key] = (raw, now)
            elif now - since > self._stale_s:
                continue
            who = describe_entry(raw)
            if who is not None:
                joined.append(who)
        return JoinSnapshot(reachable=True, joined=joined)

    def _snapshot(self, store: TCPStore, early: bool = False) -> JoinSnapshot | None:
        """The store's host reads every entry and publishes what it counted; another node reads that
        (one key) while its number moves, else every entry itself (the host has started, or stopped),
        but not ``early`` (before its first line: None), when every node reading every entry at once
        would be a herd at 1,000 nodes and the host's first summary is about to come."""
        from ddprun.protocol import store as keys

        if self._hosted:
            snap = self._entries(store)
            self._seq += 1
            store.set(keys.JOINING_SUMMARY_KEY, json.dumps({"seq": self._seq, "count": snap.nodes,
                                                            "joined": snap.joined[:NAMES_SHOWN]}))
            return snap
        summary = parse_summary(store.get(keys.JOINING_SUMMARY_KEY)) if store.check([keys.JOINING_SUMMARY_KEY]) else None
        now = time.monotonic()
        if summary is not None and summary[0] != self._summary_seen[0]:
            self._summary_seen = (summary[0], now)
        fresh = now - self._summary_seen[1] <= SUMMARY_STALE_INTERVALS * self._interval + POLL_S
        if summary is not None and fresh:
            return JoinSnapshot(reachable=True, joined=summary[2], count=summary[1])
        return None if early else self._entries(store)

    def _alone(self) -> JoinSnapshot:
        return JoinSnapshot(reachable=True, joined=[f"{self._agent[0]} pid {self._agent[1]}"])

    def line(self, snap: JoinSnapshot) -> str:
        left = max(0, round(self._timeout - (time.monotonic() - self._t0)))  # nearest: 3.0 s into 8 is 5 s left
        if not snap.reachable:
            from ddprun.agent.admission import unreachable_line

            return unreachable_line(f"{self._host}:{self._port}", self._timeout, left)
        who = names(snap.joined, snap.nodes) if snap.joined else "none"
        return (f"ddprun: {self._joined(snap.nodes)} joined ({who}); waiting up to "
                f"{self._timeout:.0f} s ({left} s left)")

    def _joined(self, nodes: int) -> str:
        """``1/2 nodes``, or for an elastic job ``1 of at least 2 (up to 4) nodes``."""
        if self._min == self._nnodes:
            return f"{nodes}/{self._nnodes} nodes"
        return f"{nodes} of at least {self._min} (up to {self._nnodes}) nodes"

    def _admitted(self) -> bool:
        """False (and this node's agent ended) when the job's round completed without this node and
        the job cannot take it in (agent/admission.py)."""
        from ddprun.agent.admission import job_alive, left_out, refusal_reason, refusal_text

        out = left_out(self._store, *self._agent)
        reason = refusal_reason(out[0], -1) if out is not None else None
        if out is None or reason is None or not job_alive(self._store, out[0]):
            return True  # a node of that round is gone: the job re-forms, with this node in it
        self._refuse(refusal_text(out[0], reason, self._me.endpoint, out[1], time.time()))
        return False

    def _stranded(self) -> bool:
        """True (said, and this node's agent ended) once this node has waited ``stranded_s`` with its
        workers not started: where :meth:`_admitted` could not tell (the job record not written: its
        node 0 could not reach the store), torch would keep it waiting for ever."""
        waited = time.monotonic() - self._t0
        if waited < self._stranded_s or self._stop.is_set():
            return False
        self._refuse(f"this node was not taken into the job at the rendezvous endpoint {self._me.endpoint}: its "
                     f"workers have not started {waited:.0f} s after it came, past --join-timeout "
                     f"{self._timeout:.0f} s, and torch would keep it waiting for a place in a round that is full "
                     "without it.\nHINT: check the job's nodes' own output; to add nodes to a running job start "
                     "it with --nnodes MIN:MAX; raise --join-timeout if nodes start late.")
        return True

    def _refuse(self, text: str) -> None:
        """Say ``text`` once, and end this node's agent, unless it hosts the store."""
        self.refused = "ddprun: error: " + text
        if self._hosted:  # the job's store lives in this process: ending it would end the job it refuses
            self.refused += ("\nddprun: this node hosts the store of that job: it serves it until the job ends "
                             "(torch then closes the rendezvous and this launcher exits 1).")
        self._out.write(self.refused + "\n")
        self._out.flush()
        if not self._hosted:
            # End this node's agent: torch turns SIGTERM into SignalException (agent/run.py ending()).
            os.kill(os.getpid(), signal.SIGTERM)

    def _loop(self) -> None:
        next_line = time.monotonic() + self._interval
        snap, read = JoinSnapshot(), False
        while not self._stop.wait(POLL_S):
            due = time.monotonic() >= next_line
            try:
                store = self._beat_once()
                if due or not read:  # for a line, and early (a join timeout shorter than a line's)
                    got = self._snapshot(store, early=not due)
                    # nothing to read yet (_snapshot): this node, which the store has just answered, is there
                    snap, read = (got, True) if got is not None else (self._alone(), False)
                if due:
                    self._say_mismatch(store)
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
            if self._stranded():
                return
            if self._stop.is_set():
                break
            # at the join timeout torch withdraws this node from the state before it raises: an empty
            # state right after a non-empty one is that, not "no node joined"
            if snap.joined or not self.last.joined:
                self.last = snap
            if due:
                next_line += self._interval
                self._out.write(self.line(snap) + "\n")
                self._out.flush()
        self._mark_started()

    def _say_mismatch(self, store: TCPStore) -> None:
        """Say, once each, a node refused for its --nnodes: it will not come (one call a line)."""
        from ddprun.agent.admission import nnodes_text, parse_nnodes
        from ddprun.protocol import store as keys

        if self._me.nnodes is None or not store.check([keys.NNODES_REFUSED_KEY]):
            return
        raw = store.get(keys.NNODES_REFUSED_KEY)
        seen = parse_nnodes(raw)
        if seen is None or raw == self._refused_raw:
            return
        self._refused_raw = raw
        if _written_at(raw) < self._wall0 - REFUSAL_NEWS_S:  # a refusal before this node came: not news
            return
        self.mismatch = (f"{seen[1]} was refused: it was started with --nnodes {nnodes_text(seen[0])}, this job's "
                         f"nodes with --nnodes {nnodes_text(self._me.nnodes)} (every node needs the same --nnodes)")
        self._out.write(f"ddprun: {self.mismatch}\n")
        self._out.flush()

    def _mark_started(self) -> None:
        """This node's entry says it is no longer waiting (another node's watcher stops counting it);
        the store's host's summary says it is no longer kept (a late node reads the entries itself)."""
        from ddprun.protocol import store as keys

        try:
            if self._store is not None and self._entry is not None:
                self._store.set(self._entry, json.dumps({"host": self._agent[0], "pid": self._agent[1],
                                                         "beat": self._beat, "started": True}))
            if self._store is not None and self._hosted:
                self._store.set(keys.JOINING_SUMMARY_KEY, json.dumps({"seq": self._seq + 1, "ended": True}))
        except Exception:  # noqa: BLE001 - the store went away: the entry goes stale by itself
            pass

    def timeout_message(self) -> str:
        snap = self.last
        if not snap.reachable:
            return f"the rendezvous host {self._host}:{self._port} was never reachable from this node"
        who = names(snap.joined, snap.nodes) or "no node"
        missing = self._min - snap.nodes  # an elastic job starts with its fewest
        said = f"{self._joined(snap.nodes)} joined ({who})"
        if self._min == self._nnodes:
            said += f"; {missing} missing"
        elif missing > 0:
            said += f"; {missing} more needed"
        return said + (f"; {self.mismatch}" if self.mismatch else "")
