"""Worker bootstrap: ``python -m ddprun.worker [-m] TARGET ARGS...``, started by torch's agent.

Before the user's code: the worker ties its life to its agent's (PR_SET_PDEATHSIG), NODE_RANK is
set, stderr joins stdout in the rank's log file, progress counting is installed
(worker/progress.py), the rank publishes its row to the agent's store, and rank 0 prints the
gathered rank table once and writes ``plan.json`` (worker/preflight.py). The user's script then runs
unmodified (runpy, as ``python`` would run it), with the monitor thread beside it
(worker/monitor.py). Afterwards the process ends through :func:`ddprun.worker.exit.hard_exit`.

A rank that fails writes a failure record (protocol/failure.py). One whose error is only a peer's
echo ("Connection reset by peer": the peer died) waits briefly for the first-hand record (the dead
rank's agent writes it) and then says one line naming that cause, without a traceback. An error
every rank raises alike (:mod:`ddprun.mismatch`) is one line, no traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from ddprun import cgroups, loaderworkers
from ddprun._util import die_with_parent, within
from ddprun.errors import ConfigError
from ddprun.preempt import PREEMPT, Preempted
from ddprun.protocol import defaults
from ddprun.protocol import failure as fr
from ddprun.protocol.env import AGENT_PID, MERGE_STDERR, WorkerEnv
from ddprun.worker import exit as ddp_exit
from ddprun.worker.channel import JobChannel, JobRefused


def die_with_agent(environ: Mapping[str, str]) -> None:
    """SIGKILL this process when its parent (the agent) dies, so a worker never outlives its agent;
    exit at once when the agent that started it (``DDPRUN_AGENT_PID``) is no longer its parent."""
    agent = environ.get(AGENT_PID, "")
    die_with_parent(int(agent) if agent.isdigit() else 0)


def _merge_stderr_into_stdout() -> None:
    # The agent points stdout at logs/rank-N.log; one file per rank keeps tracebacks next to prints.
    if os.environ.get(MERGE_STDERR) == "1":
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(1, 2)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]


def _run_user_code(argv: list[str]) -> None:
    import runpy

    if not argv:
        raise SystemExit("ddprun.worker: no script or module given")
    if argv[0] == "-m":
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, args = argv[0], argv[1:]
        sys.argv = [script, *args]
        # `python script.py` puts the script's directory first on sys.path; so do we.
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


def _known_failure(e: BaseException) -> str | None:
    """The one-line summary of an error whose traceback adds nothing (ddprun.mismatch), else None."""
    try:
        from ddprun.mismatch import translate

        return translate(e)
    except Exception:  # noqa: BLE001 - a failing translation must not hide the user's error
        return None


def _worker_env() -> WorkerEnv | None:
    """This worker's DDPRUN_* environment; a malformed value ends the process with one message (exit 2)."""
    try:
        return WorkerEnv.from_environ(os.environ)
    except ConfigError as e:
        print(f"ddprun: error: {e}", file=sys.stderr, flush=True)
        rec = ddp_exit.own_record(fr.ERROR, str(e).replace("\n", " "), os.environ, 2)
        ddp_exit.write_error_file(str(e).splitlines()[0], record=rec)
        ddp_exit.hard_exit(2)
        return None


def _open_channel(argv: list[str], wenv: WorkerEnv | None) -> JobChannel | None:
    """The job channel, started (claim, row, preflight); ends the process on a refusal or a preflight error."""
    script = None if (argv and argv[0] == "-m") else (argv[0] if argv else None)
    channel = JobChannel.from_environ(os.environ, script, wenv) if wenv is not None else None
    if channel is None:
        return None
    try:
        channel.start()
    except JobRefused as e:  # another job's store: write nothing there, say why, leave
        print(e, file=sys.stderr, flush=True)
        ddp_exit.write_error_file(str(e).splitlines()[0])
        ddp_exit.hard_exit(1)
    except SystemExit as e:  # preflight failed; already reported
        ddp_exit.hard_exit(ddp_exit.exit_code_of(e))
    return channel


BACKEND_MARKS = ("[gloo]", "gloo/transport", "NCCL", "c10d", "ProcessGroup")
"""Words of torch's collective backends in an error (a Work.wait() the user called raises from C++)."""


def raised_in_torch(e: BaseException) -> bool:
    """Whether ``e`` (or an error it was raised from) came out of torch's distributed machinery: a
    torch.distributed DistError, a backend's words, or torch's code where it was raised (a collective,
    DDP's hooks, autograd running them). Only then can "Connection refused" be a peer's death seen
    from here; the same words from the user's own client (a metrics server, a data service, also
    through a DataLoader worker) are this rank's error."""
    dist = sys.modules.get("torch.distributed")
    dist_error = getattr(dist, "DistError", None)
    seen: set[int] = set()
    err: BaseException | None = e
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = str(err)
        if "in DataLoader worker process" in text:
            return False
        if (dist_error is not None and isinstance(err, dist_error)) or any(m in text for m in BACKEND_MARKS):
            return True
        tb = err.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None and f"{os.sep}torch{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        err = err.__cause__ or err.__context__
    return False


def _on_error(e: BaseException, channel: JobChannel | None, oom0: int | None = None) -> None:
    """Record and report a failure that left the user's code (module docstring); ``oom0``: the
    cgroup's oom_kill count when the user's code started (worker/exit.py error_hint)."""
    text = ddp_exit.error_text(e)
    known = _known_failure(e)
    if channel is None:
        if known is not None:
            print(f"ddprun: {known}", file=sys.stderr, flush=True)
        else:
            ddp_exit.print_user_traceback(e)
        ddp_exit.write_error_file(known or text, e, ddp_exit.own_record(fr.MISMATCH if known else fr.ERROR,
                                                                        known or text, os.environ))
        return
    if known is not None:
        # Every rank raised this same configuration error: one line from each, no tracebacks.
        ddp_exit.say(f"ddprun: {known}")
        ddp_exit.record(channel.me(fr.MISMATCH, known), channel, e)
        return
    echo = fr.looks_like_echo(text) and raised_in_torch(e)
    cause = channel.cause()
    if (cause is None or cause.is_echo) and echo:
        cause = channel.await_cause(defaults.ECHO_WAIT_S)
        if (cause is None or cause.is_echo) and (end := channel.first_clean_end()) is not None:
            cause = fr.finished_first(end)  # a peer that ended its script while this rank still needed it
    if cause is not None and not cause.is_echo:
        # A peer failed first: one line naming the cause. An error of this rank's own that is no echo
        # (raised in the user's code, not a collective's) keeps its traceback, here and in the error file.
        first_line = (str(e).splitlines() or [""])[0][:200]
        msg = ddp_exit.stopped_message(cause, channel)
        ddp_exit.say(f"{msg}\n  (this rank then saw {type(e).__name__}: {first_line})")
        if not echo:
            ddp_exit.print_user_traceback(e)
        ddp_exit.record(channel.stopped(cause, seen=f"{type(e).__name__}: {first_line}"), channel,
                        None if echo else e, message=msg)
        channel.ack_failure()
        return
    if echo:
        # a peer went away and nobody has said why yet (its agent may be gone too): one line here; the
        # agents name the lost node, the traceback stays in this rank's error file
        first_line = (str(e).splitlines() or [""])[0][:300]
        ddp_exit.say(f"ddprun: this rank's collective failed because a peer went away ({type(e).__name__}: "
                     f"{first_line}, at {ddp_exit.user_frame(e)}); the agents name the cause")
    else:
        ddp_exit.print_user_traceback(e)
    hint = ddp_exit.error_hint(text, oom_kills=(oom0, cgroups.oom_kills() if oom0 is not None else None))
    ddp_exit.record(channel.me(fr.ERROR, fr.condense(text), hint=hint), channel, e)


def _on_failed_exit(e: SystemExit, code: int, channel: JobChannel | None, oom0: int | None = None) -> None:
    """Record a script's exit with a non-zero code. One that turned a peer's failure seen in a
    collective into ``sys.exit(N)`` (a wrapper such as Hydra's) is that peer's echo, as the exception
    itself would be (:func:`_on_error`): a first-hand record here would take the blame from the rank
    that died (its agent's record comes later)."""
    inner = e.__cause__ or e.__context__
    if (channel is not None and inner is not None and fr.looks_like_echo(ddp_exit.error_text(inner))
            and raised_in_torch(inner)):
        _on_error(inner, channel, oom0)
        return
    summary = f"SystemExit({e.code!r})"
    rec = channel.me(fr.ERROR, summary, exit_code=code) if channel else ddp_exit.own_record(
        fr.ERROR, summary, os.environ, code)
    ddp_exit.record(rec, channel)


def _preemption_signals(wenv: WorkerEnv | None) -> int | None:
    """Catch the preemption signals (ddprun.preempt); the fd the monitor reads them from, or None."""
    from ddprun import preempt
    from ddprun.protocol.preempt import parse_signals

    if wenv is None:
        return None
    return preempt.install(parse_signals(wenv.preempt_signals, "DDPRUN_PREEMPT_SIGNALS"))


def _stopped_for_preemption(e: Preempted, channel: JobChannel | None) -> None:
    """The rank stopped at the agreed step: one line in its log; rank 0 tells the agents where."""
    steps, fit_step, path, seconds, by = PREEMPT.saved or (e.step, e.step, e.saved, e.seconds, "fit")
    what = (f"checkpoint {path}" if path else "its on_preempt callbacks ran" if by == "on_preempt"
            else "checkpoint written by rank 0")
    print(f"ddprun: stopped for {e.signame} after optimizer step {steps} of this launch ({what})", flush=True)
    if channel is not None and channel.rank == 0:
        _publish_saved(channel, steps, fit_step, path, seconds, by)


def _publish_saved_early(channel: JobChannel | None) -> None:
    """Rank 0 tells the agents of the stop step's checkpoint as soon as it is written (PREEMPT.publish)."""
    if channel is not None and channel.rank == 0:
        PREEMPT.publish = lambda saved: _publish_saved(channel, *saved)


def _publish_saved(channel: JobChannel, steps: int, fit_step: int, path: str, seconds: float, by: str = "fit") -> None:
    from ddprun.protocol.preempt import Saved

    try:  # bounded: a stopped store host never answers, and every clean end of rank 0 comes here
        within(defaults.STORE_CALL_S, channel.store.set, channel.keys.preempt_saved,
               Saved(steps, fit_step, path, seconds, by).to_json())
    except Exception:  # noqa: BLE001 - the store is gone: the agents say the stop without the details
        pass


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    die_with_agent(os.environ)
    os.environ.setdefault("NODE_RANK", os.environ.get("GROUP_RANK", "0"))
    _merge_stderr_into_stdout()
    from ddprun.pgkeep import keep_destroyed_groups
    from ddprun.worker import progress
    from ddprun.worker.monitor import Monitor
    from ddprun.worker.pgstore import namespace_process_groups

    progress.install()
    wenv = _worker_env()
    channel = _open_channel(argv, wenv)
    monitor = Monitor(channel).start(_preemption_signals(wenv)) if channel is not None else None
    if channel is not None:  # the DataLoader workers it forks say where they are at a hang report
        loaderworkers.serve()
    _publish_saved_early(channel)
    # Each attempt's process group in its own part of the agent's store, which outlives attempts:
    # without it a restarted group reads the dead group's gloo/NCCL keys (agent/attempt.py).
    namespace_process_groups(os.environ)
    keep_destroyed_groups()  # a DDP model freed after destroy_process_group must not deadlock the exit
    code, by_itself = 0, False
    oom0 = cgroups.oom_kills()  # a rise by the failure is evidence against a DataLoader worker's end
    try:
        _run_user_code(argv)
        by_itself = True
    except Preempted as e:
        _stopped_for_preemption(e, channel)
    except SystemExit as e:
        code = ddp_exit.exit_code_of(e)
        by_itself = code == 0
        if code != 0:
            _on_failed_exit(e, code, channel, oom0)
    except BaseException as e:  # noqa: BLE001 - every failure must be recorded before exiting
        code = 1
        try:
            _on_error(e, channel, oom0)
        except BaseException as again:  # noqa: BLE001 - e.g. a full disk under the rank log: say it, record it
            text = f"{type(e).__name__}: {e}"
            if channel is not None:
                channel.record_failure(channel.me(fr.ERROR, text))
            os.write(2, f"ddprun: {text} (and then {type(again).__name__}: {again})\n".encode(errors="replace"))
    if by_itself and channel is not None and PREEMPT.stop_step is None:
        from ddprun.telemetry import PROGRESS

        channel.mark_clean_end(PROGRESS.steps)
    if by_itself and channel is not None and channel.rank == 0:
        # Where it stopped (a script that caught Preempted), else: it ended by itself, and a stop step
        # asked for meanwhile is moot, whether or not this rank heard of the request (its monitor
        # reads it within ~1 s: a signal in the last steps is not)
        _publish_saved(channel, *(PREEMPT.saved or (-1, -1, "", 0.0, "fit")))
    if monitor is not None:
        monitor.flush_timing() if code == 0 else monitor.stop()
    loaderworkers.end_workers()
    ddp_exit.hard_exit(code, wenv.exit_timeout if wenv is not None else defaults.EXIT_TIMEOUT_S, channel)
