"""`ddprun demo` refuses counts it cannot run before it starts anything: exit 2, one message."""

import pytest

from ddprun.cli import main


@pytest.mark.parametrize("flags, seen", [
    (["--nnodes", "0"], "--nnodes 0"),  # started no agent and said "done ... every node exited 0"
    (["--nnodes", "-1"], "--nnodes -1"),
    (["--nproc-per-node", "0"], "--nproc-per-node 0"),
    (["--steps", "0"], "--steps 0"),  # trained the demo's default number of steps
])
def test_a_count_below_one_is_one_usage_error_and_starts_nothing(monkeypatch, tmp_path, capsys, flags, seen):
    def started(*_a, **_k):
        raise AssertionError("the demo started its agents")

    monkeypatch.setattr("ddprun.demo.subprocess.Popen", started)
    assert main(["demo", *flags, "--log-dir", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.count("ddprun: error:") == 1 and seen in err and "HINT" in err
    assert list(tmp_path.iterdir()) == []  # no run directory
