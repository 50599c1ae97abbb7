"""The agent's part in failure handling: it records what it sees, keeps every record it can read,
and notices a node that is gone.

* A local worker that ends non-zero without a record of its own (a signal: the OOM killer's
  SIGKILL; an exit without a Python error) gets one from its agent, within one monitor interval:
  in the run directory (``failures/rank-N.json``) and in the job store, where the workers'
  monitors and the other agents read it before the peers' echoes.
* A thread keeps a copy of every record in the store (so the real cause is still known when the
  node hosting the store ends first), publishes this agent's heartbeat, and watches one other
  node's heartbeat (a ring: node i watches node i+1, one read per agent per beat at any scale).
  Each half second it reads one key, the alarm (protocol/store.py), and reads what changed only
  when it moved; it relays the alarm to its workers and their progress and timing to the job
  (agent/noderelay.py): one heartbeat a second carries the node's progress, and one batch the
  records of the local ranks another rank's failure stopped.
  A node whose heartbeat stops for ``lost_after_s`` gets a ``lost`` record naming it; a store that
  stops answering for as long means the node hosting it is gone: the local workers are stopped.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TextIO

from ddprun import cgroups
from ddprun._util import Bounded, within
from ddprun.protocol import defaults
from ddprun.protocol import failure as fr
from ddprun.protocol import preempt as pp
from ddprun.protocol.atomic import write_text_atomic
from ddprun.protocol.rundir import RunDir, rank_log_name
from ddprun.protocol.store import (
    Announced,
    Keys,
    present,
    publish_echoes,
    publish_failure,
    raise_alarm,
    read_causes,
    read_counter,
    read_records,
    text,
    value_or_empty,
)

BEAT_S = 1.0
STORE_CALL_S = defaults.STORE_CALL_S
LOST_AFTER_S = 10.0
STORE_ERRORS = (RuntimeError, OSError)
"""What a store call raises when the store is unreachable or slow: torch's DistStoreError and
DistNetworkError are RuntimeErrors; a refused, reset or timed-out connection an OSError."""
RECONNECT_S = 1.0
"""A new client of a store that answered before is made within this, else tried again at the next
tick: after a network outage shorter than LOST_AFTER_S, this node's beat goes through within about
two seconds of the link's return. One long connect would wait out TCP's backed-off SYN retries (1,
3, 7 s after it began), and the node would be named lost although it is back."""
ENFORCE_S = 5.0
"""A local worker still running this long after another rank's failure ended the job is killed."""
RESTART_CAUSE_WAIT_S = 3.0
"""Before a restart, how long the agent waits for a first-hand record when it knows only echoes."""
PROBE_S = 2 * BEAT_S + 0.5
"""A live agent's heartbeat moves within this long (it beats every BEAT_S): one that does not is gone."""
FIRST_BEAT_S = 2 * BEAT_S + 1.0
"""Seconds after this node's workers started by which every live agent of the attempt has beaten:
its workers start within torch's rendezvous poll (1 s) of these, its first beat within 2 beats."""


def kill_children(pids: list[int], sig: int, proc_root: str = "/proc") -> list[int]:
    """Send ``sig`` to those of ``pids`` that are still running children of this process (a pid that
    ended may have been reused by now); the pids signalled."""
    sent = []
    for pid in pids:
        if pid <= 0:  # 0 is this process's group, -1 every process it may signal: never a worker
            continue
        try:
            with open(os.path.join(proc_root, str(pid), "stat")) as fp:
                state, ppid = fp.read().rsplit(")", 1)[1].split()[:2]
            if int(ppid) == os.getpid() and state not in ("Z", "X"):
                os.kill(pid, sig)
                sent.append(pid)
        except (OSError, ValueError, IndexError):
            pass
    return sent


def worker_record(error_file: str) -> fr.FailureRecord | None:
    """The record a worker left in its torch error file (``extraInfo.ddprun``), if any."""
    try:
        with open(error_file) as fp:
            data = json.load(fp)
        return fr.FailureRecord.from_dict(data["message"]["extraInfo"]["ddprun"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass
class _Batch:
    """Stopped local ranks' records forwarded together (:meth:`AgentFailures._forward_left`); each
    step is made once, so that a retry after a failed call neither numbers them again nor
    acknowledges them twice (the ``acks`` count tells the first failing rank it may exit)."""

    keys: Keys
    count: int
    """The node store's ``left`` counter when they were read."""
    recs: list[fr.FailureRecord]
    first: int | None = None
    """Their place in the job's record list, once reserved."""
    acked: bool = False

    def send(self, store: Any) -> None:
        if self.first is None:
            self.first = int(store.add(self.keys.failures, len(self.recs))) - len(self.recs) + 1
        publish_echoes(store, self.keys, self.recs, self.first)  # the same keys on a retry
        if not self.acked:
            store.add(self.keys.acks, len(self.recs))
            self.acked = True


class AgentFailures:
    """One per ``ddprun run`` agent; see the module docstring. Thread-safe; never raises into torch."""

    def __init__(self, run_dir: RunDir, host: str, addr: str, port: int, run_id: str, out: TextIO,  # noqa: PLR0913
                 lost_after_s: float = LOST_AFTER_S, connect: Callable[[], Any] | None = None,
                 on_beat: Callable[[int, int], None] | None = None, relay: Any = None,
                 stop_grace_s: float = 30.0):
        """``on_beat(node, beat)``: called with this agent's heartbeat (the endpoint's copy, admission.py);
        ``relay``: this node's agent/noderelay.py NodeRelay, if its workers have one; ``stop_grace_s``:
        between SIGTERM and SIGKILL when this thread stops the workers (--stop-grace)."""
        self.run_dir, self.host, self.out = run_dir, host, out
        self._stop_grace = stop_grace_s
        self._kill_later: threading.Timer | None = None
        """The SIGKILL of the workers a lost store stopped (:meth:`_give_up_store`), until a new attempt."""
        self._relay = relay
        self._alarm = -1
        """The job's alarm counter as last read: -1 reads everything at the first beat."""
        self._announced: Announced | None = None
        """The preemption and stall requests as read when the alarm last moved (relayed to the workers)."""
        self._progress: dict[int, int] = {}
        """rank -> progress count of this node's ranks, as the relay last read them (the heartbeat's)."""
        self._on_beat = on_beat
        self._addr, self._port, self._run_id = addr, port, run_id
        self._lost_after = lost_after_s
        self._started_at = time.monotonic()
        """When this node's current worker group started."""
        self._connect_fn = connect
        self._lock = threading.Lock()
        self._forward_lock = threading.Lock()
        self._batch: _Batch | None = None
        """Stopped local ranks' records on their way to the job store (:meth:`_forward_left`)."""
        self._cache: dict[str, fr.FailureRecord] = {}
        self._local: dict[int, fr.FailureRecord] = {}
        self._workers: dict[int, tuple[int, int, str]] = {}  # rank -> (local rank, pid, error file)
        self._keys: Keys | None = None
        self._attempt = ""
        """The attempt id of the workers that run (agent/attempt.py; their logs are kept under it)."""
        self._node, self._nnodes, self._world = 0, 1, 1
        self._last_attempt: bool = True
        self._cause_seen: float | None = None
        self._store: Any = None
        self._retry_at = 0.0
        """A new client is tried again from then on (the last try timed out)."""
        self._answered = False
        """This store answered a connect before: a new client is a reconnect (RECONNECT_S)."""
        self._store_given_up = False
        self._stop = threading.Event()
        self._reforming = False
        """torch re-forms the group (a restart, a node joining or dropped): no workers, no store to lose."""
        self._thread: threading.Thread | None = None
        self._oom0: int | None = None
        """The cgroup's oom_kill count when this attempt's workers started (on_workers_started)."""
        self.lost: fr.FailureRecord | None = None
        self._alive_at, self._rebased_at = time.monotonic(), float("-inf")
        """When the failure thread's last tick ended, and when it last found it had not run for a while
        (:meth:`_held`)."""
        self._barrier_short = False
        """The agents' exit barrier was left before every agent arrived (:meth:`exit_barrier_left`)."""
        self._faults_said: set[str] = set()
        """The kinds of error of its own this thread has said (:meth:`_own_fault`)."""
        self._hang_said: bytes | None = None
        self._told: Keys | None = None
        """The attempt whose cause-read mark this node set (:meth:`_mark_cause_read`)."""
        self.stopping_for: fr.FailureRecord | None = None
        self.preempt_request: pp.Request | None = None
        """The job's preemption request, once read from the store (agent/preemption.py)."""
        self.preempt_stop: str | None = None
        """The agreed stop step as stored (protocol/preempt.py; NO_STEP: none), once read."""

    # -- attempts --------------------------------------------------------------------------
    def on_workers_started(self, attempt: str, node_rank: int, nnodes: int,
                           workers: dict[int, tuple[int, int, str]], world_size: int = 0,
                           store: tuple[str, int] | None = None, last_attempt: bool = True) -> None:
        """A worker group (re)started: its attempt id, this node's rank, rank -> (local rank, pid, error file),
        and the workers' store (MASTER_ADDR:MASTER_PORT; torch's c10d hosts it on node 0's agent, apart from
        the rendezvous endpoint's)."""
        oom0 = cgroups.oom_kills()  # an earlier attempt's out-of-memory kill is not this attempt's evidence
        with self._lock:
            self._oom0 = oom0
            if store is not None and store != (self._addr, self._port):
                self._addr, self._port = store
                self._store, self._answered = None, False
            self._keys, self._attempt = Keys(f"ddprun/{self._run_id}/{attempt}/"), attempt
            self._started_at = time.monotonic()
            # a store named lost in the last attempt is tried afresh: this round's may be another (a new
            # group rank 0 hosts it, agent/torch_agent.py follow_round_store) or back; lost again only
            # after lost_after of this attempt's own failing ticks (_loop)
            self._store_given_up, self._retry_at, self._reforming = False, 0.0, False
            self._node, self._nnodes, self._workers = node_rank, nnodes, dict(workers)
            self._world = world_size or len(workers)
            self._last_attempt, self._cause_seen = last_attempt, None
            self._alarm, self._progress, self._announced = -1, {}, None
            # the last attempt's records are history: a stale cause would end this attempt (_enforce_end)
            self._local.clear()
            self._cache.clear()
            self.lost, self.stopping_for = None, None
            # the request and its answer live under the last attempt's keys: this attempt's are read afresh
            self.preempt_request, self.preempt_stop = None, None
            if self._kill_later is not None:  # the last attempt's workers are gone; their pids may be reused
                self._kill_later.cancel()
                self._kill_later = None
        if self._relay is not None:
            self._relay.begin(self._keys, list(workers))
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ddprun-agent-failures", daemon=True)
            self._thread.start()

    @property
    def node_rank(self) -> int:
        return self._node

    def stop(self) -> None:
        """End the thread; this node's heartbeat says it ended (never taken for a lost node)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * BEAT_S)
        try:
            if self._keys is not None and self._store is not None:
                self._store.set(self._keys.agent(self._node), self._done())
        except Exception:  # noqa: BLE001
            pass
        self._store = None  # no store client outlives the launch (ddprun.launch runs in the caller's process)

    def _done(self) -> str:
        """This node's last heartbeat: its agent ended (an observer never names it lost)."""
        return json.dumps({"host": self.host, "done": True, "progress": self._progress})

    # -- local deaths ----------------------------------------------------------------------
    def on_worker_exit(self, rank: int, local_rank: int, pid: int, code: int) -> None:
        """torch's agent saw a worker end with ``code`` != 0 (agent/torch_agent.py)."""
        try:
            self._on_exit(rank, local_rank, code)
        except Exception as e:  # noqa: BLE001 - the agent must go on supervising whatever happens here
            print(f"ddprun: could not record rank {rank}'s exit ({type(e).__name__}: {e})", file=sys.stderr)

    def _on_exit(self, rank: int, local_rank: int, code: int) -> None:
        error_file = self._workers.get(rank, (0, 0, ""))[2]
        own = (worker_record(error_file) if error_file else None) or self._handed_over(rank)
        if own is not None:
            with self._lock:
                self._local[rank] = own
            return
        now = time.time()
        if self.stopping_for is not None:
            rec = fr.stopped_by(self.stopping_for, rank=rank, node_rank=self._node, host=self.host,
                                local_rank=local_rank, t=now)
        else:
            rec = fr.from_exit(rank, code, node_rank=self._node, host=self.host, local_rank=local_rank, t=now,
                               oom_kills=self._oom_kills())
        with self._lock:
            self._local[rank] = rec
        self._publish(rec)

    def _handed_over(self, rank: int) -> fr.FailureRecord | None:
        """The record ``rank`` left in this node's store as it failed: a full disk loses its error
        file, and a lost job-store host the job's copy, but not this one."""
        try:
            return self._relay.own_record(rank) if self._relay is not None else None
        except Exception:  # noqa: BLE001 - the node store is this process's own; never fail the exit on it
            return None

    def _oom_kills(self) -> tuple[int, int] | None:
        """The cgroup's oom_kill count when this attempt's workers started and now (None: not readable)."""
        now = cgroups.oom_kills()
        return None if self._oom0 is None or now is None else (self._oom0, now)

    def _publish(self, rec: fr.FailureRecord, keys: Keys | None = None) -> None:
        """Into the run directory and the store (best effort: the store may be gone), under ``keys``
        (default: this attempt's)."""
        try:
            os.makedirs(self.run_dir.failures, exist_ok=True)
            write_text_atomic(self.run_dir.failure_record(rec.rank if rec.rank >= 0 else f"node{rec.node_rank}"),
                              rec.to_json())
        except OSError as e:
            print(f"ddprun: could not write the failure record of {rec.where()}: {e}", file=sys.stderr)
        try:
            store, keys = self._client(), keys or self._keys
            if keys is not None:
                publish_failure(store, keys, rec)
        except Exception:  # noqa: BLE001
            pass

    # -- what is known ---------------------------------------------------------------------
    def records(self) -> list[fr.FailureRecord]:
        """Every record seen, once: this node's, and those read from the store while it answered (a
        cause is in the store twice: among the causes and in the job's list)."""
        with self._lock:
            return self._records_held()

    def _records_held(self) -> list[fr.FailureRecord]:
        """:meth:`records`, for a caller that holds the lock."""
        out = list(self._cache.values()) + list(self._local.values()) + ([self.lost] if self.lost else [])
        return list({rec.to_json(): rec for rec in out}.values())

    def local_record(self, rank: int) -> fr.FailureRecord | None:
        with self._lock:
            rec = self._local.get(rank)
        if rec is None and rank in self._workers:
            rec = worker_record(self._workers[rank][2]) or self._handed_over(rank)
        return rec

    def root_cause(self) -> fr.FailureRecord | None:
        return fr.root_cause(self.records())

    def linger(self, timeout_s: float = 5.0, finished: bool = False) -> None:
        """Keep this agent (and the store, if it hosts it) up until every rank of the job has a record
        (its own failure, or that it was stopped: it read the cause) and the node of a rank that
        finished first has read that (:meth:`_told_all`), at most ``timeout_s``: an agent that hosts
        the store and exits at once would take the cause's record with it (also this node's own: a
        signal that stopped its workers, :meth:`on_signal`). ``finished``: this node's workers all
        ended 0, and need none."""
        keys = self._keys
        if keys is not None:
            try:  # this node's stopped ranks, before anyone counts the records; no connect to a store that is gone
                self._forward_left(None, keys, every=True)
            except Exception:  # noqa: BLE001 - the store is gone: their error files still say it
                pass
        cause = self.root_cause() or self.stopping_for
        # torch's c10d hosts the workers' store on node 0's agent; a cause that is only an echo is
        # worth nothing to the others (they probe for the lost node themselves)
        if keys is None or self._world <= 1 or self._node != 0 or cause is None or cause.is_echo:
            return
        from ddprun.agent.endpoint import port_open

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._store is None and not port_open(self._addr, self._port):
                return  # the store's host is gone: what was read is all there is
            try:
                self._read_records(self._client(), keys, every=True)
                recs = self.records()
                ranks = {r.rank for r in fr.with_causes(recs)} | set(self._local)
                if finished:
                    ranks |= set(self._workers)
                if len(ranks & set(range(self._world))) >= self._world and self._told_all(keys, recs):
                    return
            except Exception:  # noqa: BLE001 - the store is gone: what was read is all there is
                self._store = None
                return
            time.sleep(0.1)

    def _told_all(self, keys: Keys, recs: list[fr.FailureRecord]) -> bool:
        """Every node that learns the job's cause only from the store has read it: a node whose rank
        finished first (the cause, carried by another rank's record) and none of whose ranks has a
        record of its own. Its ranks ended 0; its agent waits in torch's exit barrier and reads the
        cause at its next beat, which a loaded node may take seconds to reach. ``recs``: :meth:`records`."""
        own = {r.node_rank for r in recs if r.kind != fr.FINISHED_FIRST}
        first = {r.node_rank for r in fr.with_causes(recs) if r.kind == fr.FINISHED_FIRST}
        waited = [keys.cause_read(n) for n in sorted(first - own - {self._node}) if 0 <= n < self._nnodes]
        return not waited or bool(self._client().check(waited))

    def _mark_cause_read(self, store: Any, keys: Keys) -> None:
        """The job's cause is a rank of this node that finished first: say it was read here, once an
        attempt (the store's host lingers for it, :meth:`_told_all`)."""
        if self._told is keys or not self._cache:  # nothing read yet: the common beat costs nothing
            return
        cause = self.job_failed()
        if cause is None or cause.kind != fr.FINISHED_FIRST or cause.node_rank != self._node:
            return
        store.set(keys.cause_read(self._node), "1")
        self._told = keys

    # -- the thread ------------------------------------------------------------------------
    def _client(self) -> Any:
        """The job store's client; every call (its making too) bounded by STORE_CALL_S: torch's client
        waits for ever on a store whose host's process is stopped (SIGSTOP), and this thread must go
        on to name that host lost."""
        if self._store is None:
            if self._store_given_up:  # named lost, this node's workers stopped: no more waits on it
                raise TimeoutError("the job store stopped answering")
            if time.monotonic() < self._retry_at:  # it did not answer a moment ago: fail fast meanwhile
                raise TimeoutError(f"the job store did not answer within {STORE_CALL_S:g} s")
            with self._lock:
                dialled, answered = (self._addr, self._port), self._answered
            try:  # a reconnect is tried again at the next tick: its SYN then goes out again
                client = Bounded(within(RECONNECT_S if answered else STORE_CALL_S, self._connect, *dialled),
                                 STORE_CALL_S)
            except TimeoutError:
                with self._lock:  # a new attempt's store is not held back by the last one's silence
                    if not self._answered and dialled == (self._addr, self._port):
                        self._retry_at = time.monotonic() + STORE_CALL_S
                raise
            with self._lock:
                # a new attempt may have moved the store meanwhile (a new group rank 0 hosts it): a client of
                # the last one would beat there for the whole attempt, and its observers name this node lost
                if dialled != (self._addr, self._port):
                    raise ConnectionError(f"the job store moved from {dialled[0]}:{dialled[1]} while connecting")
                self._store, self._answered = client, True
        return self._store

    def _connect(self, addr: str, port: int) -> Any:
        if self._connect_fn is not None:
            return self._connect_fn()
        from torch.distributed import TCPStore

        return TCPStore(addr, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=STORE_CALL_S))

    def _loop(self) -> None:
        """Every half second a tick; the store is named lost once its ticks have failed for
        ``lost_after``, counted from the start of the first failing one: a time this agent itself was
        stopped (SIGSTOP) or starved between two ticks is not the store's silence."""
        beat, seen_at, failing_since = 0, (None, None, time.monotonic()), None
        while not self._stop.wait(BEAT_S / 2):
            started = time.monotonic()
            if failing_since is not None and failing_since < self._started_at:
                failing_since = None  # the last attempt's store: its silence does not count against this one
            self._lost_since(failing_since)  # also before a tick: its new try may wait STORE_CALL_S
            try:
                beat += 1
                seen_at = self._tick(beat, seen_at)
                failing_since = None
            except STORE_ERRORS:  # the store is unreachable; how long decides
                self._store = None
                failing_since = started if failing_since is None else failing_since
            except Exception as e:  # noqa: BLE001 - a fault of this thread's own: the store is not to blame
                failing_since = None  # the store answered this tick's beat (else that raised a store error)
                self._own_fault(e)
                self._lost_since(failing_since)  # a time before this attempt's start never counts (its store's)
            if self._stop.is_set():
                return

    def _own_fault(self, e: Exception) -> None:
        """A tick raised what no unreachable store raises (a bug here, or a value in the store that
        this code cannot read): said once per type and place, with its traceback, and the watch goes on. Taken
        for the store's silence it would name the store lost after ``lost_after`` and stop a healthy
        job's workers."""
        import traceback

        last = traceback.extract_tb(e.__traceback__)[-1:]
        kind = f"{type(e).__name__} at {last[0].filename}:{last[0].lineno}" if last else type(e).__name__
        if kind in self._faults_said:  # by type and place, not message: one whose text varies is said once too
            return
        self._faults_said.add(kind)
        where = "".join(traceback.format_exception(e)).rstrip()
        print(f"ddprun: node {self._node}'s failure watch hit an error of its own ({type(e).__name__}: {e}); "
              f"the job goes on, and this watch with it (please report this, with the traceback below)\n{where}",
              file=self.out, flush=True)

    def on_reforming(self) -> None:
        """torch stopped this attempt's workers to re-form the group: the attempt's store may be gone
        with a node that left (it hosted it), and a node that died is left out of the next round by
        torch's rendezvous; neither is a loss to name until the next attempt starts."""
        self._reforming = True

    def _lost_since(self, failing_since: float | None) -> None:
        """Name the store lost once this attempt's ticks have failed since ``failing_since`` for lost_after.
        Decided under the lock that :meth:`on_workers_started` resets under: a failure of the attempt
        before (a tick that straddled the new start) never stops the new attempt's workers."""
        with self._lock:
            if (self._reforming or failing_since is None or failing_since < self._started_at
                    or self.lost is not None or time.monotonic() - failing_since < self._lost_after):
                return
            lost, pids = self._give_up_store()
        self._stop_workers(lost, pids)

    def _tick(self, beat: int, seen_at: tuple[Any, Any, float]) -> tuple[Any, Any, float]:
        """Every half second: the alarm, and what it announces when it moved; every second (even
        ``beat``): the heartbeat with the node's progress, its timings, the neighbour's heartbeat.
        First, whether this thread ran since the last tick ended (:meth:`_held`)."""
        self._held(time.monotonic())
        try:
            return self._tick_once(beat, seen_at)
        finally:
            self._alive_at = time.monotonic()

    def _tick_once(self, beat: int, seen_at: tuple[Any, Any, float]) -> tuple[Any, Any, float]:
        keys = self._keys  # first: a client of a later attempt's store only ever sees old keys, which it skips
        store = self._client()
        if keys is None:
            return seen_at
        try:
            self._watch(store, keys, beat)
        except STORE_ERRORS:
            raise
        except Exception as e:  # noqa: BLE001 - an error of its own: said, and the beat goes on (else a peer names this node lost)
            self._own_fault(e)
        if beat % 2 == 0:
            seen_at = self._beat(store, keys, beat, seen_at)
        if self._on_beat is not None:  # another store (the endpoint's): last, so it never delays the above
            self._on_beat(self._node, beat)
        return seen_at

    def _watch(self, store: Any, keys: Keys, beat: int) -> None:
        """A tick's reads and writes before its heartbeat: the alarm and what it announces, the stopped
        ranks' records, the end of a failed job, and the relay to this node's workers."""
        self._watch_alarm(store, keys)
        self._mark_cause_read(store, keys)
        self._forward_left(store, keys)
        self._enforce_end(keys)
        if self._relay is not None:
            with self._lock:  # the records and the alarm of this tick's attempt (a restart may clear them)
                read, alarm, said = ((list(self._cache.values()), self._alarm, self._announced) if keys is self._keys
                                     else ([], -1, None))
            self._relay.mirror(beat, alarm, read, keys, said)

    def _beat(self, store: Any, keys: Keys, beat: int, seen_at: tuple[Any, Any, float]) -> tuple[Any, Any, float]:
        """Every second: this node's heartbeat with its progress, its timing windows, and the neighbour's
        heartbeat read (:meth:`_watch_neighbour`)."""
        if self._relay is not None:
            self._progress = self._relay.progress()
        store.set(keys.agent(self._node), json.dumps({"host": self.host, "beat": beat, "progress": self._progress}))
        if self._stop.is_set():  # stop() may have said "done" while this beat was on its way: not the last word
            store.set(keys.agent(self._node), self._done())
        timings = self._relay.timings() if self._relay is not None else None
        if timings is not None:
            store.set(keys.node_timing(self._node), json.dumps(timings))
        return self._watch_neighbour(store, keys, seen_at)

    def _watch_alarm(self, store: Any, keys: Keys) -> None:
        """One read of the alarm; the records, the preemption request and the hang report only when it
        moved (every writer of them advances it after the write); the agreed stop step, which is not
        announced, every beat while a preemption waits for it."""
        alarm = read_counter(store, keys.alarm)  # not add(key, 0): a value that is no number closes the client
        request, stop, said = self.preempt_request, self.preempt_stop, None
        if alarm is None or alarm != self._alarm:  # no number: it may never move again, so read on
            self._read_records(store, keys)
            said = self._read_announced(store, keys)
            request = request or pp.Request.parse(said.preempt or None)
            self._say_hang_report(store, keys)
        if request is not None and stop is None and store.check([keys.preempt_stop]):
            stop = text(store.get(keys.preempt_stop))
        with self._lock:  # on_workers_started resets them under it: no old attempt's value after that
            if keys is self._keys:  # not a value of the attempt before one that started meanwhile
                # set once, never back to None: the main thread may have set them meanwhile (publish_preempt)
                self.preempt_request = self.preempt_request or request
                self.preempt_stop = self.preempt_stop or stop
                self._announced = said or self._announced
                self._alarm = -1 if alarm is None else alarm  # once all of it was read: a failing read reads it again

    def _read_announced(self, store: Any, keys: Keys) -> Announced:
        """The job's preemption request (read until there is one: the first request stays) and its
        stall request (read at each move: a stall that resumed deletes it), for the relay: 2 to 4
        calls a node, where each rank reading them itself made 2 to 3 calls a rank."""
        known = self._announced.preempt if self._announced is not None else ""
        return Announced(known or value_or_empty(store, keys.preempt), value_or_empty(store, keys.stall))

    def _forward_left(self, store: Any, keys: Keys, every: bool = False) -> None:
        """The records local ranks left in the node store when another rank's failure stopped them
        (worker/channel.py leave_to_agent): into the job store as one batch, and acknowledged for
        them: 4 job-store calls a node, where each rank recording its own made 4 a rank. Called by
        this thread each tick and by :meth:`linger` (the launch ends before another tick), which
        gives no ``store``: the client is made only when there is something to forward and the
        store's port answers, and ``every``: it reads the node store also where the count did not
        move. A batch whose calls failed part way is finished, not sent again: its place in the
        job's record list is kept (:class:`_Batch`)."""
        if self._relay is None:
            return
        with self._forward_lock:  # this thread and the main thread (linger): each record once
            batch = self._batch if self._batch is not None and self._batch.keys is keys else None
            if batch is None:
                count, recs = self._relay.left(keys, every)
                if not recs:
                    self._relay.forwarded(keys, count, [])
                    return
                batch = self._batch = _Batch(keys, count, recs)
            if store is None:
                if self._store is None and not self._reachable():
                    return
                store = self._client()
            batch.send(store)
            self._batch = None
            self._relay.forwarded(keys, batch.count, [r.rank for r in batch.recs])

    def _enforce_end(self, keys: Keys) -> None:
        """Another rank's failure ended the job (last attempt), but a local worker still runs after
        ENFORCE_S: it cannot stop itself (stopped by SIGSTOP, frozen, its monitor starved): SIGKILL it.
        ``keys``: the tick's attempt; decided under the lock that a new attempt resets under."""
        with self._lock:  # the main thread adds records and clears them at a new attempt
            cause = fr.root_cause(list(self._cache.values()))
            if (keys is not self._keys or not self._last_attempt or cause is None or cause.is_echo
                    or cause.rank in self._workers):
                return
            now = time.monotonic()
            self._cause_seen = self._cause_seen or now
            if now - self._cause_seen < ENFORCE_S or self.stopping_for is not None:
                return
            self.stopping_for = cause
            pids = [pid for _, pid, _ in self._workers.values()]
        kill_children(pids, signal.SIGKILL)

    def _read_records(self, store: Any, keys: Keys, every: bool = False) -> None:
        """Copy the store's records not seen yet (batched reads); a malformed one is skipped. Every
        beat: the causes (protocol/store.py read_causes, bounded); ``every``: every rank's record too."""
        with self._lock:
            known = set(self._cache)
        if every:
            n = read_counter(store, keys.failures) or 0
            got = read_records(store, [k for k in map(keys.failure, range(1, n + 1)) if k not in known])
        else:
            got = read_causes(store, keys, known)
        with self._lock:
            for key, rec in got.items():
                # a read that began before a new attempt started must not bring the old attempt's records back
                if self._keys is not None and key.startswith(self._keys.prefix):
                    self._cache[key] = rec

    def _say_hang_report(self, store: Any, keys: Keys) -> None:
        """A stall report appeared: one line on this node's console (the report is in the run dir)."""
        if not store.check([keys.stall_summary]):
            return
        raw = store.get(keys.stall_summary)
        if raw == self._hang_said:
            return
        self._hang_said = raw
        try:
            data = json.loads(raw)
            text, by, host = str(data["summary"]), int(data["by"]), str(data.get("host", "?"))
        except (ValueError, KeyError, TypeError):
            return
        print(f"ddprun: hang report: {text}\n  (by rank {by}: every rank's stacks in stacks/ of the run directory "
              f"on each node; the full report in stacks/hang-report.txt on {host})", file=self.out, flush=True)

    def _watch_neighbour(self, store: Any, keys: Keys, seen_at: tuple[Any, Any, float]) -> tuple[Any, Any, float]:
        """``seen_at``: (the neighbour's heartbeat key, its value, when it last changed). A new key (a new
        attempt, another neighbour) counts from this attempt's start, not from an earlier value: a node
        that joined an elastic job has not beaten yet when the others' workers start."""
        if self._nnodes < 2:
            return seen_at
        other = (self._node + 1) % self._nnodes
        key = keys.agent(other)
        if seen_at[0] != key:
            seen_at = (key, None, self._started_at)
        value = store.get(key) if store.check([key]) else None
        now = time.monotonic()
        if value != seen_at[1]:
            return key, value, now
        silent = now - max(seen_at[2], self._rebased_at)  # not through a time this agent did not run either
        # also a neighbour that never beat in this attempt (killed right after its workers started)
        if (value is None or b'"done"' not in value) and silent >= self._lost_after and self.lost is None:
            lost = fr.FailureRecord(fr.LOST, -1, f"its agent stopped answering for {silent:.0f} s",
                                    other, self._host_of(other, value), by="observer", t=time.time())
            with self._lock:
                # Only a neighbour of the attempt that runs. While torch re-forms the group its rendezvous
                # leaves a dead node out (its keep-alive), and a tick that read the attempt before
                # on_workers_started must not name that attempt's node lost in the next one, whose node
                # of that rank is another: both ended a re-formed job that had a node back.
                current = keys is self._keys and not self._reforming
                if current:
                    self.lost = lost
            if current:
                self._publish(lost, keys)
        return seen_at

    def _held(self, now: float) -> None:
        """This thread did not run for defaults.HELD_GAP_S between the end of its last tick and ``now``
        (the job suspended, or this agent frozen, while it waited for its next tick; a slow store call
        inside a tick is no such gap): the neighbour's silence then counts from now (``_rebased_at``),
        and so does the time since which a worker's end is enforced: the others did not run either."""
        if now - self._alive_at > defaults.HELD_GAP_S:
            self._rebased_at = now
            with self._lock:
                if self._cause_seen is not None:
                    self._cause_seen = now

    def _give_up_store(self) -> tuple[fr.FailureRecord, list[int]]:
        """Under the lock: the store's host is gone; name it and give it up. Returns its record and this
        attempt's workers' pids, whose SIGKILL it schedules after the stop grace (torch's agent sees nothing
        wrong while they run: a worker that ignores SIGTERM is killed then, unless a new attempt starts)."""
        self.lost = lost = self._store_gone(f" for {self._lost_after:.0f} s")
        self._store_given_up = True
        self.stopping_for = fr.root_cause(self._records_held()) if self._cache else lost
        pids = [pid for _, pid, _ in self._workers.values()]
        self._kill_later = threading.Timer(self._stop_grace, kill_children, args=(pids, signal.SIGKILL))
        self._kill_later.daemon = True
        self._kill_later.start()
        return lost, pids

    def _stop_workers(self, lost: fr.FailureRecord, pids: list[int]) -> None:
        """The store was given up (:meth:`_give_up_store`): say so, stop the workers (torch's agent then ends)."""
        print(f"ddprun: {lost.headline()}; stopping this node's workers", file=self.out, flush=True)
        if self._relay is not None:  # the workers must not ask the lost store whether this is a preemption
            self._relay.mark_stopping(self._node)
        kill_children(pids, signal.SIGTERM)

    def on_signal(self, sig: int, why: str | None = None) -> None:
        """This agent got ``sig`` (or, ``why``, stops its workers with it for a reason of its own): say
        so in the store before its workers are stopped (their peers then name this node, not the
        stopped workers' connection errors)."""
        name = fr.signal_name(-sig)
        cause = fr.FailureRecord(fr.SIGNAL, -1, why or f"its agent got {name} and stopped its workers",
                                 self._node, self.host, signal=name, by="agent", t=time.time(),
                                 stop_step=self.preempt_stop)  # set only once a request was read
        self.stopping_for = cause
        self._publish(cause)
        with self._lock:
            ended = set(self._local)  # recorded already: their own cause, not this stop
        for rank, (local_rank, _, _) in list(self._workers.items()):  # about to be stopped by torch
            if rank in ended:
                continue
            self._publish(fr.stopped_by(cause, rank=rank, node_rank=self._node, host=self.host,
                                        local_rank=local_rank, t=time.time()))

    def on_restarting(self, left: int, most: int) -> None:
        """torch restarts the failed worker group: one line on this node's console naming the cause
        (the records read from the store now, so a failure on another node is named too). Where only
        echoes come within RESTART_CAUSE_WAIT_S, the node that wrote none is named: the workers' store's
        host where that store refuses, else an agent whose heartbeat stood still through the wait."""
        from ddprun.agent.endpoint import port_open

        keys, deadline = self._keys, time.monotonic() + RESTART_CAUSE_WAIT_S
        cause, looked = self.root_cause(), None
        # local workers that died of a peer's death (an echo) end before that peer's agent has written
        # its record: wait a little for it, so the line names the rank that failed, not a victim
        while keys is not None and (cause is None or cause.is_echo) and time.monotonic() < deadline:
            try:
                if self._store is None and not port_open(self._addr, self._port):
                    break
                self._read_records(self._client(), keys)
            except Exception:  # noqa: BLE001 - the store is gone: the local records are all there is
                self._store = None
                break
            cause = self.root_cause()
            if cause is None or cause.is_echo:
                looked = looked or self._look()  # the store answers: the agents' beats as the wait begins
                time.sleep(0.1)
        if cause is None or cause.is_echo:  # no record came: a node whose agent died with its workers writes none
            cause = next(iter(self._gone_since(looked)), cause)
        what = "a worker failed"
        if cause is not None:
            what = cause.headline()
            if cause.rank >= 0:
                # the name it has once the restart moved it aside (agent/logs.py keep_as_attempt)
                what += f" (its log: {rank_log_name(cause.rank, self._attempt)} on {cause.host})"
        print(f"ddprun: {what}; restarting the workers (restart {most - left} of {most})", file=self.out, flush=True)

    def probe_lost(self, wait_s: float = PROBE_S) -> list[fr.FailureRecord]:
        """Which nodes are gone now: agents whose heartbeat does not move within ``wait_s`` (one batched
        read before and after), or the store itself when it does not answer. For a failure whose only
        record is a peer's echo; bounded by ``wait_s`` + the store's timeout."""
        looked = self._look()
        if looked is not None and looked[1] is not None:  # a never-beaten agent is gone once a live one would have
            time.sleep(max(wait_s, FIRST_BEAT_S - (time.monotonic() - self._started_at)))
        return self._gone_since(looked, wait_s)

    def _look(self) -> tuple[float, dict[str, bytes] | None] | None:
        """(when, the other agents' heartbeats then, None where the store did not answer the read) for
        :meth:`_gone_since`; None where there is no attempt or the store refuses connections."""
        from ddprun.agent.endpoint import port_open

        keys = self._keys
        if keys is None or not port_open(self._addr, self._port):  # refused at once: no client's connect wait
            return None
        try:
            return time.monotonic(), self._beats([keys.agent(n) for n in range(self._nnodes) if n != self._node])
        except Exception:  # noqa: BLE001 - a store that takes connections and answers nothing (a stopped host)
            self._store = None
            return time.monotonic(), None

    def _gone_since(self, looked: tuple[float, dict[str, bytes] | None] | None, wait_s: float = PROBE_S
                    ) -> list[fr.FailureRecord]:
        """The store, where it does not answer now; else the agents whose heartbeat has not moved since
        ``looked`` (:meth:`_look`), when that was at least ``wait_s`` ago and this attempt has run
        FIRST_BEAT_S (a live agent has beaten by then); else none."""
        from ddprun.agent.endpoint import port_open

        keys = self._keys
        if keys is None:
            return []
        if not port_open(self._addr, self._port) or (looked is not None and looked[1] is None):
            self._store = None  # refused at once, or it did not answer the look: the store's host is gone
            return [self._store_gone("")]
        now = time.monotonic()
        if looked is None or looked[1] is None or now - looked[0] < wait_s or now - self._started_at < FIRST_BEAT_S:
            return []
        names = [keys.agent(n) for n in range(self._nnodes) if n != self._node]
        try:
            after = self._beats(names)
        except Exception:  # noqa: BLE001 - the store's host is gone
            self._store = None
            return [self._store_gone("")]
        out = []
        for name in names:
            raw = after.get(name)
            if raw == looked[1].get(name) and (raw is None or b'"done"' not in raw):
                node = int(name.rsplit("/", 1)[1])
                out.append(fr.FailureRecord(fr.LOST, -1, "its agent stopped answering", node,
                                            self._host_of(node, raw), by="observer", t=time.time()))
        return out

    def _host_of(self, node: int, beat: bytes | None) -> str:
        """Node ``node``'s host: from its heartbeat, else from its ranks' rows (c10d gives a node of
        this node's size the ranks node*size...; another layout gives '?')."""
        try:
            if beat is not None:
                return str(json.loads(beat).get("host", "?"))
            keys, size = self._keys, max(1, len(self._workers))
            names = [keys.rank(r) for r in range(node * size, (node + 1) * size)] if keys is not None else []
            for raw in self._beats(names).values():  # the same batched read of the keys present
                row = json.loads(raw)
                if row.get("node_rank") == node:
                    return str(row.get("host", "?"))
        except Exception:  # noqa: BLE001 - a name is a nicety; the record says which node either way
            pass
        return "?"

    def _beats(self, names: list[str]) -> dict[str, bytes]:
        """The values of those of ``names`` that are in the store: one check when they all are, one
        batched read (every surviving node probes at once after a node's loss: one check a node each
        would be two million calls at 1,000 nodes, when the failure is to be named)."""
        store = self._client()
        there = present(store, names)
        return dict(zip(there, store.multi_get(there))) if there else {}

    def _store_gone(self, how_long: str, addr: str | None = None, port: int | None = None) -> fr.FailureRecord:
        """The record of the node hosting the store (its node rank is not known here: -1)."""
        addr, port = addr or self._addr, port or self._port
        return fr.FailureRecord(fr.LOST, -1, f"the job store at {addr}:{port} stopped answering{how_long}",
                                -1, addr, by="observer", t=time.time())

    def endpoint_gone(self, addr: str, port: int) -> list[fr.FailureRecord]:
        """The rendezvous endpoint's store refuses connections: its node is gone. For a rendezvous
        error, whose store may not be the workers' (an elastic job's group rank 0 hosts theirs)."""
        from ddprun.agent.endpoint import port_open

        return [] if port_open(addr, port) else [self._store_gone("", addr, port)]

    # -- preemption --------------------------------------------------------------------------
    def publish_preempt(self, req: pp.Request) -> None:
        """Ask the job to stop (the first request stays); best effort, bounded by the store's timeout."""
        keys = self._keys
        try:
            if keys is not None:
                store = self._client()
                store.compare_set(keys.preempt, "", req.to_json())
                raise_alarm(store, keys)
        except Exception:  # noqa: BLE001 - no store: the grace still bounds the stop
            self._store = None
        self.preempt_request = self.preempt_request or req

    def read_preempt_request(self) -> pp.Request | None:
        """The job's preemption request, read now where no beat has read it yet: a beat reads it only
        when the alarm moves, and the workers may all have ended (stopped at the agreed step, or done
        with their last steps) before this agent's next beat. None: none asked, or the store is gone."""
        keys = self._keys
        if self.preempt_request is None and keys is not None:
            request = pp.Request.parse(self._read_now(keys.preempt))
            with self._lock:  # not into an attempt that started meanwhile (on_workers_started)
                if keys is self._keys:
                    self.preempt_request = self.preempt_request or request
        return self.preempt_request

    def _read_now(self, key: str) -> bytes | None:
        """One bounded read of ``key`` in the job store, off the beats; None where it is not there or
        the store's host is gone (then what the beats read is all there is)."""
        if self._store is None and not self._reachable():
            return None  # its host is gone: a client's connect would wait seconds for nothing
        try:
            store = self._client()
            return store.get(key) if store.check([key]) else None
        except Exception:  # noqa: BLE001 - the store's host has ended
            self._store = None
            return None

    def read_preempt_stop(self) -> str | None:
        """The agreed stop step as stored (NO_STEP: none), read now where the beats have not read it
        yet: a peer whose ranks answered NO_STEP stops its workers at once, and their peers here may
        fail of that before this node's next beat. Where that peer hosted the store, it may be gone
        by then: the answer its agent's record carries (``fr.answer_in``). None: no answer known."""
        keys = self._keys
        if self.preempt_stop is None and self.preempt_request is not None and keys is not None:
            raw = self._read_now(keys.preempt_stop)
            self.preempt_stop = text(raw) if raw is not None else fr.answer_in(self.records())
        return self.preempt_stop

    def read_preempt_saved(self, wait_s: float = 0.0) -> pp.Saved | None:
        """Where rank 0 stopped (protocol/preempt.py Saved), waiting at most ``wait_s`` for it; None if
        it is not there. Rank 0 writes it as it ends, so the others' agents wait for it before the
        exit barrier (after which the store's host may be gone)."""
        keys, deadline = self._keys, time.monotonic() + wait_s
        while keys is not None:
            try:
                store = self._client()
                if store.check([keys.preempt_saved]):
                    return pp.Saved.parse(store.get(keys.preempt_saved))
            except Exception:  # noqa: BLE001 - the store's host has ended
                self._store = None
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        return None

    def mark_stopping(self, why: str = "1") -> None:
        """Torch's agent is about to signal this node's workers (a local worker failed, a restart, the
        end): they stop at once, not for a preemption; after a local failure, a worker that ends by that
        signal without a record of its own was stopped because of the failure, not killed by SIGTERM.
        ``why``: the mark's value (protocol.preempt.STOPPING_FOR_NONE: the job answered that nothing
        stops at a step, and a script's own handler for the signal decides when its rank ends)."""
        with self._lock:
            failed_here = bool(self._local)
        if self.stopping_for is None and failed_here:
            self.stopping_for = self.root_cause()
        if self._relay is not None:  # first, where the workers look first (worker/signals.py)
            self._relay.mark_stopping(self._node, why)
        self._mark(lambda keys: keys.stopping(self._node), why)

    def mark_said(self) -> None:
        """This node printed how its launch ended (a preemption stop); best effort."""
        self._mark(lambda keys: keys.said(self._node))

    def _mark(self, key: Callable[[Keys], str], value: str = "1") -> None:
        """Set this node's mark ``key(keys)`` to ``value``, best effort, on the way out. No store (its host
        is gone: refused at once): nobody reads the mark, and a client's connect timeout is never waited for."""
        keys = self._keys
        if keys is None or (self._store is None and not self._reachable()):
            return
        try:
            self._client().set(key(keys), value)
        except Exception:  # noqa: BLE001 - the store's host is gone
            self._store = None

    def wait_all_said(self, timeout_s: float) -> bool:
        """Node 0: whether every node printed its last line within ``timeout_s`` (:meth:`mark_said`)."""
        keys, deadline = self._keys, time.monotonic() + timeout_s
        if keys is None:
            return False
        wanted = [keys.said(n) for n in range(self._nnodes)]
        while time.monotonic() < deadline:
            try:
                if self._client().check(wanted):
                    return True
            except Exception:  # noqa: BLE001
                self._store = None
                return False
            time.sleep(0.05)
        return False

    def _reachable(self) -> bool:
        """The store's port answers (a refused connect is immediate; a client's connect waits seconds)."""
        from ddprun.agent.endpoint import port_open

        return port_open(self._addr, self._port)

    def exit_barrier_done(self) -> bool:
        """Leave the agents' exit barrier early: a node is lost (this node named it, or another node's
        record says so), or the job failed (a first-hand cause is known): that node will never arrive."""
        return self.lost is not None or self._lost_record() is not None or self.job_failed() is not None

    def exit_barrier_left(self, arrived: int, n: int) -> None:
        """The exit barrier was left having seen ``arrived`` of the ``n`` agents (agent/torch_agent.py)."""
        self._barrier_short = arrived < n

    def _lost_record(self) -> fr.FailureRecord | None:
        """The first record of a lost node (or store) known, else None."""
        return fr.root_cause([rec for rec in self.records() if rec.kind == fr.LOST])

    def lost_before_end(self) -> fr.FailureRecord | None:
        """A node lost while this one waited for the others at the end: the record naming it, when the
        exit barrier was left before every agent arrived (a lost node that had arrived finished its
        ranks, and the job did not fail). None otherwise."""
        return self._lost_record() if self._barrier_short else None

    def job_failed(self) -> fr.FailureRecord | None:
        """The job's first-hand cause read so far when a rank's (a worker's failure, or its end that left
        the others waiting); never an echo, nor a node lost after its ranks may all have finished."""
        cause = self.root_cause()
        return cause if cause is not None and not cause.is_echo and cause.rank >= 0 else None
