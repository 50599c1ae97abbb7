"""What ddprun.fit adds to the training step: no collective beyond DDP's gradient all-reduce (which
runs in DDP's C++ reducer), one barrier after the first step (collectives then use the training
timeout) and one gather and one barrier per checkpoint (and one more barrier after an on_checkpoint hook);
gradient accumulation skips DDP's all-reduce with ``no_sync`` on all but the last micro-batch of each step.
Two ranks under plain torchrun: DDP needs two."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import TORCHRUN, job_env

pytestmark = pytest.mark.timeout(120)

SCRIPT = str(Path(__file__).resolve().parent / "scripts" / "fit_collectives.py")


@pytest.mark.parametrize(("hook", "accum"), [(False, 2), (True, 1)], ids=["plain-accum-2", "on_checkpoint"])
def test_fit_issues_no_collective_per_step_one_barrier_after_the_first_and_a_gather_and_barrier_per_checkpoint(
        tmp_path, hook, accum):
    r = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "2", SCRIPT, str(tmp_path / "run"), "10",
                        str(tmp_path), str(accum), *(["hook"] if hook else [])],
                       capture_output=True, text=True, timeout=100, env=job_env(PYTHONPATH=":".join(sys.path)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    # every rank's RNG states, then the write's barrier; after on_checkpoint a barrier back to the training timeout
    checkpoint = ["all_gather_object", "barrier", *(["barrier"] if hook else [])]
    for d in ranks:
        assert (d["world"], d["steps"], d["model"]) == (2, 30, "Sequential")  # DDP unwrapped for the user
        # keys: the step the collectives came before; steps 3-10, 12-20, 22-30 had none
        assert d["before_step"] == {"2": ["barrier"], "11": checkpoint, "21": checkpoint}, d
        assert d["loose_at"] == [1], d  # the init timeout only for the first step, also after on_checkpoint
        # grad_accum 2: the first micro-batch of each of the 30 steps under no_sync, the second syncs
        assert d["no_sync_before_step"] == (list(range(1, 31)) if accum == 2 else []), d
    assert ranks[0]["params"] == ranks[1]["params"]  # different shards, one model: DDP's all-reduce ran
