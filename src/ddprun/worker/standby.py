"""A warm worker: ``python -m ddprun.worker SCRIPT ARGS...`` with ``DDPRUN_STANDBY_FD`` set, started by
the agent before its rendezvous, with the very command line its worker will have.

It imports what every worker imports anyway (torch, torch.distributed, the modules DDP's first
construction imports, ddprun's worker side: about 4 s of CPU here), then blocks on ``GO_FD``. Once
the agent's rendezvous is done, torch's agent "starts" this rank's worker and ddprun hands it this
process instead of a fresh interpreter (agent/standby.py): the go message carries the exact command
line, environment, directory and log files torch would have given a new process, and the process
becomes that worker (:func:`ddprun.worker.bootstrap.main`). So the imports overlap the agent's own
start and rendezvous instead of following them.

The go message is one JSON object: ``argv`` (what follows ``-m ddprun.worker``), ``env``, ``cwd``,
``stdout`` and ``stderr`` (paths, appended to). End of file without a message (the agent did not use
this process, or died): exit 0 at once. What the imports printed before the go message (a warning
of an incompatible library, say) was captured in a file the agent gave as stdout; it is copied to the
top of the rank's log, where a fresh worker would have printed it.
"""

from __future__ import annotations

import json
import os
import sys

GO_MAX_BYTES = 64 * 1024 * 1024
"""Upper bound of a go message (an environment of a few hundred kB at most in practice)."""


def preimport() -> None:
    """What every ddprun worker imports before its first step; an import that fails is left for the
    user's code to meet (Python forgets a failed module, so it fails there the same way)."""
    for name in ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "ddprun.worker.monitor",
                 "ddprun.worker.channel", "ddprun.worker.pgstore", "ddprun.worker.preflight", "ddprun.train"):
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - see the docstring: the real worker meets it again
            pass


def read_go(fd: int) -> dict | None:
    """The go message, or None at end of file without one; blocks until the agent writes or exits."""
    chunks, size = [], 0
    while size <= GO_MAX_BYTES:
        data = os.read(fd, 1 << 16)
        if not data:
            break
        chunks.append(data)
        size += len(data)
    os.close(fd)
    if not chunks:
        return None
    return json.loads(b"".join(chunks))


def _become(go: dict) -> list[str]:
    """Take the worker's directory, environment and log files; its argv for the bootstrap."""
    os.chdir(go["cwd"])
    os.environ.clear()
    os.environ.update(go["env"])
    sys.stdout.flush()
    sys.stderr.flush()
    os.lseek(1, 0, os.SEEK_SET)
    early = b""
    while chunk := os.read(1, 1 << 16):  # stdout is the capture file the agent opened for reading too
        early += chunk
    for fd, path in ((1, go["stdout"]), (2, go["stderr"])):
        if path:
            target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(target, fd)
            os.close(target)
    if early:
        os.write(1, early)
    return list(go["argv"])


def main(go_fd: int) -> None:
    """Import, wait for the go message, become the worker (module docstring); exit 0 without one."""
    from ddprun.worker.bootstrap import die_with_agent

    die_with_agent()
    preimport()
    go = read_go(go_fd)
    if go is None:
        os._exit(0)
    argv = _become(go)
    from ddprun.worker.bootstrap import main as worker_main

    worker_main(argv)
