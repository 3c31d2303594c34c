"""The toy RL task's reward is exact, with partial credit, and its prompts share one length."""
import numpy as np

from fivefold.rl.tasks import Addition


def test_reward_exact_partial_and_format():
    t = Addition(digits=2)
    assert t.prompt(7, 35) == " 7+35=" and t.answer(7, 35) == "42;"
    assert t.reward(7, 35, "42;junk") == 1.0          # right, ended: what follows the end mark is ignored
    assert t.reward(7, 35, "42") == 0.5               # right digits, never ended
    assert t.reward(7, 35, "43;") == 0.25             # one of two digits right (from the right)
    assert t.reward(7, 35, "x;") == 0.0
    assert t.reward(99, 99, "198;") == 1.0
    rng = np.random.default_rng(0)
    assert {len(t.prompt(a, b)) for a, b in t.sample(rng, 100)} == {t.prompt_length}
    lines = t.warmup_text(rng, 20).splitlines()
    assert len(lines) == 20 and all(t.reward(int(l[:2]), int(l[3:5]), l[6:]) == 1.0 for l in lines)
