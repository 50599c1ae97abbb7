"""How often a node waiting in torch's rendezvous looks at the round again: sooner for small jobs.

torch's dynamic rendezvous (c10d backend) reads the shared round state, and when it must wait for
other nodes it sleeps a fixed second (``_delay(seconds=1)`` in its op executor) and serves its
cached state for a second (the state holder's ``cache_duration``). The node that does not complete
a round therefore learns of it up to a second later, and its workers start that much later: at every
start and every restart of a multi-node job, measured at 0.9 s of a 2 x 1 job's 6.6 s here
(agent log: the two nodes' "has joined round 0" lines; benchmarks/launch_speed.py).

The second protects the store at scale: every waiting node reads the whole state (its size grows
with the nodes) at each look. So the poll scales with the round's largest size, keeping the reads
at about :data:`READS_PER_S` a second in all for a job up to 100 nodes and leaving torch's second
from 100 nodes on. Only while a node waits in ``next_rendezvous``: the agent's per-interval check
for waiting nodes keeps torch's one-second cache, so a running job reads the state as often as
under torchrun.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

TORCH_POLL_S = 1.0
"""torch's wait between two looks at the round (2.6 to 2.13: ``_delay(seconds=1)``)."""
MIN_POLL_S = 0.1
READS_PER_S = 100
"""The state reads a second, of every waiting node together, that a small job's polls may add up to."""

_WAITING = threading.local()  # .poll_s: set in the thread that waits in next_rendezvous, else absent


def poll_s(max_nodes: int) -> float:
    """Seconds between a waiting node's looks at the round of a job of at most ``max_nodes`` nodes:
    0.1 s up to 10 nodes, then nodes / 100 up to torch's 1 s (from 100 nodes)."""
    return min(TORCH_POLL_S, max(MIN_POLL_S, max_nodes / READS_PER_S))


def _delay_in(original: Callable[..., None]) -> Callable[..., None]:
    """torch's ``_delay``, with its round poll (exactly 1 s) shortened in a thread waiting here;
    every other delay (round 0's random start skew) and every other thread as torch has it."""

    def delay(seconds: Any) -> None:
        poll = getattr(_WAITING, "poll_s", None)
        original(poll if poll is not None and seconds == TORCH_POLL_S else seconds)

    delay.ddprun_poll = True  # type: ignore[attr-defined]
    return delay


def _install() -> bool:
    """Wrap torch's module-level ``_delay`` once (process-wide, a no-op outside a waiting thread);
    False where this torch has no such poll to shorten."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    except ImportError:
        return False
    current = getattr(dr, "_delay", None)
    if current is None:
        return False
    if not getattr(current, "ddprun_poll", False):
        dr._delay = _delay_in(current)
    return True


def quicken(handler: Any) -> float | None:
    """Make ``handler`` (torch's ``DynamicRendezvousHandler``) look at its round every
    :func:`poll_s` seconds (of its round's largest size) while it waits in ``next_rendezvous``; the
    poll, or None where this handler or this torch has no such wait (another backend: left as it is)."""
    holder = getattr(handler, "_state_holder", None)
    max_nodes = getattr(getattr(handler, "_settings", None), "max_nodes", None)
    if holder is None or not hasattr(holder, "_cache_duration") or not isinstance(max_nodes, int) or not _install():
        return None
    poll = poll_s(max_nodes)
    original = handler.next_rendezvous

    def next_rendezvous() -> Any:
        cached = holder._cache_duration
        holder._cache_duration, _WAITING.poll_s = poll, poll
        try:
            return original()
        finally:
            holder._cache_duration = cached
            del _WAITING.poll_s

    handler.next_rendezvous = next_rendezvous
    return poll


__all__ = ["poll_s", "quicken"]
