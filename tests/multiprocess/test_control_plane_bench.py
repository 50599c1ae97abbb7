"""benchmarks/control_plane.py at its smallest: the simulation still drives ddprun's real agent and
monitor code (a rename there once left an override of the simulation dead, and its agents signalled
their own process group; a new rule for when the stall watch arms left its stall unreported for 30 s),
and it leaves no process behind. What it measures is the benchmark's; this only checks it runs."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from tests.helpers import REPO, Watched, job_env

pytestmark = pytest.mark.multiprocess


def bench_module():
    spec = importlib.util.spec_from_file_location("control_plane", REPO / "benchmarks" / "control_plane.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_simulations_overrides_match_ddpruns_methods_and_a_stale_one_is_named():
    mod = bench_module()
    assert mod.check_overrides() == []

    class Stale(mod.sim_agent_class()):
        def _store_lost(self):  # a method ddprun renamed: overriding it stops nothing
            pass

        def _enforce_end(self):  # a parameter ddprun added
            pass

    faults = mod.override_faults(Stale)
    assert any("Stale._store_lost overrides nothing of SimAgent" in f for f in faults), faults
    assert any(f.startswith("Stale._enforce_end(self) does not match SimAgent._enforce_end(self, keys)")
               for f in faults), faults


def test_the_simulated_node_store_answers_as_a_tcpstore_does():
    """A node's store is a dict in the simulation (LocalStore): the calls ddprun makes on a node store
    give what a TCPStore gives, a missing key's and a non-number's compare_set included."""
    from tests.helpers import store_server

    local, real = bench_module().LocalStore(), store_server()
    calls = [lambda s: s.compare_set("n", "0", "0"), lambda s: s.check(["n"]), lambda s: s.add("n", 2),
             lambda s: s.compare_set("n", "0", "0"), lambda s: s.compare_set("n", "2", "3"),
             lambda s: s.compare_set("e", "", "x"), lambda s: s.get("e"), lambda s: s.multi_get(["n", "e"]),
             lambda s: s.set("t", "text"), lambda s: s.compare_set("t", "0", "0"), lambda s: s.check(["n", "t"])]
    for i, call in enumerate(calls):
        assert call(local) == call(real), f"call {i}"


def same_group(pgid: int) -> list[int]:
    """Processes still in the process group ``pgid`` (/proc; Linux)."""
    left = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fp:
                    fields = fp.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                left.append(int(entry))
    return left


@pytest.mark.timeout(150)
def test_the_benchmark_runs_a_small_job_reports_its_stall_and_failure_and_leaves_no_process():
    cmd = [sys.executable, str(REPO / "benchmarks" / "control_plane.py"), "--ranks", "16", "--procs", "1",
           "--seconds", "2"]
    with Watched(cmd, env=job_env()) as run:
        rc, _ = run.finish(timeout=120)
        assert rc == 0, run.output
        assert same_group(run.proc.pid) == [], "the simulation left processes behind"
    rows = [line.split() for line in run.output.splitlines() if line.split()[:1] == ["16"]]
    assert len(rows) == 1, run.output
    polls, beats = float(rows[0][4]), float(rows[0][5])
    past_threshold, failure_s = float(rows[0][9].rstrip("s*")), float(rows[0][10].rstrip("s"))
    # 2 polls and 2 beats a second by design; the bounds leave room for a loaded CI machine, and
    # catch a stall the watch does not report (+27 s, its first-step bound) or a failure never seen
    assert polls > 1.0 and beats > 1.0, run.output
    assert past_threshold < 8.0, run.output
    assert 0 < failure_s < 8.0, run.output
