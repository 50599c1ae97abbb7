"""ddprun.fit of a LightningModule: which checkpoint the ranks resume from (lightning.py _agreed)."""

import pytest


@pytest.mark.parametrize("found, error", [
    (["/ck/fit-1/last.ckpt", "/ck/fit-1/last.ckpt"], None),
    ([None, None], None),
    (["/ck/fit-1/last.ckpt", "/ck/last.ckpt"], "different checkpoints"),
    (["/ck/fit-1/last.ckpt", None], "Only some ranks"),
])
def test_the_ranks_resume_a_lightning_fit_from_one_checkpoint_or_none(monkeypatch, found, error):
    """resume=True in a later fit falls back to the fit before's last.ckpt where its own is missing: a
    rank that sees its own (a shared file system's lag) and one that does not would load different
    states; every rank must name the same file, else a ConfigError on every rank."""
    import types

    import torch.distributed as dist

    from ddprun import lightning as dl
    from ddprun.errors import ConfigError

    def gather(out, mine):
        out[:] = found

    monkeypatch.setattr(dist, "all_gather_object", gather)
    info = types.SimpleNamespace(distributed=True, world_size=2)
    if error is None:
        assert dl._agreed(found[0], info) == found[0]
    else:
        with pytest.raises(ConfigError, match=error):
            dl._agreed(found[0], info)
