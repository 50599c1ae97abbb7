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
import tokenize
from dataclasses import dataclass
from multiprocessing import process
from types import FrameType


@dataclass(frozen=True)
class Unguarded:
    """The main module's top-level statement, running now, that a re-import would run again."""

    path: str
    line: int

    def where(self) -> str:
        return f"{self.path}, line {self.line}"


def _mentions_name(test: ast.expr) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "__name__" for n in ast.walk(test))


def _main_only(test: ast.expr) -> bool:
    """True only for ``__name__ == "__main__"`` (either side), alone or in an ``and``."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_main_only(v) for v in test.values)
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, *test.comparators]
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and \
        any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides)


def _covers(stmts: list[ast.stmt], line: int) -> ast.stmt | None:
    """The statement of ``stmts`` whose lines (its decorators' too) include ``line``."""
    for s in stmts:
        first = min([s.lineno, *(d.lineno for d in getattr(s, "decorator_list", []))])
        if first <= line <= (s.end_lineno or s.lineno):
            return s
    return None


def guarded(source: str, line: int) -> bool:
    """Whether ``line`` of a module's ``source`` runs only when ``__name__ == "__main__"``: in such an
    ``if``'s test or body (not its ``else``), at any depth of compound statements (pure). Where it
    cannot tell (unparsable source, another test of ``__name__``): True, so nothing is changed."""
    try:
        stmts: list[ast.stmt] = ast.parse(source).body
    except (SyntaxError, ValueError):
        return True
    while (stmt := _covers(stmts, line)) is not None:
        if isinstance(stmt, ast.If) and _mentions_name(stmt.test):
            return not (_main_only(stmt.test) and _covers(stmt.orelse, line) is not None)
        inner = [getattr(stmt, f, []) for f in ("body", "orelse", "finalbody")]
        stmts = [s for block in inner if isinstance(block, list) for s in block if isinstance(s, ast.stmt)]
        stmts += [s for h in getattr(stmt, "handlers", []) for s in h.body]
        stmts += [s for c in getattr(stmt, "cases", []) for s in c.body]
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
    # as spawn.py records it: relative to the directory the process started in, not the current one
    return os.path.normpath(os.path.join(getattr(process, "ORIGINAL_DIR", None) or os.getcwd(), path))


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
        with tokenize.open(path) as fp:  # the file's own encoding
            source = fp.read()
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    return None if guarded(source, f.f_lineno) else Unguarded(path, f.f_lineno)
