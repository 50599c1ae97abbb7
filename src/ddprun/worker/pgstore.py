"""Each attempt's process group in its own part of the agent's store (why: agent/attempt.py).

:func:`namespace_process_groups` wraps torch's registered ``env``/``tcp`` rendezvous handlers so the
store ``init_process_group`` gets is a ``PrefixStore("ddprun/<run id>/<attempt>/pg", store)``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from ddprun.protocol.store import Keys, store_prefix


def _prefixed(inner, prefix: str):
    from torch.distributed import PrefixStore

    def handler(url: str, **kwargs):
        # torch's handlers are generators that yield once, then raise on re-rendezvous: keep that.
        for store, rank, world_size in inner(url, **kwargs):
            yield PrefixStore(prefix, store), rank, world_size

    handler._ddprun_inner = inner  # type: ignore[attr-defined]
    return handler


def namespace_process_groups(environ: Mapping[str, str]) -> str | None:
    """Make ``init_process_group`` (env:// and tcp://) use this attempt's part of the agent's store.

    Only when the workers use the agent's store (TORCHELASTIC_USE_AGENT_STORE=True, torch's default
    under c10d): otherwise worker rank 0 hosts a fresh store per attempt and nothing is needed.
    Returns the prefix, or None when nothing was changed. Idempotent. Touches torch's private
    handler table, since ``register_rendezvous_handler`` refuses to replace a scheme.
    """
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import importlib

    # the module: ``torch.distributed.rendezvous`` as an attribute is the function of that name
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    handlers = getattr(rdzv, "_rendezvous_handlers", None)
    if not isinstance(handlers, dict):
        print("ddprun: this torch has no rendezvous handler table; a restarted worker group may read the previous "
              "attempt's process-group keys (ddprun.agent.attempt)", file=sys.stderr, flush=True)
        return None
    prefix = Keys(store_prefix(environ)).pg
    for scheme in ("env", "tcp"):
        inner = handlers.get(scheme)
        if inner is not None and not hasattr(inner, "_ddprun_inner"):
            handlers[scheme] = _prefixed(inner, prefix)
    return prefix
