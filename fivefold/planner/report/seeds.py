"""The seeds' rules of thumb (seeds 001 and 002), as data the planner evaluates beside its own choice.

A rule gives a layout; the planner sizes and times it with the same models as its search, or says
which validation rule it breaks or by how many GiB it misses the GPU. NOTES.md lists what in the
seeds is wrong; `seed_memory_accounting` reproduces seed 002's memory example in its own terms.
"""
from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class SeedRule:
    source: str
    text: str
    tp: tuple[int, ...]
    pp: tuple[int, ...] = (1,)
    cp: int = 1
    ep: int = 1


# Dense table "Decision by Model Size" (seed 001 and 002; 002 widens 10-70B to TP=4-8), keyed by
# (min, max) total parameters and the GPU range it is meant for.
DENSE_TABLE = [
    ((0, 1e9), (1, 8), SeedRule("001/002 dense table", "<1B, 1-8 GPUs: DP only", tp=(1,))),
    ((1e9, 10e9), (8, 16), SeedRule("001/002 dense table", "1-10B, 8-16 GPUs: TP=2-4 + DP", tp=(2, 4))),
    ((10e9, 70e9), (16, 64), SeedRule("002 dense table", "10-70B, 16-64 GPUs: TP=4-8 + PP=2-4 + DP",
                                      tp=(4, 8), pp=(2, 4))),
    ((70e9, 175e9), (64, 256), SeedRule("001/002 dense table", "70-175B, 64-256 GPUs: TP=8 + PP=4-8 + DP",
                                        tp=(8,), pp=(4, 8))),
    ((175e9, 500e9), (256, 1024), SeedRule("001/002 dense table",
                                           "175-500B, 256-1024 GPUs: TP=8 + PP=8-16 + CP=2 + DP",
                                           tp=(8,), pp=(8, 16), cp=2)),
]

# MoE table (seed 002), by our preset name.
MOE_TABLE = {
    "olmoe-1b-7b": SeedRule("002 MoE table", "OLMoE 7B/1B: TP1 PP1 EP8", tp=(1,), ep=8),
    "moonlight-16b-a3b": SeedRule("002 MoE table", "Moonlight 16B/3B: TP2 PP1 EP8", tp=(2,), ep=8),
    "deepseek-v2": SeedRule("002 MoE table", "DeepSeek-V2 236B/21B: TP1 PP4 EP32", tp=(1,), pp=(4,), ep=32),
    "glm-4.5-air": SeedRule("002 MoE table", "GLM-4.5 Air 106B/12B: TP1 PP4 EP8", tp=(1,), pp=(4,), ep=8),
    "qwen3-30b-a3b": SeedRule("002 MoE table", "Qwen3 30B-A3B: TP4 PP2 EP4", tp=(4,), pp=(2,), ep=4),
    "glm-4.5": SeedRule("002 MoE table", "GLM-4.5 355B/32B: TP2 PP8 EP16", tp=(2,), pp=(8,), ep=16),
    "qwen3-235b-a22b": SeedRule("002 MoE table", "Qwen3 235B-A22B: TP4 PP16 EP8 (CP=2 for pretrain)",
                                tp=(4,), pp=(16,), ep=8, cp=2),
    "deepseek-v3": SeedRule("002 MoE table", "DeepSeek-V3 671B/37B: TP2 PP16 EP64", tp=(2,), pp=(16,), ep=64),
    "kimi-k2": SeedRule("002 MoE table", "Kimi-K2 1T: TP2 PP16 EP32", tp=(2,), pp=(16,), ep=32),
}

# Combined examples with a GPU count.
EXAMPLES = [
    ("llama3-70b", 64, SeedRule("001/002 3D example", "LLaMA 3 70B on 64 GPUs: TP4 PP4 DP4", tp=(4,), pp=(4,))),
    ("llama3-405b", 256, SeedRule("001 4D example", "LLaMA 3 405B on 256 GPUs: TP8 PP8 CP2 DP2",
                                  tp=(8,), pp=(8,), cp=2)),
    ("deepseek-v3", 1024, SeedRule("001 5D example", "DeepSeek-V3 on 1024 GPUs: TP2 PP16 EP64 DP2",
                                   tp=(2,), pp=(16,), ep=64)),
    ("deepseek-v2", 128, SeedRule("002 EP+PP example", "DeepSeek-V2 236B on 128 GPUs: TP1 PP4 EP32",
                                  tp=(1,), pp=(4,), ep=32)),
    ("deepseek-v3", 256, SeedRule("002 small-TP example", "DeepSeek-V3 671B on 256 GPUs: TP2 PP16 EP64",
                                  tp=(2,), pp=(16,), ep=64)),
]


def topology_rule(gpus_per_node: int, world: int) -> SeedRule:
    """'Keep TP within a single NVLink domain; PP across nodes': TP = GPUs per node, PP = nodes."""
    nodes = max(1, world // gpus_per_node)
    return SeedRule("001/002 topology rule", f"TP={gpus_per_node} within a node, PP across the {nodes} nodes",
                    tp=(gpus_per_node,), pp=(nodes,))


def sequence_rule(seq: int) -> tuple[str, int, bool]:
    """Seed 002's sequence-length table -> (text, CP, SP)."""
    if seq < 2048:
        return "< 2K: standard TP + PP + DP", 1, False
    if seq <= 8192:
        return "2K-8K: add SP", 1, True
    if seq <= 32768:
        return "8K-32K: add CP=2", 2, True
    return "32K+: add CP=4-8", 4, True


def rules_for(preset: str | None, total_params: float, world: int, gpus_per_node: int) -> list[SeedRule]:
    """The seed rules that speak about this model / GPU count."""
    out = [r for name, n, r in EXAMPLES if name == preset and n == world]
    if preset in MOE_TABLE:
        out.append(MOE_TABLE[preset])
    else:
        out += [r for (lo, hi), _, r in DENSE_TABLE if lo <= total_params < hi]
    out.append(topology_rule(gpus_per_node, world))
    return out


@dataclass(frozen=True)
class SeedAccounting:
    """Seed 002's memory example: 16-bit weights and gradients, Adam at 4 bytes/param, all divided
    by TP x PP; activations = its unsharded 48 GB / (TP x PP)."""

    weights: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations


def seed_memory_accounting(params: float, tp: int, pp: int, activations_unsharded: float = 48 * GB) -> SeedAccounting:
    shards = tp * pp
    return SeedAccounting(weights=2 * params / shards, grads=2 * params / shards, optimizer=4 * params / shards,
                          activations=activations_unsharded / shards)


SEED_ACCOUNTING_EXPLAINED = (
    "Seed 002 counts Adam at 4 bytes/param and gradients in 16 bits. Megatron's mixed precision keeps "
    "bf16 weights (2), fp32 main gradients (4) and fp32 master weights + two Adam moments (12): 18 "
    "bytes/param, sharded by TP x PP only, unless the distributed optimizer shards the 12 over DP x CP "
    "(6 + 12/d). Its activations ignore the microbatches 1F1B keeps in flight: the first pipeline stage "
    "holds PP of them. (seeds/NOTES.md)")
