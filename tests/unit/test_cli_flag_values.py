"""A bad flag value stops `ddprun run` at validation: exit 2, one message naming the flag and the value, a HINT."""

import os
import re

import pytest

from ddprun.cli import main

BAD = [
    (["--straggler-margin", "0"], "--straggler-margin", "0"),
    (["--straggler-windows", "0"], "--straggler-windows", "0"),
    (["--telemetry-window", "0"], "--telemetry-window", "0"),
    (["--exit-timeout", "0"], "--exit-timeout", "0"),
    # past MAX_SECONDS: timedelta overflowed when the store opened, the exit guard's timer raised
    (["--join-timeout", "1e14"], "--join-timeout", "100000000000000"),
    (["--exit-timeout", "1e20"], "--exit-timeout", "1e+20"),
    (["--stall-timeout", "2e7"], "--stall-timeout", "20000000"),
    (["--rdzv-conf", "join_timeout=100000000000000"], "--rdzv-conf", "join_timeout=100000000000000"),
    (["--monitor-interval", "0"], "--monitor-interval", "0"),
    (["--stop-grace", "-1"], "--stop-grace", "-1"),
    (["--preempt-grace", "0"], "--preempt-grace", "0"),
    (["--rdzv-backend", "nosuch"], "--rdzv-backend", "nosuch"),
    (["--rdzv-endpoint", ":1"], "--rdzv-endpoint", ":1"),
    (["--rdzv-endpoint", "h:x"], "--rdzv-endpoint", "h:x"),
    (["--rdzv-endpoint", "h:"], "--rdzv-endpoint", "h:"),
    (["--rdzv-endpoint", "fe80::1:1234"], "--rdzv-endpoint", "fe80::1:1234"),
    (["--rdzv-endpoint", "[::1]29501"], "--rdzv-endpoint", "[::1]29501"),
    (["--nnodes", "2", "--master-addr", "node1:29500"], "--master-addr", "node1:29500"),
    (["--run-dir", ""], "--run-dir", ""),  # an unset variable: a requeue got a new run directory
    (["--log-dir", ""], "--log-dir", ""),
    (["--hostfile", ""], "--hostfile", ""),
    (["--nproc-per-node", "x"], "--nproc-per-node", "x"),
    (["--nproc-per-node", "0"], "--nproc-per-node", "0"),
    (["--rdzv-backend", "static", "--nnodes", "1:2", "--node-rank", "0", "--master-addr", "127.0.0.1"],
     "--nnodes", "1:2"),
    (["--rdzv-backend", "etcd", "--nnodes", "2", "--master-addr", "127.0.0.1"], "--rdzv-backend", "etcd"),
]


@pytest.fixture
def no_launch(monkeypatch, tmp_path):
    """Past validation `run` would start standbys and the agent: fail the test there instead."""
    from ddprun.agent.standby import StandbyPool

    def reached(*_a, **_k):
        raise AssertionError("validation passed: the launch would start")

    monkeypatch.setattr("ddprun.cli.check_endpoint", reached)  # first call after resolve(), before launch()
    monkeypatch.setattr(StandbyPool, "start", reached)
    for key in list(os.environ):  # the local environment, whatever cluster this test runs in
        if key.startswith(("SLURM_", "OMPI_", "PMI_", "SM_", "PET_", "LSB_", "SKYPILOT_")) or key in (
                "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)  # the default runs/ root is checked for writability
    (tmp_path / "t.py").write_text("raise SystemExit('must not run')\n")


@pytest.mark.timeout(20)
@pytest.mark.parametrize("flags, flag, value", BAD)
def test_a_bad_value_is_one_usage_error_naming_the_flag_and_the_value(no_launch, capsys, flags, flag, value):
    assert main(["run", *flags, "t.py"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.count("ddprun: error:") == 1 and err.count("HINT") == 1
    # the value as given, quoted or as the float argparse made of it (0 -> 0.0)
    assert re.search(rf"{re.escape(flag)}[ =]'?{re.escape(value)}(?:\.0)?'?(?![\w.])", err), err
