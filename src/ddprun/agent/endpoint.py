"""One job, one endpoint, agent side: is something listening at the endpoint, and is it ours?

The first job to reach a rendezvous store claims it (:func:`ddprun.protocol.store.claim`); another
job (a different run id, or the same run id with a different DDPRUN_JOB_TOKEN) is refused before
it joins the rendezvous or its workers send anything. The store keeps only a digest of the token.
"""

from __future__ import annotations

import socket
from datetime import timedelta

from ddprun.protocol.store import claim, refusal


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether something listens at host:port (a plain connect: refused at once when nothing does)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def claim_endpoint(host: str, port: int, run_id: str, token: str) -> str | None:
    """If a store already answers at the endpoint, claim it for this job; the refusal text if it
    belongs to another job. Nothing listening (this node will host it) costs one refused connect."""
    from torch.distributed import TCPStore

    if not port_open(host, port):
        return None
    try:
        store = TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5))
        other = claim(store, run_id, token)
    except Exception:  # noqa: BLE001 - not a store, or it went away: torch's rendezvous will say
        return None
    return refusal(f"{host}:{port}", other, run_id) if other else None


def free_port(host: str) -> int:
    """A port free on ``host`` now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("localhost",) else "127.0.0.1", 0))
        return s.getsockname()[1]
