"""The worker side of :func:`ddprun.launch`: ``python -m ddprun.worker -m ddprun.worker.fnworker DIR``.

ddprun.worker has done what it does for any script (NODE_RANK, the rank's log, the rank table,
preflight, the job monitor, failure records, the hard exit); this module is the "script": it
loads DIR/payload.pkl (:mod:`ddprun.protocol.payload`), runs ``fn(*args, **kwargs)`` and writes the return
value for the launcher (rank 0's, or every rank's with ``return_all``). An exception is recorded
in DIR for the launcher, then raised on, so that ddprun.worker reports it like a script's.

With a timeout, a timer thread ends the rank at the deadline: every thread's stack to the rank's
log, a failure record, exit code 124 once every peer is over too (at most :data:`PEERS_WAIT_S`
later). The deadline is absolute, so restarts do not extend it.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from ddprun.protocol import payload

TIMEOUT_MARK = "ddprun.launch: timeout"


PEERS_WAIT_S = 5.0
"""At the timeout, how long a rank waits (at most) for every peer to be over before it exits: the
first rank to exit gets the others stopped by torch's agent within 0.1 s, and a CPU-starved peer
whose own timer had not fired yet ended without its stacks in its log."""


def _mark_over(directory: str, rank: int) -> None:
    try:
        open(payload.over_path(directory, rank), "w").close()
    except OSError:  # the launcher's directory is gone: the launch has ended already
        pass


def _wait_for_peers(directory: str, world_size: int, bound_s: float) -> None:
    """Until every rank is over (payload.over_path) or ``bound_s`` passed (a peer holding the GIL)."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if all(os.path.exists(payload.over_path(directory, r)) for r in range(world_size)):
            return
        time.sleep(0.05)


def _arm_deadline(deadline: float, timeout_s: float, directory: str, rank: int) -> None:
    """End this process at ``deadline`` (time.time()), whatever its main thread is doing: its stacks
    into its log, then (bounded) once every peer has done the same or ended."""

    def expire() -> None:
        import faulthandler

        from ddprun.protocol.failure import TIMEOUT
        from ddprun.worker.exit import own_record, write_error_file

        msg = f"{TIMEOUT_MARK} of {timeout_s:g} s reached; this rank was still running (stacks in its log)"
        print(f"ddprun: {msg}", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        write_error_file(msg, record=own_record(TIMEOUT, msg, os.environ, 124))
        sys.stdout.flush()
        _mark_over(directory, rank)
        _wait_for_peers(directory, int(os.environ.get("WORLD_SIZE", "1")), PEERS_WAIT_S)
        os._exit(124)

    timer = threading.Timer(max(0.0, deadline - time.time()), expire)
    timer.daemon = True
    timer.start()


def main(directory: str) -> None:
    with open(os.path.join(directory, payload.PAYLOAD), "rb") as fp:
        data = fp.read()
    job = payload.loads(data)  # plain data; fn and its arguments stay bytes until the path is set
    # The launcher's import path: what fn refers to by reference must import here as it did there.
    for entry in reversed(job["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(1, entry)
    rank = int(os.environ.get("RANK", "0"))
    for stale in (payload.error_path(directory, rank), payload.result_path(directory, rank),
                  payload.result_type_path(directory, rank), payload.over_path(directory, rank)):
        if os.path.exists(stale):  # an earlier attempt's (max_restarts): not this one's outcome
            os.unlink(stale)
    if job.get("deadline") is not None:
        _arm_deadline(job["deadline"], job["timeout"], directory, rank)
    try:
        fn, args, kwargs = payload.loads(job["call"])  # may import modules fn refers to by name
        payload.restore_source_file(fn, job.get("source_file"))
        value = fn(*args, **kwargs)
    except BaseException as e:
        if not (isinstance(e, SystemExit) and e.code in (None, 0)):
            payload.write_error(directory, rank, e)
        _mark_over(directory, rank)
        raise
    _mark_over(directory, rank)  # before pickling the value: a peer at the timeout need not wait for it
    if rank == 0 or job["return_all"]:
        try:
            blob = payload.dumps(value)
        except Exception as e:  # noqa: BLE001 - say which value, not only pickle's complaint
            err = TypeError(f"rank {rank}'s return value ({type(value).__name__}) cannot be pickled back to the "
                            f"launcher: {e}. Return plain data (numbers, dicts, CPU tensors), or save it to a "
                            f"file and return the path.")
            payload.write_error(directory, rank, err, skip_frames=0)
            raise err from e
        payload.write_atomic(payload.result_type_path(directory, rank), payload.type_name(value).encode())
        payload.write_atomic(payload.result_path(directory, rank), blob)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m ddprun.worker -m ddprun.worker.fnworker DIR (started by ddprun.launch)")
    main(sys.argv[1])
