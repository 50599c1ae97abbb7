"""ddprun.launch without starting workers: argument checks, what it sends, how a failure is told;
and fit's on_checkpoint hook (the one ddprun.ray reports checkpoints through), in one process."""

from __future__ import annotations

import contextlib
import os
import pickle

import pytest
import torch
from torch import nn

import ddprun
from ddprun import runtime
from ddprun.agent.fnlaunch import _payload, _root_cause
from ddprun.agent.run import Outcome
from ddprun.errors import ClusterError, ConfigError, LaunchError, LaunchTimeout, WorkerFailed
from ddprun.protocol import failure as fr
from ddprun.protocol import payload


def test_ddprun_launch_is_a_function_with_its_own_signature_and_help():
    import inspect
    import pydoc

    import ddprun.agent.run  # importing ``ddprun run``'s agent must not replace ddprun.launch

    assert inspect.isfunction(ddprun.launch) and ddprun.launch.__module__ == "ddprun.agent.fnlaunch"
    params = inspect.signature(ddprun.launch).parameters
    assert list(params)[:2] == ["fn", "args"] and "nproc_per_node" in params and "return_all" in params
    text = pydoc.render_doc(ddprun.launch, renderer=pydoc.plaintext)
    assert "nproc_per_node" in text and "rank 0" in text


@pytest.mark.parametrize("bad, match", [
    ({"nproc_per_node": 1.5}, "nproc_per_node"),
    ({"timeout": 0}, "timeout"),
    ({"join_timeout": -1}, "join_timeout"),
    ({"stall_timeout": -1}, "stall_timeout"),
    ({"max_restarts": -1}, "max_restarts"),
])
def test_bad_options_are_config_errors_before_anything_starts(bad, match):
    with pytest.raises(ConfigError, match=match):
        ddprun.launch(print, **bad)


def test_not_a_function():
    with pytest.raises(ConfigError, match="needs a function"):
        ddprun.launch("train.py")


def test_refused_inside_a_worker(monkeypatch):
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ClusterError, match="inside a torchrun/ddprun worker"):
        ddprun.launch(print)


def test_a_main_function_travels_by_value():
    ns = {"__name__": "__main__"}
    exec("def f(x):\n    return x * k\nk = 3\n", ns)
    assert payload.by_reference_only(ns["f"]) is not None  # plain pickle could not send it
    job = pickle.loads(_payload(ns["f"], (2,), {}, return_all=False, timeout=None))
    del ns  # nothing of the namespace is needed to call it again
    fn, args, kwargs = payload.loads(job["call"])
    assert fn(*args, **kwargs) == 6
    assert job["deadline"] is None and job["return_all"] is False and job["sys_path"]


def test_what_cannot_be_sent_is_named():
    import threading

    with pytest.raises(ConfigError, match="cannot send the function or its arguments") as caught:
        _payload(print, (threading.Lock(),), {}, return_all=False, timeout=None)
    assert "HINT" in str(caught.value)


def outcome(run_dir, records):
    return Outcome(1, str(run_dir), 0.0, records, fr.root_cause(records.values()))


def test_the_rank_that_raised_is_the_cause_not_the_ranks_it_stopped(tmp_path):
    try:
        raise KeyError("missing column 'y'")
    except KeyError as e:
        payload.write_error(str(tmp_path), 3, e, skip_frames=0)
    cause = fr.FailureRecord(fr.ERROR, 3, "KeyError: \"missing column 'y'\"", 0, "h", 3, 1, t=2.0)
    records = {0: fr.stopped_by(cause, rank=0, node_rank=0, host="h", local_rank=0, t=1.0),
               1: fr.stopped_by(cause, rank=1, node_rank=0, host="h", local_rank=1, t=1.5), 3: cause}
    err = _root_cause(outcome("/runs/x", records), str(tmp_path))
    assert isinstance(err, WorkerFailed) and err.rank == 3
    assert isinstance(err.error, KeyError) and "missing column" in err.traceback
    assert err.log == "/runs/x/logs/rank-3.log" and "[0, 1]" in str(err)


def test_a_rank_killed_by_a_signal_is_named_with_its_log(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank-1.log").write_text("step 1\nstep 2\n")
    killed = fr.from_exit(1, -9, node_rank=0, host="h", local_rank=1, t=2.0)
    echo = fr.FailureRecord(fr.ERROR, 0, "RuntimeError: Connection reset by peer", 0, "h", 0, t=1.0)
    err = _root_cause(outcome(tmp_path, {0: echo, 1: killed}), str(tmp_path / "none"))
    assert err.rank == 1 and "SIGKILL" in err.message and "step 2" in err.traceback
    assert "out-of-memory" in str(err)


def test_a_timeout_is_its_own_error(tmp_path):
    msg = "ddprun.launch: timeout of 5 s reached; this rank was still running"
    records = {0: fr.FailureRecord(fr.TIMEOUT, 0, msg, 0, "h", 0, 124)}
    assert isinstance(_root_cause(outcome(tmp_path, records), str(tmp_path)), LaunchTimeout)


# -- fit's on_checkpoint hook, one process ------------------------------------------------------------

@pytest.fixture
def one_process(monkeypatch):
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "DDPRUN_RUN_DIR"):
        monkeypatch.delenv(k, raising=False)
    runtime._reset()
    yield
    runtime._reset()


TIMED_OUT_RANK = """
import os, sys, time
from ddprun.worker import fnworker
fnworker.PEERS_WAIT_S = float(sys.argv[2])
fnworker._arm_deadline(time.time() + 0.2, 6, sys.argv[1], 0)
time.sleep(60)
"""


@pytest.mark.timeout(30)
@pytest.mark.parametrize("peer", ["over-later", "never"])
def test_a_rank_at_the_timeout_exits_once_every_peer_is_over_and_no_later_than_its_bound(tmp_path, peer):
    """Before: the first rank whose timer fired exited at once, torch's agent stopped its peers, and a
    CPU-starved peer whose timer had not fired yet ended with no stacks in its log (CI, 2 cores)."""
    import subprocess
    import sys
    import time

    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "TORCHELASTIC_ERROR_FILE": str(tmp_path / "error.json")}
    bound = 20.0 if peer == "over-later" else 1.5
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", TIMED_OUT_RANK, str(tmp_path), str(bound)], env=env,
                            stderr=subprocess.PIPE, text=True)
    while not (tmp_path / "over-0").exists() and time.monotonic() - t0 < 15:
        time.sleep(0.05)
    assert (tmp_path / "over-0").exists(), "the rank marks itself over once its stacks are in its log"
    time.sleep(0.5)
    if peer == "over-later":
        assert proc.poll() is None, "it exited before its peer was over"
        (tmp_path / "over-1").touch()
        waited = time.monotonic()
    err = proc.communicate(timeout=20)[1]
    assert proc.returncode == 124, err
    assert "timeout of 6 s reached; this rank was still running" in err and "most recent call first" in err, err
    if peer == "over-later":
        assert time.monotonic() - waited < 3, "it exits soon after its peer is over"
    else:
        assert 1.4 < time.monotonic() - t0 < 12, "a peer that is never over (holding the GIL) costs the bound"


def test_on_checkpoint_sees_every_checkpoint_after_it_is_written(tmp_path, one_process):
    import os

    seen = []

    def hook(saved):
        seen.append((os.path.basename(saved.path), saved.step, saved.epoch, saved.final, os.path.exists(saved.path),
                     sorted(saved.metrics)))

    x = torch.randn(32, 4)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    ddprun.fit(nn.Linear(4, 1), data, loss_fn=nn.functional.mse_loss, batch_size=8, max_steps=5, checkpoint_every=2,
               run_dir=str(tmp_path), on_checkpoint=hook)
    assert seen == [("step-00000002.pt", 2, 0, False, True, []), ("step-00000004.pt", 4, 0, False, True, []),
                    ("step-00000005.pt", 5, 1, True, True, ["train_loss"])]
    seen.clear()  # a run that ends on a checkpoint step: the final call names that checkpoint again
    ddprun.fit(nn.Linear(4, 1), data, loss_fn=nn.functional.mse_loss, batch_size=8, max_steps=6, checkpoint_every=3,
               run_dir=str(tmp_path / "again"), on_checkpoint=hook)
    assert [s[:4] for s in seen] == [("step-00000003.pt", 3, 0, False), ("step-00000006.pt", 6, 1, False),
                                     ("step-00000006.pt", 6, 1, True)]
    with pytest.raises(ConfigError, match="on_checkpoint"):
        ddprun.fit(nn.Linear(4, 1), data, loss_fn=nn.functional.mse_loss, on_checkpoint="no")


def test_on_checkpoint_runs_as_a_declared_phase_and_validation_beats_per_batch(tmp_path, one_process):
    """The stall watchdog: a long upload in on_checkpoint is a declared phase (the monitor beats for
    it), and a long validation pass beats once per batch (the phase's own bound would end at 4 x
    --stall-timeout)."""
    from types import SimpleNamespace

    from ddprun.telemetry import PROGRESS
    from ddprun.train.loop import _validate

    phases = []
    x = torch.randn(32, 4)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    ddprun.fit(nn.Linear(4, 1), data, loss_fn=nn.functional.mse_loss, batch_size=8, max_steps=2, checkpoint_every=2,
               run_dir=str(tmp_path), on_checkpoint=lambda saved: phases.append((PROGRESS.phase, PROGRESS.busy_since)))
    assert [p for p, _ in phases] == ["on_checkpoint", "on_checkpoint"] and all(t is not None for _, t in phases)
    beats = []
    loader = [(x[i:i + 8], x[i:i + 8].sum(1, keepdim=True)) for i in range(0, 32, 8)]
    info = SimpleNamespace(device=torch.device("cpu"), distributed=False, world_size=1)
    _validate(nn.Linear(4, 1), loader, info, loss_fn=nn.functional.mse_loss, training_step=None,
              metrics={"beats": lambda out, y: beats.append(PROGRESS.beats) or torch.tensor(0.0)},
              amp=contextlib.nullcontext)
    assert len(beats) == 4 and beats == sorted(set(beats)), beats  # a new beat at every batch


def test_a_value_that_loads_only_in_the_worker_is_kept_and_named(tmp_path, one_process):
    import torch.distributed as dist

    from ddprun.agent.fnlaunch import _results

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:  # what a worker returning ``model`` (still wrapped in DDP) writes
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 1))
        (tmp_path / "result-0.pkl").write_bytes(payload.dumps(ddp))
        (tmp_path / "result-0.type").write_text("torch.nn.parallel.distributed.DistributedDataParallel")
    finally:
        dist.destroy_process_group()
    with pytest.raises(LaunchError, match=r"Rank 0's return value \(.*DistributedDataParallel\)") as caught:
        _results(str(tmp_path), 1, False, str(tmp_path / "run"))
    assert "Default process group has not been initialized" in str(caught.value)
    assert "model.module.state_dict()" in str(caught.value)
    kept = tmp_path / "run" / "result-0.pkl"
    assert f"kept in {kept}" in str(caught.value) and kept.stat().st_size > 0
