"""Launch-mismatch errors as one line (the launcher's account of ranks that failed alike: test_console.py).
No lightning import here: the worker's failure path must not need it."""

from ddprun.mismatch import TrainerMismatch, launch_shape, translate

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


def test_the_lightning_entry_point_adds_nothing_outside_a_multi_rank_ddprun_worker(monkeypatch):
    from ddprun.lightning import callbacks_factory

    monkeypatch.delenv("DDPRUN_RUN_DIR", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert callbacks_factory() == []  # plain torchrun: Lightning's own behaviour, untouched
    monkeypatch.setenv("DDPRUN_RUN_DIR", "/tmp/run")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert callbacks_factory() == []


def test_the_hint_names_the_ddprun_module_of_the_trainers_package():
    from ddprun.mismatch import TrainerMismatch, translate

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
