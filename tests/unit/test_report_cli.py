"""`ddprun report RUN_DIR` end to end: where it writes, and what it refuses."""


import pytest

from ddprun.cli import main
from tests.unit.test_report import PLOTS, make_run, plot_titles


def test_report_writes_report_html_into_the_run_directory(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    make_run(run)
    assert main(["report", str(run)]) == 0
    written = run / "report.html"
    assert capsys.readouterr().out.strip() == str(written)
    assert plot_titles(written.read_text()) == list(PLOTS)  # the fixture's run, not an empty page


@pytest.mark.parametrize("flag", ["-o", "--output"])
def test_output_flag_writes_there_and_not_into_the_run_directory(tmp_path, capsys, flag):
    run, elsewhere = tmp_path / "run", tmp_path / "out" / "r.html"
    run.mkdir()
    elsewhere.parent.mkdir()
    make_run(run)
    assert main(["report", str(run), flag, str(elsewhere)]) == 0
    assert capsys.readouterr().out.strip() == str(elsewhere)
    assert "<script id='ddprun-data'" in elsewhere.read_text()
    assert not (run / "report.html").exists()


def _missing(tmp_path):
    return tmp_path / "no-such-run", "no such directory"


def _a_file(tmp_path):
    (tmp_path / "plan.json").write_text("{}")
    return tmp_path / "plan.json", "not a directory"


def _empty_dir(tmp_path):
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty", "it holds none of plan.json, metrics.csv, timings.csv, events.jsonl"


@pytest.mark.parametrize("make", [_missing, _a_file, _empty_dir])
def test_a_path_that_is_not_a_run_directory_exits_2_naming_it(tmp_path, capsys, make):
    path, why = make(tmp_path)
    assert main(["report", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert "Not a run directory" in err and f"Seen: {path} ({why})\n" in err
    assert not (path / "report.html").exists()


def test_a_run_directory_with_only_logs_says_where_the_report_files_or_the_reason_are(tmp_path, capsys):
    """Only logs/: a node other than rank 0's (without a shared filesystem), or a launch that ended
    early. The refusal says both, instead of asking for another directory."""
    (tmp_path / "run" / "logs").mkdir(parents=True)
    assert main(["report", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "Not a run directory" in err and "Traceback" not in err
    assert "HINT: A run's report files are written on the node of rank 0: run ddprun report there." in err
    assert f"the console and {tmp_path / 'run' / 'logs'}/ (rank-N.log, agent-HOST.log) say why" in err
