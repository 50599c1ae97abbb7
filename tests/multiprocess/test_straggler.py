"""A slow rank is named live with what is slow; a healthy run names nobody; the report holds it."""

import json
import re
from pathlib import Path

import pytest

from tests.helpers import ddprun_nodes, describe, run_agents

pytestmark = pytest.mark.multiprocess
SCRIPT = str(Path(__file__).parent / "scripts" / "straggler_fit.py")


@pytest.mark.timeout(120)
def test_rank_slowed_in_data_loading_is_named_with_data_wait(tmp_path):
    # 30 ms sleep per batch on rank 3: its data wait dwarfs everyone's (< 1 ms on this machine)
    results = run_agents(ddprun_nodes(2, 2, [SCRIPT, "--steps", "400", "--slow-rank", "3"], rdzv_id="tslow",
                                      extra=["--straggler-windows", "2"]), timeout=100, cwd=tmp_path)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    both = "\n".join(r.output for r in results)
    named = re.findall(r"ddprun: straggler: rank (\d+) \((\S+)\) is \d+(?:%|x) slower: (data wait|[a-z ()+]+) ", both)
    assert named and {n[0] for n in named} == {"3"} and named[0][2] == "data wait", describe(results)
    events = [json.loads(line) for line in (tmp_path / "runs" / "tslow" / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["rank"], e["what"]) for e in events] == [("straggler", 3, "data")]
    # named within a bounded number of windows: 2 slow windows + the first partial one
    assert events[0]["window"] <= 4
    html = (tmp_path / "runs" / "tslow" / "report.html").read_text()
    assert "rank 3 (" in html and len(re.findall(r"<img class='plot'", html)) == 4


@pytest.mark.timeout(120)
def test_healthy_run_names_no_straggler(tmp_path):
    results = run_agents(ddprun_nodes(2, 2, [SCRIPT, "--steps", "1500"], rdzv_id="thealthy"), timeout=100,
                         cwd=tmp_path)
    assert [r.returncode for r in results] == [0, 0], describe(results)
    assert "steps=1500" in "\n".join(r.output for r in results)
    assert not any("straggler" in r.output for r in results), describe(results)
    run_dir = tmp_path / "runs" / "thealthy"
    assert not (run_dir / "events.jsonl").exists()
    windows = (run_dir / "timings.csv").read_text().splitlines()[1:]
    assert len({line.split(",")[1] for line in windows}) == 4, "every rank published timing windows"
    assert len(windows) >= 8, "the run was long enough to be judged over several windows"
