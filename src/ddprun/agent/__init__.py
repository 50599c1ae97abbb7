"""The ``ddprun run`` process on each node: torch's elastic agent set up by ddprun (run.py), the
console and rank logs, join progress, the endpoint claim, attempt ids, and ``ddprun.launch``
(fnlaunch.py). Never imports :mod:`ddprun.worker` or :mod:`ddprun.train`; see docs/ARCHITECTURE.md.
"""
