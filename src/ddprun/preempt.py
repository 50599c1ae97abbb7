"""Preemption inside a worker: the signal flag, the agreed stop step, and what stops there.

Shared by the worker bootstrap and monitor (which catch the signals and agree on the stop step
through the store: protocol/preempt.py) and by ``ddprun.fit`` (which checkpoints at that step). Like
:mod:`ddprun.telemetry`, state lives in one process-wide object, :data:`PREEMPT`; outside a
``ddprun run`` worker no handler is installed and nothing here ever fires.

* A signal only reaches the monitor thread (worker/monitor.py, through the wakeup fd): the first
  is a request; a second, or the first while ``ddprun run``'s agent is the one stopping its
  workers, ends the worker at once. Nothing runs in the handler but the script's own handler.
* At the agreed step, right after the optimizer step: ``ddprun.fit`` saves its checkpoint and
  raises :class:`Preempted`; any other script runs its :func:`on_preempt` callbacks and gets
  :class:`Preempted` out of ``optimizer.step()``. Either way the worker ends with one line, no
  traceback; its agent says on the console where the job stopped.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ddprun.loaderworkers import forked_by_dataloader


class Preempted(SystemExit):
    """The job stopped for a preemption signal at the agreed step: raised on every rank right after
    that optimizer step. A SystemExit (code 0: the worker's work is done; its agent ends with
    protocol/preempt.py EXIT_CODE), so a script's own ``except Exception`` does not swallow it."""

    def __init__(self, signame: str, step: int, saved: str = "", seconds: float = 0.0):
        super().__init__(0)
        self.signame, self.step, self.saved, self.seconds = signame, step, saved, seconds


@dataclass
class PreemptState:
    """This worker's view (module docstring). Steps are optimizer steps of this process (PROGRESS.steps)."""

    signum: int | None = None
    """The first preemption signal this process got, None before (set by the monitor)."""
    signals: tuple[int, ...] = ()
    """The signals handled here (``ddprun run --preempt-signals``)."""
    requested: bool = False
    """The job was asked to stop (this process's signal, or another's request read from the store)."""
    signame: str = ""
    stop_step: int | None = None
    fit_active: bool = False
    """ddprun.fit's loop runs: it checkpoints and stops at the stop step itself."""
    callbacks: list[Callable[[int], Any]] = field(default_factory=list)
    saved: tuple[int, int, str, float, str] | None = None
    """(steps, fit's step, checkpoint path, seconds, by) once the stop step's checkpoint is written
    (checkpoint_written, before the on_checkpoint hooks) or this process stopped at the agreed step
    (protocol/preempt.py Saved)."""
    publish: Callable[[tuple[int, int, str, float, str]], Any] | None = None
    """Rank 0's way to tell the agents where it saved (set by worker/bootstrap.py; None elsewhere)."""
    published: bool = False
    """Whether :attr:`saved` was said through :attr:`publish`."""
    saving: bool = False
    """ddprun.fit writes the stop step's checkpoint now: an agent's stop waits for it (bounded)."""
    _previous: dict[int, Any] = field(default_factory=dict)
    _ignored: dict[int, Any] = field(default_factory=dict)
    """Signals of ours the script set to SIG_IGN (out of :attr:`signals` meanwhile), with the script's
    handler from before; the script's next ``signal.signal`` for one puts ours back (_chaining_signal)."""
    _wakeup: int | None = None
    """The write end of this process's wakeup pipe (:func:`install`); a forked child's is the rank's."""
    handled: threading.Event = field(default_factory=threading.Event)
    """Set once the Python-level handler returned (the script's own, chained, included)."""

    def due(self, steps: int) -> bool:
        """Whether a process that completed ``steps`` optimizer steps must stop now."""
        return self.stop_step is not None and steps >= self.stop_step

    def checkpoint_written(self, saved: tuple[int, int, str, float, str]) -> None:
        """The stop step's checkpoint is on disk: said at once, before the on_checkpoint hooks, so that
        when one of them outlasts the grace the agents still say the next start resumes from it."""
        self.saved = saved
        if self.publish is not None:
            self.publish(saved)  # bounded and quiet (bootstrap._publish_saved)
            self.published = True

    def say_saved_before_stop(self, wait_s: float) -> None:
        """The agent stops this rank now (its preemption grace ended): a stop step's checkpoint being
        written gets up to ``wait_s`` to finish, and one written but not yet said is said, so the
        agents' line names the checkpoint the next start resumes from (seen: a stop that came between
        the file's rename and its publish, and the line said "the one before")."""
        if self.publish is None:
            return
        deadline = time.monotonic() + wait_s
        while self.saving and self.saved is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.saved is not None and not self.published:
            self.publish(self.saved)
            self.published = True


PREEMPT = PreemptState()


_inside = threading.local()


def _handler(signum: int, frame: Any) -> None:
    """The Python-level handler: only the script's own handler, if it set one. The signal itself
    reaches the monitor thread through the wakeup fd (:func:`install`), also while the main thread
    is blocked in C (a collective), where no Python handler runs."""
    if getattr(_inside, "yes", False):
        return  # the script's handler calls the one it replaced (ours) again: once is enough
    chained = PREEMPT._previous.get(signum)
    if callable(chained) and chained is not signal.default_int_handler:  # KeyboardInterrupt is what we replace
        _inside.yes = True
        try:
            chained(signum, frame)
        finally:
            _inside.yes = False
            PREEMPT.handled.set()
    else:
        PREEMPT.handled.set()


def stops_itself(signum: int) -> bool:
    """Whether the script set a handler of its own for ``signum`` (chained behind ours): it decides
    what the signal does (a flag its loop reads, a save, then its exit), not the signal's default."""
    chained = PREEMPT._previous.get(signum)
    return callable(chained) and chained is not signal.default_int_handler


def left_to_own_handler(signum: int, timeout_s: float) -> bool:
    """Whether the script's own handler for ``signum`` decides what it does: it has one, and that
    handler returned within ``timeout_s`` (a flag its loop reads: Megatron's --exit-signal-handler).
    One that does not return (Lightning 2.6's broadcasts from the signalled rank alone, a collective
    no other rank joins) decides nothing: the rank then ends by the signal, as it did."""
    if not stops_itself(signum):
        return False
    PREEMPT.handled.wait(timeout_s)
    return PREEMPT.handled.is_set()


def let_own_handler_run(signum: int, timeout_s: float) -> None:
    """Before this process ends by ``signum``: the script's own handler for it (chained) gets up to
    ``timeout_s`` to run and return. The main thread runs Python handlers only between bytecodes, so
    a monitor thread that decides at once (a store call or two) could end the process before it ran
    (seen under CPU load: Lightning's "Received SIGTERM" never written); a handler that never returns
    (blocked in C, or in a collective no other rank joins) is not waited for past the bound."""
    if stops_itself(signum):
        PREEMPT.handled.wait(timeout_s)


_signal_signal = signal.signal


def _chaining_signal(signum: Any, handler: Any) -> Any:
    """``signal.signal`` while ours are installed: a script's handler for one of our signals runs
    beside ours (chained) instead of replacing it; the value returned is what the script set before.
    SIG_IGN is the one disposition that replaces ours: the script ignores the signal, and so does
    ddprun, preemption included, until the script sets anything else for it (the usual ``old =
    signal.signal(SIGTERM, SIG_IGN); ...; signal.signal(SIGTERM, old)``), which brings ours back."""
    if threading.current_thread() is threading.main_thread():
        if signum in PREEMPT._ignored:
            return _unignoring(signum, handler)
        if signum in PREEMPT.signals:
            before = PREEMPT._previous.get(signum, signal.SIG_DFL)
            if handler is signal.SIG_IGN:
                PREEMPT.signals = tuple(s for s in PREEMPT.signals if s != signum)
                PREEMPT._ignored[signum] = before
                _signal_signal(signum, signal.SIG_IGN)
                return before
            PREEMPT._previous[signum] = handler
            return before
    return _signal_signal(signum, handler)


def _unignoring(signum: int, handler: Any) -> Any:
    """``signal.signal(signum, handler)`` for a signal of ours the script ignores: another SIG_IGN keeps it
    so; anything else is the script's handler again (chained), with ours reinstalled. ``handler`` may be
    ours (what ``signal.getsignal`` gave before the ignore): the script's handler from then stays."""
    if handler is signal.SIG_IGN:
        return signal.SIG_IGN
    before_ignore = PREEMPT._ignored.pop(signum)
    PREEMPT._previous[signum] = before_ignore if handler is _handler else handler
    _signal_signal(signum, _handler)
    PREEMPT.signals = (*PREEMPT.signals, signum)
    return signal.SIG_IGN


def install(signals: tuple[int, ...]) -> int | None:
    """Catch ``signals`` (main thread only); returns the read end of the wakeup pipe on which each
    signal's number arrives (for the monitor thread), None when nothing was installed."""
    import os

    if threading.current_thread() is not threading.main_thread() or not signals:
        return None
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:
        os.close(r)
        os.close(w)
        return None
    PREEMPT.signals, PREEMPT._wakeup = signals, w
    for sig in signals:
        PREEMPT._previous[sig] = _signal_signal(sig, _handler)
    signal.signal = _chaining_signal  # type: ignore[assignment]
    global _FORK_HOOK
    if not _FORK_HOOK:
        os.register_at_fork(after_in_child=_in_forked_child)
        _FORK_HOOK = True
    return r


_FORK_HOOK = False


def _in_forked_child() -> None:
    """A process the rank forked has its own signals, as without ddprun. The wakeup pipe it inherits
    is the rank's, where a byte is a signal to the rank: a scheduler's one signal to every process of
    the node (``scancel --signal``, SLURM's SIGTERM before a preemption) reached the rank twice,
    through a DataLoader worker too, and the second stopped it at once instead of at the agreed step.
    The rank's handlers go too (they only set a flag there): a Pool's ``terminate()`` ended nothing,
    and its ``join()`` waited forever. A DataLoader worker torch forks ignores the preemption signals
    instead, also once torch has set its own handlers (its SIGTERM handler ends the worker, and its
    rank with it), as fit's workers do."""
    try:
        inherited = signal.set_wakeup_fd(-1)
        if inherited < 0 or inherited != PREEMPT._wakeup:  # not ddprun's (installed, then put back)
            signal.set_wakeup_fd(inherited)
            return
    except ValueError:  # not the main thread of the main interpreter
        return
    signals, PREEMPT.signals = PREEMPT.signals, ()
    signal.signal = _signal_signal  # type: ignore[assignment]
    worker = forked_by_dataloader()
    for sig in signals:
        _signal_signal(sig, signal.SIG_IGN if worker else _scripts_own(sig))
    handling = sys.modules.get("torch.utils.data._utils.signal_handling")
    torchs = getattr(handling, "_set_worker_signal_handlers", None)
    if worker and signals and callable(torchs):
        handling._set_worker_signal_handlers = _then_ignoring(torchs, signals)  # type: ignore[union-attr]


def _scripts_own(sig: int) -> Any:
    """What the script had for ``sig`` before ddprun's handler: its own, SIG_IGN, else SIG_DFL (also
    for a handler set from C, which Python cannot put back)."""
    before = PREEMPT._previous.get(sig, signal.SIG_DFL)
    return before if callable(before) or before in (signal.SIG_DFL, signal.SIG_IGN) else signal.SIG_DFL


def _then_ignoring(torchs: Callable[..., Any], signals: tuple[int, ...]) -> Callable[..., Any]:
    def set_worker_signal_handlers(*args: Any, **kwargs: Any) -> Any:
        out = torchs(*args, **kwargs)
        for sig in signals:
            _signal_signal(sig, signal.SIG_IGN)
        return out

    return set_worker_signal_handlers


def die_by(signum: int) -> None:
    """End this process by ``signum`` as if no handler were installed (its agent is stopping it).
    Any thread: the disposition is reset through libc, which Python allows only on the main thread."""
    import ctypes

    sys.stdout.flush()
    sys.stderr.flush()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal(signum, ctypes.c_void_p(0))  # SIG_DFL
        os.kill(os.getpid(), signum)
        time.sleep(5)  # delivered before kill returns; not reached
    except (OSError, AttributeError):
        pass
    os._exit(128 + signum)


def on_preempt(fn: Callable[[int], Any]) -> Callable[[int], Any]:
    """Call ``fn(step)`` on every rank at the job's agreed stop step, after that optimizer step, then
    end the script (``ddprun run`` only; ``ddprun.fit`` checkpoints there by itself). ``step``:
    optimizer steps this process made. Usable as a decorator; returns ``fn``."""
    PREEMPT.callbacks.append(fn)
    return fn


def at_optimizer_step(steps: int) -> None:
    """From the optimizer step hook (worker/progress.py): at the stop step, outside fit, run the
    callbacks and end the script with :class:`Preempted`."""
    if PREEMPT.fit_active or not PREEMPT.due(steps):
        return
    t0 = time.monotonic()
    for fn in list(PREEMPT.callbacks):
        fn(steps)
    PREEMPT.saved = (steps, steps, "", time.monotonic() - t0, "on_preempt")
    raise Preempted(PREEMPT.signame, steps, seconds=time.monotonic() - t0)
