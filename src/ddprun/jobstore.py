"""The worker's channel to the agent's TCP store (the rendezvous store torch shares with workers).

Keys live under ``ddprun/<run id>/<restart count>/``:
  ``rank/<N>``     JSON row of rank N: host, pid, device, ranks (published at start)
  ``failures``     a counter; ``failure/<k>`` the k-th failure: rank, host, summary, exit code

Rank 0 gathers the rows into the rank table and ``plan.json``. A monitor thread in every worker
polls ``failure/1`` (one cheap ``check`` every 0.5 s, never on the training step's path) and ends
the worker when another rank failed, naming it. On the last allowed attempt only: with restarts
left, torch's agent restarts the group itself.
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


class JobChannel:
    def __init__(self, environ: Mapping[str, str]):
        self.rank = int(environ["RANK"])
        self.local_rank = int(environ["LOCAL_RANK"])
        self.world_size = int(environ["WORLD_SIZE"])
        self.node_rank = int(environ.get("GROUP_RANK", "0"))
        self.addr = environ["MASTER_ADDR"]
        self.port = int(environ["MASTER_PORT"])
        self.run_dir = environ.get("DDPRUN_RUN_DIR")
        self.join_timeout = float(environ.get("DDPRUN_JOIN_TIMEOUT", "120"))
        restart = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.last_attempt = restart == environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
        self.prefix = f"ddprun/{environ.get('TORCHELASTIC_RUN_ID', 'run')}/{restart}/"
        self.device = environ.get("DDPRUN_DEVICE") or (
            f"cuda:{self.local_rank}" if environ.get("DDPRUN_DEVICE_KIND") == "cuda" else "cpu")
        self.host = socket.gethostname()
        self._store = self._connect()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> JobChannel | None:
        """A channel when the agent shares its store with the workers (torch's default), else None."""
        if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "RANK" not in environ:
            return None
        try:
            return cls(environ)
        except Exception as e:  # noqa: BLE001 - the user's job must still run without the channel
            print(f"ddprun: job store unreachable, rank table and failure propagation off: {e}", file=sys.stderr)
            return None

    def _connect(self):
        from torch.distributed import TCPStore

        return TCPStore(self.addr, self.port, is_master=False, wait_for_workers=False,
                        timeout=timedelta(seconds=30))

    # -- rank table -------------------------------------------------------------------------
    def row(self) -> dict:
        return {"rank": self.rank, "local_rank": self.local_rank, "node_rank": self.node_rank,
                "host": self.host, "pid": os.getpid(), "device": self.device}

    def announce(self) -> None:
        """Publish this rank's row; rank 0 then gathers all rows (bounded) and reports them."""
        self._store.set(self.prefix + f"rank/{self.rank}", json.dumps(self.row()))
        if self.rank == 0:
            rows = self.gather_rows()
            from ddprun.ranktable import print_rank_table, write_plan_json

            print_rank_table(rows, self.world_size)
            if self.run_dir:
                write_plan_json(self.run_dir, rows, self.world_size)

    def gather_rows(self) -> list[dict]:
        """Every rank's row, waiting at most the join timeout; missing ranks are left out."""
        keys = [self.prefix + f"rank/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + self.join_timeout
        while time.monotonic() < deadline:
            if self._store.check(keys):
                break
            time.sleep(0.02)
        rows = []
        for r, key in enumerate(keys):
            if self._store.check([key]):
                rows.append(json.loads(self._store.get(key)))
        return rows

    # -- failures ---------------------------------------------------------------------------
    def record_failure(self, summary: str, code: int) -> None:
        try:
            k = self._store.add(self.prefix + "failures", 1)
            record = {"rank": self.rank, "node_rank": self.node_rank, "host": self.host,
                      "summary": summary, "exitcode": code}
            self._store.set(self.prefix + f"failure/{k}", json.dumps(record))
        except Exception:  # noqa: BLE001 - the store may be gone already; the error file still holds it
            pass

    def first_failure(self, store=None) -> dict | None:
        store = store or self._store
        key = self.prefix + "failure/1"
        if not store.check([key]):
            return None
        return json.loads(store.get(key))

    def start_monitor(self) -> None:
        if not self.last_attempt or self.world_size == 1:
            return
        self._thread = threading.Thread(target=self._monitor, name="ddprun-job-monitor", daemon=True)
        self._thread.start()

    def stop_monitor(self) -> None:
        self._stop.set()

    def _monitor(self) -> None:
        try:
            store = self._connect()  # its own connection: never queue behind the main thread's calls
        except Exception:  # noqa: BLE001
            return
        while not self._stop.wait(POLL_S):
            try:
                failure = self.first_failure(store)
            except Exception:  # noqa: BLE001 - store gone: the job is ending, the agent decides
                return
            if failure and failure["rank"] != self.rank and not self._stop.is_set():
                from ddprun.exit import stopped_message, write_error_file

                msg = stopped_message(failure)
                print(msg, file=sys.stderr, flush=True)
                write_error_file(msg)
                sys.stdout.flush()
                os._exit(1)
