"""One rank of a two-process gloo group started by ddprun.init(); ``--stuck`` makes this rank's
first collective never run (as when its transport is blocked), so its peer's stays unanswered."""

import atexit
import sys
import time

import torch.distributed as dist

import ddprun
from ddprun import firstcollective

# registered before init's own handler, so it runs after it (atexit is last in, first out)
atexit.register(lambda: print(f"group alive at exit: {dist.is_initialized()}", flush=True))

if "--stuck" in sys.argv:
    firstcollective._all_reduce = lambda device: time.sleep(60)
try:
    info = ddprun.init(timeout=30)
except Exception as e:  # noqa: BLE001 - the test reads the message
    print(f"{type(e).__name__}: {e}", flush=True)
    sys.exit(3)
print(f"rank {info.rank} ok", flush=True)
