"""Exit stress: the same 2 nodes x 2 processes job launched N times under ddprun and under plain
torchrun (alternating), counting healthy runs that exited non-zero or hung.

    python benchmarks/exit_stress.py [--runs 30] [--steps 5] [--no-destroy]
    python benchmarks/exit_stress.py --library [--runs 30]

The script trains a few steps and, by default, calls destroy_process_group straight after its last
collective (the case that aborts with SIGABRT under torchrun). Every run is bounded by --timeout.

--library: no ddprun agent; torchrun (1 x 2) starts tests/multiprocess/scripts/init_outlives.py,
which frees its DDP model after destroy_process_group, once with ddprun.init() and once with torch's
own init_process_group (--plain): the interpreter's exit, which ddprun.init() prepares, against none.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.faults.conftest import processes_in  # noqa: E402
from tests.helpers import DDPRUN, EXAMPLE, TORCHRUN, describe, free_port, run_agents  # noqa: E402

INIT_OUTLIVES = str(Path(__file__).resolve().parents[1] / "tests" / "multiprocess" / "scripts" / "init_outlives.py")
LIBRARY = ("ddprun.init", "plain")
"""--library's two variants of init_outlives.py, both under torchrun."""


def commands(launcher: str, run: int, steps: int, destroy: bool) -> list[list[str]]:
    if launcher in LIBRARY:
        return [[TORCHRUN, "--standalone", "--nproc-per-node", "2", INIT_OUTLIVES,
                 *(["--plain"] if launcher == "plain" else [])]]
    port = free_port()
    script = [EXAMPLE, "--steps", str(steps)] + (["--destroy"] if destroy else [])
    base = [DDPRUN, "run"] if launcher == "ddprun" else [TORCHRUN]
    return [base + ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"stress-{launcher}-{run}", *script]
            for _ in range(2)]


def run_once(cmds: list[list[str]], timeout: float, cwd: Path) -> list | None:
    """One run in its own directory; None when it was cut at ``timeout`` and a worker outside the
    launcher's process group (torch starts each in its own session) still held its output. Every
    process left in ``cwd`` is killed afterwards, so the next run does not share the CPUs with it."""
    cwd.mkdir()
    try:
        return run_agents(cmds, timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired:
        return None
    finally:
        for pid in processes_in(cwd):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--timeout", type=float, default=90)
    p.add_argument("--no-destroy", action="store_true")
    p.add_argument("--keep-failures", metavar="DIR", help="write the output of each failed run to DIR")
    p.add_argument("--library", action="store_true", help="ddprun.init() against torch's init, under torchrun")
    args = p.parse_args()
    names = LIBRARY if args.library else ("ddprun", "torchrun")
    stats = {name: {"ok": 0, "nonzero": 0, "hung": 0, "examples": []} for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for name in names[::-1] if i % 2 else names:
                results = run_once(commands(name, i, args.steps, not args.no_destroy), args.timeout,
                                   Path(tmp) / f"{name}-{i}")
                s = stats[name]
                if results is None or any(r.timed_out for r in results):
                    s["hung"] += 1
                elif any(r.returncode != 0 for r in results):
                    s["nonzero"] += 1
                    s["examples"].append([r.returncode for r in results])
                    if args.keep_failures:
                        Path(args.keep_failures).mkdir(parents=True, exist_ok=True)
                        Path(args.keep_failures, f"{name}-{i}.txt").write_text(describe(results))
                else:
                    s["ok"] += 1
            print(f"run {i + 1}/{args.runs}: " + ", ".join(
                f"{n} ok={s['ok']} nonzero={s['nonzero']} hung={s['hung']}" for n, s in stats.items()), flush=True)
    what = ("1 node x 2 processes under torchrun, init_outlives.py" if args.library else
            f"2 nodes x 2 processes, destroy_process_group={not args.no_destroy}")
    print(f"\nexit stress, {what}, {args.runs} runs each:")
    for name, s in stats.items():
        print(f"  {name:11s}: {s['nonzero']} exited non-zero, {s['hung']} hung, {s['ok']} clean "
              f"(exit codes of failed runs: {s['examples'][:5]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
