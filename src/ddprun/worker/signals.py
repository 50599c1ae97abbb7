"""The preemption signals that reach a worker, read on a thread of their own (the wakeup pipe of
:func:`ddprun.preempt.install`).

A signal that the rank's agent sends as it stops its workers (a failure, a restart, a job store
that stopped answering) ends the rank at once: the agent marks its stop in its node store before it
signals them (agent/noderelay.py ``stopping``), and that one local read is all this thread waits
for. The one exception is a stop because nothing in the job stops at a step (the mark says
``protocol.preempt.STOPPING_FOR_NONE``) of a script with its own handler for the signal: as under
torchrun, that handler decides (a flag its loop reads, a save, its exit), and the agent's
``--stop-grace`` bounds it. Every other signal goes to the monitor (worker/monitor.py), which asks the
job to stop at one step through the job store. So a monitor whose store call waits on a host that went silent (the
client's 30 s timeout: no FIN or RST comes from a machine that lost power) delays only a
preemption request, never the agent's stop.
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable
from typing import Any

from ddprun import preempt
from ddprun._util import Bounded, within
from ddprun.preempt import PREEMPT
from ddprun.protocol import defaults
from ddprun.protocol import preempt as pp

POLL_S = 1.0
"""How often the thread looks at its stop event while no signal comes (:meth:`SignalWatch.stop` wakes it at once)."""

STOP_SAVE_WAIT_S = 2.0
"""At the agent's stop, how long a stop step's checkpoint being written may take to finish (and be
said) before this rank ends (:meth:`ddprun.preempt.PreemptState.say_saved_before_stop`)."""


def wake(fd: int) -> None:
    """One byte into a wake-up pipe's write end ``fd``, so a ``select`` on its read end returns now."""
    try:
        os.write(fd, b"x")
    except OSError:  # a full pipe: a wake-up is pending already
        pass


class NodeMark:
    """Whether this node's agent marked ``key`` in the node store: one bounded read on a client of its
    own (the monitor's may be busy). False when there is no node store, or it does not answer within
    RELAY_STALE_S (a frozen agent): the monitor then asks the job store, as it always did."""

    def __init__(self, connect: Callable[[], Any] | None):
        """``connect()``: a new node store client, or None when the agent gave none; None: no node store."""
        self._connect: Callable[[], Any] | None = connect
        self._client: Bounded | None = None

    def ready(self) -> None:
        """Connect now (bounded), so that a signal finds a client; a failure is tried again then."""
        try:
            self._connected()
        except Exception:  # noqa: BLE001 - a signal will try again
            self._client = None

    def __call__(self, key: str) -> str:
        """The mark's value; "" when there is none (or no answer)."""
        try:
            client = self._connected()
            if client is None or not client.check([key]):
                return ""
            value = client.get(key)
            return (value.decode(errors="replace") if isinstance(value, bytes) else str(value)) or "1"
        except Exception:  # noqa: BLE001 - no answer: the monitor decides through the job store
            self._client = None
            return ""

    def _connected(self) -> Any:
        if self._client is None and self._connect is not None:
            client = within(defaults.RELAY_STALE_S, self._connect)
            if client is None:
                self._connect = None
                return None
            self._client = Bounded(client, defaults.RELAY_STALE_S)
        return self._client


class SignalWatch:
    """The thread (module docstring). ``mark(key)``: whether the agent marked ``key``, its stop (a
    bounded local read); ``handoff(signals)``: give the others to the monitor."""

    def __init__(self, sigfd: int, mark: NodeMark, key: str, handoff: Callable[[list[int]], None]):
        self._sigfd, self._mark, self._key, self._handoff = sigfd, mark, key, handoff
        self._stop = threading.Event()
        self._wake = os.pipe()
        self._thread = threading.Thread(target=self._loop, name="ddprun-signals", daemon=True)

    def start(self) -> SignalWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        wake(self._wake[1])

    def _loop(self) -> None:
        self._mark.ready()
        while not self._stop.is_set():
            ready, _, _ = select.select([self._sigfd, self._wake[0]], [], [], POLL_S)
            if self._sigfd not in ready or self._stop.is_set():
                continue
            try:
                sigs = [b for b in os.read(self._sigfd, 64) if b in PREEMPT.signals]
            except OSError:
                continue
            if not sigs:
                continue
            why = self._mark(self._key)
            if why:
                # a signal the script's own handler (chained, on the main thread) ends the rank by is left
                # to it, within the agent's --stop-grace; any other ends it now, as it always did
                sigs = [sig for sig in sigs if not left_to_script(why, sig)]
                if not sigs:
                    continue
                PREEMPT.say_saved_before_stop(STOP_SAVE_WAIT_S)
                preempt.die_by(sigs[0])
            self._handoff(sigs)


def left_to_script(why: str, signum: int) -> bool:
    """Whether the agent's stop (its mark, ``why``) by ``signum`` is the script's to end: the job
    answered that nothing stops at a step, and the script's own handler for that signal returned (as
    under torchrun, whose agent gives it 30 s; one blocked for OWN_HANDLER_WAIT_S decides nothing)."""
    return why == pp.STOPPING_FOR_NONE and preempt.left_to_own_handler(signum, defaults.OWN_HANDLER_WAIT_S)
