"""The walls between fivefold's layers (docs/architecture.md), read from the imports of every module.

Every `import` / `from ... import` in fivefold/ counts: at the top of a file, inside a function, under
`if TYPE_CHECKING:` — a lazy import is still a dependency. Each module lives in one room; a room may
import its own and the rooms below it in `ROOMS`, never one above. The pure rooms (base, schedule,
config, planner) never import torch, torch.distributed or any room that does, so `plan`, `validate`
and the schedule tools run without torch. No two modules import each other, directly or in a circle.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fivefold"

ROOMS = ("base", "schedule", "config", "planner", "runtime", "launch", "ops", "data", "parallel", "model", "pipeline",
         "checkpoint", "hf", "train", "engine", "rl", "testing", "cli")
"""Lowest first. base: errors, the frozen-dataclass helpers, topology, the capacity formula; schedule: the
pure pipeline schedule modules (IR, generators, verifier, simulator, renderer, CSV); config: the canonical
config, its dialects and validation, and the pure policies every layer shares (precision, batch sizes,
HF config.json); planner: memory and step-time models, the search; runtime: process groups and
collectives; launch: the local launcher and the hang watchdog; ops: attention kernels; data; parallel: TP / CP / EP layers and data-parallel modes; model;
pipeline: stages and the executor; checkpoint; hf: Hugging Face import / export; train: the loop and
parallelize; engine: the RL engine; rl: GRPO; testing: the test harness; cli: the commands and the
entry point of a launched rank."""

PURE = {"base", "schedule", "config", "planner"}
"""Rooms that import no torch (a lazy import inside a function that only the runtime calls is allowed for
torch itself, e.g. Precision.param_dtype; never a room above)."""

BASE = {"errors", "frozen", "topology", "capacity", "__init__"}
SCHEDULE = {"ir", "generators", "schedules", "lowering", "verify", "simulate", "render", "csvio", "trace",
            "send_waits", "forward", "__init__"}
LAUNCH = {"launch", "watchdog"}


def room(module: str) -> str:
    """The room of a dotted module name under fivefold."""
    parts = module.split(".")[1:] or ["__init__"]
    if len(parts) == 1 and parts[0] in BASE:
        return "base"
    if len(parts) == 1 and parts[0] in LAUNCH:
        return "launch"
    if parts[0] == "__main__":
        return "cli"
    if parts[0] == "pipeline":
        return "schedule" if len(parts) == 1 or parts[1] in SCHEDULE else "pipeline"
    return parts[0]


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(module: str, path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported module, line, whether it runs when the module is imported: not inside a function) for every
    import in the file, relative ones resolved; `from pkg import name` counts as pkg.name when that is a module."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    in_functions = {n.lineno for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                    for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno, node.lineno not in in_functions) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                found.append((full if full in known else base, node.lineno, node.lineno not in in_functions))
    return found


def crossings(package: Path = PACKAGE) -> tuple[list[str], dict[str, set[str]]]:
    """Every import across a wall, as 'module:line imports target (room -> room)', and the module graph."""
    mods = modules(package)
    known = set(mods)
    rank = {r: i for i, r in enumerate(ROOMS)}
    bad, graph = [], {m: set() for m in mods}
    for module, path in mods.items():
        src = room(module)
        for target, line, top_level in imports(module, path, known):
            if target.split(".")[0] == "torch" and src in PURE and top_level:
                bad.append(f"{module}:{line} imports {target} (the {src} room is pure: no torch at import time)")
            if target.split(".")[0] != package.name:
                continue
            while target not in known:  # an attribute of a module
                target = target.rpartition(".")[0]
            if target != module:
                graph[module].add(target)
            dst = room(target)
            if rank[dst] > rank[src]:
                bad.append(f"{module}:{line} imports {target} ({src} -> {dst}: a lower room imports a higher one)")
    return bad, graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles (strongly connected components of more than one module), Tarjan's algorithm."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_room():
    rooms = {room(m) for m in modules()}
    assert rooms <= set(ROOMS), f"modules in no room: {sorted(rooms - set(ROOMS))}; add the folder to ROOMS"


def test_no_import_crosses_a_wall():
    bad, _ = crossings()
    assert not bad, "imports across the layers' walls:\n  " + "\n  ".join(bad)


def test_no_import_circles():
    _, graph = crossings()
    assert not circles(graph), f"import circles: {circles(graph)}"


@pytest.mark.parametrize("planted, room_of_target", [
    ("from fivefold.train.loop import train\n", "train"),
    ("def f():\n    from fivefold.model.decoder import Decoder\n", "model"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fivefold.checkpoint import io\n", "checkpoint"),
    ("from ..runtime import comm\n", "runtime"),
    ("import torch\n", "torch"),
])
def test_a_planted_upward_import_is_found(tmp_path, planted, room_of_target):
    """The check fails on an import that climbs out of the pure config room (a copy of the package with one
    line added), at the top of a file, inside a function, under TYPE_CHECKING, relative, or torch itself."""
    import shutil

    copy = tmp_path / "fivefold"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "config" / "planted.py").write_text(planted)
    bad, _ = crossings(copy)
    assert [b for b in bad if b.startswith("fivefold.config.planted:")], bad
    assert all(b.startswith("fivefold.config.planted:") for b in bad), bad


def test_a_planted_circle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
