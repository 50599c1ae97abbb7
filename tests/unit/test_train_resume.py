"""fit's periodic checkpoints and resuming, in one process: a crashed run resumed from its last
checkpoint ends with the uninterrupted run's parameters, bit for bit."""

import os
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddprun
from ddprun.errors import CheckpointError, ConfigError
from ddprun.train import checkpoint, dirlock
from ddprun.train.data import ResumableSampler
from tests.unit.restart_support import new_process, one_process, regression  # noqa: F401 (autouse fixture)


def mlp(width=16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.Dropout(0.2), nn.Tanh(), nn.Linear(width, 1))


class Crash(Exception):
    pass


def stepper(crash_at=None):
    """A training_step that also draws from numpy and python's RNG (restored on resume) and raises
    on its ``crash_at``-th call."""
    calls = {"n": 0}

    def step(net, batch):
        calls["n"] += 1
        if calls["n"] == crash_at:
            raise Crash()
        x, y = batch
        noise = float(np.random.rand()) * 1e-3
        return nn.functional.mse_loss(net(x), y) + noise
    return step


KW = dict(optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2), epochs=3, batch_size=8, log_every=100,
          scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 4, 0.7))


def run(run_dir, crash_at=None, model=None, **kw):
    new_process()
    return ddprun.fit(model or mlp(), regression(), training_step=stepper(crash_at), run_dir=str(run_dir),
                      **{**KW, **kw})


def params(res):
    return [p.detach().clone() for p in res.model.parameters()]


# 8 micro-batches per epoch, 3 epochs. (1, 4, 17): the checkpoint of step 16 ends epoch 1 exactly.
@pytest.mark.parametrize("grad_accum, every, crash_at", [(1, 3, 13), (2, 3, 21), (1, 4, 17)])
def test_a_crashed_run_resumed_is_bitwise_the_uninterrupted_run(tmp_path, grad_accum, every, crash_at, capsys):
    val = regression(16)
    np.random.seed(0)
    ref = run(tmp_path / "ref", grad_accum=grad_accum, checkpoint_every=every, val_data=val)
    np.random.seed(0)
    with pytest.raises(Crash):
        run(tmp_path / "crash", crash_at=crash_at, grad_accum=grad_accum, checkpoint_every=every, val_data=val)
    torch.manual_seed(99), np.random.seed(99)  # the restarted process's RNGs start elsewhere
    res = run(tmp_path / "crash", grad_accum=grad_accum, checkpoint_every=every, val_data=val)
    assert "ddprun: resuming from" in capsys.readouterr().out
    assert res.steps == 24 // grad_accum and res.epochs == 3
    assert all(torch.equal(a, b) for a, b in zip(params(ref), params(res)))
    assert res.history == ref.history and len(res.history) == 3  # the validations before the crash came along


def test_keep_checkpoints_prunes_the_oldest(tmp_path):
    run(tmp_path, checkpoint_every=2, keep_checkpoints=2, epochs=1)
    ckdir = tmp_path / "checkpoints"
    assert sorted(os.listdir(ckdir)) == [".ddprun-writer.lock", "latest", "step-00000006.meta.json", "step-00000006.pt",
                                         "step-00000008.meta.json", "step-00000008.pt"]


def test_resume_options(tmp_path, capsys):
    first = run(tmp_path, checkpoint_every=4, epochs=1)
    again = run(tmp_path, epochs=1)  # "auto": the finished run resumes at its end and does nothing more
    assert again.steps == first.steps == 8
    assert all(torch.equal(a, b) for a, b in zip(params(first), params(again)))
    assert again.checkpoint == str(tmp_path / "checkpoints" / "step-00000008.pt")
    fresh = run(tmp_path, epochs=1, resume=False)
    assert "resuming" not in capsys.readouterr().out.split("step 8/8")[-1]
    assert fresh.steps == 8
    # the run before it was moved aside, whole, not overwritten
    assert sorted(os.listdir(tmp_path / "checkpoints" / "previous-1")) == [
        "latest", "step-00000004.meta.json", "step-00000004.pt", "step-00000008.meta.json", "step-00000008.pt"]
    more = run(tmp_path / "other", epochs=2, resume=str(tmp_path / "checkpoints" / "previous-1" / "step-00000004.pt"))
    assert more.steps == 16
    with pytest.raises(ConfigError, match="no checkpoint to resume from"):
        run(tmp_path / "empty", resume=True)
    with pytest.raises(ConfigError, match="resume must be"):
        run(tmp_path / "x", resume=3)
    with pytest.raises(ConfigError, match="checkpoint_every"):
        run(tmp_path / "x", checkpoint_every=0)


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    run(tmp_path, checkpoint_every=4, epochs=1)
    with pytest.raises(ConfigError) as err:
        run(tmp_path, model=mlp(width=32), epochs=2)
    msg = str(err.value)
    assert "different model" in msg and "shapes differ: 0.weight: (16, 8) saved, (32, 8) now" in msg
    assert "HINT:" in msg and "resume=False" in msg
    with pytest.raises(ConfigError, match="missing from the checkpoint: 4.weight"):
        run(tmp_path, model=nn.Sequential(*mlp(), nn.Linear(1, 1)), epochs=2)


def test_restarts_without_periodic_checkpoints_are_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    run(tmp_path, max_steps=1)
    err = capsys.readouterr().err
    assert "TORCHELASTIC_MAX_RESTARTS=2" in err and "saves no periodic checkpoints" in err


@pytest.mark.parametrize("n, world, batch", [(64, 4, 3), (37, 3, 2), (10, 4, 1)])
def test_resumable_sampler_continues_the_distributed_sampler_order(n, world, batch):
    ds = TensorDataset(torch.zeros(n))
    for rank in range(world):
        plain = DistributedSampler(ds, world, rank, seed=5)
        plain.set_epoch(2)
        order = list(plain)
        for k in range(len(order) // batch):
            s = ResumableSampler(ds, world, rank, seed=5)
            s.resume_at(2, k * batch * world)
            s.set_epoch(2)
            assert list(s) == order[k * batch:] and len(s) == len(order) - k * batch
            s.set_epoch(3)  # other epochs are untouched
            plain.set_epoch(3)
            assert list(s) == list(plain)
            plain.set_epoch(2)


def test_resumable_sampler_after_a_world_size_change_skips_nothing():
    ds = TensorDataset(torch.zeros(40))
    full = DistributedSampler(ds, 1, 0, seed=0)
    full.set_epoch(0)
    order = list(full)
    done = 3 * 2 * 4  # 3 batches of 2 on 4 ranks
    rest = []
    for rank in range(2):
        s = ResumableSampler(ds, 2, rank, seed=0)
        s.resume_at(0, done)
        s.set_epoch(0)
        rest += list(s)
    assert set(rest) == set(order[done:]) and len(rest) == len(order) - done


def test_a_user_dataloader_with_its_own_sampler_in_one_process_resumes_by_skipping_batches(tmp_path):
    loader = DataLoader(regression(), batch_size=8, sampler=range(64))  # a sampler of its own: kept as given
    np.random.seed(0)
    ref = params(ddprun.fit(mlp(), loader, training_step=stepper(), run_dir=str(tmp_path / "ref"), checkpoint_every=3,
                            **KW))
    new_process()
    np.random.seed(0)
    with pytest.raises(Crash):
        ddprun.fit(mlp(), loader, training_step=stepper(13), run_dir=str(tmp_path / "c"), checkpoint_every=3, **KW)
    new_process()
    res = ddprun.fit(mlp(), loader, training_step=stepper(), run_dir=str(tmp_path / "c"), checkpoint_every=3, **KW)
    assert all(torch.equal(a, b) for a, b in zip(ref, params(res)))
    assert checkpoint.load(str(tmp_path / "c" / "checkpoints"))["step"] == 24


def test_a_shuffling_user_dataloader_in_one_process_resumes_bitwise_the_uninterrupted_run(tmp_path):
    # it was kept as given: the resume drew a new shuffle order, then dropped its first batches, so
    # some samples came twice in the resumed epoch and others never
    def go(name, crash_at=None):
        new_process()
        np.random.seed(0)
        loader = DataLoader(regression(), batch_size=8, shuffle=True)
        return ddprun.fit(mlp(), loader, training_step=stepper(crash_at), run_dir=str(tmp_path / name),
                          checkpoint_every=3, **KW)

    ref = params(go("ref"))
    with pytest.raises(Crash):
        go("c", crash_at=13)
    torch.manual_seed(99)  # the restarted process's global RNG starts elsewhere
    assert all(torch.equal(a, b) for a, b in zip(ref, params(go("c"))))


def test_a_second_fit_in_one_process_after_a_finished_one_starts_anew(tmp_path, capsys):
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))

    def run():
        torch.manual_seed(0)
        return ddprun.fit(nn.Linear(4, 1), data, loss_fn=nn.functional.mse_loss, batch_size=8, max_steps=4,
                          run_dir=str(tmp_path), log_every=100)

    first = run()
    capsys.readouterr()
    with pytest.warns(UserWarning, match="starts anew"):
        second = run()
    said = capsys.readouterr()
    assert "resuming from" not in said.out + said.err  # trained again, not resumed at its end
    assert first.steps == second.steps == 4  # not "a finished run resumed: nothing left to do"
    assert all(torch.equal(a, b) for a, b in zip(first.model.parameters(), second.model.parameters()))


def test_under_torchs_agent_a_restarted_fit_without_run_dir_resumes_in_the_run_named_by_the_rdzv_id(
        tmp_path, monkeypatch, capsys):
    # torchrun --max-restarts: every restart is a new process calling fit(); without a run dir of its
    # own it picked a fresh runs/<timestamp> each time and trained from step 0, saying nothing
    monkeypatch.chdir(tmp_path)
    from tests.helpers import free_port

    worker = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(free_port()), "TORCHELASTIC_RUN_ID": "job42", "TORCHELASTIC_MAX_RESTARTS": "1"}
    for k, v in worker.items():
        monkeypatch.setenv(k, v)

    def fit():
        new_process()  # a restart is a new process
        return ddprun.fit(mlp(), regression(), loss_fn=nn.functional.mse_loss, batch_size=8, max_steps=4,
                          checkpoint_every=2, log_every=100)

    first = fit()
    assert first.run_dir == str(tmp_path / "runs" / "job42") and first.steps == 4
    capsys.readouterr()
    again = fit()
    assert again.run_dir == first.run_dir and again.steps == 4
    out = capsys.readouterr()
    assert "ddprun: run job42 finished at step 4 (checkpoint of " in out.out + out.err
    assert "names no run" not in out.err


@pytest.mark.parametrize("run_id", [None, "none"])
def test_under_torchs_agent_without_a_run_id_a_restart_that_starts_anew_is_named(tmp_path, monkeypatch, capsys,
                                                                               run_id):
    from ddprun.runtime import RankInfo
    from ddprun.train.loop import resolve_run_dir

    monkeypatch.chdir(tmp_path)
    info = RankInfo(0, 0, 0, 1, 1, torch.device("cpu"), True)
    environ = {"TORCHELASTIC_MAX_RESTARTS": "3", **({"TORCHELASTIC_RUN_ID": run_id} if run_id else {})}
    assert resolve_run_dir(None, info, environ) != resolve_run_dir(None, info, environ)
    err = capsys.readouterr().err
    assert f"this launch names no run (TORCHELASTIC_RUN_ID={run_id or '(unset)'})" in err
    assert "a restart trains from step 0. HINT: give torchrun --rdzv-id" in err
    assert resolve_run_dir(None, info, {**environ, "TORCHELASTIC_RUN_ID": "../x"}).startswith(str(tmp_path / "runs") + "/")
    # without restarts a fixed id (--rdzv-id=123 in a script) is no run name: every launch starts anew
    fixed = {"TORCHELASTIC_RUN_ID": "123", "TORCHELASTIC_MAX_RESTARTS": "0"}
    assert resolve_run_dir(None, info, fixed) != resolve_run_dir(None, info, fixed)
    assert resolve_run_dir(None, info, {**fixed, "TORCHELASTIC_MAX_RESTARTS": "2"}) == str(tmp_path / "runs" / "123")


def test_skipping_the_batches_a_checkpoint_had_taken_is_progress_for_the_stall_watch(monkeypatch):
    # a resume without fit's sampler loads the taken batches again and drops them: deep into a long
    # epoch that took longer than --stall-timeout with no progress, and the stall watch killed the restart
    from ddprun.telemetry import PROGRESS
    from ddprun.train.loop import _Skipped

    monkeypatch.setattr(PROGRESS, "began", False)
    monkeypatch.setattr(PROGRESS, "phase", "")
    totals = []

    class Batches:
        def __iter__(self):
            for i in range(8):
                totals.append(PROGRESS.total)  # when batch i is asked for
                yield i

    assert list(_Skipped(Batches(), 5)) == [5, 6, 7]
    assert all(later > earlier for earlier, later in zip(totals[:6], totals[1:6]))  # a beat per batch skipped
    assert not PROGRESS.began and PROGRESS.phase == ""  # the first trained batch still has the first-step bound


FEW = dict(optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2), batch_size=8, log_every=100)


def pretrain_then_fine_tune(run_dir, crash_at=None):
    """A script of two fits into one run dir, started from the top as a restarted worker is: the
    fine-tune's result, and the parameters the pretrain ended with."""
    new_process()
    np.random.seed(0)
    pre = ddprun.fit(mlp(), regression(), training_step=stepper(), run_dir=str(run_dir), max_steps=6,
                     checkpoint_every=2, keep_checkpoints=3, **FEW)
    pretrained = params(pre)
    fine = ddprun.fit(pre.model, regression(), training_step=stepper(crash_at), run_dir=str(run_dir), max_steps=4,
                      checkpoint_every=1, **FEW)
    return fine, pretrained


def test_a_fine_tune_after_a_pretrain_keeps_its_own_checkpoints_and_a_restart_resumes_each_fit_its_own(
        tmp_path, capsys):
    # both fits saved step-N.pt in one directory: the fine-tune overwrote the pretrain's step 2 and 4,
    # pruned by step across both, and a restart resumed the pretrain from the fine-tune's step 4
    with pytest.warns(UserWarning, match="fit\\(\\) already ran in this process .* starts anew") as said:
        ref, ref_pre = pretrain_then_fine_tune(tmp_path / "ref")
    assert [w.filename for w in said if "already ran" in str(w.message)] == [__file__.replace(".pyc", ".py")]
    ckdir = tmp_path / "ref" / "checkpoints"
    assert [checkpoint.step_of(p) for p in checkpoint.checkpoints(str(ckdir))] == [6, 4, 2]  # the pretrain's, all
    assert [checkpoint.step_of(p) for p in checkpoint.checkpoints(str(ckdir / "fit-1"))] == [4, 3, 2]
    saved = checkpoint.load(str(ckdir))
    assert saved["step"] == 6 and all(torch.equal(a, b) for a, b in zip(saved["model"].values(), ref_pre))
    capsys.readouterr()

    again, again_pre = pretrain_then_fine_tune(tmp_path / "ref")  # the whole script again: each fit is done
    out = capsys.readouterr().out
    assert f"resuming from {ckdir / 'step-00000006.pt'}: step 6" in out and "finished at step 6" in out
    assert f"resuming from {ckdir / 'fit-1' / 'step-00000004.pt'}: step 4" in out and "finished at step 4" in out
    assert all(torch.equal(a, b) for a, b in zip(ref_pre + params(ref), again_pre + params(again)))

    with pytest.raises(Crash), pytest.warns(UserWarning, match="starts anew"):
        pretrain_then_fine_tune(tmp_path / "c", crash_at=3)  # the fine-tune's checkpoints of steps 1 and 2
    torch.manual_seed(99), np.random.seed(99)
    res, res_pre = pretrain_then_fine_tune(tmp_path / "c")
    assert "resuming from " + str(tmp_path / "c" / "checkpoints" / "fit-1" / "step-00000002.pt") in capsys.readouterr().out
    assert res.steps == 4 and all(torch.equal(a, b) for a, b in zip(ref_pre + params(ref), res_pre + params(res)))


def test_a_run_started_anew_over_an_earlier_ones_checkpoints_moves_them_aside_and_falls_back_to_its_own(
        tmp_path, capsys):
    # resume=False over steps 10/20/30 of an earlier run: its saves of 5/10/15 (keep 3) overwrote that
    # run's step 10 and left [15, 20 (old), 30 (old)]; with 15 damaged, a resume took the old run's 30
    def fit(max_steps, every, **kw):
        new_process()
        return ddprun.fit(mlp(), regression(), loss_fn=nn.functional.mse_loss, run_dir=str(tmp_path),
                          max_steps=max_steps, checkpoint_every=every, keep_checkpoints=3, **FEW, **kw)

    ckdir = tmp_path / "checkpoints"
    fit(30, 10)
    earlier = {p.name: p.read_bytes() for p in ckdir.iterdir() if p.name.startswith("step-") or p.name == "latest"}
    capsys.readouterr()
    fit(15, 5, resume=False)
    assert [checkpoint.step_of(p) for p in checkpoint.checkpoints(str(ckdir))] == [15, 10, 5]
    assert {p.name: p.read_bytes() for p in (ckdir / "previous-1").iterdir()} == earlier  # whole, unchanged
    assert f"the checkpoints of an earlier run in {ckdir} were moved to {ckdir / 'previous-1'}" in capsys.readouterr().out
    newest = ckdir / "step-00000015.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    with pytest.warns(UserWarning, match="using step-00000010.pt instead"):
        res = fit(15, 5)
    assert "resuming from " + str(ckdir / "step-00000010.pt") + ": step 10" in capsys.readouterr().out
    assert res.steps == 15


def test_a_later_fit_of_a_script_whose_first_started_anew_does_not_resume_an_earlier_runs(tmp_path, capsys):
    # the pretrain trains again (resume=False): the fine-tune's checkpoints there are of the run before
    def script():
        new_process()
        for resume in (False, "auto"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the second fit's "starts anew"
                last = ddprun.fit(mlp(), regression(), loss_fn=nn.functional.mse_loss, run_dir=str(tmp_path),
                                  max_steps=2, resume=resume, **FEW)
        return last

    script()
    capsys.readouterr()
    assert script().steps == 2 and "resuming" not in capsys.readouterr().out
    ckdir = tmp_path / "checkpoints"
    assert sorted(os.listdir(ckdir / "previous-1")) == ["fit-1", "latest", "step-00000002.meta.json",
                                                        "step-00000002.pt"]
    assert checkpoint.load(str(ckdir / "previous-1" / "fit-1"))["step"] == 2


def test_a_run_that_cannot_move_an_earlier_runs_checkpoints_aside_fails_before_training_and_loses_none(
        tmp_path, monkeypatch):
    def fit(**kw):
        new_process()
        return ddprun.fit(mlp(), regression(), loss_fn=nn.functional.mse_loss, run_dir=str(tmp_path), max_steps=2,
                          **FEW, **kw)

    fit()
    ckdir = tmp_path / "checkpoints"
    before = {p.name: p.read_bytes() for p in ckdir.iterdir() if p.name.startswith("step-") or p.name == "latest"}

    def refused(src, dst):
        raise PermissionError(13, "Permission denied", src)

    monkeypatch.setattr(os, "rename", refused)
    with pytest.raises(CheckpointError) as err:
        fit(resume=False)
    assert str(err.value).startswith("The checkpoints of an earlier run could not be moved out of this fit's way.")
    assert f"HINT: Move them out of {ckdir} yourself" in str(err.value)
    assert {p.name: p.read_bytes() for p in ckdir.iterdir() if p.name != dirlock.LOCK_NAME} == before  # nor left one


def test_a_restart_that_resumes_from_a_path_keeps_the_runs_own_checkpoints_in_place(tmp_path, capsys):
    """ddprun.ray (Ray's restored checkpoint) and a script with resume=<path> under --max-restarts pass
    the path at every attempt: the run continues, so its own checkpoints stay where pruning keeps them
    to keep_checkpoints, and nothing says it starts anew (a review found each attempt moving them into
    a new previous-<k>/: the disk filled by restarts, and the line said "starts anew")."""
    origin = run(tmp_path / "origin", checkpoint_every=4, epochs=1)
    for _ in range(3):  # three attempts, each resuming from the same path
        run(tmp_path, checkpoint_every=4, keep_checkpoints=2, epochs=2, resume=origin.checkpoint)
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert not [n for n in names if n.startswith("previous-")], names
    assert [n for n in names if n.endswith(".pt")] == ["step-00000012.pt", "step-00000016.pt"], names
    assert "starts anew" not in capsys.readouterr().out
