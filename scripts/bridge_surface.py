"""Write Megatron-Bridge's config surface to fivefold/config/bridge_surface.txt.

    python scripts/bridge_surface.py BRIDGE_GIT_DIR MEGATRON_LM_GIT_DIR > fivefold/config/bridge_surface.txt

Megatron-Bridge's `ConfigContainer` (src/megatron/bridge/training/config.py) holds one dataclass per
section (train, model, optimizer, ...); most inherit Megatron-LM's dataclasses (TransformerConfig,
OptimizerConfig, megatron/training/config/*). This script reads both repositories' sources at their
HEAD commits by AST — nothing of either package is imported, so neither needs installing — follows
each section's dataclass bases across the two, and prints every `section.field` with how it takes
values (bool, value or list) and its default where the source writes it as a literal (the first
class in the method resolution order that assigns it wins, as in Python). For the GPT path the
`model` section is GPTModelProvider and `dataset` is GPTDatasetConfig.
"""
from __future__ import annotations

import ast
import subprocess
import sys

SECTIONS = {  # ConfigContainer field -> its class on the GPT path (a union's first member)
    "rng": "RNGConfig", "rerun_state_machine": "RerunStateMachineConfig", "train": "TrainingConfig",
    "model": "GPTModelProvider", "optimizer": "OptimizerConfig", "ddp": "DistributedDataParallelConfig",
    "validation": "ValidationConfig", "scheduler": "SchedulerConfig", "dataset": "GPTDatasetConfig",
    "logger": "LoggerConfig", "tokenizer": "TokenizerConfig", "checkpoint": "CheckpointConfig",
    "dist": "DistributedInitConfig", "ft": "FaultToleranceConfig", "straggler": "StragglerDetectionConfig",
    "nvrx_straggler": "NVRxStragglerDetectionConfig", "profiling": "ProfilingConfig",
    "comm_overlap": "CommOverlapConfig", "mixed_precision": "MixedPrecisionConfig",
    "tensor_inspect": "TensorInspectConfig", "inprocess_restart": "InProcessRestartConfig",
}
CONTAINER = ("megatron.bridge.training.config", "ConfigContainer")


class Sources:
    """Python modules of the two repositories at HEAD, by dotted module name."""

    def __init__(self, bridge: str, megatron: str):
        self.roots = [(bridge, "src/"), (megatron, "")]
        self.commits = [self._git(g, "rev-parse", "HEAD").strip()[:10] for g, _ in self.roots]
        self.files = {}
        for git_dir, prefix in self.roots:
            for path in self._git(git_dir, "ls-tree", "-r", "--name-only", "HEAD").splitlines():
                if path.startswith(prefix + "megatron/") and path.endswith(".py"):
                    mod = path[len(prefix):-3].replace("/", ".").removesuffix(".__init__")
                    self.files.setdefault(mod, (git_dir, path))
        self._trees = {}

    @staticmethod
    def _git(git_dir: str, *args: str) -> str:
        return subprocess.run(["git", "--git-dir", git_dir, *args], check=True, capture_output=True,
                              text=True).stdout

    def tree(self, mod: str) -> ast.Module | None:
        if mod not in self._trees:
            where = self.files.get(mod)
            self._trees[mod] = ast.parse(self._git(where[0], "show", f"HEAD:{where[1]}")) if where else None
        return self._trees[mod]

    def find_class(self, mod: str, name: str, depth: int = 0) -> tuple[str, ast.ClassDef] | None:
        """The class `name` as seen from module `mod`: defined there, or followed through its imports."""
        tree = self.tree(mod)
        if tree is None or depth > 8:
            return None
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return mod, node
        package = mod if self.files.get(mod, ("", ""))[1].endswith("__init__.py") else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        base = package
                        for _ in range(max(node.level - 1, 0)):
                            base = base.rpartition(".")[0]
                        src = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
                        found = self.find_class(src, alias.name, depth + 1)
                        if found:
                            return found
        return None


def kind(annotation: ast.expr | None) -> str:
    text = ast.unparse(annotation) if annotation is not None else ""
    bare = text.replace("Optional[", "").replace("]", "").replace("| None", "").replace("None |", "").strip()
    if bare == "bool":
        return "bool"
    if any(w in text for w in ("list", "List", "tuple", "Tuple", "Sequence")):
        return "list"
    return "value"


def default(node: ast.AnnAssign) -> str:
    value = node.value
    if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("field"):
        value = next((k.value for k in value.keywords if k.arg == "default"), None)
    if value is None:
        return "-"
    try:
        return repr(ast.literal_eval(value))
    except ValueError:
        return "-"


def init_false(node: ast.AnnAssign) -> bool:
    v = node.value
    return isinstance(v, ast.Call) and any(k.arg == "init" and isinstance(k.value, ast.Constant)
                                           and k.value.value is False for k in v.keywords)


def fields(src: Sources, mod: str, cls: ast.ClassDef, seen: dict) -> dict:
    """field -> (kind, default) over the class and its bases; the class's own assignment wins."""
    for base in reversed(cls.bases):
        name = ast.unparse(base).split("[")[0].rpartition(".")[2]
        found = src.find_class(mod, name)
        if found:
            fields(src, *found, seen)
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
            if name.startswith("_") or "ClassVar" in ast.unparse(node.annotation) or init_false(node):
                continue
            seen[name] = (kind(node.annotation), default(node))
    return seen


def main(bridge: str, megatron: str) -> None:
    src = Sources(bridge, megatron)
    rows = []
    for section, cls_name in SECTIONS.items():
        found = src.find_class(CONTAINER[0], cls_name)
        if found is None:
            sys.exit(f"class {cls_name} of section {section} not found")
        for name, (k, d) in sorted(fields(src, *found, {}).items()):
            rows.append(f"{section}.{name} {k} {d}")
    print(f"# Megatron-Bridge config surface at commit {src.commits[0]} (Megatron-LM {src.commits[1]}), "
          f"{len(rows)} fields: section.field, bool/value/list, default ('-' where not a literal).")
    print("# Generated by scripts/bridge_surface.py; fivefold.config.bridge classifies every field.")
    print("\n".join(rows))


if __name__ == "__main__":
    main(*sys.argv[1:3])
