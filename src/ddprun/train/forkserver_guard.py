"""Preloaded into multiprocessing's forkserver when ``ddprun.fit`` starts it (train/data.py
:func:`~ddprun.train.data.start_forkserver`); nothing to call.

The job's preemption signals reach every process of a node (SLURM signals every process of a step).
The forkserver would die of SIGUSR1's default action, and torch's DataLoader workers take their
parent's end for their rank's and exit. Here the forkserver outlives those signals; a process it
forks (a DataLoader worker, a pool of the user's) has their default action back from its fork on,
unless it sets its own (fit's DataLoader workers ignore them: ``LoaderWorkerInit``). The signals
were blocked while the forkserver started (no window in which one kills it); they are unblocked
here, so no process it forks inherits them blocked.

Why at the fork, not lazily at a child's first signal: CPython clears the signals a child caught
before its interpreter's after-fork step, so a SIGTERM sent the moment the child's pid is known (a
``terminate()`` right after ``start()``) would be lost to a handler. They stay blocked across the fork
and the child sets the default action before it unblocks them: one that came meanwhile is delivered
then, as without ddprun.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from typing import Any

from ddprun._util import die_with_parent
from ddprun.protocol import defaults
from ddprun.protocol import env as wenv
from ddprun.protocol.preempt import parse_signals

_SERVER = os.getpid()


def _guard(signum: int, frame: Any) -> None:
    if os.getpid() == _SERVER:
        return
    signal.signal(signum, signal.SIG_DFL)  # a forked process that kept this handler: as without ddprun
    os.kill(os.getpid(), signum)


def _fork_hooks(sigs: tuple[int, ...]) -> None:
    """Keep ``sigs`` blocked across every fork of the forkserver; its child takes the default action
    for them before unblocking (see the module docstring). Processes further down inherit these
    hooks with the interpreter: there they do nothing (a worker's own children keep what it set)."""
    def block() -> None:
        if os.getpid() == _SERVER:
            signal.pthread_sigmask(signal.SIG_BLOCK, sigs)

    def parent() -> None:
        if os.getpid() == _SERVER:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)

    def child() -> None:
        if os.getppid() == _SERVER:
            for sig in sigs:
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)

    os.register_at_fork(before=block, after_in_parent=parent, after_in_child=child)


def install(environ: Mapping[str, str]) -> tuple[int, ...]:
    """Guard the forkserver against the job's preemption signals (``DDPRUN_PREEMPT_SIGNALS``) and
    unblock them; the signals guarded. Never raises: an error here would end the forkserver."""
    blocked = set(parse_signals(defaults.PREEMPT_SIGNALS))  # start_forkserver blocked the job's, these by default
    sigs: tuple[int, ...] = ()
    try:
        asked = parse_signals(environ.get(wenv.PREEMPT_SIGNALS, ""), wenv.PREEMPT_SIGNALS)
        blocked |= set(asked)
        sigs = tuple(s for s in asked if s != signal.SIGINT)  # the forkserver ignores SIGINT itself
        for sig in sigs:
            signal.signal(sig, _guard)
        _fork_hooks(sigs)
    except Exception:  # noqa: BLE001
        pass
    signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
    return sigs


install(os.environ)
# its rank's end (SIGKILL, the OOM killer) must end it: its DataLoader workers keep its alive-pipe open
# and wait as long as it lives, so neither would ever exit (torch's worker watchdog watches its parent)
die_with_parent()
