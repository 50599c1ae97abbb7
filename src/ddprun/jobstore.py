"""The worker's channel to the agent's TCP store (the rendezvous store torch shares with workers).

Keys live under ``ddprun/<run id>/<attempt id>/`` (:func:`ddprun.attempt.store_prefix`: the c10d
rendezvous round, the same on every node; the store outlives the attempts, so each needs its own):
  ``rank/<N>``          JSON row of rank N (host, pid, device, ranks); ``rank/<N>/count`` catches twins
  ``node/<N>``          preflight facts of the node whose local rank 0 is global rank N
  ``preflight``         rank 0's verdict: ``ok`` or the error; every rank waits for it before user code
  ``progress/<N>``      optimizer steps of rank N (published at most every 0.5 s, only when changed)
  ``stall``             set by rank 0 when no rank advanced for the stall threshold
  ``place/<N>``         where rank N's main thread is, answered on ``stall``
  ``timing/<N>``        rank N's step-time medians over its latest window (telemetry.py), every 2 s
  ``failures``, ``failure/<k>``  the k-th failure: rank, host, summary, exit code

A monitor thread per worker does the polling (a few cheap store calls every 0.5 s, never on the
training step's path): it ends the worker when another rank failed (last attempt only; with
restarts left torch's agent restarts the group), answers stack requests, and in rank 0 detects
stalls and writes the hang report.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from datetime import timedelta

POLL_S = 0.5
PLACES_WAIT_S = 5.0
ACK_WAIT_S = 3.0
DEFAULT_WINDOW_S = 2.0
FINAL_WAIT_S = 2.0
"""How long rank 0 waits, at a clean exit, for the other ranks' last timing window."""
DEFAULT_STALL_S = 300.0


def stall_threshold(stall_s: float, armed: bool) -> float:
    """Seconds without progress that count as a stall. Before any rank's first optimizer step
    (imports, data preparation, compilation) the bound is max(2 x threshold, 30 s)."""
    return stall_s if armed else max(2 * stall_s, 30.0)


class JobRefused(Exception):
    """This worker reached a store that belongs to another job."""


class JobChannel:
    def __init__(self, environ: Mapping[str, str], script: str | None = None):
        self.rank = int(environ["RANK"])
        self.local_rank = int(environ["LOCAL_RANK"])
        self.world_size = int(environ["WORLD_SIZE"])
        self.node_rank = int(environ.get("GROUP_RANK", "0"))
        self.addr = environ["MASTER_ADDR"]
        self.port = int(environ["MASTER_PORT"])
        self.run_dir = environ.get("DDPRUN_RUN_DIR")
        self.join_timeout = float(environ.get("DDPRUN_JOIN_TIMEOUT", "120"))
        self.stall_s = float(environ.get("DDPRUN_STALL_TIMEOUT", str(DEFAULT_STALL_S)))
        self.run_id = environ.get("TORCHELASTIC_RUN_ID", "run")
        self.token = environ.get("DDPRUN_JOB_TOKEN", "")
        self.doctor = environ.get("DDPRUN_DOCTOR") == "1"
        restart = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.last_attempt = restart == environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
        from ddprun.attempt import store_prefix

        self.prefix = store_prefix(environ)
        self.device = f"cuda:{self.local_rank}" if environ.get("DDPRUN_DEVICE_KIND") == "cuda" else "cpu"
        self.host = socket.gethostname()
        self.environ = environ
        self.script = script
        self._store = self._connect()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.counter = None
        self.window_s = float(environ.get("DDPRUN_TELEMETRY_WINDOW", str(DEFAULT_WINDOW_S)))
        self.straggler_margin = float(environ.get("DDPRUN_STRAGGLER_MARGIN", "0.2"))
        self.straggler_windows = int(environ.get("DDPRUN_STRAGGLER_WINDOWS", "3"))
        self._window = 0
        self._seen_windows: dict[int, int] = {}
        self._detector = None
        self.hosts: dict[int, str] = {}

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], script: str | None = None) -> JobChannel | None:
        """A channel when the agent shares its store with the workers (torch's default), else None."""
        if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "RANK" not in environ:
            return None
        try:
            return cls(environ, script)
        except Exception as e:  # noqa: BLE001 - the user's job must still run without the channel
            print(f"ddprun: job store unreachable; rank table, preflight and watchdog are off: {e}", file=sys.stderr)
            return None

    def _connect(self):
        from torch.distributed import TCPStore

        return TCPStore(self.addr, self.port, is_master=False, wait_for_workers=False,
                        timeout=timedelta(seconds=30))

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _wait_for(self, keys: list[str], timeout_s: float, store=None) -> bool:
        store = store or self._store
        deadline = time.monotonic() + timeout_s
        while True:
            if store.check(keys):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    # -- start: claim, announce, preflight ---------------------------------------------------
    def row(self) -> dict:
        return {"rank": self.rank, "local_rank": self.local_rank, "node_rank": self.node_rank,
                "host": self.host, "pid": os.getpid(), "device": self.device}

    def start(self) -> None:
        """Claim the store for this job, publish this rank, and wait for rank 0's preflight verdict.

        Raises JobRefused (another job's store) or SystemExit (preflight error, already reported)."""
        from ddprun.guard import claim, refusal

        other = claim(self._store, self.run_id, self.token)
        if other is not None:
            raise JobRefused(refusal(f"{self.addr}:{self.port}", other, self.run_id))
        if self._store.add(self._key(f"rank/{self.rank}/count"), 1) > 1:
            from ddprun.exit import report_failure

            msg = (f"preflight: global rank {self.rank} was started twice (this one on {self.host}, node rank "
                   f"{self.node_rank}): two nodes share a node rank. HINT: give each node its own --node-rank, "
                   f"or use c10d rendezvous (the default), which numbers nodes itself.")
            print(f"ddprun: {msg}", file=sys.stderr, flush=True)
            report_failure(self, msg, 1)
            raise SystemExit(1)
        self._store.set(self._key(f"rank/{self.rank}"), json.dumps(self.row()))
        self._store.set(self._key(f"progress/{self.rank}"), "0")
        if self.local_rank == 0:
            from ddprun.preflight import node_facts

            self._store.set(self._key(f"node/{self.rank}"), json.dumps(node_facts(self.environ, self.script)))
        if self.rank == 0:
            self._rank0_preflight()
        verdict_key = self._key("preflight")
        if not self._wait_for([verdict_key], self.join_timeout + 10):
            print(f"ddprun: rank 0's preflight verdict did not come within {self.join_timeout + 10:.0f} s; "
                  "going on without it", file=sys.stderr)
            return
        verdict = self._store.get(verdict_key).decode()
        if verdict != "ok" and self.rank != 0:
            from ddprun.exit import stopped_message, write_error_file

            cause = self.first_failure() or {"rank": 0, "node_rank": 0, "host": "?", "summary": verdict}
            msg = stopped_message(cause)
            print(msg, file=sys.stderr, flush=True)
            write_error_file(msg)
            self.ack_failure()
            raise SystemExit(1)

    def _rank0_preflight(self) -> None:
        from ddprun.preflight import check, render_facts
        from ddprun.atomic import write_json_atomic
        from ddprun.ranktable import print_rank_table, write_plan_json

        rows = self.gather(lambda r: f"rank/{r}", range(self.world_size))
        self.hosts = {r["rank"]: r["host"] for r in rows}
        print_rank_table(rows, self.world_size)
        if self.run_dir:
            write_plan_json(self.run_dir, rows, self.world_size)
        missing = sorted(set(range(self.world_size)) - {r["rank"] for r in rows})
        heads = [r["rank"] for r in rows if r["local_rank"] == 0]
        facts = self.gather(lambda r: f"node/{r}", heads)
        findings = check(facts, self.world_size)
        errors = [f for f in findings if f.level == "error"]
        if missing:
            from ddprun.preflight import Finding

            errors.append(Finding("error", f"ranks {missing} did not start within {self.join_timeout:.0f} s"))
        if self.doctor or findings or missing:
            sys.stdout.write(render_facts(facts, findings))
            sys.stdout.flush()
        if self.run_dir:
            write_json_atomic(os.path.join(self.run_dir, "preflight.json"), {
                "nodes": facts, "findings": [f.__dict__ for f in findings]})
        if errors:
            from ddprun.exit import report_failure

            summary = "preflight: " + " | ".join(f.message.split(" HINT:")[0] for f in errors)
            report_failure(self, summary, 1)
            self._store.set(self._key("preflight"), summary)
            print(f"ddprun: {summary}", file=sys.stderr, flush=True)
            raise SystemExit(1)
        self._store.set(self._key("preflight"), "ok")

    def gather(self, key_of, ranks) -> list[dict]:
        """JSON values of ``key_of(r)`` for ``ranks``, waiting at most the join timeout; missing left out."""
        keys = [self._key(key_of(r)) for r in ranks]
        self._wait_for(keys, self.join_timeout)
        return [json.loads(self._store.get(k)) for k in keys if self._store.check([k])]

    # -- failures ----------------------------------------------------------------------------
    def record_failure(self, summary: str, code: int) -> None:
        try:
            k = self._store.add(self._key("failures"), 1)
            record = {"rank": self.rank, "node_rank": self.node_rank, "host": self.host,
                      "summary": summary, "exitcode": code}
            self._store.set(self._key(f"failure/{k}"), json.dumps(record))
            if k == 1:
                self._await_acks()
        except Exception:  # noqa: BLE001 - the store may be gone already; the error file still holds it
            pass

    def _await_acks(self, timeout_s: float = ACK_WAIT_S) -> None:
        """Stay (bounded) until every other rank has read the failure: this process keeps its node's
        agent, and maybe the store the others read it from, alive meanwhile."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._store.add(self._key("acks"), 0) < self.world_size - 1:
            time.sleep(0.05)

    def ack_failure(self, store=None) -> None:
        """Tell the failing rank this one has read its failure."""
        try:
            (store or self._store).add(self._key("acks"), 1)
        except Exception:  # noqa: BLE001
            pass

    def first_failure(self, store=None) -> dict | None:
        store = store or self._store
        key = self._key("failure/1")
        try:
            if not store.check([key]):
                return None
            return json.loads(store.get(key))
        except Exception:  # noqa: BLE001
            return None

    # -- monitor -----------------------------------------------------------------------------
    def start_monitor(self) -> None:
        from ddprun.watchdog import StepCounter

        self.counter = StepCounter().install()
        self._thread = threading.Thread(target=self._monitor, name="ddprun-job-monitor", daemon=True)
        self._thread.start()

    def stop_monitor(self) -> None:
        self._stop.set()

    def flush_timing(self) -> None:
        """At a clean exit: publish the last, partial timing window, so that a run shorter than a
        window (the demo trains in about 2 s) still has every rank's step time in timings.csv.
        Rank 0 waits up to FINAL_WAIT_S for the others' and keeps them. Best effort, never raises."""
        try:
            if self._thread is not None:
                self._thread.join(timeout=2 * POLL_S)  # no window published twice at once
            self._publish_timing(self._store)
            self._store.set(self._key(f"timing-final/{self.rank}"), "1")
            if self.rank == 0:
                keys = [self._key(f"timing-final/{r}") for r in range(self.world_size)]
                self._wait_for(keys, FINAL_WAIT_S)
                self._watch_stragglers(self._store)
        except Exception:  # noqa: BLE001 - the store may be gone; the run itself has succeeded
            pass

    def _monitor(self) -> None:
        try:
            store = self._connect()  # its own connection: never queue behind the main thread's calls
        except Exception:  # noqa: BLE001
            return
        published = 0
        answered = False
        last_total, last_change = -1, time.monotonic()
        last_check = 0.0
        last_window = time.monotonic()
        while not self._stop.wait(POLL_S):
            try:
                if self.last_attempt and self.world_size > 1:
                    failure = self.first_failure(store)
                    if failure and failure["rank"] != self.rank and not self._stop.is_set():
                        self._stopped_by(failure)
                steps = self.counter.steps
                if steps != published:
                    store.set(self._key(f"progress/{self.rank}"), str(steps))
                    published = steps
                if not answered and store.check([self._key("stall")]):
                    self._answer_stall(store)
                    answered = True
                now = time.monotonic()
                if now - last_window >= self.window_s:
                    last_window = now
                    self._publish_timing(store)
                    if self.rank == 0:
                        self._watch_stragglers(store)
                if self.rank == 0 and self.stall_s > 0 and now - last_check >= 1.0:
                    last_check = now
                    keys = [self._key(f"progress/{r}") for r in range(self.world_size)]
                    total = sum(int(v) for v in store.multi_get(keys)) if store.check(keys) else -1
                    if total != last_total:
                        last_total, last_change = total, now
                    elif now - last_change >= stall_threshold(self.stall_s, armed=total > 0):
                        self._report_stall(store, now - last_change)
            except Exception:  # noqa: BLE001 - store gone: the job is ending, the agent decides
                return

    # -- step timing and stragglers ----------------------------------------------------------
    def _publish_timing(self, store) -> None:
        """This rank's medians over the last window, if it made steps (one store write)."""
        from ddprun.telemetry import TIMER, summarize

        summary = summarize(TIMER.drain())
        if summary is None:
            return
        self._window += 1
        summary.update(w=self._window, t=round(time.time(), 3))
        store.set(self._key(f"timing/{self.rank}"), json.dumps(summary))

    def _watch_stragglers(self, store) -> None:
        """Rank 0: read every rank's latest window, keep it in timings.csv, name stragglers."""
        from ddprun.report import EVENTS, TIMING_COLUMNS, TIMINGS
        from ddprun.straggler import StragglerDetector

        keys = [self._key(f"timing/{r}") for r in range(self.world_size)]
        fresh: dict[int, dict] = {}
        for r, key in enumerate(keys):
            if store.check([key]):
                summary = json.loads(store.get(key))
                if summary["w"] != self._seen_windows.get(r):
                    self._seen_windows[r] = summary["w"]
                    fresh[r] = summary
        if not fresh or not self.run_dir:
            return
        path = os.path.join(self.run_dir, TIMINGS)
        new_file = not os.path.exists(path)
        with open(path, "a") as fp:
            if new_file:
                fp.write(",".join(TIMING_COLUMNS) + "\n")
            for r, s in sorted(fresh.items()):
                row = {**s, "rank": r, "window": s["w"]}
                fp.write(",".join("" if row.get(c) is None else str(row[c]) for c in TIMING_COLUMNS) + "\n")
        if self._detector is None:
            self._detector = StragglerDetector(margin=self.straggler_margin, k=self.straggler_windows)
        if len(fresh) < 2:
            return
        for event in self._detector.update(fresh, self.hosts, time.monotonic()):
            msg = f"ddprun: straggler: {event.message()}"
            print(msg, file=sys.stderr, flush=True)
            with open(os.path.join(self.run_dir, EVENTS), "a") as fp:
                fp.write(json.dumps({"kind": "straggler", "t": time.time(), "rank": event.rank, "host": event.host,
                                     "what": event.what, "value_s": event.value_s, "median_s": event.median_s,
                                     "window": fresh[event.rank]["w"], "message": event.message()}) + "\n")

    def _stopped_by(self, failure: dict) -> None:
        from ddprun.exit import stopped_message, write_error_file

        msg = stopped_message(failure)
        print(msg, file=sys.stderr, flush=True)
        write_error_file(msg)
        self.ack_failure()
        sys.stdout.flush()
        os._exit(1)

    def _answer_stall(self, store) -> None:
        from ddprun.watchdog import dump_stacks, main_thread_place

        if self.run_dir:
            try:
                dump_stacks(os.path.join(self.run_dir, "stacks", f"rank-{self.rank}.txt"))
            except OSError:
                pass
        place = main_thread_place()
        place["host"] = self.host
        store.set(self._key(f"place/{self.rank}"), json.dumps(place))

    def _report_stall(self, store, stalled_s: float) -> None:
        from ddprun.exit import write_error_file
        from ddprun.watchdog import hang_report

        store.set(self._key("stall"), "1")
        self._answer_stall(store)
        keys = {r: self._key(f"place/{r}") for r in range(self.world_size)}
        self._wait_for(list(keys.values()), PLACES_WAIT_S, store)
        places = {r: json.loads(store.get(k)) for r, k in keys.items() if store.check([k])}
        steps = {r: int(store.get(self._key(f"progress/{r}"))) for r in range(self.world_size)
                 if store.check([self._key(f"progress/{r}")])}
        summary, report = hang_report(places, self.world_size, stalled_s, steps)
        if self.run_dir:
            os.makedirs(os.path.join(self.run_dir, "stacks"), exist_ok=True)
            with open(os.path.join(self.run_dir, "stacks", "hang-report.txt"), "w") as fp:
                fp.write(report + "\n")
        print(report, file=sys.stderr, flush=True)
        if self.run_dir:
            from ddprun.report import EVENTS

            with open(os.path.join(self.run_dir, EVENTS), "a") as fp:
                fp.write(json.dumps({"kind": "hang", "t": time.time(), "message": summary}) + "\n")
        self.record_failure(f"stall: {summary}", 1)
        write_error_file(f"stall: {summary}")
        sys.stdout.flush()
        os._exit(1)
