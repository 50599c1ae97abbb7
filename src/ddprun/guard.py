"""One job, one endpoint: the first job to reach a rendezvous store claims it; another job (a
different run id, or the same run id with a different DDPRUN_JOB_TOKEN) is refused before it joins
the rendezvous or its workers send anything. The store keeps only a digest of the token."""

from __future__ import annotations

import hashlib
import socket

OWNER_KEY = "ddprun/endpoint-owner"


def owner_value(run_id: str, token: str) -> str:
    return f"{run_id}:{hashlib.sha256(token.encode()).hexdigest()[:16]}"


def claim(store, run_id: str, token: str) -> str | None:
    """Claim the store for this job; None if it is ours, else the run id of the job that holds it."""
    mine = owner_value(run_id, token)
    current = store.compare_set(OWNER_KEY, "", mine)
    current = current.decode() if isinstance(current, bytes) else str(current)
    if current == mine:
        return None
    return current.rsplit(":", 1)[0] or "?"


def refusal(endpoint: str, other: str, run_id: str) -> str:
    same = other == run_id
    who = (f"another job with the same run id '{run_id}' but a different DDPRUN_JOB_TOKEN" if same
           else f"another job (run id '{other}'; this one is '{run_id}')")
    return (f"ddprun: refused: the rendezvous endpoint {endpoint} is in use by {who}.\n"
            f"HINT: give each job its own --rdzv-endpoint port and --rdzv-id, or wait for the other job to end.")


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether something listens at host:port (a plain connect: refused at once when nothing does)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
