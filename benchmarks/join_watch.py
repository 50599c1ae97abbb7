"""Join progress at scale: many nodes waiting in one rendezvous, against the endpoint's one store.

    python benchmarks/join_watch.py [--nodes 16,64,256,1024] [--procs 2] [--seconds 9]

While a job forms, every node's agent runs a join watcher (agent/joinwatch.py): it beats in the
endpoint's store, checks that the job's round did not leave it out, and prints a progress line every
3 s from every waiting node's entry. That store also serves torch's rendezvous, and at 1,000 nodes
every node waits at once, so what the watchers cost it must not grow with the count of nodes.

Each simulated node here is the real JoinWatcher, its thread and its own client of one TCPStore (the
agent's own server, agent/endpoint.py, in a process of its own), as threads of ``--procs`` processes.
Every call to the store is counted (one call = one round trip; multi_get is one) and so are the keys
the batched reads return. Measured over ``--seconds`` after every watcher's first line was due.

Printed per N nodes: store calls per second in all and per node, keys read per second, and the
lines a node printed per interval (1.00: the watchers kept their schedule; fewer: the simulation or
the store fell behind, and the rates are what it managed, not what the nodes asked for).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from benchmarks.control_plane import SERVER, Counted, Ops, answer  # noqa: E402 - after the paths

INTERVAL_S = 3.0
"""The watchers' line interval (protocol/defaults.py JOIN_PROGRESS_S)."""


def child_main(args: argparse.Namespace) -> int:
    """Watchers ``first .. last-1`` of ``n``: connects them, says ``ready``, starts them at ``go`` on
    stdin, and answers one JSON line of counts over the measured window."""
    from ddprun.agent import admission
    from ddprun.agent.joinwatch import JoinWatcher

    counts, reconnects = Ops(), Ops()
    connect = admission.client

    def counted_connect(*a, **kw):  # a watcher reconnects only after a failed call: there should be none
        reconnects.n += 1
        return Counted(connect(*a, **kw), counts)

    me = admission.Newcomer(f"127.0.0.1:{args.port}", "ddprun", "", False, "p")
    nodes = range(args.first, args.last)
    with ThreadPoolExecutor(64) as pool:  # connecting is a start-up cost (the resolver holds some connects 5 s)
        clients = list(pool.map(lambda _: connect("127.0.0.1", args.port, timeout_s=30.0), nodes))
    admission.client = counted_connect
    watchers, outs = [], []
    for node, store in zip(nodes, clients):
        out = io.StringIO()
        w = JoinWatcher("127.0.0.1", args.port, "ddprun", me, args.n, 3600, out, (f"node-{node}", 10_000 + node),
                        interval_s=INTERVAL_S, hosted=node == 0 and not args.no_host)
        w._store = Counted(store, counts)  # connected before the start
        watchers.append(w)
        outs.append(out)
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.monotonic()
    for w in watchers:
        w.start()
    time.sleep(max(0.0, t0 + INTERVAL_S + 0.5 - time.monotonic()))  # every watcher announced and read once
    calls, keys, lines = counts.n, counts.keys, sum(len(o.getvalue().splitlines()) for o in outs)
    t1 = time.monotonic()
    time.sleep(args.seconds)
    t2 = time.monotonic()
    result = {"calls": counts.n - calls, "keys": counts.keys - keys, "s": t2 - t1,
              "lines": sum(len(o.getvalue().splitlines()) for o in outs) - lines, "reconnects": reconnects.n}
    print(json.dumps(result), flush=True)
    os._exit(0)  # the watchers' threads and clients go with the process


def one_size(n: int, procs: int, seconds: float, no_host: bool) -> dict:
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    children: list[subprocess.Popen] = []
    try:
        port = int(answer(server, "the store server's start"))
        cuts = [n * i // procs for i in range(procs + 1)]
        for a, b in zip(cuts, cuts[1:]):
            if a < b:
                children.append(subprocess.Popen(
                    [sys.executable, __file__, "--child", "--n", str(n), "--port", str(port), "--first", str(a),
                     "--last", str(b), "--seconds", str(seconds), *(["--no-host"] if no_host else [])],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for c in children:
            if answer(c, "its connects").strip() != "ready":
                raise RuntimeError(f"a simulation process ended while connecting (exit {c.wait()})")
        for c in children:  # every watcher starts at once, as the nodes of a job started by one scheduler
            c.stdin.write("go\n")
            c.stdin.flush()
        results = [json.loads(answer(c, "its counts") or "{}") for c in children]
    finally:
        for p in (*children, server):
            if p.poll() is None:
                p.kill()
            p.wait()
    s = max(r["s"] for r in results)
    calls, keys, lines, again = (sum(r[k] for r in results) for k in ("calls", "keys", "lines", "reconnects"))
    return {"calls_s": calls / s, "calls_node_s": calls / s / n, "keys_s": keys / s,
            "lines_per_interval": lines / n / (s / INTERVAL_S), "reconnects": again}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="16,64,256,1024", help="simulated node counts")
    p.add_argument("--procs", type=int, default=2, help="simulation processes")
    p.add_argument("--seconds", type=float, default=9.0, help="seconds measured per count")
    p.add_argument("--no-host", action="store_true", help="no watcher is the store's host's (none publishes the "
                   "summary: every node reads every entry, as where the store's host is no node of the job)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--n", "--port", "--first", "--last"):
        p.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    sizes = [int(x) for x in args.nodes.split(",")]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 2 * max(sizes) + 4096)), hard))
    if args.child:
        return child_main(args)
    who = "no node hosts the store: every node reads every entry" if args.no_host else "node 0 hosts the store"
    print(f"# {who}; {args.procs} simulation processes; a line every {INTERVAL_S:g} s; {args.seconds:g} s measured "
          "per count", flush=True)
    print(f"{'nodes':>6} {'calls/s':>9} {'/node':>7} {'keys read/s':>11} {'lines/interval':>14} {'reconnects':>10}",
          flush=True)
    for n in sizes:
        r = one_size(n, min(args.procs, n), args.seconds, args.no_host)
        print(f"{n:>6} {r['calls_s']:>9.0f} {r['calls_node_s']:>7.2f} {r['keys_s']:>11.0f} "
              f"{r['lines_per_interval']:>14.2f} {r['reconnects']:>10}", flush=True)
    print("lines/interval: 1.00 when every watcher kept its schedule; fewer, the simulation or the store fell "
          "behind and the rates are what it managed", flush=True)
    return 0


if __name__ == "__main__":
    threading.stack_size(512 * 1024)  # a thousand watcher threads: their stacks, not the default 8 MiB each
    sys.exit(main())
