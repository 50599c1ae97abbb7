"""The CUDA path end to end on one GPU, with a JSON summary (scripts/gpu-check.sh runs it).

    python scripts/gpu_check.py --out gpu-check.json            # on a GPU machine, < 10 min
    python scripts/gpu_check.py --dry-run --out gpu-check.json  # anywhere: CUDA steps skipped, with the reason

Steps: NVML facts, ``ddprun doctor``, ``ddprun run --nproc-per-node 1`` with ddprun.fit in
fp32/bf16/fp16 (loss falls, the checkpoint loads with weights_only), the Lightning path, a refused
``--nproc-per-node 2`` on a one-GPU machine (ddprun's message, not NCCL's "Duplicate GPU detected"),
a Flight Recorder dump of an NCCL group, and ddprun.fit's step time against a hand-written loop.
Each step is {"name", "status": pass|fail|skipped, "detail", "seconds"}; the exit code is 1 if any failed.
``--worker KIND`` is the part that runs inside a launched process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
STEP_TIMEOUT_S = 180  # every launched step is bounded; the whole script stays under 10 minutes
DDPRUN = [sys.executable, "-m", "ddprun"]


def _launch(argv: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=STEP_TIMEOUT_S,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _tail(p: subprocess.CompletedProcess, n: int = 6) -> str:
    return " | ".join((p.stdout + p.stderr).strip().splitlines()[-n:])


# -- steps that run in the driver ------------------------------------------------------------------

def step_nvml(work: Path) -> tuple[str, str]:
    from ddprun.worker import gpufacts

    g = gpufacts.collect(os.environ, 1)
    if g.get("nvml") != "ok":
        return "skipped", f"nvml: {g.get('nvml')}"
    return "pass", json.dumps({k: g[k] for k in ("driver", "cuda_driver", "visible", "ranks")})


def step_doctor(work: Path) -> tuple[str, str]:
    p = _launch([*DDPRUN, "doctor", "--nnodes", "1", "--nproc-per-node", "1"], work)
    ok = p.returncode == 0 and "ddprun preflight: node facts" in p.stdout
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(("preflight", "node "))]
    return ("pass" if ok else "fail"), " | ".join(lines) if ok else _tail(p)


def step_fit(work: Path, precision: str) -> tuple[str, str]:
    out = work / f"fit-{precision}.json"
    p = _launch([*DDPRUN, "run", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-id", f"fit{precision}",
                 str(HERE), "--worker", "fit", "--precision", precision, "--result", str(out)], work)
    if p.returncode != 0 or not out.exists():
        return "fail", f"exit {p.returncode}: {_tail(p)}"
    r = json.loads(out.read_text())
    ok = r["device"].startswith("cuda") and r["last_loss"] < r["first_loss"] and r["checkpoint_loaded"]
    return ("pass" if ok else "fail"), json.dumps(r)


def step_lightning(work: Path) -> tuple[str, str]:
    try:
        import lightning  # noqa: F401
    except ImportError:
        return "skipped", "lightning is not installed (pip install 'ddprun[lightning]')"
    out = work / "lightning.json"
    p = _launch([*DDPRUN, "run", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-id", "lit",
                 str(HERE), "--worker", "lightning", "--result", str(out)], work)
    ok = p.returncode == 0 and out.exists() and json.loads(out.read_text())["device"].startswith("cuda")
    return ("pass" if ok else "fail"), out.read_text() if out.exists() else _tail(p)


def step_refused_two(work: Path) -> tuple[str, str]:
    import torch

    if torch.cuda.device_count() != 1:
        return "skipped", f"needs exactly one GPU ({torch.cuda.device_count()} visible)"
    p = _launch([*DDPRUN, "run", "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-id", "two",
                 str(HERE), "--worker", "fit", "--precision", "32", "--result", str(work / "two.json")], work)
    text = p.stdout + p.stderr
    ok = p.returncode != 0 and "Duplicate GPU detected" not in text and "has 1 GPUs but runs 2 processes" in text
    return ("pass" if ok else "fail"), _tail(p, 3)


def step_short_uuid(work: Path) -> tuple[str, str]:
    """CUDA_VISIBLE_DEVICES as a shortened GPU UUID (CUDA accepts a unique prefix): preflight must pass."""
    from ddprun.worker import gpufacts

    g = gpufacts.collect(os.environ, 1)
    if g.get("nvml") != "ok" or not g.get("ranks"):
        return "skipped", f"nvml: {g.get('nvml')}"
    prefix = str(g["ranks"][0]["uuid"])[:12]
    out = work / "short-uuid.json"
    p = _launch([*DDPRUN, "run", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-id", "shortuuid",
                 str(HERE), "--worker", "fit", "--precision", "32", "--result", str(out)], work,
                env={"CUDA_VISIBLE_DEVICES": prefix})
    ok = p.returncode == 0 and out.exists() and json.loads(out.read_text())["device"].startswith("cuda")
    return ("pass" if ok else "fail"), f"CUDA_VISIBLE_DEVICES={prefix}: " + (out.read_text() if ok else _tail(p))


def step_one_gpu_two_ranks(work: Path) -> tuple[str, str]:
    """Two ranks an mpirun wrapper both gave CUDA_VISIBLE_DEVICES=0: each names the shared GPU (a
    ClusterError), not NCCL's bare 'invalid usage', and neither hangs."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "0", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "DDPRUN_FIRST_COLLECTIVE_TIMEOUT": "20"}
        env.pop("TORCHELASTIC_RUN_ID", None)
        procs.append(subprocess.Popen([sys.executable, str(HERE), "--worker", "init"], cwd=work, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    texts = [p.communicate(timeout=STEP_TIMEOUT_S)[0] for p in procs]
    named = ["Two ranks of this job were given the same GPU" in t for t in texts]
    ok = all(p.returncode != 0 for p in procs) and any(named)
    return ("pass" if ok else "fail"), f"named on ranks {[r for r in (0, 1) if named[r]]}; " + \
        " | ".join(t.strip().splitlines()[-1] if t.strip() else "" for t in texts)


def step_flight_recorder(work: Path) -> tuple[str, str]:
    out = work / "fr.json"
    p = _launch([sys.executable, str(HERE), "--worker", "fr", "--result", str(out)], work,
                env={"TORCH_FR_BUFFER_SIZE": "2000"})
    if p.returncode != 0 or not out.exists():
        return "fail", f"exit {p.returncode}: {_tail(p)}"
    names = json.loads(out.read_text())["collectives"]
    return ("pass" if any("allreduce" in n.lower().replace("_", "") for n in names) else "fail"), ", ".join(names)


def step_overhead(work: Path) -> tuple[str, str]:
    out = work / "overhead.json"
    p = _launch([sys.executable, str(HERE), "--worker", "overhead", "--result", str(out)], work)
    if p.returncode != 0 or not out.exists():
        return "fail", f"exit {p.returncode}: {_tail(p)}"
    r = json.loads(out.read_text())
    return "pass", (f"ddprun.fit {r['fit_ms']:.3f} ms/step (a 1,200-step fit less a 300-step one) vs hand-written "
                    f"{r['raw_ms']:.3f} ms/step ({r['ratio']:.3f}x)")


STEPS = [("nvml facts", step_nvml, False), ("ddprun doctor", step_doctor, False),
         *[(f"fit {p}", lambda w, p=p: step_fit(w, p), True) for p in ("32", "bf16", "16")],
         ("lightning on one GPU", step_lightning, True), ("refused --nproc-per-node 2 on one GPU", step_refused_two, True),
         ("shortened GPU UUID in CUDA_VISIBLE_DEVICES", step_short_uuid, True),
         ("two ranks given one GPU are named", step_one_gpu_two_ranks, True),
         ("flight recorder dump of an NCCL group", step_flight_recorder, True),
         ("step overhead: fit vs hand-written loop", step_overhead, True)]
"""(name, function, needs CUDA)."""


def run_steps(work: Path, dry_run: bool, cuda: bool) -> list[dict]:
    """Every step's result; a CUDA step is skipped with the reason in a dry run or without CUDA."""
    results = []
    for name, fn, needs_cuda in STEPS:
        t0 = time.monotonic()
        if needs_cuda and (dry_run or not cuda):
            status, detail = "skipped", "dry run: needs CUDA" if dry_run else "no CUDA device visible"
        else:
            try:
                status, detail = fn(work)
            except Exception as e:  # noqa: BLE001 - one failing step must not hide the others
                status, detail = "fail", f"{type(e).__name__}: {e}"
        results.append({"name": name, "status": status, "detail": detail,
                        "seconds": round(time.monotonic() - t0, 2)})
        print(f"gpu-check: {status:7} {name}: {detail[:200]}", flush=True)
    return results


# -- workers: run inside a launched process ---------------------------------------------------------

def _data(n: int = 4096):
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    return TensorDataset(x, (x[:, :4].sum(1) > 0).long())


def worker_fit(precision: str, result: str) -> None:
    import torch
    from torch import nn

    import ddprun

    losses = []

    def training_step(m, batch):
        loss = nn.functional.cross_entropy(m(batch[0]), batch[1])
        losses.append(float(loss.detach()))
        return loss

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))
    r = ddprun.fit(model, _data(), training_step=training_step, max_steps=200, batch_size=64, precision=precision,
                   optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    info = ddprun.rank_info()
    loaded = False
    if r.checkpoint:
        loaded = isinstance(torch.load(r.checkpoint, weights_only=True, map_location="cpu"), dict)
    if info.is_main:
        Path(result).write_text(json.dumps({"device": str(info.device), "first_loss": sum(losses[:10]) / 10,
                                            "last_loss": sum(losses[-10:]) / 10, "checkpoint_loaded": loaded}))


def worker_lightning(result: str) -> None:
    import lightning.pytorch as pl
    import torch
    from torch import nn

    import ddprun

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))

        def training_step(self, batch, _):
            self.seen_device = str(self.device)
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    lit = Lit()
    ddprun.fit(lit, _data(), max_steps=50, batch_size=64)
    if ddprun.rank_info().is_main:
        Path(result).write_text(json.dumps({"device": getattr(lit, "seen_device", "none")}))


def worker_init() -> None:
    """ddprun.init() and one all_reduce, as a script an mpirun wrapper starts would do."""
    import torch
    import torch.distributed as dist

    import ddprun

    info = ddprun.init()
    dist.all_reduce(torch.ones(1, device=info.device))
    print(f"rank {info.rank} on {info.device}: all_reduce done", flush=True)


def worker_fr(result: str) -> None:
    """An NCCL group of one with the Flight Recorder on (TORCH_FR_BUFFER_SIZE), one all_reduce, the dump."""
    import socket

    import torch
    import torch.distributed as dist

    from ddprun.worker.collectives import last_collectives

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    dist.all_reduce(torch.ones(4, device="cuda"))
    torch.cuda.synchronize()
    last = last_collectives() or []  # ddprun's reader of the recorder, as a hang report uses it
    Path(result).write_text(json.dumps({"collectives": [c["op"] for c in last]}))
    dist.destroy_process_group()


def _timed(steps: int, one_step) -> float:
    import torch

    for _ in range(20):  # warm-up: kernels, allocator
        one_step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        one_step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1000


def worker_overhead(result: str) -> None:
    """ms per step of ddprun.fit and of a hand-written loop, same model, data and GPU, one process."""
    import torch
    from torch import nn

    import ddprun

    data, steps = _data(64 * 400), 300  # 4 x 300 steps of 64: less than 3 epochs
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 2)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = iter(torch.utils.data.DataLoader(data, batch_size=64, shuffle=True))

    def raw_step():
        x, y = next(batches)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x.cuda(non_blocking=True)), y.cuda(non_blocking=True)).backward()
        opt.step()

    raw_ms = _timed(steps, raw_step)

    def fit_s(n: int) -> float:
        t0 = time.perf_counter()
        ddprun.fit(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 2)), data,
                   loss_fn=nn.functional.cross_entropy, max_steps=n, batch_size=64,
                   optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    fit_s(20)  # the first fit in a process pays its one-time set-up (imports, the process group)
    # fit's own set-up and its final checkpoint cost the same in both: the difference is steps alone
    fit_ms = (fit_s(4 * steps) - fit_s(steps)) / (3 * steps) * 1000
    Path(result).write_text(json.dumps({"raw_ms": raw_ms, "fit_ms": fit_ms, "ratio": fit_ms / raw_ms}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="skip every step that needs CUDA, with the reason")
    ap.add_argument("--out", default="gpu-check.json", help="where the JSON summary goes")
    ap.add_argument("--workdir", default=None, help="run directory of the steps (default: beside --out)")
    ap.add_argument("--worker", choices=("fit", "lightning", "fr", "overhead", "init"), help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="32", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        {"fit": lambda: worker_fit(args.precision, args.result), "lightning": lambda: worker_lightning(args.result),
         "fr": lambda: worker_fr(args.result), "overhead": lambda: worker_overhead(args.result),
         "init": worker_init}[args.worker]()
        return 0
    import torch

    out = Path(args.out).resolve()
    work = Path(args.workdir).resolve() if args.workdir else out.parent / "gpu-check-work"
    work.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    t0 = time.monotonic()
    steps = run_steps(work, args.dry_run, cuda)
    summary = {"dry_run": args.dry_run, "cuda": cuda, "torch": torch.__version__, "seconds": round(time.monotonic() - t0, 1),
               "passed": sum(s["status"] == "pass" for s in steps), "failed": sum(s["status"] == "fail" for s in steps),
               "skipped": sum(s["status"] == "skipped" for s in steps), "steps": steps}
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"gpu-check: {summary['passed']} passed, {summary['failed']} failed, {summary['skipped']} skipped; {out}")
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
