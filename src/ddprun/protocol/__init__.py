"""What ``ddprun run``'s agent and its workers agree on; imports nothing of ddprun above :mod:`ddprun.errors`.

env.py (the worker environment) · rundir.py (every file of a run) · store.py (the store key schema)
· failure.py (failure records and their classifier) · defaults.py · atomic.py · payload.py
(``ddprun.launch``'s files). See docs/ARCHITECTURE.md.
"""
