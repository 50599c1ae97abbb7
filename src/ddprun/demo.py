"""``ddprun demo``: the main job on one machine — 2 simulated nodes x 2 processes (gloo), each node
its own ``ddprun run`` agent on 127.0.0.1, training the demo model with ddprun.fit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ddprun.errors import ConfigError
from ddprun.protocol.rundir import new_run_id

DEMO_TIMEOUT_S = 120


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_counts(nnodes: int, nproc_per_node: int, steps: int | None) -> None:
    """Each count at least 1 (``steps`` None: the demo's own), said before anything starts: 0 nodes
    would start no agent and report success, 0 steps would train the default number."""
    given = {"--nnodes": nnodes, "--nproc-per-node": nproc_per_node, "--steps": steps}
    bad = [f"{flag} {n}" for flag, n in given.items() if n is not None and n < 1]
    if bad:
        raise ConfigError(f"ddprun demo needs at least 1 for {', '.join(b.split()[0] for b in bad)}.",
                          seen=", ".join(bad),
                          hint="e.g. ddprun demo --nnodes 2 --nproc-per-node 2 --steps 50 (leave --steps out for "
                               "the demo's own).")


def run_demo(nnodes: int = 2, nproc_per_node: int = 2, steps: int | None = None, log_dir: str = "runs") -> int:
    """Start ``nnodes`` agents, show node 0's console, keep the others' in the run directory."""
    check_counts(nnodes, nproc_per_node, steps)
    run_id = "demo-" + new_run_id()
    port = _free_port()
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # every rank shares this machine's cores
    script = ["-m", "ddprun.demo_train"] + (["--steps", str(steps)] if steps is not None else [])
    cmd = [sys.executable, "-m", "ddprun", "run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node),
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "--log-dir", log_dir,
           # the demo trains for about 2 s: half-second timing windows give its report a step-time curve
           "--telemetry-window", "0.5", *script]
    run_dir = os.path.join(log_dir, run_id)
    os.makedirs(run_dir, exist_ok=True)
    print(f"ddprun demo: {nnodes} simulated nodes x {nproc_per_node} processes on this machine "
          f"(one `ddprun run` agent per node):\n  {' '.join(cmd[2:])}", flush=True)
    t0 = time.monotonic()
    procs = []
    for node in range(nnodes):
        # The console shows the agent that gets rank 0; the others write theirs to the run directory.
        out = open(os.path.join(run_dir, f"console-agent{node}.txt"), "w") if node else None
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                      start_new_session=True))
    codes = []
    try:
        for p in procs:
            left = max(1.0, DEMO_TIMEOUT_S - (time.monotonic() - t0))
            codes.append(p.wait(timeout=left))
    except subprocess.TimeoutExpired:
        print(f"ddprun demo: not finished after {DEMO_TIMEOUT_S} s; stopping it. Logs: {run_dir}/logs", file=sys.stderr)
        codes.append(124)
    except KeyboardInterrupt:
        codes.append(130)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
    wall = time.monotonic() - t0
    code = next((c for c in codes if c), 0)
    if code == 0:
        print(f"ddprun demo: done in {wall:.1f} s, every node exited 0. Run directory: {run_dir}")
    else:
        print(f"ddprun demo: failed (exit codes {codes}) after {wall:.1f} s. Logs: {run_dir}/logs", file=sys.stderr)
    return code
