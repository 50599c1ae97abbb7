"""A process group that ``destroy_process_group`` destroyed stays referenced until the process ends
its groups on its own terms: a ``ddprun run`` worker's hard exit (worker/exit.py), or, in a script
that called :func:`ddprun.init` under srun/mpirun/torchrun, :func:`release_kept` at exit
(runtime._destroy_at_exit). Its C++ destructor never runs while the script does.

Why: torch 2.13's backward stashes a Python object (a ``contextvars`` context) in the thread-local
state, and every gloo work that DDP's gradient all-reduce starts captures that state. When the
user's DDP model outlives ``destroy_process_group`` (a local freed as ``main()`` returns, a
``del model``), freeing its Reducer drops the group's last reference on the main thread, which holds
the GIL while ``~ProcessGroupGloo`` joins the group's threads; a gloo thread still releasing its
last work needs the GIL to drop that Python object. Both wait for ever, after training finished
(seen: a SLURM test hung after its last step, py-spy showing both threads; the same script hangs
under torchrun; torch 2.11 stashed nothing). Kept here, a destroyed group ends with the process at
``os._exit``, which runs no destructor.

The interpreter's own finalization is no place for that destructor either: a gloo thread that
releases its last work there needs the GIL after finalization began, and CPython ends such a thread
with a forced unwind that std::terminate turns into SIGABRT ("terminate called without an active
exception", pytorch/pytorch#190489; seen: 1 srun run in 40 of a script that destroyed its group).
:func:`release_kept` frees the groups before that, with the GIL released.

Cost: a destroyed gloo group's threads and sockets stay until the process ends (a script that makes
its group N times keeps N of them). NCCL groups are destroyed as torch does (their GPU memory freed).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

KEPT: list[Any] = []
"""Every gloo group destroyed in this process, in order."""


def _uses_gloo(group: Any) -> bool:
    import torch.distributed.distributed_c10d as c10d

    try:
        return "gloo" in str(c10d.get_backend(group))
    except Exception:  # noqa: BLE001 - not a group torch still knows: nothing of it to keep
        return False


def _groups(group: Any) -> list[Any]:
    """The gloo groups ``destroy_process_group(group)`` ends: that one, or every group (None). An NCCL
    group is not kept: destroying it frees its communicators' GPU memory, which a script may need after."""
    import torch.distributed.distributed_c10d as c10d

    if group is None:
        world = getattr(c10d, "_world", None)
        groups = list(getattr(world, "pg_map", {}) or {})
        default = getattr(c10d.GroupMember, "WORLD", None)
        candidates = groups if default is None or default in groups else [default, *groups]
    else:
        candidates = [group]
    return [g for g in candidates if _uses_gloo(g)]


def _keeping(destroy: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(destroy)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        try:
            KEPT.extend(_groups(args[0] if args else kwargs.get("group")))
        except Exception:  # noqa: BLE001 - a torch without these internals: destroy as it would
            pass
        return destroy(*args, **kwargs)

    destroy_process_group._ddprun_keeps = True  # type: ignore[attr-defined]
    return destroy_process_group


def keep_destroyed_groups() -> None:
    """Wrap ``torch.distributed.destroy_process_group`` so the groups it destroys stay referenced
    (idempotent). Only for a process that ends through :func:`ddprun.worker.exit.hard_exit`, or that
    calls :func:`release_kept` before the interpreter's finalization."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = getattr(c10d, "destroy_process_group", None)
    if original is None or getattr(original, "_ddprun_keeps", False):
        return
    wrapped = _keeping(original)
    c10d.destroy_process_group = wrapped
    if getattr(dist, "destroy_process_group", None) is original:
        dist.destroy_process_group = wrapped


def release_kept() -> None:
    """Let go of every kept group, newest first, while the interpreter still runs (an atexit handler).

    torch binds ProcessGroup with a destructor that releases the GIL, so where this drops a group's
    last reference, ``~ProcessGroupGloo`` joins the group's threads while they can still take the GIL
    for their last works. Call it from a thread the caller bounds: that join waits for the group's
    queued works. A group a live object still holds (a DDP model in a module global) ends with it,
    and so does the default group if ``torch._dynamo`` was first imported after it was made (its
    import records it: runtime._import_dynamo)."""
    while KEPT:
        KEPT.pop()
