"""Before torch's agent joins the rendezvous: reach the endpoint's store (host it on the host), be
admitted or refused, and agree on the run id.

* Another job holds the endpoint (another rendezvous id or job token): refused (protocol/store.py
  :func:`~ddprun.protocol.store.claim`).
* The job at the endpoint already runs (its :class:`~ddprun.protocol.store.JobRecord`): a full job
  whose nodes are all alive refuses a newcomer (torch would park it in its redundancy list until one of
  them is gone; a node restarted after its agent died is let in); an elastic job with
  room takes in a node with its identity (the claim: the same rendezvous id and token), a node that
  arrives late being the reason for ``--nnodes MIN:MAX`` (torch restarts the running workers to add
  it). Without a token or an explicit id every node started with the same command has that identity:
  :func:`elastic_note` says so at launch.
* ``--nnodes``: the first node's MIN:MAX is the job's; a node started with another is refused at once
  (:func:`agree_nnodes`), where torch would keep it and the job's nodes waiting the whole join timeout.
* The run id: an explicit one (``--rdzv-id``, a scheduler's job id) as given; else the first agent's
  proposal (a fresh id) wins in the store, so every launch is a new run and all its nodes agree.

The store object lives for the launch: on the host it is the server that torch's c10d and static
handlers then share (they ask for ``multi_tenant`` too), and the agent writes the job record through it.
"""

from __future__ import annotations

import errno
import json
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, TextIO

from ddprun._util import Bounded, within
from ddprun.agent.endpoint import bound_server, dialled_as, port_open, store_client, store_server
from ddprun.config import run_id_problem
from ddprun.errors import LaunchError
from ddprun.protocol import defaults
from ddprun.protocol import store as keys
from ddprun.protocol.store import JobRecord

STORE_TIMEOUT_S = 10.0
"""The admission store's timeout for one request (the host answers in milliseconds)."""


@dataclass(frozen=True)
class Newcomer:
    """What a node brings to the endpoint: the identity it claims, and its proposal for the run id."""

    endpoint: str
    rdzv_id: str
    token: str
    explicit: bool
    """The run id was given (--rdzv-id, a scheduler's job id), not the multi-node default."""
    proposal: str
    """A fresh run id, taken when no other node proposed one first."""
    nnodes: tuple[int, int] | None = None
    """``--nnodes`` as (MIN, MAX), which every node of the job must share; None: not checked."""
    agent: tuple[str, int] = ("?", 0)
    """This node's host name and agent pid, for the messages of the others."""


def should_host(addr: str, rdzv_conf: Mapping[str, Any], backend: str, node_rank: int) -> bool:
    """Whether this node hosts the store, by torch's own rules (c10d: ``is_host``, else the endpoint
    names this machine; static: node rank 0). Several agents on one machine: the first one binds."""
    if backend == "static":
        return node_rank == 0
    value = str(rdzv_conf.get("is_host", "")).lower()
    if value in ("1", "true", "t", "yes", "y", "0", "false", "f", "no", "n"):  # RendezvousParameters.get_as_bool
        return value in ("1", "true", "t", "yes", "y")
    try:
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
    except ImportError:  # another torch: as torch would then decide, unknown; try to bind
        return True
    return bool(_matches_machine_hostname(addr))


def unreachable_line(endpoint: str, timeout_s: float, left_s: float) -> str:
    return (f"ddprun: rendezvous host {endpoint} not reachable yet (has the node that hosts it started?); "
            f"waiting up to {timeout_s:.0f} s ({max(0, int(left_s))} s left)")


def slow_store_line(took_s: float, where: str, what: str) -> str:
    """The note for the store at ``where`` (an IP or a name) that took ``took_s`` to ``what``."""
    lines = ["'::ffff:127.0.0.1 localhost' (every node's own store)"]
    mapped = dialled_as(where)
    if mapped is None:
        lines.append(f"'::ffff:<the IPv4 address {where} resolves to> {where}'")
    elif mapped != "::ffff:127.0.0.1":
        lines.append(f"'{mapped} <its name>'")
    return (f"ddprun: note: the rendezvous store at {where} took {took_s:.1f} s to {what}. torch looks up the name "
            "of each address it connects to (reverse DNS), so the likely cause is a DNS server in /etc/resolv.conf "
            "that does not answer, and each process of the job can wait as long again when it first connects. A "
            "nameserver that answers removes the wait, as do /etc/hosts lines on every node for the addresses as "
            f"torch dials them: {' and '.join(lines)}")


def _timed(out: TextIO, where: str, what: str, make: Any, *args: Any) -> Any:
    """``make(*args)``, and the note of :func:`slow_store_line` when it made a store but took longer
    than SLOW_STORE_START_S."""
    started = time.monotonic()
    store = make(*args)
    took = time.monotonic() - started
    if store is not None and took > defaults.SLOW_STORE_START_S:
        print(slow_store_line(took, where, what), file=out, flush=True)
    return store


def connect(addr: str, port: int, host_it: bool, timeout_s: float, out: TextIO, bind: str | None = None,
            line_every_s: float = 3.0) -> tuple[Any, bool]:
    """The endpoint's store at ``addr`` within ``timeout_s``: hosted here (``host_it`` and nothing
    listens yet), listening on ``bind`` only (None: every interface, torch's way), or a client of it;
    (store, hosted). Raises LaunchError when nothing answered in time or this node cannot listen.
    One connect may overrun ``timeout_s`` by up to SELF_CONNECT_S (endpoint.py: a silent DNS server)."""
    import torch.distributed  # noqa: F401 - before any store is timed: the import is not the store's start

    t0 = time.monotonic()
    next_line = t0 + line_every_s
    answered: BaseException | None = None
    """Why the port takes connections but no store answered there (None: it did not take them)."""
    while True:
        if host_it and not port_open(addr, port):
            hosted = _timed(out, bind or addr, "start", _host, addr, port, bind)
            if hosted is not None:
                if bind is None:  # SECURITY.md: the one case a store of ddprun's listens everywhere
                    print(f"ddprun: note: the rendezvous store listens on every interface, port {port}: {addr} "
                          "is no address ddprun could bind on this machine (a virtual IP, or a name that resolves "
                          "elsewhere); keep the port behind the cluster's firewall", file=out, flush=True)
                return hosted, True
        if port_open(addr, port):
            try:
                return _timed(out, addr, "answer", store_client, addr, port, STORE_TIMEOUT_S), False
            except (RuntimeError, ValueError, TimeoutError) as e:  # not a store yet, or it went away
                answered = e
        else:
            answered = None
        now = time.monotonic()
        # the host's client tried for its whole connect bound (SELF_CONNECT_S: a store another agent of
        # this machine starts answers within a second): another program holds the port
        if answered is not None and (host_it or now - t0 >= timeout_s):
            what, seen, hint = not_a_store(addr, port, answered, host_it)
            raise LaunchError(what, seen=seen, hint=hint)
        if now - t0 >= timeout_s:
            raise LaunchError(f"Not every node joined within {timeout_s:.0f} s: the rendezvous host {addr}:{port} "
                              "was never reachable from this node.", seen=f"nothing answered at {addr}:{port}",
                              hint="Start ddprun on the node that hosts the endpoint (the same --rdzv-endpoint on "
                                   "every node); check the address and the firewall; raise --join-timeout if nodes "
                                   "start late.")
        if now >= next_line:
            next_line += line_every_s
            print(unreachable_line(f"{addr}:{port}", timeout_s, timeout_s - (now - t0)), file=out, flush=True)
        time.sleep(0.2)


def not_a_store(addr: str, port: int, error: BaseException, here: bool) -> tuple[str, str, str]:
    """(what, seen, hint) of a LaunchError for an endpoint whose port takes connections but answers
    as no store: another program holds it (or a stopped process); ``here``: this node hosts it."""
    why = str(error).strip().splitlines()[0] if str(error).strip() else ""
    what = f"The rendezvous endpoint {addr}:{port} takes connections, but no rendezvous store answers there."
    seen = f"{type(error).__name__}: {why}" + ("; this node is the endpoint's host, and the port is taken" if here else "")
    hint = ("Another program (or a stopped process) holds that port on the endpoint's host: free it, or give every "
            "node another --rdzv-endpoint port.")
    return what, seen, hint


def client(addr: str, port: int, timeout_s: float = STORE_TIMEOUT_S) -> Any:
    """A client of the store at addr:port whose connect, too, is bounded by ``timeout_s``: for threads
    that must not stall on a stopped host (the join watch, the job's beat); :func:`connect` makes the
    agent's main client with endpoint.store_client, whose connect outlasts a silent DNS server."""
    from torch.distributed import TCPStore

    return TCPStore(addr, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def _host(addr: str, port: int, bind: str | None) -> Any:
    """The store server (None: the port is taken, another agent on this machine hosts it). Raises
    LaunchError when this node cannot listen there at all."""
    try:
        if bind is not None:
            return bound_server(bind, port, STORE_TIMEOUT_S)
        return store_server(addr, port, STORE_TIMEOUT_S, multi_tenant=True)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return None
        raise LaunchError(f"This node hosts the rendezvous endpoint but cannot listen at {bind or addr}:{port}.",
                          seen=f"{type(e).__name__}: {e}", hint="Give --rdzv-endpoint an address of this node and "
                          "a free port (ports below 1024 need root).") from e
    except (RuntimeError, ValueError):  # torch's own bind failed: the port is taken
        return None


def read_job(store: Any) -> tuple[JobRecord | None, int]:
    """The running job's record (None: none, or a bad value) and the latest re-forming round (-1: none,
    and not read without a job: one call while a job forms, when every node asks every second)."""
    job = JobRecord.parse(store.get(keys.JOB_KEY)) if store.check([keys.JOB_KEY]) else None
    reforming = -1
    if job is None:
        return job, reforming
    if store.check([keys.REFORMING_KEY]):
        try:
            reforming = int(store.get(keys.REFORMING_KEY))
        except ValueError:
            reforming = -1
    return job, reforming


def refusal_reason(job: JobRecord | None, reforming: int) -> str | None:
    """Why a node with the job's identity (the claim passed) may not join it (None: it may). Pure.
    A job re-forming (``reforming >= job.round``) takes a node back even when its record says it ended:
    node 0's agent may have ended (a signal) while the others re-form with --max-restarts."""
    if job is None or reforming >= job.round:
        return None  # the job is forming, or re-forming after a failure: torch's rendezvous decides
    if job.ended:
        return "it has ended and the node hosting its store is closing: start again in a few seconds"
    if job.nnodes >= job.max_nodes:
        return (f"it is full ({job.nnodes} of {job.max_nodes} node(s)), every one alive: torch would keep this "
                "node waiting until one of them is gone")
    return None  # an elastic job with room: a node with its identity (claim) is one of its own, arriving late


def elastic_note(me: Newcomer, min_nodes: int, max_nodes: int) -> str | None:
    """The launch line for an elastic multi-node job whose identity is only the defaults."""
    if max_nodes <= 1 or min_nodes == max_nodes or me.explicit or me.token:
        return None
    return ("ddprun: note: this elastic job takes in any node started with the same command at this endpoint; "
            "give every node the same DDPRUN_JOB_TOKEN (or --rdzv-id) to take in only this job's nodes")


def hosts_of(store: Any, job: JobRecord) -> list[str]:
    """``host (pid N)`` of each node of the job's round that said so (one batched read)."""
    present = keys.present(store, [keys.job_host_key(job.round, n) for n in range(job.nnodes)])
    out = []
    for raw in store.multi_get(present) if present else []:
        try:
            data = json.loads(raw)
            out.append(f"{data['host']} (agent pid {int(data['pid'])})")
        except (ValueError, KeyError, TypeError):
            out.append("?")
    return out


def refusal_text(job: JobRecord, reason: str, endpoint: str, hosts: list[str], now: float) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job.since))
    return (f"Refused: the job at the rendezvous endpoint {endpoint} runs already, and {reason}.\n"
            f"Seen: run {job.run_id}, {job.nnodes} node(s): {', '.join(hosts) or '?'}; running since {since} "
            f"({now - job.since:.0f} s)\n"
            "HINT: to start another job give it its own --rdzv-endpoint port (and --rdzv-id); to add nodes to "
            "a job start it with --nnodes MIN:MAX and the same DDPRUN_JOB_TOKEN on every node; or wait for "
            "this one to end.")


def admit(store: Any, me: Newcomer) -> str:
    """Claim the endpoint, check the running job, agree on the run id; the run id. Raises LaunchError
    when refused."""
    other = keys.claim(store, me.rdzv_id, me.token)
    if other is not None:
        raise LaunchError(keys.refusal(me.endpoint, other, me.rdzv_id).removeprefix("ddprun: "))
    job, reforming = read_job(store)
    reason = refusal_reason(job, reforming)
    if job is not None and reason is not None and not job.ended and not job_alive(store, job):
        reason = None  # a node of the job is gone (its restarted agent, say): torch's rendezvous decides
    if job is not None and reason is not None:
        raise LaunchError(refusal_text(job, reason, me.endpoint, hosts_of(store, job), time.time()))
    agree_nnodes(store, me)
    if me.explicit:
        return me.rdzv_id
    agreed = keys.text(store.compare_set(keys.RUN_ID_KEY, "", me.proposal))
    problem = run_id_problem(agreed)
    if problem:  # the run directory is named after it: never a path another writer of the store chose
        raise LaunchError(f"the run id agreed at the endpoint cannot name a run directory: {problem}.",
                          seen=f"run id {agreed!r} in the store at {me.endpoint}",
                          hint="Something other than this job's nodes wrote it: give the job its own "
                               "--rdzv-endpoint port, or name the run with --rdzv-id.")
    return agreed


def nnodes_text(nnodes: tuple[int, int]) -> str:
    """``--nnodes`` as given: ``2``, or ``1:3`` for an elastic job."""
    return str(nnodes[1]) if nnodes[0] == nnodes[1] else f"{nnodes[0]}:{nnodes[1]}"


def parse_nnodes(raw: bytes | str) -> tuple[tuple[int, int], str] | None:
    """(MIN, MAX) and ``host (agent pid N)`` of the node of a :data:`~ddprun.protocol.store.NNODES_KEY`
    value; None for a bad one (never trusted)."""
    try:
        data = json.loads(raw)
        return (int(data["min"]), int(data["max"])), f"{data['host']} (agent pid {int(data['pid'])})"
    except (ValueError, KeyError, TypeError):
        return None


def agree_nnodes(store: Any, me: Newcomer) -> None:
    """Take the job's ``--nnodes`` from the first node at the endpoint (compare_set, as the run id), and
    raise LaunchError at once when this node's differs, leaving its own for the job's waiting nodes to
    name (:data:`~ddprun.protocol.store.NNODES_REFUSED_KEY`): torch completes a round by each joining
    node's own MIN:MAX, so nodes that differ wait the whole join timeout, or form a round of another
    size. The key lives as long as the store, one job's (the claim keeps other jobs out)."""
    if me.nnodes is None:
        return
    mine = json.dumps({"min": me.nnodes[0], "max": me.nnodes[1], "host": me.agent[0], "pid": me.agent[1],
                       "t": time.time()})
    agreed = parse_nnodes(keys.text(store.compare_set(keys.NNODES_KEY, "", mine)))
    if agreed is None or agreed[0] == me.nnodes:
        return  # a bad value is not this node's to judge: torch's rendezvous decides
    store.set(keys.NNODES_REFUSED_KEY, mine)
    theirs, ours = nnodes_text(agreed[0]), nnodes_text(me.nnodes)
    raise LaunchError(
        f"Refused: this node was started with --nnodes {ours}, the job at the rendezvous endpoint {me.endpoint} "
        f"with --nnodes {theirs}.", seen=f"--nnodes {theirs} from {agreed[1]}, the job's first node; "
        f"--nnodes {ours} on this node", hint=f"Give every node of the job the same --nnodes: {theirs} to join "
        f"this job, or stop its nodes and start every one with {ours}. If that job has just ended, start again "
        "in a few seconds.")


def publish_start(store: Any, job: JobRecord, node: int, host: str, pid: int) -> None:
    """A worker group started (every node, every attempt): this node's entry of the round and, from
    node 0, the job record (its first start time kept across attempts). Best effort."""
    try:
        store.set(keys.job_host_key(job.round, node), json.dumps({"host": host, "pid": pid}))
        if node == 0:
            first = store.compare_set(keys.SINCE_KEY, "", repr(job.since))
            store.set(keys.JOB_KEY, replace(job, since=float(keys.text(first))).to_json())
    except Exception:  # noqa: BLE001 - the store is gone: the job is ending, nobody will ask
        pass


def publish_end(store: Any, job: JobRecord) -> None:
    """Node 0's agent ended, and the job with it (agent/run.py ``ends_the_job``): the job is over (best
    effort). A re-forming mark from before (a restart whose rendezvous then timed out) is cleared: a
    relaunch is told the job ended, not admitted to a closing store; one made after (an elastic job
    re-forming without node 0) still takes nodes in."""
    try:
        store.set(keys.REFORMING_KEY, "-1")
        store.set(keys.JOB_KEY, replace(job, ended=True).to_json())
    except Exception:  # noqa: BLE001 - the store is gone with its host: nobody will ask
        pass


def job_alive(store: Any, job: JobRecord, wait_s: float = 3.0, poll_s: float = 0.25) -> bool:
    """Whether every node of the job's round is alive: its agent's beat (:class:`EndpointBeat`, every
    0.5 s) moves within ``wait_s``. One batched read every ``poll_s``; True as soon as every beat
    moved (about half a second), so a beat held up by a loaded node is waited for, not taken for dead."""
    names = [keys.job_beat_key(n) for n in range(job.nnodes)]

    def beats() -> list[bytes] | None:
        return store.multi_get(names) if store.check(names) else None  # check: every one of them is set

    before = beats()
    if before is None:
        return False
    moved = [False] * len(names)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        now = beats()
        if now is None:
            return False
        moved = [m or a != b for m, a, b in zip(moved, before, now)]
        if all(moved):
            return True
    return False


class EndpointBeat:
    """This agent's beat in the endpoint's store (``job/beat/<node>``), for a newcomer's liveness check
    (:func:`job_alive`). Called from the agent's failure thread every half second: its own client with
    a short timeout, and after a failure it tries again only 5 s later, so it never stalls that thread."""

    def __init__(self, addr: str, port: int):
        self._addr, self._port = addr, port
        self._store: Any = None
        self._retry_at = 0.0

    def __call__(self, node: int, beat: int) -> None:
        now = time.monotonic()
        if self._store is None and now < self._retry_at:
            return
        # torch's client retries a refused connect for its whole timeout: when the endpoint's host has
        # ended, that would hold this thread (and the failure watch after it) seconds
        if self._store is None and not port_open(self._addr, self._port):
            self._retry_at = now + 5.0
            return
        try:
            if self._store is None:  # bounded: a stopped host accepts the connection and never answers
                self._store = Bounded(within(2.0, client, self._addr, self._port, 2.0), 2.0)
            self._store.set(keys.job_beat_key(node), str(beat))
        except Exception:  # noqa: BLE001 - the endpoint's host is gone or slow: the job's own watch says
            self._store, self._retry_at = None, now + 5.0


class EndpointClient:
    """The agent's client of the endpoint's store after admission (the job record: :func:`publish_start`,
    :func:`publish_reforming`, :func:`publish_end`), whose every call is made within ``timeout_s``
    (:class:`~ddprun._util.Bounded`): a stopped host (SIGSTOP, a paused VM) never holds torch's loop.
    A call that timed out leaves that client stuck; a thread then makes a new one with ``connect``
    (again every ``retry_s`` until one is made, or :meth:`close`), and calls go to it once it is made.
    Meanwhile every call raises at once, as on the stuck client: no call waits longer than
    ``timeout_s``. The first client (on the store's host: the server itself) is kept for the launch."""

    def __init__(self, store: Any, connect: Any, timeout_s: float, retry_s: float = 5.0):
        self._first, self._connect = store, connect
        self._store = Bounded(store, timeout_s)
        self._timeout_s, self._retry_s = timeout_s, retry_s
        self._dialling = threading.Lock()
        """Held while the thread that makes a new client runs (one at a time)."""
        self._closed = threading.Event()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # never the wrapper's own (copy, pickle: before __init__ ran)
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            store = self._store
            try:
                return getattr(store, name)(*args, **kwargs)
            finally:
                if store.stuck_at is not None:
                    self._redial()

        return call

    def close(self) -> None:
        """No new client from now on (the launch is over)."""
        self._closed.set()

    def _redial(self) -> None:
        if self._closed.is_set() or not self._dialling.acquire(blocking=False):
            return
        try:
            threading.Thread(target=self._dial, name="ddprun-endpoint-redial", daemon=True).start()
        except RuntimeError:  # no thread left: the next stuck call tries again
            self._dialling.release()

    def _dial(self) -> None:
        """On its own thread: a connect to a stopped host waits until it runs again, and holds only this."""
        try:
            while not self._closed.is_set():
                try:
                    self._store = Bounded(self._connect(), self._timeout_s)
                    return
                except Exception:  # noqa: BLE001 - refused, or timed out: the host is gone or not back yet
                    self._closed.wait(self._retry_s)
        finally:
            self._dialling.release()


def publish_reforming(store: Any, round_: int) -> None:
    """The group of ``round_`` failed and torch restarts it: its nodes may come back (best effort)."""
    try:
        store.set(keys.REFORMING_KEY, str(round_))
    except Exception:  # noqa: BLE001
        pass


def left_out(store: Any, host: str, pid: int) -> tuple[JobRecord, list[str]] | None:
    """While this node waits in the rendezvous: the running job and its nodes when its round is
    complete without this node (it was not taken in); else None."""
    job, reforming = read_job(store)
    if job is None or reforming >= job.round:
        return None
    names = [keys.job_host_key(job.round, n) for n in range(job.nnodes)]
    if not store.check(names):  # the round's nodes have not all said so yet: this node may be one
        return None
    me = json.dumps({"host": host, "pid": pid})
    return None if me in map(keys.text, store.multi_get(names)) else (job, hosts_of(store, job))
