"""Launch-mismatch errors as one line, and the launcher's account of ranks that failed alike.
No lightning import here: the worker's failure path must not need it."""

import os
from dataclasses import dataclass

from ddprun.exit import STOPPED_MARK
from ddprun.launch import summarize_failures
from ddprun.lightning_errors import TrainerMismatch, launch_shape, translate

LAUNCH_2X2 = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2", "LOCAL_RANK": "1"}
LIGHTNING_MSG = ("You set `devices=2` and `num_nodes=1` in Lightning, but the product (2 * 1) does not match the "
                 "world size (4).")  # lightning/fabric/plugins/environments/torchelastic.py, validate_settings


def test_lightnings_devices_times_nodes_error_becomes_one_line_naming_both_sides():
    line = translate(ValueError(LIGHTNING_MSG), LAUNCH_2X2)
    assert line is not None and "\n" not in line
    assert "Trainer devices=2 x num_nodes=1 = 2" in line
    assert "LOCAL_WORLD_SIZE=2 x 2 node(s) = WORLD_SIZE=4" in line
    assert "HINT:" in line and "ddprun.lightning.trainer_kwargs()" in line and "devices=2, num_nodes=2" in line
    # the same line on every rank: the launcher groups identical messages
    assert translate(ValueError(LIGHTNING_MSG), {**LAUNCH_2X2, "LOCAL_RANK": "0"}) == line


def test_other_errors_and_plain_processes_keep_their_traceback():
    assert translate(ValueError("bad value"), LAUNCH_2X2) is None
    assert translate(RuntimeError(LIGHTNING_MSG), LAUNCH_2X2) is None
    assert translate(IndexError("list index out of range"), LAUNCH_2X2) is None  # not from a strategy's root_device
    assert translate(ValueError(LIGHTNING_MSG), {}) is None  # not launched: nothing to compare with


def test_ddpruns_own_mismatch_error_is_its_one_line():
    err = TrainerMismatch(1, 1, LAUNCH_2X2, "no process group: every rank would train its own copy")
    assert translate(err, {}) == err.one_line()
    assert "devices=1 x num_nodes=1 = 1" in err.one_line() and "every rank would train its own copy" in err.one_line()


def test_launch_shape():
    assert launch_shape(LAUNCH_2X2) == (2, 2, 4)
    assert launch_shape({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "3"}) == (3, 2, 6)
    assert launch_shape({}) is None


@dataclass
class Failure:  # the fields of torch's ProcessFailure that summarize_failures reads
    local_rank: int
    exitcode: int
    message: str

    def signal_name(self) -> str:
        return "SIGTERM"


def test_ranks_that_failed_alike_are_one_line_and_their_logs_are_not_repeated(tmp_path):
    line = translate(ValueError(LIGHTNING_MSG), LAUNCH_2X2)
    os.makedirs(tmp_path / "logs")
    (tmp_path / "logs" / "rank-3.log").write_text(f"Adding 1 callbacks\nddprun: {line}\n")
    stopped = f"{STOPPED_MARK} rank 2 (node 1, h) failed: {line} (its log: logs/rank-2.log on h)"
    text = summarize_failures({2: Failure(0, 1, line), 3: Failure(1, 1, line), 4: Failure(0, 1, stopped),
                               5: Failure(1, -15, "")}, str(tmp_path), "h")
    assert text.count(line) == 2, text  # once for the failed ranks, once in the stopped ranks' cause
    assert "ranks 2, 3 (local ranks 0, 1 on h) exited with code 1" in text
    assert "last lines" not in text  # rank 3's log ends with the same line
    assert "rank(s) 4, 5 on h were stopped because rank 2" in text


def test_a_rank_terminated_after_reporting_its_own_error_is_a_root_cause(tmp_path):
    text = summarize_failures({0: Failure(0, -15, "RuntimeError: boom"), 1: Failure(1, 1, "RuntimeError: other")},
                              str(tmp_path), "h")
    assert "rank 0 (local rank 0 on h) failed: RuntimeError: boom" in text
    assert "rank 1 (local rank 1 on h) exited with code 1: RuntimeError: other" in text


def test_torchs_text_for_a_terminated_rank_is_no_message_of_its_own(tmp_path):
    text = summarize_failures({0: Failure(0, -15, "Signal 15 (SIGTERM) received by PID 7"),
                               1: Failure(1, 1, "ValueError: x")}, str(tmp_path), "h")
    assert "rank(s) 0 on h were stopped because of the failure above." in text and "PID 7" not in text


def test_the_lightning_entry_point_adds_nothing_outside_a_multi_rank_ddprun_worker(monkeypatch):
    from ddprun.lightning_errors import callbacks_factory

    monkeypatch.delenv("DDPRUN_RUN_DIR", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert callbacks_factory() == []  # plain torchrun: Lightning's own behaviour, untouched
    monkeypatch.setenv("DDPRUN_RUN_DIR", "/tmp/run")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert callbacks_factory() == []


def test_the_hint_names_the_ddprun_module_of_the_trainers_package():
    from ddprun.lightning_errors import TrainerMismatch, translate

    environ = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    assert "Trainer(**ddprun.pytorch_lightning.trainer_kwargs()" in TrainerMismatch(
        1, 1, environ, module="ddprun.pytorch_lightning").one_line()
    namespace = {"__name__": "lightning_fabric.plugins.environments.torchelastic"}
    exec("def validate():\n    raise ValueError('You set `devices=2` and `num_nodes=1` in Lightning, but the product')",
         namespace)
    try:
        namespace["validate"]()
    except ValueError as e:
        line = translate(e, environ)
    assert "devices=2 x num_nodes=1" in line and "ddprun.pytorch_lightning.trainer_kwargs()" in line
