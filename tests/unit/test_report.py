"""The run report: plots embedded, and the numbers behind them are the run directory's."""

import csv
import json
import re
import subprocess
import sys

from ddprun.report import TIMING_COLUMNS, write_report


def make_run(d):
    (d / "plan.json").write_text(json.dumps({"world_size": 2, "nnodes": 1, "started_at": 1000.0, "ranks": [
        {"rank": r, "local_rank": r, "node_rank": 0, "host": "h", "pid": 100 + r, "device": "cpu"} for r in (0, 1)]}))
    with open(d / "metrics.csv", "w", newline="") as fp:
        w = csv.writer(fp)
        w.writerow(["step", "epoch", "loss", "val_loss", "val_accuracy", "samples_per_s", "step_time_s"])
        w.writerow([10, 0, 1.5, "", "", 1000.0, 0.01])
        w.writerow([12, 0, "", 1.2, 0.7, "", ""])
        w.writerow([20, 1, 0.9, "", "", 1100.0, 0.009])
        w.writerow([24, 1, "", 0.8, 0.85, "", ""])
    with open(d / "timings.csv", "w") as fp:
        fp.write(",".join(TIMING_COLUMNS) + "\n")
        for wdw in (1, 2, 3):
            fp.write(f"{1000 + 2 * wdw},0,{wdw},100,0.010,0.001,0.006,0.002,0.001\n")
            fp.write(f"{1000 + 2 * wdw},1,{wdw},100,0.012,0.005,0.003,0.001,0.001\n")
    (d / "events.jsonl").write_text(
        json.dumps({"kind": "straggler", "t": 1006.0, "rank": 1, "host": "h", "window": 3,
                    "message": "rank 1 (h) is 400% slower: data wait"}) + "\n"
        + json.dumps({"kind": "preemption", "t": 1007.5, "message": "SIGTERM from the scheduler: stop at step 24"})
        + "\n")


def embedded(html: str) -> dict:
    m = re.search(r"<script id='ddprun-data' type='application/json'>(.*?)</script>", html, re.S)
    return json.loads(m.group(1).replace("<\\/", "</"))


PLOTS = ("Loss", "val_accuracy", "Throughput", "Per-rank step time", "Time split per rank")


def plot_titles(html: str) -> list[str]:
    return re.findall(r"<img class='plot' alt='([^']+)' src='data:image/png;base64,", html)


def test_report_has_a_plot_per_quantity_the_rank_table_and_the_events(tmp_path):
    make_run(tmp_path)
    html = open(write_report(str(tmp_path))).read()
    assert plot_titles(html) == list(PLOTS)  # accuracy on its own axes, not the loss's
    assert "<td>101</td>" in html  # rank 1's pid from plan.json
    assert "<tr class='event-straggler'><td>straggler</td><td>+6.0 s</td><td>1</td><td>h</td>" in html
    assert "<tr class='event-preemption'><td>preemption</td><td>+7.5 s</td>" in html
    assert "http://" not in html and "https://" not in html  # self-contained


def test_summary_card_states_world_steps_duration_throughput_and_events(tmp_path):
    make_run(tmp_path)
    html = open(write_report(str(tmp_path))).read()
    card = re.search(r"<section class='card' id='summary'>(.*?)</section>", html, re.S).group(1)
    cells = dict(re.findall(r"<dt>([^<]+)</dt><dd>([^<]+)</dd>", card))
    assert cells["world"] == "2 ranks on 1 node(s)" and cells["steps"] == "24"
    assert cells["duration"] == "7.5 s"  # started_at 1000 to the last record (the preemption at 1007.5)
    assert cells["samples/s"] == "1100"  # median of the logged throughput
    assert cells["step time"] == "12.0 ms median, slowest rank 1"
    assert cells["final loss"] == "0.9" and cells["val_accuracy"] == "0.85" and cells["val_loss"] == "0.8"
    assert cells["events"] == "1 preemption, 1 straggler"
    summary = embedded(html)["this"]["summary"]
    assert summary["events"] == {"straggler": 1, "preemption": 1} and summary["slowest_rank"] == 1


def test_a_run_without_telemetry_keeps_the_layout_and_says_what_is_missing(tmp_path):
    make_run(tmp_path)
    (tmp_path / "timings.csv").unlink()
    (tmp_path / "events.jsonl").unlink()
    html = open(write_report(str(tmp_path))).read()
    assert plot_titles(html) == ["Loss", "val_accuracy", "Throughput"]
    for title in ("Per-rank step time", "Time split per rank"):
        assert f"<h2>{title}</h2><p class='missing'>No step timing was recorded" in html
    assert "No straggler, hang or preemption events." in html


def test_numbers_behind_the_plots_match_metrics_csv(tmp_path):
    make_run(tmp_path)
    data = embedded(open(write_report(str(tmp_path))).read())["this"]
    with open(tmp_path / "metrics.csv", newline="") as fp:
        rows = list(csv.DictReader(fp))
    assert [(p["step"], p["loss"], p["samples_per_s"]) for p in data["train"]] == [
        (int(r["step"]), float(r["loss"]), float(r["samples_per_s"])) for r in rows if r["loss"]]
    assert [(p["step"], p["val_accuracy"]) for p in data["val"]] == [
        (int(r["step"]), float(r["val_accuracy"])) for r in rows if r["val_accuracy"]]
    assert [row["data"] for row in data["timings"]["1"]] == [0.005, 0.005, 0.005]


def test_compare_overlays_a_second_run(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    make_run(a), make_run(b)
    html = open(write_report(str(a), compare=str(b))).read()
    assert embedded(html)["other"]["run_dir"] == str(b)
    assert plot_titles(html) == list(PLOTS)


def test_a_report_written_in_a_process_that_plots_leaves_its_backend_and_figures_alone(tmp_path):
    """ddprun.launch writes the report in the caller's process (a notebook): the report must neither
    switch matplotlib's backend (before: ``matplotlib.use("Agg")``, a notebook's inline plots went
    silent) nor touch pyplot's figures."""
    script = f"""
import base64, matplotlib
matplotlib.use("svg")
import matplotlib.pyplot as plt
fig = plt.figure()
from ddprun.report import write_report
html = open(write_report({str(tmp_path)!r})).read()
assert base64.b64decode(html.split("data:image/png;base64,")[1].split("'")[0])[:4] == b"\\x89PNG"
print(matplotlib.get_backend(), plt.get_fignums())
"""
    make_run(tmp_path)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["svg", "[1]"]


def test_the_warm_up_imports_what_the_report_draws_with_and_leaves_pyplot_alone(tmp_path):
    """The agent of rank 0's node warms the report up on a thread while the job runs (agent/run.py,
    warm_run_report); a report written meanwhile waits for the import instead of importing twice."""
    script = f"""
import sys, threading
from ddprun.report import warm_up, write_report
assert "matplotlib" not in sys.modules
t = threading.Thread(target=warm_up)
t.start()
html = open(write_report({str(tmp_path)!r})).read()
t.join(60)
print(not t.is_alive(), html.count("data:image/png;base64,"),
      sorted(m for m in ("matplotlib.figure", "matplotlib.backends.backend_agg", "matplotlib.pyplot")
             if m in sys.modules))
"""
    make_run(tmp_path)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # pyplot, which picks a backend for the whole process, is never imported
    assert out.stdout.split() == ["True", str(len(PLOTS)), "['matplotlib.backends.backend_agg',",
                                  "'matplotlib.figure']"]


def test_the_warm_up_wants_a_cpu_more_than_the_worker_processes_the_machine_runs():
    from ddprun.agent.run import processes_here, spare_cpu

    assert spare_cpu(processes_here(8, 4, "10.0.0.1"), 96) and spare_cpu(processes_here(1, 1, None), 2)
    assert not spare_cpu(processes_here(1, 2, "127.0.0.1"), 2)  # 2 nodes on loopback: both run here
    assert not spare_cpu(processes_here(8, 1, None), 8)
    assert not spare_cpu(processes_here(8, 2, None), 96)  # the rendezvous host is not known


def test_a_torn_events_line_a_short_metrics_row_and_a_nan_loss_keep_the_report(tmp_path):
    """A failed run gets its report too, and a full disk or a SIGKILL mid-append leaves a torn last
    line in events.jsonl and a short last row in metrics.csv (and timings.csv): those are left out,
    the rest is reported. A NaN loss is null in the embedded data, which JSON.parse (strict JSON,
    no NaN) must read."""
    make_run(tmp_path)
    with open(tmp_path / "metrics.csv", "a") as fp:
        fp.write("28,1,nan,,,1200.0,0.008\n30,1,0.")  # a diverged step, then a row cut short
    with open(tmp_path / "timings.csv", "a") as fp:
        fp.write("1008,1,4,1")
    with open(tmp_path / "events.jsonl", "a") as fp:
        fp.write('{"kind": "hang", "t": 1009.0, "mess')
    html = open(write_report(str(tmp_path))).read()

    def strict(text: str) -> None:
        raise ValueError(f"not JSON: {text}")

    m = re.search(r"<script id='ddprun-data' type='application/json'>(.*?)</script>", html, re.S)
    data = json.loads(m.group(1).replace("<\\/", "</"), parse_constant=strict)["this"]
    assert [p["step"] for p in data["train"]] == [10, 20, 28] and data["train"][-1]["loss"] is None
    assert [e["kind"] for e in data["events"]] == ["straggler", "preemption"]
    assert [row["window"] for row in data["timings"]["1"]] == [1, 2, 3]
    assert plot_titles(html) == list(PLOTS)
