"""Preflight: facts every node publishes after rendezvous, and the checks over all of them.

Each node's local rank 0 publishes :func:`node_facts`; global rank 0 gathers them and runs
:func:`check`, which returns findings: errors stop the job before user code (every node's console
names them), warnings are printed. ``ddprun doctor`` prints the same facts and findings as a table.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import socket
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ddprun.protocol.env import WorkerEnv, device_kind
from ddprun.worker import gpufacts


@dataclass(frozen=True)
class Finding:
    level: str  # "error" or "warning"
    message: str


def file_sha256(path: str | None) -> str:
    if not path or not os.path.isfile(path):
        return ""
    h = hashlib.sha256()
    with open(path, "rb") as fp:
        for chunk in iter(lambda: fp.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _package_hash() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the whole ddprun package
    h = hashlib.sha256()
    for dirpath, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), "rb") as fp:
                    h.update(fp.read())
    return h.hexdigest()[:16]


def _addresses(host: str) -> list[str]:
    try:
        return sorted({str(ai[4][0]) for ai in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})
    except OSError:
        return []


def node_facts(environ: Mapping[str, str], script: str | None) -> dict:
    """What this node publishes (called by its local rank 0 at worker start)."""
    import torch

    from ddprun._version import __version__

    host = socket.gethostname()
    wenv = WorkerEnv.from_environ(environ)
    run_dir = wenv.run_dir if wenv is not None else os.getcwd()
    try:
        free_gb = round(shutil.disk_usage(run_dir).free / 2**30, 1)
    except OSError:
        free_gb = -1.0
    # device_count() asks NVML: no CUDA initialised before the script runs (is_available() would, and
    # then a script's own CUDA_VISIBLE_DEVICES, or CUDA in children it forks, fails on this rank only).
    # A job the launcher put on cpu counts none: NVML also counts GPUs that torch's CUDA cannot use
    # (a CPU build, an old driver), where the launch trains on cpu (cluster/probe.py unused_gpus)
    gpus = 0 if device_kind(environ) == "cpu" else torch.cuda.device_count()
    nccl = ""
    if gpus:
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - a build without NCCL
            nccl = "none"
    return {
        "node_rank": int(environ.get("GROUP_RANK", "0")),
        "host": host,
        "addresses": _addresses(host),
        "nproc": int(environ.get("LOCAL_WORLD_SIZE", "1")),
        "uneven_ok": bool(wenv and wenv.allow_uneven_nodes),
        "gpus": gpus,
        "nnodes": f"{wenv.min_nodes}:{wenv.max_nodes}" if wenv is not None else "",
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "",
        "nccl": nccl,
        "python": platform.python_version(),
        "script_sha": file_sha256(script),
        "ddprun": f"{__version__}+{_package_hash()}",
        "run_id": environ.get("TORCHELASTIC_RUN_ID", ""),
        "free_disk_gb": free_gb,
        # NVML, NCCL settings and plugin, InfiniBand (gpufacts.py); NVML creates no CUDA context
        "gpu": gpufacts.collect(environ, int(environ.get("LOCAL_WORLD_SIZE", "1"))),
    }


def _odd_ones(facts: Sequence[dict], key: str) -> tuple[str, list[dict]] | None:
    """The majority value of ``key`` and the nodes that differ from it (None if all agree)."""
    counts = Counter(str(f.get(key)) for f in facts)
    if len(counts) <= 1:
        return None
    majority = counts.most_common(1)[0][0]
    return majority, [f for f in facts if str(f.get(key)) != majority]


def _name(f: dict) -> str:
    return f"node {f['node_rank']} ({f['host']})"


def check(facts: Sequence[dict], world_size: int) -> list[Finding]:
    """Every inconsistency that breaks or slows DDP, naming the odd node(s) and the values.

    Different process counts are an error unless every node was started with --allow-uneven-nodes
    (fact ``uneven_ok``); the flag on some nodes only is an error of its own."""
    out: list[Finding] = []
    allowed = [f for f in facts if f.get("uneven_ok")]
    if allowed and len(allowed) != len(facts):
        out.append(Finding("error", "--allow-uneven-nodes is given on some nodes only: "
                                    + ", ".join(f"{_name(f)} {'with' if f.get('uneven_ok') else 'without'}"
                                                for f in sorted(facts, key=lambda f: f["node_rank"]))
                                    + ". HINT: use one launch line on every node."))
    if _odd_ones(facts, "nproc") and len(allowed) != len(facts):
        detail = ", ".join(f"{_name(f)} runs {f['nproc']}" for f in sorted(facts, key=lambda f: f["node_rank"]))
        out.append(Finding("error", f"nodes run different numbers of processes: {detail}; "
                                    f"WORLD_SIZE became {world_size}. HINT: give every node the same "
                                    f"--nproc-per-node (or leave it out to use every GPU), or, if the nodes really "
                                    f"have different GPU counts, pass --allow-uneven-nodes on every node."))
    for f in facts:
        if f["gpus"] and f["gpus"] != f["nproc"]:
            idle = f"{f['gpus'] - f['nproc']} GPUs idle" if f["gpus"] > f["nproc"] else "processes share GPUs"
            out.append(Finding("error", f"{_name(f)} has {f['gpus']} GPUs but runs {f['nproc']} processes "
                                        f"({idle}). HINT: leave --nproc-per-node out to use every visible GPU, "
                                        f"or set CUDA_VISIBLE_DEVICES to the GPUs you mean."))
    for key, what in (("torch", "torch"), ("cuda", "CUDA"), ("nccl", "NCCL"), ("nnodes", "--nnodes")):
        odd = _odd_ones(facts, key)
        if odd:
            majority, nodes = odd
            detail = ", ".join(f"{_name(f)} has {f.get(key)!r}" for f in nodes)
            out.append(Finding("error", f"{what} differs between nodes: most have {majority!r}, {detail}. "
                                        f"HINT: use one environment (image/venv) and one launch line on every node."))
    seen = Counter((f["host"], f["node_rank"]) for f in facts)
    for (host, node_rank), n in seen.items():
        if n > 1:
            out.append(Finding("error", f"{n} nodes report the same host and node rank ({host}, node {node_rank}). "
                                        f"HINT: give each node its own --node-rank, or drop --rdzv-backend static."))
    odd = _odd_ones(facts, "script_sha")
    if odd:
        majority, nodes = odd
        out.append(Finding("warning", "the training script differs between nodes: "
                                      + ", ".join(_name(f) for f in nodes) + " have another version than the rest."))
    for key in ("python",):
        odd = _odd_ones(facts, key)
        if odd:
            out.append(Finding("warning", f"Python versions differ: {', '.join(_name(f) + ' ' + f[key] for f in facts)}"))
    for f in facts:
        if 0 <= f.get("free_disk_gb", -1) < 1:
            out.append(Finding("warning", f"{_name(f)} has {f['free_disk_gb']} GB free in the run directory."))
    out.extend(Finding(level, message) for level, message in gpufacts.check(facts))
    return out


def render_facts(facts: Sequence[dict], findings: Sequence[Finding]) -> str:
    from ddprun.ranktable import render_table

    cols = ("node_rank", "host", "nproc", "gpus", "torch", "cuda", "nccl", "python", "script_sha", "free_disk_gb")
    text = render_table(sorted(facts, key=lambda f: f["node_rank"]), cols, "ddprun preflight: node facts")
    text += "".join(gpufacts.summary(f) + "\n" for f in sorted(facts, key=lambda f: f["node_rank"]) if "gpu" in f)
    if findings:
        text += "\n".join(f"preflight {f.level}: {f.message}" for f in findings) + "\n"
    else:
        text += "preflight: every check passed\n"
    return text


# -- the preflight protocol over the job channel (worker/channel.py) ------------------------------
def announce(ch: Any) -> None:
    """Publish this rank's row (and, on a node's local rank 0, the node's facts); rank 0 then checks."""
    from ddprun.protocol import failure as fr
    from ddprun.worker.exit import record

    if ch.store.add(ch.keys.rank_count(ch.rank), 1) > 1:
        msg = (f"preflight: global rank {ch.rank} was started twice (this one on {ch.host}, node rank "
               f"{ch.node_rank}): two nodes share a node rank. HINT: give each node its own --node-rank, "
               f"or use c10d rendezvous (the default), which numbers nodes itself.")
        print(f"ddprun: {msg}", file=sys.stderr, flush=True)
        record(ch.me(fr.PREFLIGHT, msg), ch)
        raise SystemExit(1)
    ch.store.set(ch.keys.rank(ch.rank), json.dumps(ch.row()))
    ch.store.set(ch.keys.progress(ch.rank), "0")
    if ch.local_rank == 0:
        ch.store.set(ch.keys.node(ch.rank), json.dumps(node_facts(ch.environ, ch.script)))
    if ch.rank == 0:
        run_checks(ch)


def await_verdict(ch: Any) -> None:
    """Wait for rank 0's verdict; a rank other than 0 that reads an error stops, naming its cause."""
    from ddprun.protocol import failure as fr
    from ddprun.worker.exit import record, stopped_message

    bound = start_bound(ch.wenv) + 10
    if not ch.await_key(ch.keys.preflight, bound):
        print(f"ddprun: rank 0's preflight verdict did not come within {bound:.0f} s; going on without it",
              file=sys.stderr)
        return
    verdict = ch.store.get(ch.keys.preflight).decode(errors="replace")
    if verdict != "ok" and ch.rank != 0:
        cause = ch.cause() or fr.FailureRecord(fr.PREFLIGHT, 0, verdict, 0, "?")
        msg = stopped_message(cause, ch)
        print(msg, file=sys.stderr, flush=True)
        record(ch.stopped(cause), ch, message=msg)
        ch.ack_failure()
        raise SystemExit(1)


def start_bound(wenv: WorkerEnv) -> float:
    """How long rank 0 waits for every rank to start (s): as long as the process group's init may
    take (every node's workers import and start; thousands of cold imports from a shared file system
    take minutes), and at least the join timeout. A rank that died meanwhile is named by its agent
    within seconds: this bound only ends the wait for one alive but not starting."""
    from ddprun.protocol import defaults

    return max(wenv.join_timeout, defaults.INIT_TIMEOUT_S)


def _rows(ch: Any, timeout: float, say_every_s: float = 30.0) -> list[dict]:
    """Every rank's row, waiting at most ``timeout``; every ``say_every_s`` a line naming the ranks
    not started yet."""
    import time

    from ddprun.protocol.store import present

    keys = [ch.keys.rank(r) for r in range(ch.world_size)]
    t0 = time.monotonic()
    while not ch.wait_for(keys, min(say_every_s, max(0.0, timeout - (time.monotonic() - t0)))):
        waited = time.monotonic() - t0
        if waited >= timeout:
            break
        started = set(present(ch.store, keys))
        missing = [r for r, k in enumerate(keys) if k not in started]
        shown = ", ".join(map(str, missing[:16])) + (f" and {len(missing) - 16} more" if len(missing) > 16 else "")
        print(f"ddprun: preflight: rank(s) {shown} not started yet after {waited:.0f} s; waiting up to "
              f"{timeout:.0f} s", file=sys.stderr, flush=True)
    return list(ch.gather(keys, 0).values())


def run_checks(ch: Any) -> None:
    """Rank 0: gather every row and node's facts, print the rank table, check, publish the verdict."""
    from ddprun.protocol import failure as fr
    from ddprun.protocol.atomic import write_json_atomic
    from ddprun.protocol.rundir import RunDir
    from ddprun.ranktable import print_rank_table, write_plan_json
    from ddprun.worker.exit import record

    timeout = start_bound(ch.wenv)
    rows = _rows(ch, timeout)
    ch.hosts = {r["rank"]: r["host"] for r in rows}
    print_rank_table(rows, ch.world_size)
    rundir = RunDir(ch.run_dir)
    write_plan_json(ch.run_dir, rows, ch.world_size)
    missing = sorted(set(range(ch.world_size)) - {r["rank"] for r in rows})
    heads = [r["rank"] for r in rows if r["local_rank"] == 0]
    facts = list(ch.gather((ch.keys.node(r) for r in heads), timeout).values())
    findings = check(facts, ch.world_size)
    errors = [f for f in findings if f.level == "error"]
    if missing:
        errors.append(Finding("error", f"ranks {missing} did not start within {timeout:.0f} s"))
    if ch.wenv.doctor or findings or missing:
        sys.stdout.write(render_facts(facts, findings))
        sys.stdout.flush()
    try:
        write_json_atomic(rundir.preflight_json, {"nodes": facts, "findings": [f.__dict__ for f in findings]})
    except OSError as e:
        print(f"ddprun: could not write {rundir.preflight_json}: {e}", file=sys.stderr)
    if errors:
        summary = "preflight: " + " | ".join(f.message.split(" HINT:")[0] for f in errors)
        ch.store.set(ch.keys.preflight, summary)
        print(f"ddprun: {summary}", file=sys.stderr, flush=True)
        record(ch.me(fr.PREFLIGHT, summary), ch)
        raise SystemExit(1)
    ch.store.set(ch.keys.preflight, "ok")
