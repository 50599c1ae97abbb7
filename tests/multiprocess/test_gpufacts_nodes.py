"""Two `ddprun run` agents as two nodes whose (fake) GPUs and NCCL settings differ: the preflight
publishes each node's NVML facts and rank 0 warns about the drift, naming both nodes."""

import json
import os
from pathlib import Path

import pytest

from tests.helpers import EXAMPLE, ddprun_nodes, describe, run_agents

pytestmark = pytest.mark.multiprocess

FAKE_NVML_DIR = Path(__file__).resolve().parents[1] / "fakes" / "nvml"


def gpu(uuid):
    return {"name": "NVIDIA H100 80GB HBM3", "uuid": uuid, "memory": 80 * 2**30, "cc": [9, 0], "mig": 0, "ecc": 0,
            "retired_pending": 0, "remap": [0, 0, 0, 0], "throttle": 0, "pcie": [5, 5, 16, 16]}


@pytest.mark.timeout(90)
def test_nodes_with_different_fake_gpus_and_nccl_settings_are_warned_about(tmp_path):
    specs = [{"driver": "550.54.15", "cuda": 12040, "gpus": [gpu("GPU-a")]},
             {"driver": "535.129.03", "cuda": 12020, "gpus": [gpu("GPU-b")]}]
    cmds = ddprun_nodes(2, 1, [EXAMPLE, "--steps", "3"], rdzv_id="tgpu")
    for i, (cmd, spec) in enumerate(zip(cmds, specs)):
        (tmp_path / f"nvml-{i}.json").write_text(json.dumps(spec))
        # this node's `import pynvml` finds the fake, which answers from its own spec
        path = os.pathsep.join([str(FAKE_NVML_DIR), os.environ.get("PYTHONPATH", "")])
        cmd[:0] = ["env", f"PYTHONPATH={path}", f"FAKE_NVML_SPEC={tmp_path / f'nvml-{i}.json'}",
                   f"NCCL_IB_HCA=mlx5_{i}"]
    results = run_agents(cmds, timeout=75, cwd=tmp_path)
    assert [r.returncode for r in results] == [0, 0], describe(results)  # warnings do not stop the job

    pre = json.loads((tmp_path / "runs" / "tgpu" / "preflight.json").read_text())
    gpus = {n["gpu"]["ranks"][0]["uuid"]: n["gpu"] for n in pre["nodes"]}
    assert set(gpus) == {"GPU-a", "GPU-b"} and gpus["GPU-b"]["driver"] == "535.129.03"
    assert gpus["GPU-a"]["env"]["NCCL_IB_HCA"] != gpus["GPU-b"]["env"]["NCCL_IB_HCA"]
    warnings = [f["message"] for f in pre["findings"] if f["level"] == "warning"]
    assert any(m.startswith("NVIDIA driver differs between nodes: node 0 (") and "'535.129.03'" in m
               and "'550.54.15'" in m for m in warnings), warnings
    assert any(m.startswith("CUDA driver version differs between nodes:") for m in warnings), warnings
    assert any(m.startswith("NCCL/GLOO settings differ between nodes: NCCL_IB_HCA: node 0 (") for m in warnings), warnings
    assert not [f for f in pre["findings"] if f["level"] == "error"]  # a CPU job: no per-GPU errors
    both = "\n".join(r.output for r in results)
    assert "preflight warning: NVIDIA driver differs between nodes" in both, describe(results)
