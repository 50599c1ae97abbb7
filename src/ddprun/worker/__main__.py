"""``python -m ddprun.worker [-m] TARGET ARGS...``: the command torch's agent starts for every rank.

With DDPRUN_STANDBY_FD set it is a standby that becomes such a worker later (worker/standby.py)."""

import os

from ddprun.protocol.env import STANDBY_FD

if os.environ.get(STANDBY_FD, "").isdigit():
    from ddprun.worker.standby import main as standby

    standby(int(os.environ[STANDBY_FD]))
else:
    from ddprun.worker.bootstrap import main

    main()
