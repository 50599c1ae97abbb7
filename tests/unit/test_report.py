"""The run report: plots embedded, and the numbers behind them are the run directory's."""

import csv
import json
import re

from ddprun.report import TIMING_COLUMNS, write_report


def make_run(d):
    (d / "plan.json").write_text(json.dumps({"world_size": 2, "nnodes": 1, "ranks": [
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
            fp.write(f"{wdw},0,{wdw},100,0.010,0.001,0.006,0.002,0.001\n")
            fp.write(f"{wdw},1,{wdw},100,0.010,0.005,0.003,0.001,0.001\n")
    (d / "events.jsonl").write_text(json.dumps({"kind": "straggler", "rank": 1, "window": 3,
                                                "message": "rank 1 (h) is 400% slower: data wait"}) + "\n")


def embedded(html: str) -> dict:
    m = re.search(r"<script id='ddprun-data' type='application/json'>(.*?)</script>", html, re.S)
    return json.loads(m.group(1).replace("<\\/", "</"))


def test_report_holds_four_plots_the_rank_table_and_the_events(tmp_path):
    make_run(tmp_path)
    html = open(write_report(str(tmp_path))).read()
    assert len(re.findall(r"<img class='plot' alt='([^']+)' src='data:image/png;base64,", html)) == 4
    for title in ("Loss and validation metrics", "Throughput", "Per-rank step time", "Time split per rank"):
        assert f"alt='{title}'" in html
    assert "<td>101</td>" in html  # rank 1's pid from plan.json
    assert "rank 1 (h) is 400% slower: data wait" in html
    assert "http://" not in html and "https://" not in html  # self-contained


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
    assert len(re.findall(r"<img class='plot'", html)) == 4
