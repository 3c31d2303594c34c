"""RL post-training pieces: a verifiable toy task (fivefold.rl.tasks)."""
