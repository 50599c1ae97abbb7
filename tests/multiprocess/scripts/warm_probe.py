"""What a worker is, seen from its first line: pid, command line, environment, what was imported.

    warm_probe.py OUT_DIR   (writes OUT_DIR/rank-<RANK>.json)
"""

import json
import os
import sys

imported_first = {m: m in sys.modules for m in ("torch", "torch._dynamo")}
print(f"probe stdout rank {os.environ['RANK']}", flush=True)
print(f"probe stderr rank {os.environ['RANK']}", file=sys.stderr, flush=True)
with open(f"/proc/{os.getpid()}/cmdline", "rb") as f:
    cmdline = [a.decode() for a in f.read().split(b"\0") if a]
facts = {"pid": os.getpid(), "ppid": os.getppid(), "cmdline": cmdline, "argv": sys.argv, "cwd": os.getcwd(),
         "imported_first": imported_first, "env": dict(os.environ)}
with open(os.path.join(sys.argv[1], f"rank-{os.environ['RANK']}.json"), "w") as f:
    json.dump(facts, f)
