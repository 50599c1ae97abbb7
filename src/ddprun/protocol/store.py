"""The store key schema: every key ddprun writes in the agent's TCPStore, and the endpoint claim.

Values are JSON text (or plain integers for counters); ddprun never unpickles what it reads. Keys
of one attempt of the worker group live under ``ddprun/<run id>/<attempt id>/`` (the store outlives
attempts: torch's c10d shares one store server for the whole job, see agent/attempt.py):

    rank/<N>           JSON row of rank N (host, pid, device, ranks); rank/<N>/count catches twins
    node/<N>           preflight facts of the node whose local rank 0 is global rank N
    preflight          rank 0's verdict: "ok" or the error; every rank waits for it before user code
    progress/<N>       rank N's progress count (optimizer steps, collectives, heartbeats)
    stall              set by the observer that found no progress for the stall threshold (who, when)
    stall/summary      the hang report's one-line summary, once written (every agent prints it)
    place/<N>          where rank N's main thread is, answered on ``stall`` (the request it answers in it)
    stall/answers/<d>  a counter: the ranks that wrote their place for the request whose digest is <d>
    timing/<N>         rank N's step-time medians over its latest window (telemetry), every window
    timing-final/<N>   rank N published its last window at a clean exit
    failures           a counter; failure/<k> the k-th failure record (protocol/failure.py)
    causes             a counter; cause/<k> the k-th first-hand record (not an echo), also in failure/:
                       what every rank reads to learn the cause (there are few; echoes are one a rank)
    alarm              a counter every writer of what the ranks act on advances after its write (a
                       failure record, a preemption request, a stall report and its end): a rank's
                       monitor reads only this key a poll until it moves
    acks               how many ranks have read the first failure
    pg                 the prefix of this attempt's process-group keys (gloo/NCCL bootstrap)
    agent/<node>       the heartbeat of that node's agent, once a second (JSON: host, beat or done,
                       and ``progress``: rank -> progress count of its ranks, from the node store)
    timing-node/<node> JSON rank -> latest timing window of that node's ranks (its agent relays them)
    direct             a counter; direct/<k> the rank that talks to this store itself, its node's
                       relay having stopped (its progress/<N> and timing/<N> are here, not in its node's)
    stopping/<node>    that node's agent stops its workers now (a restart, a failure, a forced stop):
                       a signal that reaches them is not a preemption request
    cause-read/<node>  that node's agent read the job's cause, a rank of its that finished first: the
                       store's host stays up for it (its ranks ended 0, nothing else tells it)
    preempt            JSON preemption request (protocol/preempt.py Request; the first one wins)
    preempt/stop       the agreed stop step (optimizer steps of this attempt; the first proposal wins)
    preempt/saved      JSON protocol/preempt.py Saved: rank 0 stopped there (and saved its checkpoint),
                       or its script ended by itself (step -1)

Each agent also hosts a node store on 127.0.0.1 for its own workers (agent/noderelay.py), with the
same prefix, so that the job's store hears from each node, not from each rank:

    progress/<N>       rank N's progress count (written every monitor poll in which it changed)
    timing/<N>         rank N's latest timing window
    relay              ``<beat> <alarm>``: the agent's beat and the job's alarm counter as it last read
                       it, every half second; a worker whose relay stops beating reads the job store
    relayed-causes     JSON list of the failure records the agent had read when it relayed that alarm
                       (:func:`relayable`; written before ``relay``, only when they changed): a rank
                       that sees the relayed alarm move reads the cause here, not in the job store
    relayed-announced  JSON ``{"preempt": ..., "stall": ...}``: the job's preemption request and stall
                       request as the agent read them with the alarm it relays ("": none; written before
                       ``relay``, only when they changed): a rank that sees the relayed alarm move
                       reads them here, not in the job store (:func:`announced_value`)
    stopping/<node>    as in the job store, written there first: the workers' signal thread reads
                       it here (worker/signals.py), so a job store that went silent never delays it
    own-failure/<N>    rank N's own failure record, written before the job's copy: its agent reads it
                       when N ends (a full disk loses the error file, a lost store host the job's copy)
    left/<N>           rank N's record that another rank's failure stopped it (an echo), left to its
                       agent: the agent forwards its node's into the job store in one batch and
                       acknowledges them (:func:`publish_echoes`); ``left`` counts them

and job-wide keys in the rendezvous endpoint's store (agent/admission.py), written before and
between attempts:

    endpoint-owner     ``<rendezvous id>:<digest of the job token>`` of the job that first reached
                       the store (:func:`claim`)
    run-id             the run id the nodes agreed on (the first agent's proposal wins)
    nnodes             JSON {min, max, host, pid}: the --nnodes of the first node at the endpoint (the
                       first writer wins); a node started with another is refused
    nnodes/refused     the same of the latest node refused for its --nnodes (the waiting nodes name it)
    job                JSON :class:`JobRecord`: the running round's membership, written by node 0
    job/host/<round>/<node>  JSON {host, pid} of that node's agent in that round
    job/reforming      the latest round whose group failed and is re-forming (a restart)
    job/since          epoch seconds of the job's first worker start
    job/beat/<node>    a counter node <node>'s agent advances every half second while the job runs
    joining            a counter; joining/<k> JSON {host, pid, beat} of the k-th node that came to join
                       (agent/joinwatch.py: its beat moves while it waits)
    joining/summary    JSON {seq, count, joined}: the waiting nodes as the store's host counted them
                       (its watcher reads every entry; the others read this one key)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ddprun.protocol import failure as fr

ECHOES_READ = 16
"""While the job has no first-hand record, a reader reads at most this many of its first records
(echoes: what each peer of a dead rank saw): enough to name what they saw, where reading every
rank's echo at every rank would be quadratic in the job's size."""

OWNER_KEY = "ddprun/endpoint-owner"
RUN_ID_KEY = "ddprun/run-id"
JOB_KEY = "ddprun/job"
REFORMING_KEY = "ddprun/job/reforming"
SINCE_KEY = "ddprun/job/since"
NNODES_KEY = "ddprun/nnodes"
NNODES_REFUSED_KEY = "ddprun/nnodes/refused"
JOINING_COUNT_KEY = "ddprun/joining"


JOINING_SUMMARY_KEY = "ddprun/joining/summary"


def joining_key(k: int) -> str:
    return f"ddprun/joining/{k}"


def job_beat_key(node: int) -> str:
    return f"ddprun/job/beat/{node}"


def job_host_key(round_: int, node: int) -> str:
    return f"ddprun/job/host/{round_}/{node}"


@dataclass(frozen=True)
class JobRecord:
    """A running job as a newcomer at its endpoint sees it (:data:`JOB_KEY`)."""

    run_id: str
    round: int
    """The rendezvous round whose workers run (0 where the backend has none: static)."""
    nnodes: int
    min_nodes: int
    max_nodes: int
    since: float
    """Epoch seconds of the job's first worker start."""
    ended: bool = False
    """The job ended (node 0's agent is done); its store host is closing."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def parse(cls, raw: bytes | str | None) -> JobRecord | None:
        """The record in ``raw``; None for anything else (a bad value is not a job)."""
        if raw is None:
            return None
        try:
            data = json.loads(raw)
            return cls(str(data["run_id"]), int(data["round"]), int(data["nnodes"]), int(data["min_nodes"]),
                       int(data["max_nodes"]), float(data["since"]), bool(data.get("ended", False)))
        except (ValueError, TypeError, KeyError, IndexError):
            return None


def attempt_id(environ: Mapping[str, str]) -> str:
    """This worker group's attempt id: DDPRUN_ATTEMPT (set by ``ddprun run``), else ``c<restart count>``."""
    from ddprun.protocol.env import ATTEMPT

    return environ.get(ATTEMPT) or f"c{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def store_prefix(environ: Mapping[str, str]) -> str:
    """``ddprun/<run id>/<attempt id>/``: where this attempt's keys live in the agent's store."""
    return f"ddprun/{environ.get('TORCHELASTIC_RUN_ID', 'run')}/{attempt_id(environ)}/"


class Keys:
    """The keys of one attempt (module docstring), under ``prefix``."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def _k(self, name: str) -> str:
        return self.prefix + name

    def rank(self, r: int) -> str:
        return self._k(f"rank/{r}")

    def rank_count(self, r: int) -> str:
        return self._k(f"rank/{r}/count")

    def node(self, r: int) -> str:
        return self._k(f"node/{r}")

    def progress(self, r: int) -> str:
        return self._k(f"progress/{r}")

    def place(self, r: int) -> str:
        return self._k(f"place/{r}")

    def timing(self, r: int) -> str:
        return self._k(f"timing/{r}")

    def timing_final(self, r: int) -> str:
        return self._k(f"timing-final/{r}")

    def node_timing(self, node: int) -> str:
        return self._k(f"timing-node/{node}")

    @property
    def relay(self) -> str:
        """In the node store: the relay's ``<beat> <alarm>`` (:func:`relay_value`)."""
        return self._k("relay")

    @property
    def relayed_causes(self) -> str:
        """In the node store: the records the relay had read with the alarm it relays (:func:`relayed_value`)."""
        return self._k("relayed-causes")

    @property
    def relayed_announced(self) -> str:
        """In the node store: the preemption and stall requests the relay had read with its alarm
        (:func:`announced_value`)."""
        return self._k("relayed-announced")

    @property
    def directs(self) -> str:
        return self._k("direct")

    def direct(self, k: int) -> str:
        return self._k(f"direct/{k}")

    def agent(self, node: int) -> str:
        """The heartbeat of node ``node``'s agent (agent/failures.py)."""
        return self._k(f"agent/{node}")

    def failure(self, k: int) -> str:
        return self._k(f"failure/{k}")

    def own_failure(self, r: int) -> str:
        """In the node store: rank ``r``'s own failure record, for its agent."""
        return self._k(f"own-failure/{r}")

    @property
    def lefts(self) -> str:
        """In the node store: a counter each rank advances after writing its ``left/<N>``."""
        return self._k("left")

    def left(self, r: int) -> str:
        """In the node store: rank ``r``'s record that it was stopped, for its agent to forward."""
        return self._k(f"left/{r}")

    @property
    def preflight(self) -> str:
        return self._k("preflight")

    @property
    def stall(self) -> str:
        return self._k("stall")

    @property
    def stall_summary(self) -> str:
        return self._k("stall/summary")

    def answers(self, request: str) -> str:
        """How many ranks answered the stall request ``request`` (each adds 1 after its ``place``): the
        claimant reads this one counter until every rank answered, then their places once. Named by
        the request, so an answer to an earlier one that comes after its clean-up is not counted."""
        return self._k(f"stall/answers/{hashlib.sha1(request.encode()).hexdigest()[:16]}")

    @property
    def failures(self) -> str:
        return self._k("failures")

    def cause(self, k: int) -> str:
        return self._k(f"cause/{k}")

    @property
    def causes(self) -> str:
        return self._k("causes")

    @property
    def alarm(self) -> str:
        return self._k("alarm")

    @property
    def acks(self) -> str:
        return self._k("acks")

    @property
    def first_end(self) -> str:
        """The first rank whose script ended cleanly (protocol/failure.py ``CleanEnd``; first writer wins)."""
        return self._k("first-end")

    @property
    def pg(self) -> str:
        return self._k("pg")

    def stopping(self, node: int) -> str:
        return self._k(f"stopping/{node}")

    def cause_read(self, node: int) -> str:
        """Node ``node``'s agent has read the job's cause, one of its ranks that finished first."""
        return self._k(f"cause-read/{node}")

    def said(self, node: int) -> str:
        """Node ``node``'s agent has printed its last line of a preemption stop (node 0 requeues after)."""
        return self._k(f"said/{node}")

    @property
    def preempt(self) -> str:
        return self._k("preempt")

    @property
    def preempt_stop(self) -> str:
        return self._k("preempt/stop")

    @property
    def preempt_saved(self) -> str:
        return self._k("preempt/saved")


PRESENT_SPLIT = 8
""":func:`present` splits a list longer than this in halves, else checks key by key."""


def present(store: Any, keys: list[str]) -> list[str]:
    """Those of ``keys`` that exist: one call when all do (the usual case); else the halves in
    turn, key by key below PRESENT_SPLIT: about 2·log2(N/8) + 8 calls a missing key, where one call a
    key at thousands of ranks (a few ranks late to answer a stall) costs seconds."""
    if not keys:
        return []
    if store.check(keys):
        return list(keys)
    if len(keys) <= PRESENT_SPLIT:
        return [k for k in keys if store.check([k])]
    mid = len(keys) // 2
    return present(store, keys[:mid]) + present(store, keys[mid:])


def value_or_empty(store: Any, key: str) -> str:
    """``key``'s value as text, or "" when it is not there (a check, and a get when it is)."""
    return text(store.get(key)) if store.check([key]) else ""


def read_counter(store: Any, key: str) -> int | None:
    """A counter's value (0 when absent); None when it holds something that is not an integer.

    Not ``add(key, 0)``: on such a value TCPStore's server fails the add and closes the client's
    connection (DistNetworkError), so every later call of that client fails as if the store were
    down. One ``compare_set`` that changes nothing reads it instead: "0" is put back as "0", another
    value is returned as it is, and an absent key is not created (the server returns the expected
    "0")."""
    try:
        return int(text(store.compare_set(key, "0", "0")))
    except ValueError:
        return None


def raise_alarm(store: Any, keys: Keys) -> None:
    """After a write the ranks act on (the module docstring's ``alarm``)."""
    store.add(keys.alarm, 1)


def publish_failure(store: Any, keys: Keys, rec: fr.FailureRecord) -> int:
    """Record ``rec`` (and, when first-hand, among the causes), then raise the alarm; 5 store calls
    for a cause, 3 for an echo. Returns its place among the causes (0: an echo)."""
    store.set(keys.failure(int(store.add(keys.failures, 1))), rec.to_json())
    c = 0
    if not rec.is_echo:
        c = int(store.add(keys.causes, 1))
        store.set(keys.cause(c), rec.to_json())
    raise_alarm(store, keys)
    return c


def publish_echoes(store: Any, keys: Keys, recs: list[fr.FailureRecord], first: int) -> None:
    """Write ``recs`` (echoes: a node's stopped ranks) at ``failure/<first>`` on, a place the caller
    reserved (``add(keys.failures, len(recs))``), then raise the alarm: with the reservation 3 store
    calls whatever their number, where :func:`publish_failure` makes 3 for each. Safe to repeat."""
    store.multi_set([keys.failure(k) for k in range(first, first + len(recs))], [r.to_json() for r in recs])
    raise_alarm(store, keys)


def read_records(store: Any, names: list[str]) -> dict[str, fr.FailureRecord]:
    """The well-formed records among the keys ``names`` that are set (one batched read)."""
    found = present(store, names)
    out = {}
    for key, raw in zip(found, store.multi_get(found) if found else []):
        parsed = fr.parse_many([raw])
        if parsed:
            out[key] = parsed[0]
    return out


def read_causes(store: Any, keys: Keys, known: Any = ()) -> dict[str, fr.FailureRecord]:
    """Every first-hand record, or while there is none the job's first ECHOES_READ records; the
    keys in ``known`` are not read again. A bounded read whatever the job's size. A counter that is not
    an integer counts 0: the first-hand records are among the job's first records too."""
    n = read_counter(store, keys.causes) or 0
    names = [keys.cause(c) for c in range(1, n + 1)]
    if n == 0:
        names = [keys.failure(k) for k in range(1, min(read_counter(store, keys.failures) or 0, ECHOES_READ) + 1)]
    return read_records(store, [k for k in names if k not in known])


def relay_value(beat: int, alarm: int) -> str:
    """The node store's ``relay`` value: the agent's beat and the job's alarm counter."""
    return f"{beat} {alarm}"


def parse_relay(raw: bytes | str | None) -> tuple[int, int] | None:
    """``(beat, alarm)`` from a ``relay`` value; None for anything else (a bad value is no relay)."""
    try:
        beat, alarm = text(raw or b"").split()
        return int(beat), int(alarm)
    except (ValueError, TypeError):
        return None


def relayable(records: list[fr.FailureRecord]) -> list[fr.FailureRecord]:
    """What :func:`read_causes` would give of ``records``: the first-hand ones, or while there is none
    the first ECHOES_READ echoes (a bounded value whatever the job's size)."""
    first_hand = [r for r in records if not r.is_echo]
    return first_hand if first_hand else records[:ECHOES_READ]


def relayed_value(records: list[fr.FailureRecord]) -> str:
    """The node store's ``relayed-causes`` value."""
    return json.dumps([r.to_json() for r in records], separators=(",", ":"))


def parse_relayed(raw: bytes | str) -> list[fr.FailureRecord] | None:
    """The records of a ``relayed-causes`` value; None unless it is a list of well-formed records (a
    reader then reads the job store: a bad value must not read as "no failure")."""
    try:
        items = json.loads(raw)
    except (ValueError, TypeError):
        return None
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        return None
    records = fr.parse_many(items)
    return records if len(records) == len(items) else None


@dataclass(frozen=True)
class Announced:
    """What the ranks act on besides failures, as one read of the job store found it: the raw
    ``preempt`` and ``stall`` values ("": not there)."""

    preempt: str = ""
    stall: str = ""


def announced_value(a: Announced) -> str:
    """The node store's ``relayed-announced`` value."""
    return json.dumps({"preempt": a.preempt, "stall": a.stall}, separators=(",", ":"))


def parse_announced(raw: bytes | str | None) -> Announced | None:
    """A ``relayed-announced`` value; None for anything else (a reader then reads the job store: a
    bad value must not read as "nothing announced")."""
    try:
        d = json.loads(raw) if raw is not None else None
    except (ValueError, TypeError):
        return None
    if not isinstance(d, dict) or not all(isinstance(d.get(k), str) for k in ("preempt", "stall")):
        return None
    return Announced(d["preempt"], d["stall"])


def int_map(raw: Any) -> dict[int, int]:
    """``{rank: count}`` from a decoded JSON object; entries that are not both integers are skipped."""
    out: dict[int, int] = {}
    if isinstance(raw, dict):
        for k, v in raw.items():
            if isinstance(v, int) and not isinstance(v, bool) and str(k).isdigit():
                out[int(k)] = v
    return out


def text(value: bytes | str) -> str:
    """A store value as text (TCPStore returns bytes; compare_set may return either)."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def owner_value(run_id: str, token: str) -> str:
    return f"{run_id}:{hashlib.sha256(token.encode()).hexdigest()[:16]}"


def claim(store: Any, run_id: str, token: str) -> str | None:
    """Claim the store for this job; None if it is ours, else the run id of the job that holds it."""
    mine = owner_value(run_id, token)
    current = store.compare_set(OWNER_KEY, "", mine)
    current = text(current)
    if current == mine:
        return None
    return current.rsplit(":", 1)[0] or "?"


def refusal(endpoint: str, other: str, run_id: str) -> str:
    """The console's message for a job refused at ``endpoint`` held by run ``other``."""
    same = other == run_id
    who = (f"another job with the same run id '{run_id}' but a different DDPRUN_JOB_TOKEN" if same
           else f"another job (run id '{other}'; this one is '{run_id}')")
    return (f"ddprun: refused: the rendezvous endpoint {endpoint} is in use by {who}.\n"
            f"HINT: give each job its own --rdzv-endpoint port and --rdzv-id, or wait for the other job to end.")
