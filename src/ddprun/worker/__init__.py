"""What runs in every rank before, beside and after the user's code: the bootstrap
(``python -m ddprun.worker``), the job channel to the agent's store, preflight, the stall monitor,
stacks and hang reports, stragglers, and the exit. Never imports :mod:`ddprun.agent` or
:mod:`ddprun.train`; see docs/ARCHITECTURE.md.
"""
