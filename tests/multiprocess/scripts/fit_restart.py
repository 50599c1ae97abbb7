"""ddprun.fit with periodic checkpoints, and a failure injected on the first attempt only.

    python fit_restart.py --out DIR --steps N --checkpoint-every K
        [--kill-rank R --kill-step S]   rank R SIGKILLs itself during step S+1 (after S steps)
        [--raise-rank R --raise-step S] rank R raises instead
        [--kill-node-step S]            local rank 0 of this node kills its agent, its siblings, itself
                                        (only while the job has more than this node)
        [--marker PATH]                 the failure happens only while PATH does not exist (first attempt)
        [--wipe-before-kill]            the killed rank deletes its node's run dir/checkpoints first
        [--timeline PATH]               rank 0 logs each training_step call and optimizer step (benchmarks)
        [--signal-rank R --signal-step S --send-signal NAME --signal-to self|agent|node|tree]
                                        rank R sends SIGNAME during step S+1 to itself, its agent, its
                                        agent and every worker of its node, or every process under the
                                        agent, DataLoader workers included (a preemption; SLURM: tree)
        [--num-workers N]               fit's num_workers: DataLoader worker processes per rank
        [--slow-checkpoint SECONDS]     the checkpoint hook sleeps this long after a non-final checkpoint

Every rank writes DIR/params-<RANK>.pt (final parameters) and DIR/facts-<RANK>.json (world size,
steps, attempt). The model has dropout and every rank its own RNG seed after the model is built, so
a restart that restored the wrong rank's RNG state (or none) gives other parameters.
"""

import argparse
import json
import os
import signal
import time

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import TensorDataset

import ddprun


def data(n=96):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, x[:, :4].sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g))


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 1))


def workers_of(agent: int) -> list[int]:
    """pids of the agent's children (this node's workers, this process included)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == agent:
            out.append(int(pid))
    return out


def kill_node() -> None:
    """SIGKILL this node's agent (our parent), then its other workers, then this process."""
    agent = os.getppid()
    siblings = [pid for pid in workers_of(agent) if pid != os.getpid()]
    for pid in [agent, *siblings]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--checkpoint-every", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--kill-rank", type=int)
    p.add_argument("--kill-step", type=int)
    p.add_argument("--raise-rank", type=int)
    p.add_argument("--raise-step", type=int)
    p.add_argument("--kill-node-step", type=int)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (slows the run for benchmarks)")
    p.add_argument("--marker")
    p.add_argument("--wipe-before-kill", action="store_true",
                   help="the killed rank first deletes its node's checkpoints (a node back with an empty disk)")
    p.add_argument("--signal-rank", type=int)
    p.add_argument("--signal-step", type=int)
    p.add_argument("--send-signal", default="TERM")
    p.add_argument("--signal-to", choices=["self", "agent", "node", "tree"], default="self",
                   help="tree: the agent and every process below it (DataLoader workers too), as SLURM signals a step")
    p.add_argument("--num-workers", type=int, default=None, help="fit's num_workers (DataLoader worker processes)")
    p.add_argument("--slow-checkpoint", type=float, default=0.0)
    p.add_argument("--hold-after-signal", type=float, default=0.0,
                   help="the signalling rank then waits this long in its step: no rank reaches the stop step")
    p.add_argument("--timeline", help="rank 0 appends '<event> <pid> <unix time>' per training_step call and step")
    p.add_argument("--wait-world", type=int, default=0,
                   help="while WORLD_SIZE is below this and --wait-unless does not exist, wait for the restart a "
                        "joining node brings (an elastic round formed before every node arrived)")
    p.add_argument("--wait-unless")
    args = p.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) < args.wait_world and not (
            args.wait_unless and os.path.exists(args.wait_unless)):
        time.sleep(120)  # torch's agent restarts this group when the late node waits to join
        raise SystemExit(f"no node joined within 120 s (WORLD_SIZE {os.environ.get('WORLD_SIZE')})")
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    os.makedirs(args.out, exist_ok=True)
    first = args.marker is None or not os.path.exists(args.marker)

    def fail_now(how: str) -> None:
        if args.marker:
            with open(args.marker, "w") as f:
                f.write(f"{how} rank {rank} at {time.time()}\n")
        if how == "kill":
            if args.wipe_before_kill:
                import shutil

                shutil.rmtree(os.path.join(os.environ["DDPRUN_RUN_DIR"], "checkpoints"))
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "node":
            kill_node()
        raise RuntimeError(f"injected failure on rank {rank}")

    calls = {"n": 0}

    def send_signal() -> None:
        if args.marker:
            with open(args.marker, "w") as f:
                f.write(f"SIG{args.send_signal} from rank {rank} at {time.time()}\n")
        sig = getattr(signal, f"SIG{args.send_signal}")
        agent = os.getppid()
        below = workers_of(agent)
        if args.signal_to == "tree":
            todo = list(below)
            while todo:
                more = workers_of(todo.pop())
                below += more
                todo += more
        targets = {"self": [os.getpid()], "agent": [agent]}.get(args.signal_to, [agent, *below])
        for pid in targets:
            os.kill(pid, sig)

    def mark(event: str) -> None:
        if args.timeline and rank == 0:
            with open(args.timeline, "a") as f:
                f.write(f"{event} {os.getpid()} {time.time():.6f}\n")

    if args.timeline:
        register_optimizer_step_post_hook(lambda *_: mark("step"))

    def training_step(net, batch):
        step = calls["n"]  # grad_accum 1: one call per optimizer step; this call makes step `step + 1`
        calls["n"] += 1
        mark("call")
        if first and rank == args.kill_rank and step == args.kill_step:
            fail_now("kill")
        if first and rank == args.raise_rank and step == args.raise_step:
            fail_now("raise")
        if first and rank == args.signal_rank and step == args.signal_step:
            send_signal()
            time.sleep(args.hold_after_signal)
        several_nodes = int(os.environ.get("WORLD_SIZE", "1")) > int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if first and local_rank == 0 and several_nodes and step == args.kill_node_step:
            fail_now("node")
        if args.step_sleep:
            time.sleep(args.step_sleep)
        x, y = batch
        return nn.functional.mse_loss(net(x), y)

    net = model()
    torch.manual_seed(100 + rank)  # dropout masks differ by rank: the per-rank RNG states matter
    def on_checkpoint(saved):
        if args.slow_checkpoint and not saved.final:
            time.sleep(args.slow_checkpoint)

    res = ddprun.fit(net, data(), training_step=training_step, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                     on_checkpoint=on_checkpoint,
                     scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 5, 0.5), batch_size=args.batch_size,
                     max_steps=args.steps, checkpoint_every=args.checkpoint_every, seed=0, log_every=100,
                     num_workers=args.num_workers)
    torch.save({k: v.detach().cpu() for k, v in res.model.state_dict().items()},
               os.path.join(args.out, f"params-{rank}.pt"))
    with open(os.path.join(args.out, f"facts-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")), "steps": res.steps,
                   "training_step_calls": calls["n"], "attempt": os.environ.get("DDPRUN_ATTEMPT"),
                   "restart_count": os.environ.get("TORCHELASTIC_RESTART_COUNT"), "run_dir": res.run_dir}, f)


if __name__ == "__main__":
    main()
