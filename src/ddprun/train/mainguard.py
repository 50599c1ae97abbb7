"""Whether a DataLoader worker that fit starts would run the user's script again.

fit starts DataLoader workers by forkserver (spawn where there is none), since forking a process that
holds the process group's threads is unsafe (train/data.py). Such a worker imports the main module
(as ``__mp_main__``) before it unpickles the dataset, so a script whose top-level code calls
``ddprun.fit`` outside ``if __name__ == "__main__":`` would run again in every worker: its model, its
data, fit. There fit's own workers fail ("An attempt has been made to start a new process before
the current process has finished its bootstrapping phase"), which the rank sees only as "DataLoader
worker (pid(s) N) exited unexpectedly". torch's default start method, fork, imports nothing, which
is why such a script works under torchrun.

multiprocessing re-imports neither a package's ``__main__`` (``python -m pkg``) nor IPython's
launcher, and a notebook or ``python -c`` has no file to re-import: none of these is unguarded.
"""

from __future__ import annotations

import ast
import os
import sys
from dataclasses import dataclass
from types import FrameType


@dataclass(frozen=True)
class Unguarded:
    """The main module's top-level statement, running now, that a re-import would run again."""

    path: str
    line: int

    def where(self) -> str:
        return f"{self.path}, line {self.line}"


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either side, possibly inside an ``and``)."""
    for node in ast.walk(test):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
            sides = [node.left, *node.comparators]
            names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
            consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
            if names and consts:
                return True
    return False


def _covers(stmts: list[ast.stmt], line: int) -> ast.stmt | None:
    return next((s for s in stmts if s.lineno <= line <= (s.end_lineno or s.lineno)), None)


def guarded(source: str, line: int) -> bool:
    """Whether ``line`` of a module's ``source`` runs only when ``__name__ == "__main__"``: inside the
    body of such an ``if``, at any depth of compound statements (pure). Unparsable source: True
    (nothing is known, so nothing is changed)."""
    try:
        stmts: list[ast.stmt] = ast.parse(source).body
    except (SyntaxError, ValueError):
        return True
    while (stmt := _covers(stmts, line)) is not None:
        if isinstance(stmt, ast.If) and _is_main_test(stmt.test):
            return _covers(stmt.body, line) is not None
        inner = [getattr(stmt, f, []) for f in ("body", "orelse", "finalbody", "handlers")]
        stmts = [s for block in inner if isinstance(block, list) for s in block if isinstance(s, ast.stmt)]
        stmts += [s for h in getattr(stmt, "handlers", []) for s in h.body]
    return False


def reimported(main: object) -> str | None:
    """The file a forkserver or spawn worker re-imports as the main module ``main``, or None where
    multiprocessing re-imports nothing (spawn.py's ``_fixup_main_from_name``/``_from_path``)."""
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    path = getattr(main, "__file__", None)
    if not isinstance(path, str) or (spec_name is not None and spec_name.split(".")[-1] == "__main__"):
        return None
    if os.path.splitext(os.path.basename(path))[0] == "ipython":
        return None
    return path


def find(frame: FrameType | None = None) -> Unguarded | None:
    """Where the main module's top-level code, on this thread's stack now, runs outside
    ``if __name__ == "__main__":``; None when it is guarded, or not re-imported, or not on the stack
    (a call from another thread, a notebook)."""
    main = sys.modules.get("__main__")
    path = reimported(main)
    if main is None or path is None:
        return None
    f: FrameType | None = frame or sys._getframe(1)
    while f is not None and not (f.f_code.co_name == "<module>" and f.f_globals is vars(main)):
        f = f.f_back
    if f is None:
        return None
    try:
        with open(path, encoding="utf-8") as fp:
            source = fp.read()
    except (OSError, UnicodeDecodeError):
        return None
    return None if guarded(source, f.f_lineno) else Unguarded(path, f.f_lineno)
