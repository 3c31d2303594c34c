"""Megatron's `--pipeline-model-parallel-layout` string, read as decoder layers per virtual stage.

The string lists the virtual pipeline stages in model order, separated by `|`; in a stage, `E` is the
embedding, `t` a decoder layer, `m` a multi-token-prediction layer, `L` the loss (output layer).
`X*n` repeats one symbol, `(...)*n` a group (which may hold `|`). Examples from the Megatron-Core MoE
report: `Et*3|(tt|)*29m|L` (DeepSeek-V3 on PP8 x VPP4: 32 stages, 61 decoder layers, the MTP layer
and the loss alone on the last two) and `Et*4|(tttt|)*14tmL` (PP4 x VPP4). Stage i runs on pipeline
rank i mod PP (Megatron's interleaving), as `fivefold.planner.layout` places virtual stages.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from fivefold.errors import UserError

SYMBOLS = "Etm L"


@dataclass(frozen=True)
class StageLayout:
    decoder: tuple[int, ...]
    """Decoder layers per virtual stage (`ParallelConfig.pipeline_layers_per_stage`)."""
    mtp: tuple[int, ...]
    """MTP layers per virtual stage."""

    @property
    def stages(self) -> int:
        return len(self.decoder)


def _expand(text: str, pos: int, spec: str) -> tuple[str, int]:
    """Expand `text` from `pos` to the matching ')' (or the end): (the expansion, where it stopped)."""
    out = []
    while pos < len(text) and text[pos] != ")":
        c = text[pos]
        if c == "(":
            inner, pos = _expand(text, pos + 1, spec)
            if pos >= len(text):
                raise UserError(f"--pipeline-model-parallel-layout {spec!r}: '(' without ')'")
            piece, pos = inner, pos + 1
        elif c in "Etm L|":
            piece, pos = c, pos + 1
        else:
            raise UserError(f"--pipeline-model-parallel-layout {spec!r}: unexpected {c!r} at {pos}; use E, t, m, L, "
                            "'|' between stages, X*n and (...)*n")
        if m := re.match(r"\*(\d+)", text[pos:]):
            piece, pos = piece * int(m.group(1)), pos + m.end()
        out.append(piece)
    return "".join(out), pos


def parse_layout(spec: str, pp: int | None = None, vpp: int | None = None, num_layers: int | None = None) -> StageLayout:
    """The stages of `spec`; with pp / vpp / num_layers given, checked against them (UserError)."""
    flat, end = _expand(spec.replace(" ", ""), 0, spec)
    if end != len(spec.replace(" ", "")):
        raise UserError(f"--pipeline-model-parallel-layout {spec!r}: ')' without '('")
    stages = flat.split("|")
    if "E" not in stages[0] or any("E" in s for s in stages[1:]):
        raise UserError(f"--pipeline-model-parallel-layout {spec!r}: E (the embedding) must be in the first stage only")
    if "L" not in stages[-1] or any("L" in s for s in stages[:-1]):
        raise UserError(f"--pipeline-model-parallel-layout {spec!r}: L (the loss) must be in the last stage only")
    out = StageLayout(tuple(s.count("t") for s in stages), tuple(s.count("m") for s in stages))
    chunks = (pp or 1) * (vpp or 1)
    if pp is not None and out.stages != chunks:
        raise UserError(f"--pipeline-model-parallel-layout {spec!r} has {out.stages} stages; PP={pp} x VPP={vpp or 1} "
                        f"needs {chunks} (set --num-virtual-stages-per-pipeline-rank {out.stages // pp})"
                        if out.stages % pp == 0 else
                        f"--pipeline-model-parallel-layout {spec!r} has {out.stages} stages, not a multiple of PP={pp}")
    if num_layers is not None and sum(out.decoder) != num_layers:
        raise UserError(f"--pipeline-model-parallel-layout {spec!r} places {sum(out.decoder)} decoder layers (t); "
                        f"the model has {num_layers}")
    return out
