"""fit_lightning's preemption stop (ddprun/lightning.py ``_PreemptAtStep``): the stop step's
``last.ckpt`` is said to the agents as soon as Lightning wrote it, before the barrier every rank
then waits in, which a peer stopped meanwhile (its node's grace ended) fails."""

import pytest

from ddprun import preempt
from ddprun.telemetry import PROGRESS


class Strategy:
    def __init__(self, peer_stopped: bool):
        self.peer_stopped, self.names = peer_stopped, []

    def barrier(self, name=None):
        self.names.append(name)
        if self.peer_stopped and name == "Trainer.save_checkpoint":  # the peer was stopped after the dump
            raise RuntimeError("[gloo] Connection closed by peer")


class Trainer:
    """Lightning's Trainer.save_checkpoint order (trainer.py): dump, rank 0 writes, then the barrier."""

    global_step = 7
    checkpoint_callbacks: list = []

    def __init__(self, peer_stopped: bool):
        self.strategy = Strategy(peer_stopped)

    def save_checkpoint(self, path):
        self.strategy.barrier("_CheckpointConnector.dump")  # another barrier: the file is not written yet
        with open(path, "wb") as fp:
            fp.write(b"checkpoint")
        self.strategy.barrier("Trainer.save_checkpoint")


@pytest.mark.parametrize("peer_stopped", [True, False], ids=["peer-stopped", "healthy"])
def test_the_stop_steps_last_ckpt_is_published_before_lightnings_barrier(tmp_path, monkeypatch, peer_stopped):
    from ddprun.lightning import _PreemptAtStep

    published = []
    state = preempt.PreemptState(stop_step=PROGRESS.steps, signame="SIGUSR1", requested=True,
                                 publish=published.append)
    monkeypatch.setattr(preempt, "PREEMPT", state)
    trainer = Trainer(peer_stopped)
    with pytest.raises(RuntimeError if peer_stopped else preempt.Preempted) as e:
        _PreemptAtStep(str(tmp_path)).on_train_batch_end(trainer)
    if peer_stopped:
        assert "closed by peer" in str(e.value)
    path = str(tmp_path / "last.ckpt")
    assert [(p[0], p[1], p[2], p[4]) for p in published] == [(state.stop_step, 7, path, "fit")]
    assert trainer.strategy.names == ["_CheckpointConnector.dump", "Trainer.save_checkpoint"]
    assert "barrier" not in vars(trainer.strategy)  # the strategy's own barrier again
