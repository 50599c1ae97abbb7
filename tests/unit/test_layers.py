"""The architecture stays as docs/ARCHITECTURE.md draws it: layers that import only downwards, agent/,
worker/ and train/ never importing each other, no import cycle, no long function. Reads the source
(imports inside functions count too); imports nothing of ddprun."""

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = SRC / "ddprun"

LAYERS = [
    ("base", ["ddprun.errors", "ddprun._util", "ddprun._version", "ddprun.cpus", "ddprun.cgroups"]),
    ("protocol", ["ddprun.protocol"]),
    ("model", ["ddprun.config", "ddprun.cluster", "ddprun.telemetry", "ddprun.preempt", "ddprun.loaderworkers",
               "ddprun.ranktable", "ddprun.report",
               "ddprun.mismatch", "ddprun.plan_json", "ddprun.cli_help"]),
    ("runtime", ["ddprun.runtime", "ddprun.firstcollective", "ddprun.pgkeep", "ddprun.openfiles"]),
    ("sides", ["ddprun.agent", "ddprun.worker", "ddprun.train"]),
    ("top", ["ddprun.api", "ddprun.lightning", "ddprun.pytorch_lightning", "ddprun.ray", "ddprun.demo",
             "ddprun.demo_train", "ddprun.cli", "ddprun.__main__", "ddprun"]),
]
SIDES = ("ddprun.agent", "ddprun.worker", "ddprun.train")
MAX_CODE_LINES = 60


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PKG.rglob("*.py")}


def target(name: str) -> str:
    """The module an import refers to (``ddprun.worker.exit`` for ``from ddprun.worker import exit``)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            graph[mod].update(target(n) for n in names if n.startswith("ddprun"))
        graph[mod].discard(mod)
    return graph


def layer_of(mod: str) -> tuple[int, str]:
    best = (-1, "", "")
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > len(best[2]):
                best = (i, p, p)
    assert best[0] >= 0, f"{mod} is in no layer: add it to LAYERS and docs/ARCHITECTURE.md"
    return best[0], best[1]


def test_every_import_goes_down_the_layers_and_the_sides_stay_apart():
    wrong = []
    for mod, deps in imports().items():
        (mine, my_group) = layer_of(mod)
        for dep in deps:
            (theirs, their_group) = layer_of(dep)
            side = lambda m: next((s for s in SIDES if m == s or m.startswith(s + ".")), None)  # noqa: E731
            if theirs > mine or (side(mod) and side(dep) and side(mod) != side(dep)):
                wrong.append(f"{mod} ({LAYERS[mine][0]}) imports {dep} ({LAYERS[theirs][0]})")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_import_graph_has_no_cycle():
    graph = imports()
    seen, stack, cycles = set(), [], []

    def visit(m: str) -> None:
        if m in stack:
            cycles.append(stack[stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d != "ddprun" or m == "ddprun.__main__":  # the package's lazy re-exports import at use
                visit(d)
        stack.pop()

    for m in sorted(MODULES):
        visit(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def code_lines(fn: ast.AST) -> int:
    """Lines of a function without its docstring."""
    body = fn.body  # type: ignore[attr-defined]
    first = body[1] if (len(body) > 1 and isinstance(body[0], ast.Expr)
                        and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)) \
        else body[0]
    return fn.end_lineno - first.lineno + 1  # type: ignore[attr-defined]


def test_no_function_is_longer_than_sixty_lines_of_code():
    long = []
    for mod, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and code_lines(node) > MAX_CODE_LINES:
                long.append(f"{mod}.{node.name}: {code_lines(node)} lines")
    assert not long, "\n".join(long)
