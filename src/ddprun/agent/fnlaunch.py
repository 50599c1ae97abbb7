"""``ddprun.launch(fn, *args, **kwargs)``: run a function on every device of this machine, from a
script, a notebook or a REPL, and get rank 0's return value back.

How: the same torch elastic agent as ``ddprun run`` (:func:`ddprun.agent.run.launch`), with the worker
bootstrap of ``ddprun run`` (:mod:`ddprun.worker`: rank logs, rank table, preflight, stall watchdog,
failure propagation, hard exit) running :mod:`ddprun.worker.fnworker` in place of a script. So workers see
exactly ``ddprun run``'s environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, TORCHELASTIC_*, NODE_RANK), and ``ddprun.fit``/``ddprun.init`` inside ``fn`` join it.

Start-method rules, and why not ``torch.multiprocessing.spawn`` or ``elastic_launch(fn)``: both
start workers with multiprocessing's *spawn*, which pickles ``fn`` by reference and re-imports the
launching script's ``__main__`` in every child. A function defined in a notebook or a REPL then
cannot be found ("Can't get attribute 'train' on <module '__main__'>"), and a script without an
``if __name__ == "__main__":`` guard launches itself again in every child. Here each worker is a
fresh ``python -m ddprun.worker`` process (the agent's subprocess start, as for ``ddprun run``) that
never imports the caller's ``__main__``; ``fn`` and its arguments travel *by value* (cloudpickle,
:mod:`ddprun.protocol.payload`), together with the caller's ``sys.path`` for what they import by reference.
No ``__main__`` guard is needed, and CUDA may already be initialised in the caller (nothing forks it).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ddprun.config import DEFAULT_JOIN_TIMEOUT_S, DEFAULT_STALL_TIMEOUT_S
from ddprun.errors import ClusterError, ConfigError, LaunchError, LaunchTimeout, WorkerFailed

_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
"""What torch's agent takes over while it runs (TORCHELASTIC_SIGNALS_TO_HANDLE); given back after."""


def _positive(name: str, value: Any, *, zero_ok: bool = False, optional: bool = False) -> None:
    if value is None and optional:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value >= 0 if zero_ok else value > 0)
    if not ok:
        raise ConfigError(f"ddprun.launch's {name} must be {'0 or ' if zero_ok else ''}a positive number of "
                          f"seconds{' or None' if optional else ''}.", seen=f"{name}={value!r}",
                          hint=f"e.g. {name}=600.")


def _check(fn: Any, nproc_per_node: Any, max_restarts: Any, options: Mapping[str, Any]) -> str | None:
    """Argument checks before anything starts; returns --nproc-per-node as ``ddprun run`` reads it."""
    if not callable(fn):
        raise ConfigError("ddprun.launch needs a function to run on every rank.", seen=f"fn: {type(fn).__name__}",
                          hint="ddprun.launch(train, arg1, nproc_per_node=2, key=value) calls train(arg1, key=value) "
                               "on every rank.")
    if nproc_per_node is not None and not (isinstance(nproc_per_node, str) or (
            isinstance(nproc_per_node, int) and not isinstance(nproc_per_node, bool))):
        raise ConfigError("nproc_per_node must be a number of processes, 'gpu', 'cpu', 'auto' or None.",
                          seen=f"nproc_per_node={nproc_per_node!r}", hint="e.g. nproc_per_node=2.")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ConfigError("max_restarts must be an integer >= 0.", seen=f"max_restarts={max_restarts!r}",
                          hint="0 (default): a failure ends the launch; N: the worker group is restarted N times.")
    _positive("timeout", options["timeout"], optional=True)
    _positive("join_timeout", options["join_timeout"])
    _positive("stall_timeout", options["stall_timeout"], zero_ok=True)
    return None if nproc_per_node is None else str(nproc_per_node)


def _payload(fn: Callable, args: tuple, kwargs: dict, *, return_all: bool, timeout: float | None) -> bytes:
    from ddprun.protocol import payload

    try:
        call = payload.dumps((fn, args, kwargs))
    except Exception as e:  # noqa: BLE001 - pickling fails with many exception types
        why = payload.by_reference_only(fn) if payload._pickler().__name__ == "pickle" else None
        raise ConfigError("ddprun.launch cannot send the function or its arguments to the workers.",
                          seen=f"{type(e).__name__}: {e}" + (f"; {why}" if why else ""),
                          hint=("pip install cloudpickle (it sends functions from notebooks by value)" if why else
                                "Pass arguments that pickle (tensors, numbers, datasets of tensors); build what does "
                                "not (open files, locks, sockets, CUDA streams) inside the function.")) from e
    if payload._pickler().__name__ == "pickle":
        why = payload.by_reference_only(fn)
        if why:  # plain pickle accepted it by name, but no worker can look that name up
            raise ConfigError("ddprun.launch cannot send this function without cloudpickle.", seen=why,
                              hint="pip install cloudpickle, or move the function into a module the workers import.")
    import pickle

    deadline = time.time() + timeout if timeout is not None else None
    job = {"sys_path": [p for p in sys.path if isinstance(p, str)], "return_all": return_all,
           "deadline": deadline, "timeout": timeout, "call": call, "source_file": payload.source_file(fn)}
    return pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)


def _root_cause(outcome: Any, directory: str) -> WorkerFailed | LaunchTimeout:
    """One exception for a failed launch: the rank whose own failure ended it, never an echo of it."""
    from ddprun.agent.console import log_tail
    from ddprun.protocol import failure as fr
    from ddprun.protocol import payload
    from ddprun.protocol.rundir import RunDir

    rundir, cause = RunDir(outcome.run_dir), outcome.cause
    if cause is not None and cause.kind == fr.TIMEOUT:
        ranks = sorted(r for r, rec in outcome.records.items() if rec.kind == fr.TIMEOUT)
        return LaunchTimeout(f"ddprun.launch ran past its timeout; rank(s) {ranks} were still running.",
                             seen=cause.summary.replace("ddprun: ", ""),
                             hint=f"Every rank's stacks are at the end of its log in {rundir.logs}; raise timeout= "
                                  "if the work needs longer.")
    rank = cause.rank if cause is not None and cause.rank >= 0 else min(outcome.records, default=0)
    others = sorted(r for r in outcome.records if r != rank)
    also = f"ranks {others} were stopped or failed after it" if others else ""
    log = rundir.rank_log(rank)
    record = payload.read_error(directory, rank)
    if record is not None:
        return WorkerFailed(rank, record["message"], traceback=record["traceback"], error=record["exception"],
                            log=log, others=also)
    msg = (cause.summary or cause.how()) if cause is not None else "the job failed"
    if cause is not None and cause.kind in (fr.SIGNAL, fr.EXIT):
        msg = f"the process {cause.how()} without a Python error"
    tail = "\n".join(log_tail(log, 12))
    return WorkerFailed(rank, msg, traceback=tail and f"(last lines of its log)\n{tail}", log=log, others=also,
                        hint=cause.hint if cause is not None and cause.hint else None)


class _AgentSignals:
    """torch's agent installs handlers for SIGTERM/SIGINT/SIGHUP/SIGQUIT in the main thread and
    leaves them there; a notebook kernel or an application keeps its own after the launch."""

    def __enter__(self) -> _AgentSignals:
        self.saved = {}
        if threading.current_thread() is threading.main_thread():
            for name in _SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self.saved[sig] = signal.getsignal(sig)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def launch(fn: Callable[..., Any], /, *args: Any, nproc_per_node: int | str | None = None, return_all: bool = False,
           timeout: float | None = None, run_dir: str | None = None, log_dir: str | None = None,
           max_restarts: int = 0, join_timeout: float = DEFAULT_JOIN_TIMEOUT_S,
           stall_timeout: float = DEFAULT_STALL_TIMEOUT_S, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` in one process per device of this machine; return rank 0's value.

    ``nproc_per_node``: processes to start; None = every visible GPU, else 1 (on CPU give the count,
    e.g. 2); also ``"gpu"``, ``"cpu"`` (one per core) or ``"auto"`` as for ``ddprun run``.
    ``return_all``: return ``{rank: value}`` of every rank instead of rank 0's value alone (by
    default the other ranks' values are discarded, and never pickled). Values come back pickled:
    keep them small and on the CPU (a ``state_dict`` moved ``.cpu()``, metrics).

    ``fn``, ``args`` and ``kwargs`` are sent by value (module docstring: any function, also one
    defined in a notebook; no ``__main__`` guard needed). The names of this function's own options
    cannot reach ``fn`` as keywords: pass such values positionally or with ``functools.partial``.

    Each worker runs ddprun's bootstrap: rank log ``<run dir>/logs/rank-N.log`` (rank 0's output is
    shown here), the rank table, preflight, the stall watchdog (no optimizer step on any rank for
    ``stall_timeout`` s, 2 x that before the first step, ends the job with a hang report; 0 = off:
    set it for work that makes no optimizer steps for long) and failure propagation. Run dir:
    ``run_dir``, else ``<log_dir or "runs">/<run id>``.

    Raises :class:`~ddprun.errors.WorkerFailed` when a rank fails: ``.rank`` is the rank whose own
    error ended the job (not one stopped because of it), ``.message``/``.traceback`` its error and
    traceback, ``.error`` the original exception when it could be carried back (also ``__cause__``).
    Every wait is bounded: rendezvous by ``join_timeout``, a hung job by ``stall_timeout``, the whole
    launch by ``timeout`` (seconds, None = no limit; then :class:`~ddprun.errors.LaunchTimeout`).
    ``max_restarts``: restart the worker group that many times after a failure (``fn`` runs again
    from the start; ``ddprun.fit`` inside it resumes from its checkpoint). Ctrl-C (a notebook's
    interrupt) stops every worker and raises KeyboardInterrupt.
    """
    from ddprun.agent.run import launch as run_agent
    from ddprun.cluster.detect import resolve
    from ddprun.cluster.local import LocalEnvironment
    from ddprun.cluster.probe import probe_node
    from ddprun.cluster.torchrun import TorchrunEnvironment
    from ddprun.config import Entry, LaunchConfig

    nproc = _check(fn, nproc_per_node, max_restarts,
                   {"timeout": timeout, "join_timeout": join_timeout, "stall_timeout": stall_timeout})
    environ = dict(os.environ)
    if TorchrunEnvironment.detect(environ):
        raise ClusterError(
            "ddprun.launch was called inside a torchrun/ddprun worker: every rank would start a job of its own.",
            seen=f"RANK={environ.get('RANK')}, WORLD_SIZE={environ.get('WORLD_SIZE')}",
            hint="Call fn directly in this worker (it already is one rank of a job), or call ddprun.launch from a "
                 "plain python process.")
    blob = _payload(fn, args, kwargs, return_all=return_all, timeout=timeout)
    node = probe_node(environ)
    directory = tempfile.mkdtemp(prefix="ddprun-launch-")
    try:
        with open(os.path.join(directory, "payload.pkl"), "wb") as fp:
            fp.write(blob)
        # One machine, whatever cluster this process runs in: a notebook on a SLURM node launches there only.
        cfg = LaunchConfig(entry=Entry("ddprun.worker.fnworker", (directory,), is_module=True), nproc_per_node=nproc,
                           standalone=True, max_restarts=max_restarts, join_timeout=join_timeout,
                           stall_timeout=stall_timeout, run_dir=run_dir, log_dir=log_dir,
                           preempt_signals="none")  # interactive: Ctrl-C interrupts now (KeyboardInterrupt)
        spec = resolve(cfg, environ, node, env=LocalEnvironment(), launcher=True)
        with _AgentSignals():  # torch's loggers: AgentLog (agent/run.py) puts them back
            outcome = run_agent(cfg, spec, environ, node.hostname)
        code = outcome.exit_code
        if code == 128 + signal.SIGINT:
            raise KeyboardInterrupt("ddprun.launch was interrupted; every worker was stopped.")
        if code != 0:
            if outcome.records or outcome.cause is not None:
                raise _root_cause(outcome, directory)
            how = f"stopped by signal {code - 128}" if code > 128 else f"exit code {code}"
            raise LaunchError("ddprun.launch failed; no worker reported an error of its own.",
                              seen=f"{how}; run dir {outcome.run_dir}",
                              hint=f"See the lines above and {outcome.run_dir}/logs/agent-{node.hostname}.log.")
        return _results(directory, spec.nproc_per_node, return_all, outcome.run_dir)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _results(directory: str, world_size: int, return_all: bool, run_dir: str) -> Any:
    """Rank 0's value, or {rank: value} of every rank; a missing one, or one that does not load here, is a
    LaunchError (the latter keeps its file: the trained result is never deleted with the directory)."""
    from ddprun.protocol import payload

    wanted = range(world_size) if return_all else [0]
    values = {}
    for rank in wanted:
        path = payload.result_path(directory, rank)
        try:
            with open(path, "rb") as fp:
                data = fp.read()
        except FileNotFoundError:
            raise LaunchError(f"Rank {rank} ended without a return value.", seen=f"no {os.path.basename(path)}",
                              hint="fn must return normally (not sys.exit / os._exit); see "
                                   f"{run_dir}/logs/rank-{rank}.log.") from None
        try:
            values[rank] = payload.loads(data)
        except Exception as e:  # noqa: BLE001 - a value's own __setstate__ / __reduce__ may raise anything
            raise _unloadable(directory, rank, run_dir, e) from e
    return values if return_all else values[0]


def _unloadable(directory: str, rank: int, run_dir: str, error: Exception) -> LaunchError:
    """The error for rank ``rank``'s value that pickled in the worker but does not load here (a model still
    wrapped in DDP needs a process group), with its file moved where it outlives the launch directory."""
    from ddprun.protocol import payload

    try:
        with open(payload.result_type_path(directory, rank), encoding="utf-8") as fp:
            kind = fp.read().strip() or "unknown type"
    except OSError:
        kind = "unknown type"
    kept = _keep(payload.result_path(directory, rank), run_dir)
    where = f"kept in {kept}" if kept else f"could not be kept (it was {payload.result_path(directory, rank)})"
    return LaunchError(
        f"Rank {rank}'s return value ({kind}) was pickled by the worker but cannot be loaded by ddprun.launch.",
        seen=f"{type(error).__name__}: {str(error).rstrip('.')}; the pickled value is {where}",
        hint="Return plain data: model.module.state_dict() for a model wrapped in DistributedDataParallel (or "
             "model.module), numbers, dicts, CPU tensors. The kept file loads with pickle.load where its value can "
             "be rebuilt (for a DDP module: after torch.distributed.init_process_group).")


def _keep(path: str, run_dir: str) -> str | None:
    """Move ``path`` into the run directory (else a directory of its own); its new path, or None."""
    for target in (run_dir, None):
        try:
            folder = target or tempfile.mkdtemp(prefix="ddprun-result-")
            os.makedirs(folder, exist_ok=True)
            return shutil.move(path, os.path.join(folder, os.path.basename(path)))
        except OSError:
            continue
    return None
