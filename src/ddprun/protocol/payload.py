"""What :func:`ddprun.launch` hands its workers and gets back, as files in a private directory.

The directory (``tempfile.mkdtemp``: mode 0700, on the launching machine, removed afterwards) holds:
  ``payload.pkl``         the function, its arguments and the options, written once by the launcher
  ``result-<rank>.pkl``   a rank's return value (rank 0 only, or every rank with ``return_all``)
  ``result-<rank>.type``  the value's type (``module.QualName``), written first: named by the launcher
                          when the value pickled in the worker but does not load in the launcher (a
                          model still wrapped in DDP needs a process group); the result file is then
                          kept in the run directory, not removed
  ``error-<rank>.pkl``    a rank's exception: type, message, traceback text, and the pickled
                          exception when it pickles
  ``over-<rank>``         empty: the rank is done with the call (returned, raised, or dumped its
                          stacks at the timeout); the ranks at a timeout wait for each other's

Serialization is by value where it matters: with cloudpickle (a dependency of ddprun) a function
defined in ``__main__`` (a notebook, a REPL, ``python -c``), a lambda or a closure travels with its
code and the globals it uses; functions and classes of importable modules travel by reference and
are imported in the worker. Without cloudpickle, plain pickle sends everything by reference, which
only works for functions a worker can import: :func:`check_picklable` says so before anything starts.
Only this process and its own workers read these files: they are the launcher's, never a peer's.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from typing import Any

PAYLOAD = "payload.pkl"


def _pickler():
    try:
        import cloudpickle

        return cloudpickle
    except ImportError:  # pragma: no cover - cloudpickle is a dependency; kept for trimmed installs
        return pickle


def dumps(obj: Any) -> bytes:
    return _pickler().dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return pickle.loads(data)  # cloudpickle's output is ordinary pickle data


def by_reference_only(fn: Any) -> str | None:
    """Why plain pickle cannot send ``fn`` to a worker (None when it can): a function of ``__main__``
    is pickled as ``__main__.<name>``, which in the worker names ddprun's entry module instead."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if module == "__main__":
        return f"{qualname or fn!r} is defined in __main__ (a notebook, a REPL or the script itself)"
    if "<locals>" in qualname or "<lambda>" in qualname:
        return f"{qualname} is a lambda or a nested function"
    return None


def source_file(fn: Any) -> str | None:
    """The file ``fn`` was defined in (its code's co_filename), for :func:`restore_source_file`."""
    code = getattr(fn, "__code__", None)
    return code.co_filename if code is not None else None


def restore_source_file(fn: Any, filename: str | None) -> None:
    """Give a function sent by value its file name back: cloudpickle replaces it with "<dynamic-code>"
    (deterministic payloads), which leaves a worker's traceback without file or source lines."""
    import types

    def fixed(code: types.CodeType) -> types.CodeType:
        consts = tuple(fixed(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
        name = filename if (filename and code.co_filename == "<dynamic-code>") else code.co_filename
        return code.replace(co_filename=name, co_consts=consts)

    if filename and isinstance(fn, types.FunctionType) and fn.__code__.co_filename == "<dynamic-code>":
        fn.__code__ = fixed(fn.__code__)


def write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fp:
        fp.write(data)
    os.replace(tmp, path)


def result_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"result-{rank}.pkl")


def result_type_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"result-{rank}.type")


def type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def error_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"error-{rank}.pkl")


def over_path(directory: str, rank: int) -> str:
    """Exists once rank ``rank`` is done with the call: returned, raised, or dumped its stacks at the
    timeout (worker/fnworker.py)."""
    return os.path.join(directory, f"over-{rank}")


def write_error(directory: str, rank: int, e: BaseException, skip_frames: int = 1) -> None:
    """Record ``e`` for the launcher: its text, its traceback from the user's frame down
    (``skip_frames`` of ddprun's own dropped), and the exception itself when it pickles."""
    tb = e.__traceback__
    for _ in range(skip_frames):
        if tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
    record: dict[str, Any] = {
        "type": type(e).__name__, "message": f"{type(e).__name__}: {e}",
        "traceback": "".join(traceback.format_exception(type(e), e, tb)), "exception": None,
    }
    try:
        data = dumps(e)
        loads(data)  # an exception whose __init__ takes other arguments pickles but does not load
        record["exception"] = data
    except Exception:  # noqa: BLE001 - the text is enough; the object is a bonus
        pass
    try:
        write_atomic(error_path(directory, rank), pickle.dumps(record))
    except OSError as err:
        print(f"ddprun: could not record the error for the launcher: {err}", file=sys.stderr)


def read_error(directory: str, rank: int) -> dict[str, Any] | None:
    """The record :func:`write_error` left for ``rank``, with ``exception`` loaded (or None)."""
    try:
        with open(error_path(directory, rank), "rb") as fp:
            record = pickle.load(fp)
    except (OSError, pickle.UnpicklingError, EOFError):
        return None
    if record.get("exception") is not None:
        try:
            record["exception"] = loads(record["exception"])
        except Exception:  # noqa: BLE001 - e.g. its class is not importable here
            record["exception"] = None
    return record
