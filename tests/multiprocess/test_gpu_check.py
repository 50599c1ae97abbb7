"""scripts/gpu-check.sh in its dry mode (the CI run on CPU): every CUDA step is skipped with its
reason, the CPU steps run (ddprun doctor launches a real agent), and the JSON summary is written."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, job_env

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(120)
def test_dry_run_skips_cuda_steps_with_a_reason_and_writes_the_summary(tmp_path):
    env = job_env(PYTHON=sys.executable)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    p = subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), "--dry-run", "--out", str(tmp_path / "s.json")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stdout + p.stderr
    summary = json.loads((tmp_path / "s.json").read_text())
    steps = {s["name"]: s for s in summary["steps"]}
    assert summary["dry_run"] is True and summary["failed"] == 0
    cuda_steps = ["fit 32", "fit bf16", "fit 16", "lightning on one GPU", "refused --nproc-per-node 2 on one GPU",
                  "flight recorder dump of an NCCL group", "step overhead: fit vs hand-written loop"]
    for name in cuda_steps:
        assert steps[name] == {**steps[name], "status": "skipped", "detail": "dry run: needs CUDA"}
    assert steps["ddprun doctor"]["status"] == "pass", steps["ddprun doctor"]
    assert "preflight" in steps["ddprun doctor"]["detail"]
    assert steps["nvml facts"]["status"] in ("pass", "skipped") and steps["nvml facts"]["detail"]
    assert f"gpu-check: {summary['passed']} passed, 0 failed, {summary['skipped']} skipped" in p.stdout
