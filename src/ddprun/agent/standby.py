"""Warm workers: one standby interpreter per local rank, started before the rendezvous, handed to
torch's agent as the first attempt's worker processes (the worker side: worker/standby.py).

Why: a fresh worker spends ~4 s of CPU importing torch and what DDP's first construction imports
before its first step, and it can only start once the rendezvous is done. A standby does those imports
while the agent starts and waits for its peers.

What torch's agent sees is unchanged: :class:`StandbyHandler` is torch's ``SubprocessHandler`` whose
process is the standby (a child of this agent, in its own session as torch's are, so torch's
``killpg`` and ``poll`` work on it), given the exact command line, environment and log files torch
would have started a new process with. A standby is used only when that process would be the same
one: the entrypoint is this interpreter running ``-m ddprun.worker``, and the environment differs
from the standby's only in what the launch itself sets (:data:`LAUNCH_VARS`). Otherwise, and for every
later attempt, torch starts its process as usual; unused standbys are killed (:meth:`StandbyPool.close`).
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ddprun.protocol.env import AGENT_PID, STANDBY_FD

log = logging.getLogger("ddprun.agent.standby")

GO_WRITE_S = 10.0
"""Seconds the agent waits for a standby to read its go message (it reads once its imports are done;
one that fits the pipe, made up to 1 MiB, never waits). Past them no standby is used."""
REAP_S = 5.0

LAUNCH_VARS = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME",
    "TORCH_FR_DUMP_TEMP_FILE"})
"""Variables the launch sets per worker that nothing reads while importing (torch reads
CUDA_VISIBLE_DEVICES when CUDA initialises, the interface names and the Flight Recorder's dump path
when a process group starts, none at import); with every ``DDPRUN_*`` and ``TORCHELASTIC_*``
variable they may differ between a standby and its worker."""

WORKER_MODULE = ("-m", "ddprun.worker")



def _launch_var(name: str) -> bool:
    return name in LAUNCH_VARS or name.startswith(("DDPRUN_", "TORCHELASTIC_"))


def env_mismatch(standby_env: Mapping[str, str], worker_env: Mapping[str, str]) -> list[str]:
    """The variables, other than launch ones, whose value differs (or that one side lacks): a
    standby may become the worker only when this is empty."""
    keys = set(standby_env) | set(worker_env)
    return sorted(k for k in keys if not _launch_var(k) and standby_env.get(k) != worker_env.get(k))


@dataclass
class _Standby:
    proc: subprocess.Popen
    go_w: int


class StandbyPool:
    """Standby interpreters for this node's first attempt (module docstring)."""

    def __init__(self, python: str = sys.executable):
        self.python = python
        self._ready: list[_Standby] = []
        self.args: tuple[str, ...] = ()
        self.env: dict[str, str] = {}
        """Every standby's environment (the go message's may differ from it only in launch variables)."""

    @property
    def size(self) -> int:
        """Standbys started and not yet handed out or closed."""
        return len(self._ready)

    def start(self, count: int, env: Mapping[str, str], argv: list[str]) -> StandbyPool:
        """Start ``count`` standbys of ``python -m ddprun.worker *argv`` with ``env`` (the agent's
        environment and the workers' extras): the command line each worker will have."""
        self.args, self.env = (self.python, *WORKER_MODULE, *argv), dict(env)
        for _ in range(count):
            go_r, go_w = os.pipe()
            try:
                # what the imports print before the go message (worker/standby.py copies it to the rank log)
                with tempfile.TemporaryFile() as capture:
                    env = {**self.env, STANDBY_FD: str(go_r), AGENT_PID: str(os.getpid())}
                    proc = subprocess.Popen(self.args, env=env, stdout=capture, stderr=capture, pass_fds=(go_r,),
                                            start_new_session=True)
            except OSError as e:  # no temporary file (a full /tmp), no process: the workers start as usual
                log.info("no standby worker: %s", e)
                os.close(go_w)
                break
            finally:
                os.close(go_r)
            self._ready.append(_Standby(proc, go_w))
            log.info("standby worker %d started (pid %d)", len(self._ready), proc.pid)
        return self

    def take(self, args: tuple[str, ...], env: Mapping[str, str], cwd: str, stdout: str | None,
             stderr: str | None) -> subprocess.Popen | None:
        """A standby become the worker torch would start as ``args`` with ``env``, or None (start one)."""
        if tuple(args) != self.args or not stdout:
            return None
        while self._ready:
            sb = self._ready.pop(0)
            if sb.proc.poll() is not None:  # it died while importing: a fresh process meets the same
                os.close(sb.go_w)
                continue
            differs = env_mismatch(self.env, env)
            if differs:
                log.info("standby worker not used: the worker's environment differs in %s", ", ".join(differs[:5]))
                self._ready.insert(0, sb)
                return None
            go = json.dumps({"argv": list(args[3:]), "env": dict(env), "cwd": cwd, "stdout": stdout,
                             "stderr": stderr}).encode()
            try:
                _fit_pipe(sb.go_w, len(go))
                _write_all(sb.go_w, go, GO_WRITE_S)
            except TimeoutError as e:  # still importing, and the message is over the pipe: the others are too
                log.info("standby worker pid %d not used, nor the others: %s", sb.proc.pid, e)
                _kill(sb)
                self.close()
                return None
            except OSError as e:  # it died just now: a fresh process instead
                log.info("standby worker pid %d not used: %s", sb.proc.pid, e)
                _kill(sb)
                continue
            finally:
                os.close(sb.go_w)
            log.info("standby worker pid %d is the worker of rank %s", sb.proc.pid, env.get("RANK", "?"))
            return sb.proc
        return None

    def close(self) -> None:
        """Kill and reap the standbys not used (their imports may still be running)."""
        ready, self._ready = self._ready, []
        for sb in ready:
            os.close(sb.go_w)
            _kill(sb, wait=False)
        for sb in ready:
            _reap(sb)


def _kill(sb: _Standby, wait: bool = True) -> None:
    try:
        os.killpg(sb.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if wait:
        _reap(sb)


def _reap(sb: _Standby) -> None:
    try:
        sb.proc.wait(timeout=REAP_S)
    except subprocess.TimeoutExpired:  # SIGKILL cannot end a process in D state at once; init reaps it later
        pass


def _fit_pipe(fd: int, size: int) -> None:
    """Make the pipe hold ``size`` bytes where Linux lets it (up to /proc/sys/fs/pipe-max-size, 1 MiB
    by default): a go message over the 64 KiB default (a large environment: HPC modules) is then
    written at once, not when the standby, still importing, reads it."""
    import fcntl

    if size <= 65536 or not hasattr(fcntl, "F_SETPIPE_SZ"):
        return
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)
    except OSError:  # over the maximum: the write waits for the reader (GO_WRITE_S)
        pass


def _write_all(fd: int, data: bytes, timeout_s: float) -> None:
    """Write all of ``data`` to a pipe within ``timeout_s`` (a message over the pipe's buffer waits for
    the reader); OSError (TimeoutError) when it cannot."""
    os.set_blocking(fd, False)
    view, deadline = memoryview(data), time.monotonic() + timeout_s
    while view:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([], [fd], [], left)[1]:
            raise TimeoutError(f"its go message was not read within {timeout_s:g} s")
        view = view[os.write(fd, view):]


def handler_factory(pool: StandbyPool, original: Any) -> Any:
    """torch's ``get_subprocess_handler`` whose handlers take a standby when :meth:`StandbyPool.take` gives one."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

    class StandbyHandler(SubprocessHandler):
        def _popen(self, args: tuple, env: dict[str, str]) -> subprocess.Popen:
            out = self._stdout.name if self._stdout else None
            err = self._stderr.name if self._stderr else None
            proc = pool.take(tuple(str(a) for a in args), env, os.getcwd(), out, err)
            return proc if proc is not None else super()._popen(args, env)

    def factory(entrypoint: str, args: tuple, env: dict[str, str], stdout: str, stderr: str, local_rank_id: int,
                numa_options: Any = None) -> Any:
        if numa_options is not None:
            return original(entrypoint, args, env, stdout, stderr, local_rank_id, numa_options)
        return StandbyHandler(entrypoint=entrypoint, args=args, env=env, stdout=stdout, stderr=stderr,
                              local_rank_id=local_rank_id, numa_options=None)

    return factory
