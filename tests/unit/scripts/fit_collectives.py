"""One rank of ddprun.fit with every torch.distributed collective that Python issues counted, keyed by
the optimizer step they came before (tests/unit/test_fit_collectives.py), written to OUT/rank-N.json.

    fit_collectives.py RUN_DIR CHECKPOINT_EVERY OUT GRAD_ACCUM [hook]

``hook``: with an on_checkpoint callback. Also recorded per step: whether collectives use the
training timeout (ddprun.runtime) after it; and how often DDP's ``no_sync`` was entered.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

import ddprun
from ddprun import runtime

NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
         "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor",
         "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single", "send",
         "recv", "isend", "irecv", "batch_isend_irecv")
calls: list[str] = []
after_step: list[int] = []
tight: list[bool] = []


def counted(name, fn):
    def call(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)
    return call


for name in NAMES:
    if hasattr(dist, name):
        setattr(dist, name, counted(name, getattr(dist, name)))
no_syncs: list[int] = []
_no_sync = DistributedDataParallel.no_sync


def no_sync(self):
    no_syncs.append(len(after_step))  # the optimizer steps done before it
    return _no_sync(self)


DistributedDataParallel.no_sync = no_sync


def optimizer(params):
    opt = torch.optim.SGD(params, lr=0.05)
    opt.register_step_post_hook(lambda *_: after_step.append(len(calls)) or tight.append(runtime._state.tightened))
    return opt


x = torch.randn(1024, 8, generator=torch.Generator().manual_seed(0))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
res = ddprun.fit(model, TensorDataset(x, x[:, :1]), loss_fn=nn.functional.mse_loss, batch_size=8, max_steps=30,
                 log_every=5, checkpoint_every=int(sys.argv[2]), optimizer=optimizer, run_dir=sys.argv[1], resume=False,
                 grad_accum=int(sys.argv[4]), on_checkpoint=(lambda saved: None) if sys.argv[5:] == ["hook"] else None)
between = {i + 2: calls[a:b] for i, (a, b) in enumerate(zip(after_step, after_step[1:])) if b > a}
with open(f"{sys.argv[3]}/rank-{dist.get_rank()}.json", "w") as out:
    json.dump({"world": dist.get_world_size(), "steps": res.steps, "model": type(res.model).__name__,
               "params": [p.sum().item() for p in res.model.parameters()],
               "before_step": between, "loose_at": [i + 1 for i, t in enumerate(tight) if not t],
               "no_sync_before_step": [n + 1 for n in no_syncs]}, out)
