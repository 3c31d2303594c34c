"""A verifiable toy task for RL on CPU: byte-level addition.

A prompt is "A+B=" with A, B in [0, 10**digits) written in decimal, padded on the left with spaces to
one width (so every prompt of a task has the same length: generation takes equal-length prompts);
the answer is the sum's digits followed by ";" — e.g. " 17+ 5=" -> "22;". The reward is computed
exactly from the text: 1 for the right answer ending in ";", else partial credit — the share of the
answer's digit positions that are right (from the right, so a right last digit counts), times 0.5.
A random model scores ~0 on it, so RL starts from a short supervised warm-up on the format
(`warmup_text`), as the issue asks: with every reward 0 every GRPO advantage would be 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

END = ";"


@dataclass(frozen=True)
class Addition:
    digits: int = 2

    @property
    def width(self) -> int:
        """Characters of one operand."""
        return self.digits

    @property
    def prompt_length(self) -> int:
        return 2 * self.width + 2  # "A+B="

    @property
    def answer_length(self) -> int:
        """Characters to generate: the longest sum and the end mark."""
        return self.digits + 2

    def sample(self, rng: np.random.Generator, n: int) -> list[tuple[int, int]]:
        return [(int(a), int(b)) for a, b in rng.integers(0, 10 ** self.digits, size=(n, 2))]

    def prompt(self, a: int, b: int) -> str:
        return f"{a:>{self.width}}+{b:>{self.width}}="

    def answer(self, a: int, b: int) -> str:
        return f"{a + b}{END}"

    def reward(self, a: int, b: int, completion: str) -> float:
        """1 for the exact answer; else 0.5 x the share of the answer's digits right, from the right."""
        want = str(a + b)
        got = completion.split(END, 1)[0] if END in completion else completion
        if END in completion and got == want:
            return 1.0
        got = got[: len(want) + 1]
        right = sum(1 for x, y in zip(reversed(want), reversed(got)) if x == y) if got.isdigit() else 0
        return 0.5 * right / len(want)

    def warmup_text(self, rng: np.random.Generator, n: int) -> str:
        """n solved examples, one per line: a corpus for the supervised warm-up."""
        return "".join(f"{self.prompt(a, b)}{self.answer(a, b)}\n" for a, b in self.sample(rng, n))
