"""The worker's channel to the agent's TCP store (the rendezvous store torch shares with workers).

Keys: :mod:`ddprun.protocol.store`. The channel claims the store for this job, publishes this rank's
row, waits for rank 0's preflight verdict (worker/preflight.py), and reads and writes failure
records. The polling thread beside the user's code is worker/monitor.py.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any

from ddprun._util import Bounded, within
from ddprun.errors import ConfigError
from ddprun.protocol import defaults
from ddprun.protocol import failure as fr
from ddprun.protocol.env import WorkerEnv, node_store_address
from ddprun.protocol.store import (
    Keys,
    claim,
    present,
    publish_failure,
    read_causes,
    read_counter,
    refusal,
    store_prefix,
)


class JobRefused(Exception):
    """This worker reached a store that belongs to another job."""


class JobChannel:
    """This rank's view of the job: who it is, and the store calls every part of the worker makes."""

    def __init__(self, environ: Mapping[str, str], wenv: WorkerEnv, script: str | None = None,
                 connect: Callable[[], Any] | None = None, connect_node: Callable[[], Any] | None = None):
        """``connect``/``connect_node``: make a client of the job's/the node's store (default: TCPStore)."""
        self.rank = int(environ["RANK"])
        self.local_rank = int(environ["LOCAL_RANK"])
        self.world_size = int(environ["WORLD_SIZE"])
        self.node_rank = int(environ.get("GROUP_RANK", "0"))
        group = environ.get("GROUP_WORLD_SIZE", "")
        self.nnodes = int(group) if group.isdigit() and int(group) > 0 else self.node_rank + 1
        """Nodes in this attempt (torch's GROUP_WORLD_SIZE)."""
        self.addr = environ["MASTER_ADDR"]
        self.port = int(environ["MASTER_PORT"])
        self.wenv = wenv
        self.run_dir = wenv.run_dir
        self.run_id = environ.get("TORCHELASTIC_RUN_ID", "run")
        restart = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.last_attempt = restart == environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
        self.keys = Keys(store_prefix(environ))
        self.device = f"cuda:{self.local_rank}" if wenv.device_kind == "cuda" else "cpu"
        self.host = socket.gethostname()
        self.environ, self.script = environ, script
        self._connect_fn, self._connect_node_fn = connect, connect_node
        self.store = self.connect()
        self._bounded: Bounded | None = None
        self.hosts: dict[int, str] = {}

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], script: str | None = None,
                     wenv: WorkerEnv | None = None) -> JobChannel | None:
        """A channel when the agent shares its store with the workers (torch's default), else None.

        Raises ConfigError for a malformed ``DDPRUN_*`` value (protocol/env.py)."""
        if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "RANK" not in environ:
            return None
        wenv = wenv or WorkerEnv.from_environ(environ)
        if wenv is None:
            return None
        try:
            return cls(environ, wenv, script)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's job must still run without the channel
            print(f"ddprun: the job store at {environ.get('MASTER_ADDR')}:{environ.get('MASTER_PORT')} is "
                  f"unreachable ({type(e).__name__}: {e}); rank table, preflight and watchdog are off",
                  file=sys.stderr)
            return None

    def connect(self) -> Any:
        """A new client of the store (the monitor thread keeps its own: it never queues behind us)."""
        if self._connect_fn is not None:
            return self._connect_fn()
        from torch.distributed import TCPStore

        return TCPStore(self.addr, self.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))

    def connect_node(self, timeout_s: float = 10.0) -> Any:
        """A client of this node's store (agent/noderelay.py); None when the agent gave none."""
        if self._connect_node_fn is not None:
            return self._connect_node_fn()
        address = node_store_address(self.wenv.node_store) if self.wenv.node_store else None
        if address is None:
            return None
        from torch.distributed import TCPStore

        return TCPStore(address[0], address[1], is_master=False, wait_for_workers=False,
                        timeout=timedelta(seconds=timeout_s))

    def wait_for(self, keys: list[str], timeout_s: float, store: Any = None) -> bool:
        store = store or self.store
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def await_key(self, key: str, timeout_s: float) -> bool:
        """Whether ``key`` is set within ``timeout_s``: one wait that the store answers when the key is
        set, where :meth:`wait_for` polls (at thousands of ranks those polls are most of the store's load)."""
        from torch.distributed import DistStoreError

        try:
            self.store.wait([key], timedelta(seconds=timeout_s))
        except DistStoreError:  # the timeout; the client stays usable
            return False
        return True

    def gather(self, keys: Iterable[str], timeout_s: float, store: Any = None) -> dict[str, Any]:
        """JSON values of ``keys`` (one batched read), waiting at most ``timeout_s``; missing or malformed left out."""
        store, keys = store or self.store, list(keys)
        if not keys:
            return {}
        if timeout_s > 0:
            self.wait_for(keys, timeout_s, store)
        found = present(store, keys)
        out = {}
        for key, raw in zip(found, store.multi_get(found) if found else []):
            try:
                out[key] = json.loads(raw)
            except ValueError:
                continue
        return out

    # -- start -------------------------------------------------------------------------------
    def row(self) -> dict[str, Any]:
        return {"rank": self.rank, "local_rank": self.local_rank, "node_rank": self.node_rank,
                "host": self.host, "pid": os.getpid(), "device": self.device}

    def start(self) -> None:
        """Claim the store for this job, publish this rank, and wait for rank 0's preflight verdict.

        Raises JobRefused (another job's store) or SystemExit (preflight error, already reported)."""
        from ddprun.worker.preflight import announce, await_verdict

        other = claim(self.store, self.run_id, self.wenv.job_token)
        if other is not None:
            raise JobRefused(refusal(f"{self.addr}:{self.port}", other, self.run_id))
        announce(self)
        await_verdict(self)

    # -- failures ----------------------------------------------------------------------------
    def me(self, kind: str, summary: str, *, exit_code: int | None = 1, hint: str = "") -> fr.FailureRecord:
        """A record of this rank's own failure."""
        return fr.FailureRecord(kind, self.rank, summary, self.node_rank, self.host, self.local_rank,
                                exit_code, hint=hint, t=time.time())

    def stopped(self, cause: fr.FailureRecord, seen: str = "") -> fr.FailureRecord:
        return fr.stopped_by(cause, rank=self.rank, node_rank=self.node_rank, host=self.host,
                             local_rank=self.local_rank, t=time.time(), seen=seen)

    def record_failure(self, rec: fr.FailureRecord) -> None:
        """Publish ``rec``: first to this node's store (its agent's copy, which needs neither the disk
        nor the job store's host), then to the job's; the first cause waits (bounded) until the
        others have read it."""
        try:  # bounded: a frozen agent (SIGSTOP) would hold a TCPStore client for ever
            within(defaults.NODE_RECORD_TIMEOUT_S, self._hand_to_node, rec)
        except Exception:  # noqa: BLE001 - no node store, or its agent is gone or frozen: the job's copy remains
            pass
        try:  # bounded: a stopped store host would hold this failing process for ever
            if publish_failure(self._failure_store(), self.keys, rec) == 1:
                self._await_acks()
        except Exception:  # noqa: BLE001 - the store may be gone already; the error file still holds it
            pass

    def leave_to_agent(self, rec: fr.FailureRecord) -> bool:
        """Hand ``rec``, this rank's record that it was stopped, to its agent, which forwards its
        node's stopped ranks into the job store in one batch and acknowledges them: about 4 job-store
        calls a node, not 4 a rank (agent/failures.py). False when the node store did not take it
        (none, or its agent is gone or frozen): the caller records it in the job store itself. Once
        the record is there it is the agent's, even if the count that tells the agent fails next:
        the rank recording it too would count it, and its acknowledgement, twice."""
        try:  # bounded: a frozen agent (SIGSTOP) would hold a TCPStore client for ever
            node = within(defaults.NODE_RECORD_TIMEOUT_S, self._hand_to_node, rec, True)
        except Exception:  # noqa: BLE001 - no node store, or its agent is gone or frozen
            return False
        if node is None:
            return False
        try:
            within(defaults.NODE_RECORD_TIMEOUT_S, node.add, self.keys.lefts, 1)
        except Exception:  # noqa: BLE001 - the agent reads it when another rank's count moves, or not at all
            pass
        return True

    def _failure_store(self) -> Any:
        """This process's job-store client for the failure path: each call bounded by STORE_CALL_S, and
        after one timed out the others fail at once (a stopped store host never answers)."""
        if self._bounded is None:
            self._bounded = Bounded(self.store, defaults.STORE_CALL_S)
        return self._bounded

    def _hand_to_node(self, rec: fr.FailureRecord, leave: bool = False) -> Any:
        """Write ``rec`` into this node's store as this rank's own record (the copy a full disk cannot
        take), and with ``leave`` also as one for its agent to forward (:meth:`leave_to_agent`); the
        node store's client, None when the agent gave none."""
        node = self.connect_node(timeout_s=defaults.NODE_RECORD_TIMEOUT_S)
        if node is None:
            return None
        keys = [self.keys.own_failure(rec.rank)] + ([self.keys.left(rec.rank)] if leave else [])
        node.multi_set(keys, [rec.to_json()] * len(keys))
        return node

    def _await_acks(self, timeout_s: float = defaults.ACK_WAIT_S) -> None:
        """Stay (bounded) until every other rank has read the failure: this process keeps its node's
        agent, and maybe the store the others read it from, alive meanwhile."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            acks = read_counter(self._failure_store(), self.keys.acks)
            if acks is None or acks >= self.world_size - 1:  # None: not a count; nothing to wait for
                return
            time.sleep(0.05)

    def ack_failure(self, store: Any = None) -> None:
        """Tell the failing rank this one has read its failure."""
        try:  # another client (the monitor's): bounded by itself
            if store is None:
                self._failure_store().add(self.keys.acks, 1)
            else:
                within(defaults.STORE_CALL_S, store.add, self.keys.acks, 1)
        except Exception:  # noqa: BLE001
            pass

    def failures(self, store: Any = None) -> list[fr.FailureRecord]:
        """The job's first-hand records, or while there is none its first echoes (protocol/store.py
        read_causes: 3 store calls whatever the job's size); [] when the store cannot be read.
        ``store``: another client than the channel's (the monitor's), on which a read that fails or
        takes over STORE_CALL_S raises instead (TimeoutError): read as "no failure", the alarm that
        announced one was taken as read, and not read again until it moved again."""
        if store is not None:  # bounded: a stopped store host would hold the monitor for ever
            return list(within(defaults.STORE_CALL_S, read_causes, store, self.keys).values())
        try:  # bounded: a stopped store host would hold the caller (a failing rank) for ever
            return list(read_causes(self._failure_store(), self.keys).values())
        except Exception:  # noqa: BLE001 - the store is gone or does not answer: nothing to read
            return []

    def cause(self, store: Any = None) -> fr.FailureRecord | None:
        """The root cause among the records of other ranks (None: no other rank failed); raises as
        :meth:`failures` does with ``store``."""
        return self.cause_among(self.failures(store))

    def cause_among(self, records: list[fr.FailureRecord]) -> fr.FailureRecord | None:
        """The root cause among ``records`` of other ranks than this one (None: none)."""
        return fr.root_cause(r for r in records if r.rank != self.rank)

    def mark_clean_end(self, steps: int) -> None:
        """This rank's script ended by itself with exit 0 after ``steps`` optimizer steps: the job's
        first such end, if it is (one compare_set, bounded; first writer wins), for a rank whose peer
        then goes away to name (:meth:`first_clean_end`)."""
        end = fr.CleanEnd(self.rank, self.node_rank, self.host, self.local_rank, steps, time.time())
        try:
            self._failure_store().compare_set(self.keys.first_end, "", end.to_json())
        except Exception:  # noqa: BLE001 - the store may be gone: there is nothing to name then
            pass

    def first_clean_end(self, store: Any = None) -> fr.CleanEnd | None:
        """The first rank whose script ended cleanly, when it is another (None: none did, or the store
        cannot say). ``store``: another client than the main thread's (the monitor's), bounded here."""
        def read(client: Any) -> bytes | None:
            return client.get(self.keys.first_end) if client.check([self.keys.first_end]) else None

        try:  # bounded: a failing rank's path, or a stall's, and the store's host may be gone
            raw = read(self._failure_store()) if store is None else within(defaults.STORE_CALL_S, read, store)
            end = fr.CleanEnd.parse(raw)
        except Exception:  # noqa: BLE001
            return None
        return end if end is not None and end.rank != self.rank else None

    def await_cause(self, timeout_s: float) -> fr.FailureRecord | None:
        """Wait (bounded) for another rank's first-hand failure (not an echo); None if none came."""
        deadline = time.monotonic() + timeout_s
        while True:
            cause = self.cause()
            if cause is not None and not cause.is_echo:
                return cause
            if time.monotonic() >= deadline:
                return cause
            time.sleep(0.1)
