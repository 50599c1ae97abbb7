"""Flag parsing is torchrun's: both spellings, same meanings, pure config out."""

import pytest

from ddprun.cli import build_parser, config_from_args, main, parse_rdzv_conf
from ddprun.errors import ConfigError


def cfg(*argv):
    return config_from_args(build_parser().parse_args(["run", *argv]))


def test_lab_notes_line_parses_with_underscore_spellings():
    c = cfg("--nnodes=5", "--nproc_per_node=4", "--rdzv_id=job1", "--rdzv_backend=c10d",
            "--rdzv-endpoint=10.0.0.1:29400", "scripts.py", "--their", "--args")
    assert (c.nnodes, c.nproc_per_node, c.rdzv_id, c.rdzv_backend) == ("5", "4", "job1", "c10d")
    assert c.rdzv_endpoint == "10.0.0.1:29400"
    assert c.entry.target == "scripts.py" and c.entry.args == ("--their", "--args")
    assert c.entry.argv() == ["scripts.py", "--their", "--args"]


def test_dash_spellings_and_module_mode():
    c = cfg("--nnodes", "2:4", "--nproc-per-node", "gpu", "--node-rank", "1", "--master-addr", "h",
            "--master-port", "1234", "--max-restarts", "3", "--monitor-interval", "0.5", "--log-dir", "L",
            "--tee", "3", "--redirects", "3", "-m", "pkg.train", "--lr", "0.1")
    assert c.nnodes == "2:4" and c.nproc_per_node == "gpu" and c.node_rank == 1
    assert (c.master_addr, c.master_port, c.max_restarts, c.monitor_interval) == ("h", 1234, 3, 0.5)
    assert c.log_dir == "L" and c.tee == "3"
    assert c.entry.argv() == ["-m", "pkg.train", "--lr", "0.1"]


def test_script_args_that_look_like_flags_are_left_to_the_script():
    c = cfg("train.py", "--nnodes", "9")
    assert c.nnodes is None and c.entry.args == ("--nnodes", "9")


def test_rdzv_conf_parses_and_rejects_garbage():
    assert parse_rdzv_conf("join_timeout=300, read_timeout=60") == {"join_timeout": "300", "read_timeout": "60"}
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_rdzv_conf("oops")


def test_nonpositive_join_timeout_is_refused():
    with pytest.raises(ConfigError, match="HINT"):
        cfg("--join-timeout", "0", "t.py")


def test_rdzv_conf_join_timeout_is_the_join_timeout_ddprun_waits_and_prints_too():
    c = cfg("--rdzv-conf", "join_timeout=300,read_timeout=60", "t.py")
    assert c.join_timeout == 300 and c.rdzv_conf["join_timeout"] == "300"
    assert cfg("--join-timeout", "300", "--rdzv-conf", "join_timeout=300", "t.py").join_timeout == 300
    assert cfg("--join-timeout", "45", "t.py").join_timeout == 45
    assert cfg("t.py").join_timeout == 120  # the default, when neither is given


def test_an_explicit_join_timeout_equal_to_the_default_still_disagrees_with_rdzv_conf(capsys):
    assert main(["run", "--join-timeout", "120", "--rdzv-conf", "join_timeout=300", "t.py"]) == 2
    assert "--join-timeout 120, --rdzv-conf join_timeout=300" in capsys.readouterr().err


def test_static_rendezvous_timeout_in_rdzv_conf_is_the_join_timeout_too(capsys):
    """torch's static rendezvous (ddprun's on SLURM, LSF, SageMaker) bounds the join with ``timeout``:
    the other nodes' admission must wait as long, not 120 s."""
    assert cfg("--rdzv-conf", "timeout=900", "t.py").join_timeout == 900
    assert cfg("--rdzv-conf", "timeout=900,join_timeout=900", "--join-timeout", "900", "t.py").join_timeout == 900
    assert main(["run", "--rdzv-conf", "join_timeout=300,timeout=900", "t.py"]) == 2
    err = capsys.readouterr().err
    assert "--rdzv-conf join_timeout and --rdzv-conf timeout disagree" in err
    assert "--rdzv-conf join_timeout=300, --rdzv-conf timeout=900" in err
    assert main(["run", "--join-timeout", "60", "--rdzv-conf", "timeout=900", "t.py"]) == 2
    assert "--join-timeout and --rdzv-conf timeout disagree" in capsys.readouterr().err


def test_join_timeout_and_rdzv_conf_join_timeout_that_disagree_are_one_error(capsys):
    assert main(["run", "--join-timeout", "60", "--rdzv-conf", "join_timeout=300", "t.py"]) == 2
    err = capsys.readouterr().err
    assert "--join-timeout and --rdzv-conf join_timeout disagree" in err
    assert "--join-timeout 60, --rdzv-conf join_timeout=300" in err and "HINT" in err and "Traceback" not in err


def test_run_inside_a_worker_is_an_error_with_hint(monkeypatch, capsys):
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "x", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    assert main(["run", "train.py"]) == 2
    err = capsys.readouterr().err
    assert "inside a torchrun/ddprun worker" in err and "HINT" in err and "RANK=0" in err


def test_plan_json_for_five_nodes_of_four(capsys):
    import json

    assert main(["plan", "--nnodes", "5", "--nproc-per-node", "4", "--rdzv-endpoint", "h:1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world_size"] == 20 and len(out["ranks"]) == 20
    assert all(r["rank"] == r["node_rank"] * 4 + r["local_rank"] for r in out["ranks"])
    assert out["sources"]["nproc_per_node"] == "--nproc-per-node 4"


def test_plan_explain_names_sources(capsys):
    assert main(["plan", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "environment: local" in out
    assert "nproc_per_node: 1  <- default on a node without GPUs" in out


def test_the_defaults_are_the_ones_the_readme_tables():
    """README, "Flags and defaults compared with torchrun": the values a user gets without a flag."""
    c = cfg("t.py")
    assert (c.join_timeout, c.stall_timeout, c.stall_end, c.exit_timeout, c.stop_grace) == (120, 300, None, 60, 30)
    assert (c.preempt_signals, c.preempt_grace, c.spot_notice, c.requeue) == ("TERM,INT,USR1,USR2,HUP", None, "off", False)
    assert (c.telemetry_window, c.monitor_interval, c.max_restarts, c.start_method) == (2, 0.1, None, "spawn")
    assert (c.warm_start, c.allow_uneven_nodes, c.rdzv_conf, c.log_dir, c.run_dir) == ("auto", False, {}, None, None)
    assert (c.straggler_margin, c.straggler_windows) == (0.2, 3)  # README, "Stragglers": 20%, 3 windows


@pytest.mark.parametrize("raw, what", [("read_timeout=1.5", "whole number"), ("last_call_timeout=0", "whole number"),
                                       ("keep_alive_max_attempt=x", "whole number"), ("is_host=maybe", "boolean")])
def test_rdzv_conf_values_torch_reads_as_numbers_or_booleans_are_checked(raw, what):
    with pytest.raises(ConfigError, match=what) as e:
        parse_rdzv_conf(raw)
    assert repr(raw) in str(e.value) and "HINT" in str(e.value)
    assert parse_rdzv_conf("is_host=True,timeout=30,store_type=tcp") == {"is_host": "True", "timeout": "30",
                                                                          "store_type": "tcp"}


def test_a_join_timeout_under_a_second_is_refused_and_a_fraction_above_is_accepted():
    """torch counts whole seconds; the round-up is test_launch_units.py's."""
    from ddprun.cli import check_numbers

    with pytest.raises(ConfigError, match="at least 1 second"):
        check_numbers(build_parser().parse_args(["run", "--join-timeout", "0.5", "t.py"]))
    check_numbers(build_parser().parse_args(["run", "--join-timeout", "1.5", "t.py"]))


@pytest.mark.parametrize("extra", [["--nnodes", "2"], ["--rdzv-endpoint", "h:29500"], ["--master-port", "29500"],
                                   ["--node-rank", "1"], ["--master-addr", "10.0.0.1", "--nnodes", "1:2"]])
def test_standalone_with_a_flag_that_places_the_job_elsewhere_is_a_usage_error_naming_both(extra):
    with pytest.raises(ConfigError, match="--standalone .* contradicts") as e:
        cfg("--standalone", *extra, "t.py")
    assert " ".join(extra[:2]) in str(e.value) and "HINT" in str(e.value)
    assert cfg("--standalone", "--nnodes", "1", "t.py").standalone  # one node says the same


@pytest.mark.parametrize("conf, need", [("keep_alive_interval=1,keep_alive_max_attempt=2", 5),
                                        ("keep_alive_max_attempt=2", 3), ("keep_alive_interval=2", 4)])
def test_a_keep_alive_torch_would_let_expire_on_a_healthy_node_is_refused(conf, need):
    with pytest.raises(ConfigError, match="keep_alive_interval x keep_alive_max_attempt") as e:
        parse_rdzv_conf(conf)
    assert f"HINT: keep_alive_max_attempt={need} or more" in str(e.value) and repr(conf) in str(e.value)
    for fine in ("", "keep_alive_interval=1,keep_alive_max_attempt=5", "keep_alive_interval=10"):
        parse_rdzv_conf(fine)  # torch's defaults (5 s x 3), and enough attempts for a short interval


def test_the_keep_alive_defaults_ddprun_checks_and_prints_are_the_ones_torch_uses():
    import inspect

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    from ddprun.protocol import defaults

    torch_defaults = inspect.signature(DynamicRendezvousHandler.from_backend).parameters
    assert defaults.keep_alive({}) == (torch_defaults["keep_alive_interval"].default,
                                       torch_defaults["keep_alive_max_attempt"].default)
    assert defaults.keep_alive({"keep_alive_interval": "2", "keep_alive_max_attempt": "7"}) == (2, 7)


@pytest.mark.parametrize("argv, env, seen", [
    (["--nnodes", "0"], {}, "--nnodes='0'"),
    ([], {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu[01-05", "SLURM_JOB_NUM_NODES": "5"},
     "SLURM_JOB_NODELIST='gpu[01-05'"),
    # `run` refuses it; plan said "rendezvous: h, a free port" and exited 0
    (["--nnodes", "2", "--master-addr", "h", "--master-port", "0"], {}, "port 0 for 2 nodes (<- --master-port 0)"),
])
def test_plan_refuses_contradictory_input_with_exit_2_and_one_message(monkeypatch, capsys, argv, env, seen):
    """docs/plan-json.md: an unknown endpoint is exit 0, contradictory input exit 2, as under ``run``."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["plan", *argv, "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and seen in err and "HINT" in err and "Traceback" not in err


@pytest.mark.parametrize("run_id", ["a/b", "..", "../elsewhere"])
def test_an_rdzv_id_that_is_a_path_is_a_usage_error(capsys, run_id):
    """--rdzv-id names runs/<run id>: a path would put the run's files somewhere else."""
    assert main(["run", "--rdzv-id", run_id, "train.py"]) == 2
    err = capsys.readouterr().err
    assert f"Seen: --rdzv-id {run_id!r}" in err and "HINT: Give a plain name" in err and "Traceback" not in err


def test_torchruns_run_path_local_ranks_filter_role_and_shutdown_timeout_are_honoured():
    """torchtitan's launch line: --local-ranks-filter 0 --role rank --tee 3 (it was 'unrecognized arguments')."""
    c = cfg("--local-ranks-filter", "0", "--role", "rank", "--tee", "3", "--run-path", "--shutdown-timeout", "12",
            "train.py", "--lr", "0.1")
    assert (c.tee, c.role, c.stop_grace) == ("0:3", "rank", 12.0)
    assert c.entry.argv() == ["train.py", "--lr", "0.1"]
    assert cfg("--local_ranks_filter=1,2", "train.py").tee == "1:3,2:3"  # the console shows exactly those ranks
    assert cfg("train.py").role == "trainer"


@pytest.mark.parametrize("argv, flag", [
    (["--no-python", "prog"], "--no-python"),
    (["--no_python", "prog"], "--no-python"),
    (["--logs-specs", "mine", "t.py"], "--logs-specs"),
    (["--numa-binding", "node", "t.py"], "--numa-binding"),
    (["--event-log-handler", "console", "t.py"], "--event-log-handler"),
    (["--duplicate-stdout-filters", "loss", "t.py"], "--duplicate-stdout-filters"),
    (["--duplicate-stderr-filters", "err", "t.py"], "--duplicate-stderr-filters"),
    (["--signals-to-handle", "SIGUSR1", "t.py"], "--signals-to-handle"),
    (["--virtual-local-rank", "t.py"], "--virtual-local-rank"),
])
def test_a_torchrun_flag_ddprun_cannot_honour_is_one_error_naming_it_and_what_to_do(capsys, argv, flag):
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("ddprun: error:") == 1 and f"torchrun's {flag} " in err and "HINT: " in err
    assert "unrecognized arguments" not in err and "Traceback" not in err


@pytest.mark.parametrize("argv, seen", [
    (["--local-ranks-filter", "0,x", "t.py"], "--local-ranks-filter '0,x'"),
    (["--run-path", "-m", "pkg.train"], "--run-path -m pkg.train"),
])
def test_a_bad_local_ranks_filter_or_run_path_with_a_module_is_one_usage_error(capsys, argv, seen):
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("ddprun: error:") == 1 and f"Seen: {seen}" in err and "HINT: " in err


def test_plan_takes_a_whole_run_line_and_checks_its_run_flags_as_run_does(capsys):
    """`ddprun plan` with `run`'s flags and script copied from a run line (it was 'unrecognized arguments')."""
    import json

    line = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "h:29500", "--max-restarts", "3",
            "--tee", "3", "train.py", "--lr", "0.1"]
    assert main(["plan", "--json", *line]) == 0
    assert json.loads(capsys.readouterr().out)["world_size"] == 2
    assert main(["plan", "--tee", "x", "train.py"]) == 2  # a bad run flag: what `run` says
    err = capsys.readouterr().err
    assert err.count("ddprun: error:") == 1 and "Seen: --tee 'x'" in err
