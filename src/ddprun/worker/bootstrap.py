"""Worker bootstrap: ``python -m ddprun.worker [-m] TARGET ARGS...``, started by torch's agent.

Before the user's code: NODE_RANK is set, stderr joins stdout in the rank's log file, the rank
publishes its row (host, pid, device) to the agent's store, and rank 0 prints the gathered rank
table once and writes ``plan.json``. The user's script then runs unmodified (runpy, as ``python``
would run it). Afterwards the process ends through :func:`ddprun.worker.exit.hard_exit`, which runs atexit
handlers and flushes files but skips interpreter and C++ static teardown: that teardown is where
healthy gloo/NCCL workers abort with SIGABRT ("terminate called without an active exception").

A rank that fails records a failure in the store; the other ranks' job monitor stops them within a
second, naming that rank, instead of leaving them in a collective until the 30-minute timeout. An
error every rank raises alike (a Lightning Trainer that disagrees with the launch, see
:mod:`ddprun.mismatch`) is reported as one line without a traceback.
"""

from __future__ import annotations

import os
import sys


def _merge_stderr_into_stdout() -> None:
    # The agent points stdout at logs/rank-N.log; one file per rank keeps tracebacks next to prints.
    if os.environ.get("DDPRUN_MERGE_STDERR") == "1":
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(1, 2)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)


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


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("NODE_RANK", os.environ.get("GROUP_RANK", "0"))
    _merge_stderr_into_stdout()

    from ddprun.worker import exit as ddp_exit
    from ddprun.worker.pgstore import namespace_process_groups
    from ddprun.worker.channel import JobChannel, JobRefused

    script = None if (argv and argv[0] == "-m") else (argv[0] if argv else None)
    channel = JobChannel.from_environ(os.environ, script)
    if channel is not None:
        try:
            channel.start()
        except JobRefused as e:
            # Another job's store: write nothing there, say why, leave.
            print(e, file=sys.stderr, flush=True)
            ddp_exit.write_error_file(str(e).splitlines()[0])
            ddp_exit.hard_exit(1)
        except SystemExit as e:  # preflight failed; already reported
            ddp_exit.hard_exit(ddp_exit.exit_code_of(e))
        channel.start_monitor()
    # Each attempt's process group in its own part of the agent's store, which outlives attempts:
    # without it a restarted group reads the dead group's gloo/NCCL keys (ddprun.agent.attempt, ddprun.worker.pgstore).
    namespace_process_groups(os.environ)

    code = 0
    try:
        _run_user_code(argv)
    except SystemExit as e:
        code = ddp_exit.exit_code_of(e)
        if code != 0:
            ddp_exit.report_failure(channel, f"SystemExit({e.code!r})", code)
    except BaseException as e:  # noqa: BLE001 - every failure must be recorded before exiting
        code = 1
        cause = channel.first_failure() if channel is not None else None
        known = _known_failure(e)
        if known is not None:
            # Every rank raised this same configuration error (Lightning vs the launch): the same one
            # line from each, no tracebacks, so the launcher prints it once with the ranks' numbers.
            print(f"ddprun: {known}", file=sys.stderr, flush=True)
            if cause is not None and cause["rank"] != channel.rank:
                ddp_exit.write_error_file(known, e)
                channel.ack_failure()
            else:
                ddp_exit.report_failure(channel, known, code, exc=e)
        elif cause is not None and cause["rank"] != channel.rank:
            # A peer failed first and this rank's error (usually "connection closed by peer") is
            # its echo: one line here, the root cause named, no second wall of traceback.
            first_line = (str(e).splitlines() or [""])[0][:200]
            msg = ddp_exit.stopped_message(cause)
            print(f"{msg}\n  (this rank then saw {type(e).__name__}: {first_line})", file=sys.stderr, flush=True)
            ddp_exit.write_error_file(msg)
            channel.ack_failure()
        else:
            ddp_exit.print_user_traceback(e)
            ddp_exit.report_failure(channel, f"{type(e).__name__}: {e}", code, exc=e)
    ddp_exit.hard_exit(code, channel)


if __name__ == "__main__":
    main()
