"""The demo's report is the full report: every rank's step time (the demo trains for ~2 s, shorter
than a default telemetry window), the time split, each metric on its own axes, and the summary card."""

import re
import sys

import pytest

from tests.helpers import describe, run_agents

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(150)
def test_demo_report_has_every_rank_step_time_and_the_summary(tmp_path):
    results = run_agents([[sys.executable, "-m", "ddprun", "demo", "--log-dir", str(tmp_path)]], timeout=130,
                         cwd=tmp_path)
    assert results[0].returncode == 0, describe(results)
    (run_dir,) = [p for p in tmp_path.iterdir() if p.name.startswith("demo-")]
    windows = (run_dir / "timings.csv").read_text().splitlines()[1:]
    assert {line.split(",")[1] for line in windows} == {"0", "1", "2", "3"}, windows
    html = (run_dir / "report.html").read_text()
    titles = re.findall(r"<img class='plot' alt='([^']+)'", html)
    assert titles == ["Loss", "val_accuracy", "Throughput", "Per-rank step time", "Time split per rank"]
    cells = dict(re.findall(r"<dt>([^<]+)</dt><dd>([^<]+)</dd>", html))
    assert cells["world"] == "4 ranks on 2 node(s)" and cells["steps"] == "150"
    assert cells["duration"].endswith(" s") and cells["step time"].endswith(tuple("0123"))
    assert float(cells["val_accuracy"]) > 0.9
