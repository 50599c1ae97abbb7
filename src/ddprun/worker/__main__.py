"""``python -m ddprun.worker [-m] TARGET ARGS...``: the command torch's agent starts for every rank."""

from ddprun.worker.bootstrap import main

main()
