"""ddprun's errors. Every message says what is wrong, the values seen, and a HINT on what to do."""

from __future__ import annotations


class DdprunError(Exception):
    """Base of every error ddprun raises on purpose.

    ``what`` is one sentence naming the problem, ``seen`` the values that show it, ``hint`` what the
    user should do. ``str(err)`` joins them into the one message the console prints.
    """

    exit_code = 2

    def __init__(self, what: str, *, seen: str | None = None, hint: str | None = None):
        self.what = what
        self.seen = seen
        self.hint = hint
        super().__init__(self._format())

    def _format(self) -> str:
        parts = [self.what]
        if self.seen:
            parts.append(f"Seen: {self.seen}")
        if self.hint:
            parts.append(f"HINT: {self.hint}")
        return "\n".join(parts)


class ConfigError(DdprunError):
    """Flags or configuration values that cannot work together."""


class ClusterError(DdprunError):
    """The cluster environment (SLURM, MPI, SageMaker, ...) is contradictory or incomplete."""


class LaunchError(DdprunError):
    """The launch failed: a worker failed, a node did not join, or the job was refused."""

    exit_code = 1


class CheckpointError(DdprunError):
    """A checkpoint could not be written (disk full, no permission), or the one asked for is damaged."""

    exit_code = 1


class WorkerFailed(LaunchError):
    """A worker of :func:`ddprun.launch` (or of :func:`ddprun.ray.fit`) failed; the job is over.

    ``rank``: the global rank whose failure ended the job (the first one that is not only an echo
    of another rank's failure). ``message``: that rank's one-line error (``"ValueError: ..."``).
    ``traceback``: its traceback as text ("" when the process died without one, e.g. a signal).
    ``error``: the original exception object when it could be carried back, else None (it is also
    this exception's ``__cause__``, except under ``ddprun.ray.fit``, where the cause is Ray's own error,
    whose text has every failed worker's traceback). ``log``: the rank's log file, when there is one.
    """

    def __init__(self, rank: int, message: str, *, traceback: str = "", error: BaseException | None = None,
                 log: str | None = None, others: str = "", hint: str | None = None):
        self.rank = rank
        self.message = message
        self.traceback = traceback
        self.error = error
        self.log = log
        seen = "\n".join(filter(None, [f"log: {log}" if log else "", others,
                                       f"traceback of rank {rank}:\n{traceback.rstrip()}" if traceback else ""]))
        super().__init__(f"Rank {rank} failed: {message}", seen=seen or None,
                         hint=hint or "Fix the error above; the traceback is rank "
                                      f"{rank}'s own" + (f", its full output is in {log}." if log else "."))
        if error is not None:
            self.__cause__ = error  # as `raise ... from error` would (the object carries no traceback)


class LaunchTimeout(LaunchError):
    """:func:`ddprun.launch` ran past its ``timeout``; every worker was stopped."""
