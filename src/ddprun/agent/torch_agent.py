"""torch's elastic agent, set up the way ``torch.distributed.launcher.api.launch_agent`` does, with
the hooks ddprun needs and torch does not offer:

* ``on_worker_exit(global_rank, local_rank, pid, exit_code)``: called within one monitor interval of
  a worker ending non-zero, *before* torch stops its siblings (which may take torch's 30 s SIGTERM
  grace): the agent records a worker that died by a signal while the peers' echoes are still in
  flight (agent/failures.py).
* ``on_workers_started(worker_group, pids, restarts_left)``: after each (re)start of the worker group.
* ``on_restarting(left, most)``: a failed group is about to be restarted (not a restart because a
  node joined): the agent says on its console which rank failed and how, every time.
* ``on_dropped()``: torch's rendezvous moved past this node's round while its workers still train:
  the sanitizer removed it when its keep-alive went stale (the agent was frozen or starved), the
  round was left empty, and a new round (a second group) may form without it. torch's agent would
  not notice; its healthy-group check then reports a waiting node, so torch restarts the group and
  it joins again (:func:`round_moved_on`).
* ``on_signal(sig)``: the agent got a death signal; called before torch stops the workers, so the
  record of why reaches the other nodes before the echoes of the stopped workers do.
* node 0 shares the workers' store address in every rendezvous round (:func:`share_bootstrap`:
  torch 2.13 hangs when a node joins a running elastic job).
* preemption (agent/preemption.py): while the workers run, the preemption signals only set a flag
  (``on_preempt_signal``); ``preempt_check()`` runs every monitor interval and returns a signal
  when the grace is over (then the workers are stopped as torch stops them); while preempting no
  restart is made; ``on_stopping()`` before torch signals its workers for any other reason. From a
  restart's start until its workers run, there is no step to stop at: a signal then (or one already
  flagged) ends the agent at once, as during the first rendezvous.
* a node waiting in the rendezvous looks at the round sooner in a small job (agent/rendezvous_poll.py).
* a bounded exit barrier that ends early when ``exit_barrier_done()`` says so (a node was lost),
  instead of torch's fixed 300 s wait for agents that may be gone; ``on_exit_barrier_left(arrived,
  n)`` says how many agents it saw arrive.

Everything else (rendezvous, worker processes, restarts, supervision) is torch's LocalElasticAgent.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from ddprun._util import within
from ddprun.agent import rendezvous_poll
from ddprun.agent.attempt import handler_round
from ddprun.protocol import defaults
from ddprun.protocol import preempt as pp


@dataclass
class AgentHooks:
    """What ddprun adds to torch's agent; every callback must return quickly and never raise."""

    on_worker_exit: Callable[[int, int, int, int], None] = lambda rank, local_rank, pid, code: None
    on_workers_started: Callable[[WorkerGroup, dict[int, int], int], None] = lambda group, pids, left: None
    on_restarting: Callable[[int, int], None] = lambda left, most: None
    """A failed worker group is about to be restarted; ``left`` restarts remain after this one, of ``most``."""
    on_rendezvous: Callable[[int | None], None] = lambda round_: None
    """A rendezvous completed: its round (agent/attempt.py handler_round), before the workers start."""
    on_membership_change: Callable[[], None] = lambda: None
    """torch restarts a healthy group because a node waits to join (an elastic job with room)."""
    on_dropped: Callable[[], None] = lambda: None
    """torch restarts a healthy group because the rendezvous dropped this node (module docstring)."""
    on_signal: Callable[[int], None] = lambda sig: None
    """This agent got a death signal (SIGTERM, SIGINT, ...): called before torch stops the workers."""
    exit_barrier_done: Callable[[], bool] = lambda: False
    on_exit_barrier_left: Callable[[int, int], None] = lambda arrived, n: None
    """The exit barrier was left with ``arrived`` of ``n`` agents seen there (the last count read)."""
    exit_barrier_s: float = 300.0
    stop_grace_s: float = 30.0
    """Seconds between SIGTERM and SIGKILL when the agent stops its workers."""
    preempt_signals: tuple[int, ...] = ()
    on_preempt_signal: Callable[[int], None] = lambda sig: None
    """A preemption signal reached this agent (its handler: a flag only)."""
    preempt_check: Callable[[], int | None] = lambda: None
    """Every monitor interval: a signal to stop the workers with now (the grace is over), else None."""
    preempting: Callable[[], bool] = lambda: False
    """The job stops at an agreed step, as this agent's beats last read it (agent/preemption.py)."""
    restart_forbidden: Callable[[], bool] = lambda: False
    """Asked when the group failed: no restart (this node got a preemption signal, or the job stops at
    a step, the job's answer read first)."""
    before_exit_barrier: Callable[[], None] = lambda: None
    """The workers ended: called before the agents' exit barrier, while every node's store still answers."""
    on_stopping: Callable[..., None] = lambda why="1": None
    """torch's agent is about to signal its workers (a restart, a failure, the end): not a preemption.
    ``why``: the mark's value, protocol.preempt.STOPPING_FOR_NONE when the job answered that nothing
    stops at a step (a script's own handler for the signal then decides, as under torchrun)."""
    answered_none: Callable[[], bool] = lambda: False
    """The job answered the preemption request NO_STEP (agent/preemption.py)."""
    seen: set[int] = field(default_factory=set)
    """pids of this attempt's workers already reported to on_worker_exit."""
    standby: Any = None
    """A started agent/standby.py StandbyPool: the first attempt's workers are its processes; closed then."""


TORCH_TAKES_SHUTDOWN_TIMEOUT = "shutdown_timeout" in inspect.signature(LocalElasticAgent.__init__).parameters
"""torch >= 2.12 takes the workers' stop grace (``shutdown_timeout``); 2.6-2.11 stop them with a fixed 30 s."""


class DdprunAgent(LocalElasticAgent):
    """LocalElasticAgent with :class:`AgentHooks` (module docstring)."""

    _stop_why = "1"
    """The value of this agent's stopping mark at its shutdown (AgentHooks.on_stopping): "1", or
    protocol.preempt.STOPPING_FOR_NONE for a stop because nothing in the job stops at a step."""

    def __init__(self, *, hooks: AgentHooks, shutdown_timeout: int = 30, **kwargs: Any):
        kwargs["exit_barrier_timeout"] = hooks.exit_barrier_s
        if TORCH_TAKES_SHUTDOWN_TIMEOUT:
            kwargs["shutdown_timeout"] = shutdown_timeout
        super().__init__(**kwargs)
        self._stop_grace_s = shutdown_timeout
        self._hooks = hooks
        self._hooks_said_signal: int | None = None
        self._preempt_said: int | None = None
        self._dropped = False
        self._joined_round: int | None = None
        self._workers_run = False
        """Workers of this attempt run (a preemption signal is a flag), from their start to a restart."""

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        # a pid reported in an attempt before may be a new worker's now (pids wrap): its death is news
        self._hooks.seen.clear()
        pool, self._hooks.standby = self._hooks.standby, None
        if pool is None:
            pids = super()._start_workers(worker_group)
        else:
            pids = self._start_from(pool, worker_group)
        self._workers_run = True
        self._catch_preemption()  # after torch's own handlers, which its process context installs at start
        self._say_before_close(worker_group)
        self._hooks.on_workers_started(worker_group, pids, self._remaining_restarts)
        return pids

    def _say_before_close(self, worker_group: WorkerGroup) -> None:
        """torch's process context stops the other workers itself (SIGTERM) when it finds one failed, in
        its poll, not through :meth:`_shutdown`: every worker that ended is reported and ``on_stopping``
        called first, so the stopped ones read the signal as their agent's stop (not a preemption) and
        are recorded as stopped because of the failure."""
        pcontext: Any = self._pcontext
        if pcontext is None:
            return
        close = pcontext.close
        closed: list[bool] = []

        def close_after_saying(*args: Any, **kwargs: Any) -> Any:
            if not closed:  # again (torch's _shutdown after a failed rendezvous): its exits are torch's SIGTERM
                closed.append(True)
                self._report_exits(worker_group)
                self._hooks.on_stopping(self._stop_why)  # as _shutdown marked it, when it is the closer
            return close(*args, **kwargs)

        pcontext.close = close_after_saying

    def _start_from(self, pool: Any, worker_group: WorkerGroup) -> dict[int, Any]:
        """torch's start with the standby processes in place of new ones (agent/standby.py), once."""
        from torch.distributed.elastic.multiprocessing import api

        from ddprun.agent.standby import handler_factory

        original = api.get_subprocess_handler
        api.get_subprocess_handler = handler_factory(pool, original)
        try:
            return super()._start_workers(worker_group)
        finally:
            api.get_subprocess_handler = original
            pool.close()

    def _catch_preemption(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self._hooks.preempt_signals:
            if sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN:
                continue  # nohup: a closed terminal is no preemption (run_agent)
            signal.signal(sig, self._preempt_signal)

    def _preempt_signal(self, signum: int, frame: Any) -> None:
        # a second signal, or one while no workers run (a restart: nothing to stop at a step): stop now
        if self._preempt_said is not None or not self._workers_run:
            _signal_exception(signum, frame)
        self._preempt_said = signum
        self._hooks.on_preempt_signal(signum)

    def _monitor_workers(self, worker_group: WorkerGroup):  # type: ignore[override]
        self._report_exits(worker_group)  # first: a worker that died is named so, also when the grace ends now
        forced = self._hooks.preempt_check()
        if forced is not None:
            if self._hooks.answered_none():  # stopped as torch stops them: a script's handler decides
                self._stop_why = pp.STOPPING_FOR_NONE
            _signal_exception(forced, None)
        result = super()._monitor_workers(worker_group)
        if result.state in {WorkerState.FAILED, WorkerState.UNHEALTHY}:
            # a worker that ended between the poll above and torch's is reported before torch
            # restarts or stops the group (its handler is gone after that)
            self._report_exits(worker_group)
            if self._hooks.restart_forbidden():
                self._remaining_restarts = 0
                if self._preempt_said is not None and not self._hooks.preempting():
                    # the job answered that nothing stops at a step, and its workers died of the signal
                    # this agent got too (SLURM, Kubernetes signal every process): what preempt_check()
                    # does a poll later, now; torch then leaves the rendezvous open for the other nodes
                    _signal_exception(self._preempt_said, None)
        return result

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        # torch restarts a FAILED/UNHEALTHY group (one restart spent) or a HEALTHY one (a node joined)
        if worker_group.state in {WorkerState.FAILED, WorkerState.UNHEALTHY}:
            self._hooks.on_restarting(self._remaining_restarts, worker_group.spec.max_restarts)
        elif self._dropped:
            self._dropped = False
            self._hooks.on_dropped()
        else:
            self._hooks.on_membership_change()
        # from here until the new workers run, a signal ends the agent (torch's handler or ours): a
        # restart whose rendezvous cannot complete would otherwise wait out --join-timeout
        self._workers_run = False
        if self._preempt_said is not None:  # it came while the group failed or the hooks above ran
            _signal_exception(self._preempt_said, None)
        super()._restart_workers(worker_group)

    def _report_exits(self, worker_group: WorkerGroup) -> None:
        handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
        for local_rank, handler in handlers.items():
            code = handler.proc.poll()
            if code is None or code == 0 or handler.proc.pid in self._hooks.seen:
                continue
            self._hooks.seen.add(handler.proc.pid)
            worker = worker_group.workers[local_rank]
            self._hooks.on_worker_exit(worker.global_rank, local_rank, handler.proc.pid, code)

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        super()._rendezvous(worker_group)
        self._joined_round = handler_round(worker_group.spec.rdzv_handler)
        self._watch_dropped(worker_group.spec.rdzv_handler)
        self._hooks.on_rendezvous(self._joined_round)

    def _watch_dropped(self, handler: Any) -> None:
        """torch asks ``num_nodes_waiting()`` every monitor interval while the group is healthy (after
        syncing the rendezvous state): it also answers 1, once, when that state moved past this node's
        round (:func:`round_moved_on`). While preempting it answers 0: a restart then would give the
        job a new attempt whose workers never heard of the stop step. The question never holds torch's
        loop (:class:`AnswerSoon`), and the handler's ``shutdown`` is bounded (SHUTDOWN_S)."""
        if getattr(handler, "_ddprun_watches_drop", False):
            handler._ddprun_answers.forget()  # a new round: the last one's answer is no answer for it
            return
        if not hasattr(handler, "num_nodes_waiting"):
            return
        waiting, shutdown = AnswerSoon(handler.num_nodes_waiting, 0), handler.shutdown

        def num_nodes_waiting() -> int:
            if self._hooks.preempting():  # the job stops at one step: a waiting node joins the next launch
                return 0
            n = int(waiting())
            if self._hooks.preempting():  # a signal may have come while waiting() asked the store
                return 0
            dropped = n == 0 and not self._dropped and round_moved_on(handler, self._joined_round)
            # a restart is looked at after the answer (the agent may have been stopped while it waited):
            # torch's next poll sees the group FAILED or SUCCEEDED, which comes first
            if (n or dropped) and self._workers_ended():
                return 0
            if dropped:
                self._dropped = True
                return 1
            return n

        def bounded_shutdown() -> bool:
            try:  # closing the rendezvous is best effort: a short bound
                return bool(within(SHUTDOWN_S, shutdown))
            except Exception:  # noqa: BLE001 - the endpoint's store does not answer: nothing to close there
                return False

        handler.num_nodes_waiting = num_nodes_waiting
        handler.shutdown = bounded_shutdown
        handler._ddprun_watches_drop, handler._ddprun_answers = True, waiting

    def _workers_ended(self) -> bool:
        """Whether, since torch's last poll saw the group healthy (the agent was frozen or slow between
        the two), a worker ended non-zero or every worker ended: a drop or a waiting node must not
        restart that group (a failure would be lost or taken for a membership change; a finished
        node would join a rendezvous the others have left)."""
        handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
        codes = [handler.proc.poll() for handler in handlers.values()]
        # a worker whose main thread ended while another thread runs on cannot be reaped yet (waitpid:
        # running); its error file says it failed (seen: the frozen-agent fault test, 1 run in 10)
        errors = getattr(self._pcontext, "error_files", None) or {}
        wrote = any(code is None and os.path.isfile(errors.get(rank, "")) for rank, code in zip(handlers, codes))
        return wrote or any(code not in (None, 0) for code in codes) or (bool(codes) and None not in codes)

    def _assign_worker_ranks(self, store: Any, group_rank: int, group_world_size: int,  # type: ignore[override]
                             spec: WorkerSpec) -> Any:
        if group_rank == 0:
            share_bootstrap(store, spec.rdzv_handler)
        return super()._assign_worker_ranks(store, group_rank, group_world_size, spec)

    def _shutdown(self, death_sig: Any = None, timeout: int | None = None, **kwargs: Any) -> None:  # type: ignore[override]
        self._report_exits(self._worker_group)  # a worker that died before the signal is its own cause
        self._hooks.on_stopping(self._stop_why)
        # torch passes death_sig only when a signal ended the agent (else only the timeout, at every end)
        if death_sig is not None and self._hooks_said_signal is None:
            self._hooks_said_signal = int(death_sig)
            self._hooks.on_signal(int(death_sig))
        sig = death_sig if death_sig is not None else signal.SIGTERM
        if TORCH_TAKES_SHUTDOWN_TIMEOUT:
            super()._shutdown(sig, 30 if timeout is None else timeout, **kwargs)
            return
        # older torch passes no grace: a signal's stop gets ddprun's (as torch >= 2.12 passes it), others
        # torch's 30 s; the workers closed here, torch's own close then finds them ended
        if self._pcontext is not None:
            self._pcontext.close(sig, self._stop_grace_s if death_sig is not None else 30)
        super()._shutdown(sig, **kwargs)

    def _exit_barrier(self) -> None:
        """torch's barrier of agents at the end, bounded and left early when a node is lost."""
        self._hooks.before_exit_barrier()
        store, n = self._store, self._worker_group.group_world_size
        if store is None or n is None:
            return
        key = "ddprun/exit-barrier/" + str(self._worker_group.spec.rdzv_handler.get_run_id())
        deadline, arrived = time.monotonic() + self._exit_barrier_timeout, 0
        try:  # each call bounded: a stopped store host would hold it for ever
            arrived = within(defaults.STORE_CALL_S, store.add, key, 1)
            while arrived < n and time.monotonic() < deadline and not self._hooks.exit_barrier_done():
                time.sleep(0.1)
                arrived = within(defaults.STORE_CALL_S, store.add, key, 0)
        except Exception:  # noqa: BLE001 - the store host ended first (or froze): nothing left to wait for
            pass
        self._hooks.on_exit_barrier_left(int(arrived), n)


RENDEZVOUS_CALL_S = 60.0
"""How long one ``num_nodes_waiting`` of torch's rendezvous handler may stay unanswered before torch's
agent is ended with RendezvousConnectionError: torch's own store read_timeout. Its TCPStore client
waits for ever when the endpoint's host is stopped (SIGSTOP); a slow store (a 1,000-node job's, where
the keep-alive thread holds the handler's lock through its retries) must never end a healthy job."""

SHUTDOWN_S = 3.0
"""How long torch's rendezvous ``shutdown`` (closing the round in the endpoint's store) may take."""

ANSWER_WAIT_S = 1.0
"""How long torch's loop waits for a fresh answer before it gets the last one (its poll is 0.1 s)."""


class AnswerSoon:
    """``fn()`` for a loop that must not stop: one call at a time on a helper thread. A call that
    answers within ANSWER_WAIT_S gives its result (or raises its exception); one still pending gives
    the last result, and once it has been pending RENDEZVOUS_CALL_S, torch's RendezvousConnectionError
    (its agent then ends, and ddprun names what its failure thread found: agent/run.py ``ending``)."""

    def __init__(self, fn: Callable[[], Any], first: Any):
        self._fn, self._first, self._last = fn, first, first
        self._pending: tuple[threading.Thread, threading.Event, dict[str, Any], float] | None = None

    def forget(self) -> None:
        """A new question (torch's next round): the last answer, and a call still pending (left to
        end on its own), are of the old one."""
        self._last, self._pending = self._first, None

    def __call__(self) -> Any:
        if self._pending is None:
            done, box = threading.Event(), dict[str, Any]()
            thread = threading.Thread(target=self._run, args=(done, box), name="ddprun-rendezvous-call", daemon=True)
            thread.start()
            self._pending = (thread, done, box, time.monotonic())
        _, done, box, since = self._pending
        if done.wait(ANSWER_WAIT_S):
            self._pending = None
            if "error" in box:
                raise box["error"]
            self._last = box["value"]
            return self._last
        if time.monotonic() - since >= RENDEZVOUS_CALL_S:
            from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

            raise RendezvousConnectionError(f"the rendezvous endpoint's store did not answer for "
                                            f"{time.monotonic() - since:.0f} s (its host stopped or frozen?)")
        return self._last

    def _run(self, done: threading.Event, box: dict[str, Any]) -> None:
        try:
            box["value"] = self._fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            done.set()


def round_moved_on(handler: Any, joined: int | None) -> bool:
    """Whether torch's c10d rendezvous state (as the handler last synced it) is past round
    ``joined``, the one this node's healthy workers train in. A complete round's number moves only
    when its participants are all gone (``_remove_participant_epilogue``), and a participant leaves
    only through its own next rendezvous or the sanitizer: so this node was dropped, and a new round
    can form without it. A drop that leaves others in the round only edits the record (every group
    still trains together; a newcomer waits, and is seen as waiting): no restart for that. False for
    a handler that keeps no such state."""
    try:
        return joined is not None and int(handler._state_holder.state.round) != joined
    except (AttributeError, TypeError, ValueError):
        return False


def share_bootstrap(store: Any, handler: Any) -> None:
    """Give a node that joins a later round the workers' store address, as in round 0.

    torch 2.13's c10d handler (shared TCP store) publishes MASTER_ADDR/MASTER_PORT in the round's
    store only in the round where node 0 creates the workers' store server; a node joining a running
    elastic job (round >= 1) waits for them for ever in ``RendezvousStoreInfo.build`` while the others
    wait for it in ``_assign_worker_ranks``: plain torchrun --nnodes 1:3 hangs the whole job when a
    third node arrives (seen here, 127.0.0.1). Node 0 writes them in every round (a no-op where set)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

    info = getattr(handler, "_bootstrap_store_info", None)
    if info is None:  # another backend, or a torch that keeps it elsewhere: nothing to add
        return
    try:
        if not store.check([RendezvousStoreInfo.MASTER_ADDR_KEY]):
            store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(info.master_port))
            store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, str(info.master_addr))
    except Exception:  # noqa: BLE001 - the store is gone: torch's own next call says so
        pass


def follow_round_store(handler: Any) -> None:
    """Every node of a round gives its workers the workers' store of that round's group rank 0.

    torch 2.13's c10d handler (shared TCP store) keeps the store address a node read in its first
    round, but makes a new store on a node that becomes group rank 0 later (ranks follow the nodes'
    sorted (address, pid): a late node that sorts first). The running nodes then keep the old store,
    the new rank 0 its new one: their workers wait on different stores, and each agent names the other
    lost (seen here, 127.0.0.1, a node started first and reaching the rendezvous last). So after each
    rendezvous a non-zero rank takes the address its round's rank 0 published (torch's
    ``RendezvousStoreInfo.build``, or :func:`share_bootstrap`), and a rank 0 its own server's."""
    if not hasattr(handler, "_shared_tcp_store_server"):  # another backend, or another torch
        return
    original = handler.next_rendezvous

    def next_rendezvous() -> Any:
        info = original()
        fresh = round_store_info(handler, info)
        if fresh is None:
            return info
        from torch.distributed.elastic.rendezvous.api import RendezvousInfo

        handler._bootstrap_store_info = fresh
        return RendezvousInfo(info.store, info.rank, info.world_size, fresh)

    handler.next_rendezvous = next_rendezvous


def round_store_info(handler: Any, info: Any) -> Any:
    """The workers' store of ``info``'s round where it differs from the one torch gave (else None):
    rank 0's own server; for another rank, what rank 0 published in the round's store (a read that
    waits for it, bounded by that store's timeout, as torch's own first-round read)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

    given = info.bootstrap_store_info
    if info.rank == 0:
        server = handler._shared_tcp_store_server
        if server is None:  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: torch built it for this round
            return None
        own = (str(handler._this_node.addr), int(server.port))
    else:
        own = (info.store.get(RendezvousStoreInfo.MASTER_ADDR_KEY).decode(),
               int(info.store.get(RendezvousStoreInfo.MASTER_PORT_KEY).decode()))
    if given is not None and (str(given.master_addr), int(given.master_port)) == own:
        return None
    return RendezvousStoreInfo(master_addr=own[0], master_port=own[1])


def bind_workers_store(handler: Any) -> None:
    """The workers' store that torch's c10d handler creates on node 0 listens on the address it tells
    the workers (this node's local address) instead of every interface (agent/endpoint.py)."""
    if not hasattr(handler, "_create_tcp_store_server"):  # another backend, or another torch
        return
    from ddprun.agent.endpoint import bound_server

    def create(master_addr: str, master_port: int) -> Any:
        try:
            return bound_server(master_addr, master_port, 300.0)  # torch's default timeout
        except OSError as e:  # an address this node cannot bind: torch's own way, every interface
            print(f"ddprun: note: the workers' store listens on every interface: {master_addr} could not be "
                  f"bound here ({e})", file=sys.stderr, flush=True)  # the agent's log (SECURITY.md)
            return type(handler)._create_tcp_store_server(handler, master_addr, master_port)

    handler._create_tcp_store_server = create


def run_agent(config: Any, entrypoint: str, args: list[str], hooks: AgentHooks) -> dict[int, Any]:
    """torch's ``launch_agent(config, entrypoint, args)`` with :class:`DdprunAgent` (same exceptions)."""
    params = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
                                  min_nodes=config.min_nodes, max_nodes=config.max_nodes,
                                  local_addr=config.local_addr, **config.rdzv_configs)
    # torch's agent leaves its handlers installed when it ends: after it, a Ctrl-C is a KeyboardInterrupt again.
    # Only the main thread may set handlers (ddprun.launch may run in another: torch skips them there too).
    main = threading.current_thread() is threading.main_thread()
    caught: set[int] = {*EARLY_SIGNALS, signal.SIGINT, signal.SIGQUIT, *hooks.preempt_signals}
    saved = {sig: signal.getsignal(sig) for sig in caught} if main else {}
    nohup = saved.get(signal.SIGHUP) is signal.SIG_IGN
    for sig in EARLY_SIGNALS if main else ():
        if not (nohup and sig == signal.SIGHUP):
            signal.signal(sig, _signal_exception)
    try:
        with _hangup_kept_ignored(nohup):
            return _run(config, entrypoint, args, hooks, params)
    finally:
        for num, handler in saved.items():
            if handler is not None:  # None: a handler set from C, which Python cannot put back
                signal.signal(num, handler)


@contextlib.contextmanager
def _hangup_kept_ignored(nohup: bool) -> Iterator[None]:
    """With ``nohup`` (SIGHUP ignored when the agent started), torch's agent is told the signals it
    handles without SIGHUP while the block runs (:func:`without_hangup`); otherwise nothing."""
    if not nohup:
        yield
        return
    print("ddprun: SIGHUP is ignored (nohup): a closed terminal does not stop this node", file=sys.stderr, flush=True)
    before = os.environ.get(SIGNALS_VAR)
    os.environ[SIGNALS_VAR] = without_hangup(before)  # an explicit export: torch reads it from os.environ
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SIGNALS_VAR, None)
        else:
            os.environ[SIGNALS_VAR] = before


SIGNALS_VAR = "TORCHELASTIC_SIGNALS_TO_HANDLE"
"""The signals torch's agent stops its workers for, read at each start of the workers; its default
is SIGTERM, SIGINT, SIGHUP and SIGQUIT."""


def without_hangup(value: str | None) -> str:
    """:data:`SIGNALS_VAR`'s ``value`` (None: torch's default) without SIGHUP. torch would replace the
    SIG_IGN that ``nohup`` leaves with its handler, and a terminal closed under a job its user started
    with nohup would stop it (torch's ``SignalException: Process N got signal: 1``)."""
    names = (value if value is not None else "SIGTERM,SIGINT,SIGHUP,SIGQUIT").split(",")
    return ",".join(n.strip() for n in names if n.strip() and n.strip() != "SIGHUP")


EARLY_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Handled as torch does once workers run, from the start: a SIGTERM while the rendezvous waits (a
scheduler's, or ddprun's own join watcher refusing this node) ends the agent with its one message."""


def _signal_exception(signum: int, frame: Any) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))


def _run(config: Any, entrypoint: str, args: list[str], hooks: AgentHooks, params: RendezvousParameters) -> Any:
    master_addr, master_port = None, None
    if config.rdzv_backend == "static":
        master_addr, master_port = parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=-1)
    handler = rdzv_registry.get_rendezvous_handler(params)
    bind_workers_store(handler)
    follow_round_store(handler)
    rendezvous_poll.quicken(handler)
    spec = WorkerSpec(role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint,
                      args=tuple(args), rdzv_handler=handler,
                      max_restarts=config.max_restarts, monitor_interval=config.monitor_interval,
                      master_addr=master_addr, master_port=master_port, local_addr=config.local_addr)
    agent = DdprunAgent(spec=spec, logs_specs=config.logs_specs, start_method=config.start_method, hooks=hooks,
                        shutdown_timeout=max(1, round(hooks.stop_grace_s)))
    shutdown = True
    try:
        result = agent.run()
        if result is None:  # torch's RendezvousGracefulExitError: the job closed while this node waited
            raise RendezvousClosedError("the rendezvous closed while this node waited in it as a spare "
                                        "(beyond the job's maximum node count); it ran no workers")
        if result.is_failed():
            raise ChildFailedError(name=entrypoint, failures=result.failures)
        return result.return_values
    except Exception as e:
        # a SignalException ends this agent, not the rendezvous: other nodes may go on (torch's rule)
        shutdown = type(e).__name__ != "SignalException"
        raise
    finally:
        if shutdown:
            spec.rdzv_handler.shutdown()


__all__ = ["AgentHooks", "DdprunAgent", "WorkerState", "run_agent"]
