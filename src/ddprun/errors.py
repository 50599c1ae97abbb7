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
