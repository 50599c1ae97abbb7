"""The monitor thread beside the user's code in every worker (one read of its node's store a poll,
never on the training step's path).

Every rank: publishes its progress count (telemetry.PROGRESS: optimizer steps, collectives,
heartbeats) when it changed, and its step timings once per window, into its node's store
(agent/noderelay.py: its agent sends the node's counts to the job once a second, and relays the
job's alarm back); a rank whose relay stops beating talks to the job store itself. It ends itself
when another rank failed (last attempt only: with restarts left torch's agent restarts the group),
naming the root cause; answers a stall report's request for its stacks; ends itself if its agent
is gone; acts on preemption signals (:mod:`ddprun.preempt`): the first asks the job to stop, and
every rank agrees on the stop step through the store (protocol/preempt.py); a second one, or one
its agent sends while stopping its workers, ends the rank at once.

Stall observers (rank 0 and the last rank, so a stopped or GIL-bound rank 0 is covered): when no
rank's progress changed for the threshold, the first observer to claim the ``stall`` key collects
every rank's place and stacks and writes the hang report (once); the job ends only when the stall
lasts ``stall_end`` seconds more (then a ``stall`` failure record ends every rank). Progress after
the report re-arms it. Bad values in the store are skipped; a failing poll is said once on the
console and in the run directory, and the thread goes on.
"""

from __future__ import annotations

import collections
import json
import os
import select
import signal
import sys
import threading
import time
from typing import Any

from ddprun import loaderworkers, preempt
from ddprun._util import Bounded, within
from ddprun.preempt import PREEMPT
from ddprun.protocol import defaults
from ddprun.protocol import failure as fr
from ddprun.protocol import preempt as pp
from ddprun.protocol.rundir import RunDir
from ddprun.protocol.store import (
    Announced,
    int_map,
    parse_announced,
    parse_relay,
    parse_relayed,
    present,
    raise_alarm,
    read_counter,
    text,
    value_or_empty,
)
from ddprun.telemetry import PROGRESS, TIMER, summarize
from ddprun.worker import collectives, stacks
from ddprun.worker.channel import JobChannel
from ddprun.worker.exit import record, stopped_message
from ddprun.worker.signals import NodeMark, SignalWatch, left_to_script, wake

RATE_SAMPLE_S = 0.4
"""At least this long between two samples of the step rate (a stop step's horizon, protocol/preempt.py)."""

ANSWERS_POLL_S = 0.02
ANSWERS_POLL_MAX_S = 0.25
"""The stall report's claimant reads the answers' counter this often at first, then less often, up to this."""

MAX_FAILED_POLLS = 20
"""Consecutive failing polls (the store gone: the job is ending) before the thread says so and tries the
store only every RETRY_S; a preemption signal then ends the rank at once (no store to agree through)."""

RETRY_S = 5.0


def stall_threshold(stall_s: float, armed: bool) -> float:
    """Seconds without progress that count as a stall. Before the observer's loop runs (``armed``
    False, telemetry.Progress.began: imports, data preparation, compilation, the first batch) the
    bound is max(2 x threshold, 30 s)."""
    return stall_s if armed else max(2 * stall_s, defaults.STALL_FIRST_STEP_MIN_S)


def observers(world_size: int) -> set[int]:
    """The ranks that watch for stalls: rank 0 and the last rank."""
    return {0, world_size - 1}


def parse_int(raw: Any) -> int | None:
    try:
        return int(raw)
    except (TypeError, ValueError):
        return None


class StallObserver:
    """One observer's view: the job's progress total over time, and the report/end decisions (pure)."""

    def __init__(self, stall_s: float, end_s: float, grace_s: float = 0.0):
        self.stall_s, self.end_s, self.grace_s = stall_s, end_s, grace_s
        self.total, self.since = -1, time.monotonic()
        self.reported_at: float | None = None
        self.began = False

    def update(self, total: int, now: float, began: bool) -> str:
        """``report``, ``end``, ``resumed`` or ``""`` for the job-wide progress ``total`` seen at ``now``;
        ``began``: whether the observer's own loop runs (:func:`stall_threshold`,
        telemetry.Progress.began). Its own, because in DDP its first step waits for every rank's first
        backward, while a job's total > 0 may be ddprun's setup collectives with every rank's first
        batch still to come, or one rank's first forward while another's first batch is slow.

        The loop's start is progress itself: the total comes through the agents' beats (up to a
        second late), and the time before it, under the longer bound, must not count against the
        short one."""
        started, self.began = began and not self.began, began  # began again: Lightning's next fit
        if total != self.total or started:
            resumed = self.reported_at is not None
            self.total, self.since, self.reported_at = total, now, None
            return "resumed" if resumed else ""
        stalled = now - self.since
        if self.reported_at is None and stalled >= stall_threshold(self.stall_s, armed=began) + self.grace_s:
            self.reported_at = now
            return "report"
        if self.reported_at is not None and now - self.reported_at >= self.end_s:
            return "end"
        return ""


def left_to_handler(cause: fr.FailureRecord) -> bool:
    """Whether a peer's record is no reason to stop this rank yet: an agent stopped its workers with a
    signal because nothing in the job stops at a step, and this script handles that signal itself (as
    under torchrun, its handlers decide: a flag the ranks agree on, a save, their exit). Every node's
    agent gets it where the cluster deletes the job (Kubernetes: every pod). The monitor leaves it for
    as long as an agent gives such a handler (defaults.STOP_GRACE_S), then stops the rank as ever: a
    peer that ended without such agreement, with this rank's own agent never signalled."""
    if cause.kind != fr.SIGNAL or cause.by != "agent" or cause.stop_step != pp.NO_STEP:
        return False
    signum = getattr(signal, str(cause.signal), None)
    return isinstance(signum, int) and preempt.stops_itself(signum)


class Monitor:
    """The thread (module docstring); :meth:`start` after the channel started, :meth:`stop` at exit."""

    def __init__(self, ch: JobChannel):
        self.ch = ch
        self.rundir = RunDir(ch.run_dir)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ddprun-monitor", daemon=True)
        self._ppid = os.getppid()
        self._published, self._published_at = -1, float("-inf")
        self._alarm: int | None = -1
        """The alarm counter as last read (protocol/store.py): -1 reads everything at the first poll."""
        self._answered = ""
        self._last_window = self._last_check = time.monotonic()
        self._window = 0
        self._failed_polls = 0
        self._node: Any = None
        """The node store's client (agent/noderelay.py), once connected."""
        self._direct = not ch.wenv.node_store
        """This rank talks to the job store itself: no node store, or its relay stopped beating."""
        self._registered = False
        self._relay_seen: tuple[int, float] = (-1, time.monotonic())
        """The relay's latest beat and when it moved (at first: the thread's start)."""
        self._alive_at = time.monotonic()
        """When this thread's last poll ended (:meth:`_held`)."""
        self._interval = defaults.MONITOR_POLL_S
        """The last wait between polls (s): RETRY_S while the job store is gone."""
        self._directs: set[int] = set()
        self._directs_read = 0
        """Readers (observers, rank 0): the ranks registered as talking to the job store, and how many."""
        self._echo_seen: float | None = None
        self._left_since: float | None = None
        """When a peer's record this rank leaves to its script's signal handler came (left_to_handler)."""
        self._claim: str | None = None
        """The stall request this observer wrote (its report's), until progress resumes and it clears it.
        Kept here: the other observer's read of a request already cleared would wait the client's 30 s."""
        self._detail = self._summary = ""
        self._signal_watch: SignalWatch | None = None
        self._handed: collections.deque[int] = collections.deque()
        """Signals the signal thread handed over (worker/signals.py), not read yet."""
        self._wake: tuple[int, int] | None = None
        """A pipe that :meth:`stop` and the signal thread write to, to end the thread's wait at once."""
        self._rate_samples: collections.deque[tuple[float, int]] = collections.deque(maxlen=12)
        wenv = ch.wenv
        # rank 0 reports first (its output is on a console); the backup only if rank 0 does not
        grace = 0.0 if ch.rank == 0 else defaults.PLACES_WAIT_S + 2 * defaults.STALL_CHECK_S
        self.observer = (StallObserver(wenv.stall_timeout, wenv.stall_end, grace)
                         if wenv.stall_timeout > 0 and ch.rank in observers(ch.world_size) else None)
        self.stragglers = None
        if ch.rank == 0:
            from ddprun.worker.stragglers import StragglerWatch

            self.stragglers = StragglerWatch(ch.run_dir, wenv.straggler_margin, wenv.straggler_windows)

    def start(self, signal_fd: int | None = None) -> Monitor:
        """``signal_fd``: where preemption signals arrive (:func:`ddprun.preempt.install`); a thread of
        their own reads them (worker/signals.py) and hands this one those that are not its agent's stop."""
        if signal_fd is not None:  # a handed signal, and stop(), end this thread's wait at once
            self._wake = os.pipe()
            ch = self.ch
            mark = NodeMark((lambda: ch.connect_node(defaults.RELAY_STALE_S)) if ch.wenv.node_store else None)
            self._signal_watch = SignalWatch(signal_fd, mark, ch.keys.stopping(ch.node_rank), self._hand)
        self._thread.start()
        if self._signal_watch is not None:
            self._signal_watch.start()
        return self

    def _hand(self, sigs: list[int]) -> None:
        """The signal thread's: signals for the monitor. While the job store is gone (:meth:`_gone`)
        there is no stop step to agree through, and the monitor may wait in a connect for the
        client's timeout: the first ends the rank here, as it does without ddprun."""
        if self._gone():
            preempt.die_by(sigs[0])
        self._handed.extend(sigs)
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None:
            wake(self._wake[1])

    def stop(self) -> None:
        self._stop.set()
        if self._signal_watch is not None:
            self._signal_watch.stop()
        self._poke()

    def flush_timing(self) -> None:
        """At a clean exit: publish the last, partial timing window, so that a run shorter than a
        window (the demo trains in about 2 s) still has every rank's step time in timings.csv.
        Rank 0 waits up to FINAL_TIMING_WAIT_S for the others' and keeps them. Best effort, never raises."""
        self.stop()
        try:
            if self._thread.is_alive():  # no window published twice at once
                self._thread.join(timeout=2 * defaults.MONITOR_POLL_S)
            store, keys = self.ch.store, self.ch.keys
            self._publish_timing(store)
            store.set(keys.timing_final(self.ch.rank), "1")
            if self.stragglers is not None:
                self.ch.wait_for([keys.timing_final(r) for r in range(self.ch.world_size)],
                                 defaults.FINAL_TIMING_WAIT_S)
                self.stragglers.update(self._timings(store, final=True), self.ch.hosts, time.monotonic())
        except Exception:  # noqa: BLE001 - the store may be gone; the run itself has succeeded
            pass

    def _loop(self) -> None:
        """Poll until stopped; never ends by itself while its signal thread may hand it signals."""
        store = None
        while (sigs := self._wait()) is not None:
            try:
                store = store or self.ch.connect()  # its own connection: never queue behind the main thread
                if sigs:
                    self._signals(store, sigs)
                    sigs = []  # asked: a call below that fails is made again next poll, not this signal's end
                self._tick(store)
                if self._gone():
                    self._note(f"rank {self.ch.rank}'s monitor: the job store answers again; the watch goes on")
                self._failed_polls = 0
            except Exception as e:  # noqa: BLE001 - say it, keep watching; the store may be briefly away
                store = None
                self._alive_at = time.monotonic()  # it ran: a failed poll (or connect) is no hold
                if sigs:  # no store to agree through: the agent or the store's host is going away
                    preempt.die_by(sigs[0])
                self._poll_failed(e)

    def _gone(self) -> bool:
        """The job store has failed MAX_FAILED_POLLS polls in a row (and none since has succeeded)."""
        return self._failed_polls >= MAX_FAILED_POLLS

    def _wait(self) -> list[int] | None:
        """One poll interval (RETRY_S once the store is gone), or less when a signal is handed over:
        the signals handed; None at stop."""
        interval = RETRY_S if self._gone() else defaults.MONITOR_POLL_S
        self._interval = interval  # a gap of it is this thread's own wait, no hold (_held)
        if self._wake is None:
            return None if self._stop.wait(interval) else []
        ready, _, _ = select.select([self._wake[0]], [], [], interval)
        if ready:
            try:
                os.read(self._wake[0], 64)
            except OSError:
                pass
        if self._stop.is_set():
            return None
        sigs = []
        while self._handed:
            sigs.append(self._handed.popleft())
        return sigs

    def _poll_failed(self, e: Exception) -> None:
        """Say a failing poll once, and once more when the store counts as gone (:meth:`_gone`)."""
        self._failed_polls += 1
        what = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if self._failed_polls == 1:
            self._note(f"rank {self.ch.rank}'s monitor: a poll of the job store failed ({what}); still watching")
        if self._failed_polls == MAX_FAILED_POLLS:
            self._note(f"rank {self.ch.rank}'s monitor: the job store has not answered for "
                       f"{MAX_FAILED_POLLS * defaults.MONITOR_POLL_S:.0f} s; it is tried every {RETRY_S:g} s, "
                       "and a preemption signal ends this rank at once")

    def _note(self, msg: str) -> None:
        print(f"ddprun: {msg}", file=sys.stderr, flush=True)
        try:
            with open(self.rundir.join("logs", f"monitor-rank-{self.ch.rank}.log"), "a") as fp:
                fp.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}\n")
        except OSError:
            pass

    def _tick(self, store: Any) -> None:
        self._held(time.monotonic())
        try:
            self._poll(store)
        finally:
            self._alive_at = time.monotonic()

    def _poll(self, store: Any) -> None:
        if os.getppid() != self._ppid:  # the agent is gone (PR_SET_PDEATHSIG does this on Linux first)
            os._exit(1)
        ch = self.ch
        self._sample_rate()
        self._watch_events(store)
        busy = PROGRESS.busy_since
        if busy is not None and time.monotonic() - busy < ch.wenv.busy_limit_s:
            PROGRESS.beats += 1  # a declared phase (telemetry.busy): a checkpoint write, a validation pass
        self._publish_progress(store)
        now = time.monotonic()
        if now - self._last_window >= ch.wenv.telemetry_window:
            self._last_window = now
            self._publish_timing(self._node_store() or store)
            if self.stragglers is not None:
                self.stragglers.update(self._timings(store), ch.hosts, now)
        if self.observer is not None and now - self._last_check >= defaults.STALL_CHECK_S:
            self._last_check = now
            self._observe(store, now)

    def _watch_events(self, store: Any) -> None:
        """One read of the alarm a poll (from the node store while its relay beats); what it announces
        is read only when it moved (or while this rank still waits on it: a first-hand record after an
        echo, its own preemption signal), from the relay's copies while it beats: a quiet move costs
        the job store nothing from this rank (a stall request then costs it one write, the answer)."""
        alarm = self._relayed_alarm(store)
        relayed = alarm is not None
        if alarm is None:
            alarm = read_counter(store, self.ch.keys.alarm)
        moved = alarm is None or alarm != self._alarm  # not a number: it may never move again, so read on
        if self.ch.world_size > 1 and (moved or self._echo_seen is not None or self._left_since is not None):
            self._watch_failures(store, relayed)
        said = self._relayed_announced() if relayed and moved else None
        if moved or (PREEMPT.signum is not None and not PREEMPT.requested):
            self._watch_preemption(store, said)
        if moved:
            self._answer_stall(store, said)
        self._alarm = alarm  # only once all of it was read: a failing read reads it again next poll

    # -- the node store ------------------------------------------------------------------------
    def _node_store(self) -> Any:
        """The node store's client; None once this rank talks to the job store itself."""
        if self._direct:
            return None
        if self._node is None:
            try:  # every call bounded: a frozen agent (SIGSTOP) holds a TCPStore client for ever; the
                # connect gives up when the bound does (no attempt left running on its helper thread)
                node = within(defaults.RELAY_STALE_S, self.ch.connect_node, defaults.RELAY_STALE_S)
            except Exception as e:  # noqa: BLE001 - the job store still works
                self._go_direct(f"its node store is unreachable ({type(e).__name__})")
                return None
            if node is None:
                self._direct = True
                return None
            self._node = Bounded(node, defaults.RELAY_STALE_S)
        return self._node

    def _publish_progress(self, store: Any) -> None:
        """This rank's count when it changed: into the node store (a local write, every poll), or into
        the job store at most once every PROGRESS_PUBLISH_S."""
        total, now, node, key = PROGRESS.total, time.monotonic(), self._node_store(), self.ch.keys.progress(self.ch.rank)
        if total == self._published:
            return
        if node is not None:
            try:
                node.set(key, str(total))
                self._published = total
                return
            except Exception as e:  # noqa: BLE001 - its agent is gone or broken: the job store still works
                self._node_failed(e)
        if now - self._published_at >= defaults.PROGRESS_PUBLISH_S:
            store.set(key, str(total))
            self._published, self._published_at = total, now

    def _relayed_alarm(self, store: Any) -> int | None:
        """The job's alarm as this node's relay last read it; None: read the job store's (no relay
        yet, or none any more)."""
        node, key = self._node_store(), self.ch.keys.relay
        if node is None:
            self._register(store)
            return None
        try:
            relay = parse_relay(node.get(key)) if node.check([key]) else None
        except Exception as e:  # noqa: BLE001 - its agent is gone or broken: the job store still works
            self._node_failed(e)
            return None
        now = time.monotonic()
        if relay is not None and relay[0] != self._relay_seen[0]:
            self._relay_seen = (relay[0], now)
        if now - self._relay_seen[1] >= defaults.RELAY_STALE_S:
            self._go_direct(f"its node's relay has not beaten for {now - self._relay_seen[1]:.0f} s")
            self._register(store)
            return None
        return relay[1] if relay is not None else None

    def _held(self, now: float) -> None:
        """This thread did not run for defaults.HELD_GAP_S between the end of its last poll and ``now``
        (the job suspended, this rank frozen; a slow store call inside a poll is no such gap): the
        relay's beat and the job's progress are judged from now (the others did not run either), so a
        resume is no hang report and no switch to the job store."""
        if now - self._alive_at > defaults.HELD_GAP_S + self._interval:
            self._relay_seen = (self._relay_seen[0], now)
            obs = self.observer
            if obs is not None:
                obs.since = now
                if obs.reported_at is not None:
                    obs.reported_at = now

    def _node_failed(self, e: Exception) -> None:
        self._go_direct(f"its node store did not answer within {defaults.RELAY_STALE_S:.0f} s (its agent is stopped "
                        "or frozen)" if isinstance(e, TimeoutError) else f"its node store failed ({type(e).__name__})")

    def _go_direct(self, why: str) -> None:
        """From now on (this attempt) this rank publishes to the job store itself."""
        self._direct, self._node, self._published = True, None, -1
        self._note(f"rank {self.ch.rank}'s monitor: {why}; it reports to the job store itself")

    def _register(self, store: Any) -> None:
        """Once, when direct: readers learn to read this rank's own keys (also a rank whose agent gave
        no node store: the other nodes' may have one)."""
        if self._registered:
            return
        keys = self.ch.keys
        if read_counter(store, keys.directs) is None:  # its add would fail, and close the connection
            self._note(f"rank {self.ch.rank}'s monitor: the store's {keys.directs!r} holds no number; "
                       "this rank cannot register as reporting to the job store itself")
        else:
            store.set(keys.direct(int(store.add(keys.directs, 1))), str(self.ch.rank))
        self._registered = True

    def _direct_ranks(self, store: Any) -> set[int]:
        """Readers: the ranks registered by :meth:`_register` (one call while none is new); every rank
        in a job without node stores (its agents gave none)."""
        if not self.ch.wenv.node_store:
            return set(range(self.ch.world_size))
        keys, n = self.ch.keys, read_counter(store, self.ch.keys.directs) or 0
        if n > self._directs_read:
            names = [keys.direct(k) for k in range(self._directs_read + 1, n + 1)]
            found = present(store, names)
            for raw in store.multi_get(found) if found else []:
                r = parse_int(raw)
                if r is not None and 0 <= r < self.ch.world_size:
                    self._directs.add(r)
            if len(found) == len(names):  # else one is still being written: read them again next time
                self._directs_read = n
        return self._directs

    def _node_records(self, store: Any, key: Any) -> list[Any]:
        """Every node's record ``key(node)`` (one batched read), decoded; missing or malformed left out."""
        return list(self.ch.gather([key(n) for n in range(self.ch.nnodes)], 0, store).values())

    # -- failures ----------------------------------------------------------------------------
    def _watch_failures(self, store: Any, relayed: bool = False) -> None:
        """``relayed``: the alarm came from the relay, whose records are read first (on this node)."""
        if not self.ch.last_attempt:
            return
        known, cause = self._relayed_cause() if relayed else (False, None)
        if not known:
            cause = self.ch.cause(store)
        if cause is None or self._stop.is_set():
            return
        if left_to_handler(cause):  # for as long as an agent gives a script's handler, then as ever
            self._left_since = self._left_since or time.monotonic()
            if time.monotonic() - self._left_since < defaults.STOP_GRACE_S:
                return
        if cause.is_echo:  # give the first-hand record (its agent's, say) a moment to arrive
            self._echo_seen = self._echo_seen or time.monotonic()
            if time.monotonic() - self._echo_seen < defaults.ECHO_WAIT_S:
                return
        self._stopped_by(cause, store)

    def _relayed_cause(self) -> tuple[bool, fr.FailureRecord | None]:
        """(known, cause): the cause among the records the relay read with the alarm it relays (no
        record: None); known is False when the node store cannot say (gone, or a value that is not a
        record list), and the job store's records are read instead."""
        node, key = self._node_store(), self.ch.keys.relayed_causes
        if node is None:
            return False, None
        try:
            raw = node.get(key) if node.check([key]) else None
        except Exception as e:  # noqa: BLE001 - its agent is gone or broken: the job store still works
            self._node_failed(e)
            return False, None
        records = parse_relayed(raw) if raw is not None else []
        if records is None:
            return False, None
        return True, self.ch.cause_among(records)

    def _relayed_announced(self) -> Announced | None:
        """The preemption and stall requests the relay read with the alarm it relays; None when the
        node store cannot say (gone, not written yet, a malformed value): the job store is read then."""
        node, key = self._node_store(), self.ch.keys.relayed_announced
        if node is None:
            return None
        try:
            return parse_announced(node.get(key)) if node.check([key]) else None
        except Exception as e:  # noqa: BLE001 - its agent is gone or broken: the job store still works
            self._node_failed(e)
            return None

    def _stopped_by(self, cause: fr.FailureRecord, store: Any) -> None:
        msg = stopped_message(cause, self.ch)
        print(msg, file=sys.stderr, flush=True)
        rec = self.ch.stopped(cause)
        from ddprun.worker.exit import write_error_file

        write_error_file(msg, record=rec)
        self._record_stopped(rec, store)
        sys.stdout.flush()
        os._exit(1)

    def _record_stopped(self, rec: fr.FailureRecord, store: Any) -> None:
        """Publish that this rank was stopped, and that it read the cause: through its agent while
        its relay beats (one batch a node, channel.leave_to_agent), else into the job store itself."""
        if not self._direct and self.ch.leave_to_agent(rec):
            return
        self.ch.record_failure(rec)
        self.ch.ack_failure(store)

    # -- preemption --------------------------------------------------------------------------
    def _signals(self, store: Any, sigs: list[int]) -> None:
        """Preemption signals that reached this rank (module docstring)."""
        for sig in sigs:
            why = self._agent_stopping(store)
            if why and left_to_script(why, sig):
                continue  # the script's own handler ends it (worker/signals.py)
            if why:
                preempt.die_by(sig)  # torch's agent stops its workers: as it always did
            if PREEMPT.signum is None:
                PREEMPT.signum = sig
                name = signal.Signals(sig).name
                req = pp.Request(name, f"rank {self.ch.rank}", self.ch.node_rank, self.ch.host, time.time())
                store.compare_set(self.ch.keys.preempt, "", req.to_json())
                raise_alarm(store, self.ch.keys)
                self._note(f"rank {self.ch.rank} got {name}: asking every rank to stop at one step "
                           f"(a second signal stops this rank at once)")
            else:
                self._forced(sig)

    def _agent_stopping(self, store: Any) -> str:
        """The agent's stop mark in the job store ("" when none; "1" when the store does not answer)."""
        key = self.ch.keys.stopping(self.ch.node_rank)
        try:
            return (text(store.get(key)) or "1") if store.check([key]) else ""
        except Exception:  # noqa: BLE001 - no store: the job is ending anyway
            return "1"

    def _forced(self, sig: int) -> None:
        """A second preemption signal: end this rank now, with one line and a record."""
        name = signal.Signals(sig).name
        where = f"at step {PROGRESS.steps}" + (f", before the agreed stop step {PREEMPT.stop_step}"
                                                if PREEMPT.stop_step is not None else "")
        rec = self.ch.me(fr.SIGNAL, f"stopped by a second {name} {where}", exit_code=128 + sig)
        print(f"ddprun: rank {self.ch.rank} stopped by a second {name} {where}", file=sys.stderr, flush=True)
        record(rec, self.ch)
        sys.stdout.flush()
        os._exit(128 + sig)

    def _watch_preemption(self, store: Any, said: Announced | None = None) -> None:
        """Once the job is asked to stop: propose a stop step (``none`` where nothing in this process
        stops at one: neither ddprun.fit nor an on_preempt callback), keep what the job agreed on.
        ``said``: the request as the relay read it (None: read the job store)."""
        steps, keys = PROGRESS.steps, self.ch.keys
        if PREEMPT.requested:
            return
        if said is None:  # one check a move until the job is asked to stop
            said = Announced(preempt=value_or_empty(store, keys.preempt))
        if not said.preempt and PREEMPT.signum is None:
            return
        req = pp.Request.parse(said.preempt) if said.preempt else None
        signame = req.signal if req else signal.Signals(PREEMPT.signum or 15).name
        consumer = PREEMPT.fit_active or bool(PREEMPT.callbacks)
        mine = str(pp.propose(steps, self._rate())) if consumer else pp.NO_STEP
        agreed = text(store.compare_set(keys.preempt_stop, "", mine))
        # only now: a call that failed above (a store timeout as every rank asks at once) is made again
        # next poll; marked before, this rank would never learn the stop step the others stop at
        PREEMPT.requested, PREEMPT.signame = True, signame
        if agreed == pp.NO_STEP:
            if PREEMPT.signum is not None and preempt.left_to_own_handler(PREEMPT.signum, defaults.OWN_HANDLER_WAIT_S):
                self._note(f"rank {self.ch.rank}: nothing stops at a step, and the script handles {signame} "
                           "itself: its handler decides when this rank ends, as under torchrun")
            elif PREEMPT.signum is not None:  # nothing stops at a step: this signal does what it always did
                preempt.die_by(PREEMPT.signum)  # (after the script's handler, if any, returned: 5 s at most)
            return  # the signalled processes end now; this rank then ends as a peer of theirs
        stop = parse_int(agreed)
        if stop is None:
            return  # a malformed value: not ours to repair; the agent's grace bounds the stop
        PREEMPT.stop_step = stop
        asked = req.where() if req else "this rank"
        self._note(f"rank {self.ch.rank}: stopping after optimizer step {stop} of this launch for {PREEMPT.signame} "
                   f"(asked by {asked}; now at step {steps})")
        if steps > stop:
            self._note(f"rank {self.ch.rank} is past the agreed stop step ({steps} > {stop}): it stops at its "
                       f"next step, or its agent stops it at the end of the grace")

    def _sample_rate(self) -> None:
        """This rank's step count over time, for :meth:`_rate` (a signal wakes the thread early: no
        rate over a millisecond)."""
        now = time.monotonic()
        if not self._rate_samples or now - self._rate_samples[-1][0] >= RATE_SAMPLE_S:
            self._rate_samples.append((now, PROGRESS.steps))

    def _rate(self) -> float | None:
        """This rank's fastest optimizer steps per second: between two polls of the last few seconds,
        or its latest step's own time (the fastest, not the mean: a mean over start-up or a validation
        pass is far too slow, and a stop step proposed too close is one a rank may pass before it learns
        it). None before any of them."""
        samples = list(self._rate_samples)
        rates = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(samples, samples[1:]) if b[0] > a[0]]
        if PROGRESS.step_s > 0:  # the latest step's own time: right from the second step on
            rates.append(1.0 / PROGRESS.step_s)
        return max(rates) if rates else None

    # -- stalls ------------------------------------------------------------------------------
    def _answer_stall(self, store: Any, said: Announced | None = None) -> None:
        """On a stall request not answered yet: this rank's stacks into the run dir, its place into
        the job store. ``said``: the request as the relay read it (None: read the job store)."""
        keys = self.ch.keys
        if said is None:
            said = Announced(stall=value_or_empty(store, keys.stall))
        request = said.stall
        if not request:
            self._answered = ""
            return
        if request == self._answered:
            return
        self._answered = request
        try:
            stacks.dump_stacks(self.rundir.stack_file(self.ch.rank))
        except OSError:
            pass
        place = stacks.main_thread_place()
        place.update(request=request, host=self.ch.host, phase=PROGRESS.phase, steps=PROGRESS.steps,
                     loaders=stacks.loader_places(place, self.rundir.loader_stack_prefix(self.ch.rank)
                                                  if loaderworkers.SERVING else None),
                     collectives=collectives.last_collectives(self.rundir.flight_recorder_file(self.ch.rank)))
        store.set(keys.place(self.ch.rank), json.dumps(place))
        store.add(keys.answers(request), 1)  # counted after the place: the claimant reads the places then

    def _progress(self, store: Any) -> dict[int, int]:
        """rank -> progress count: from every node's heartbeat, and the own keys of the direct ranks."""
        out: dict[int, int] = {}
        for rec in self._node_records(store, self.ch.keys.agent):
            if isinstance(rec, dict):
                out.update(int_map(rec.get("progress")))
        direct = sorted(self._direct_ranks(store))
        names = present(store, [self.ch.keys.progress(r) for r in direct])
        for key, raw in zip(names, store.multi_get(names) if names else []):
            v = parse_int(raw)
            if v is not None:
                out[int(key.rsplit("/", 1)[1])] = v
        return out

    def _observe(self, store: Any, now: float) -> None:
        obs = self.observer
        if obs is None:
            return
        decision = obs.update(sum(self._progress(store).values()), now, PROGRESS.began)
        if decision == "report":
            self._report(store, now - obs.since)
        elif decision == "resumed" and self._claim is not None:  # this observer wrote the report: it clears it
            for r in range(self.ch.world_size):  # the next report must not read this one's answers
                store.delete_key(self.ch.keys.place(r))
            store.delete_key(self.ch.keys.answers(self._claim))
            store.delete_key(self.ch.keys.stall_summary)
            store.delete_key(self.ch.keys.stall)
            self._claim = None
            raise_alarm(store, self.ch.keys)  # the others answer the next report again
            self._note("progress resumed after the hang report; the job goes on")
        elif decision == "end":
            self._end_stalled(now - obs.since)

    def _report(self, store: Any, stalled_s: float) -> None:
        """Claim the report; the claimant gathers every rank's place and writes and prints it once."""
        keys, ch = self.ch.keys, self.ch
        mine = json.dumps({"by": ch.rank, "t": time.time()})
        held = store.compare_set(keys.stall, "", mine).decode(errors="replace")
        if held != mine and held == self._claim:  # this observer's last report, whose clean-up failed
            held = store.compare_set(keys.stall, held, mine).decode(errors="replace")
        if held != mine:
            return  # another observer reports this stall
        self._claim = mine
        raise_alarm(store, keys)
        self._answer_stall(store)
        places_keys = [keys.place(r) for r in range(ch.world_size)]
        self._await_answers(store, mine)
        got = ch.gather(places_keys, 0, store)
        # an answer to an earlier report that came after its clean-up is not one to this report
        places = {r: got[k] for r, k in enumerate(places_keys) if isinstance(got.get(k), dict)
                  and isinstance(got[k].get("where"), str) and got[k].get("request") == mine}
        steps = {r: int(p.get("steps", 0)) for r, p in places.items() if isinstance(p.get("steps", 0), int)}
        summary, report = stacks.hang_report(places, ch.world_size, stalled_s, steps, collectives.attribution(places),
                                             ch.first_clean_end(store) if len(places) < ch.world_size else None)
        self._detail = summary.split(": ", 1)[1] if ": " in summary else ""
        self._summary = summary
        end_s = ch.wenv.stall_end
        report += (f"\nThe job ends if no rank advances within {end_s:.0f} s more (--stall-end-after)."
                   if end_s > 0 else "")
        self._write_report(report)
        print(report, file=sys.stderr, flush=True)
        store.set(keys.stall_summary, json.dumps({"by": ch.rank, "host": ch.host, "summary": summary}))
        raise_alarm(store, keys)  # the agents read the summary when the alarm moves

    def _await_answers(self, store: Any, request: str) -> None:
        """Until every rank answered ``request`` (its counter, :meth:`Keys.answers`), at most
        PLACES_WAIT_S: one read of one key a poll, the polls ANSWERS_POLL_S apart growing to
        ANSWERS_POLL_MAX_S. Checking every rank's place instead cost 20-110 ms a poll at 8,192 ranks,
        every 20 ms, on the store's one thread while the ranks wrote their answers to it."""
        key, pause = self.ch.keys.answers(request), ANSWERS_POLL_S
        deadline = time.monotonic() + defaults.PLACES_WAIT_S
        while (read_counter(store, key) or 0) < self.ch.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(pause, left))
            pause = min(pause * 1.5, ANSWERS_POLL_MAX_S)

    def _write_report(self, report: str) -> None:
        try:
            os.makedirs(self.rundir.stacks, exist_ok=True)
            with open(self.rundir.hang_report, "w") as fp:
                fp.write(report + "\n")
            with open(self.rundir.events_jsonl, "a") as fp:
                fp.write(json.dumps({"kind": "hang", "t": time.time(), "message": self._summary}) + "\n")
        except OSError as e:
            print(f"ddprun: could not write the hang report: {e}", file=sys.stderr, flush=True)

    def _end_stalled(self, stalled_s: float) -> None:
        """The stall outlasted the report by stall_end: a ``stall`` record ends every rank (this one now)."""
        if not self._detail:  # another observer wrote the report: its summary says where the ranks are
            with_summary = self.ch.gather([self.ch.keys.stall_summary], 0).get(self.ch.keys.stall_summary)
            text = with_summary.get("summary", "") if isinstance(with_summary, dict) else ""
            self._detail = text.split(": ", 1)[1] if isinstance(text, str) and ": " in text else ""
        summary = f"no rank advanced for {stalled_s:.0f} s" + (f": {self._detail}" if self._detail else "")
        rec = self.ch.me(fr.STALL, f"stall: {summary}")
        print(f"ddprun: ending the job: {rec.summary}", file=sys.stderr, flush=True)
        record(rec, self.ch)
        sys.stdout.flush()
        os._exit(1)

    # -- timing ------------------------------------------------------------------------------
    def _publish_timing(self, store: Any) -> None:
        """This rank's medians over the last window, if it made steps (one write, to ``store``: the
        node's, or the job's)."""
        summary = summarize(TIMER.drain())
        if summary is None:
            return
        self._window += 1
        summary.update(w=self._window, t=round(time.time(), 3))
        store.set(self.ch.keys.timing(self.ch.rank), json.dumps(summary))

    def _timings(self, store: Any, final: bool = False) -> dict[int, object]:
        """rank -> latest timing window: from every node's record, then the ranks' own keys in the job
        store (the direct ranks'; ``final``: every rank's last window, published at its exit)."""
        out: dict[int, object] = {}
        for rec in self._node_records(store, self.ch.keys.node_timing):
            if isinstance(rec, dict):
                out.update({int(r): v for r, v in rec.items() if str(r).isdigit()})
        ranks = range(self.ch.world_size) if final else sorted(self._direct_ranks(store))
        got = self.ch.gather([self.ch.keys.timing(r) for r in ranks], 0, store)
        out.update({int(k.rsplit("/", 1)[1]): v for k, v in got.items()})
        return out
