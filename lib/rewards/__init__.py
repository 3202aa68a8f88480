"""Rewards: the built-in reward functions and answer checking (functions.py), --reward_funcs resolved and called
(scoring.py), open-r1's other rewards (open_r1.py), the reward worker with a time limit per call (worker.py)."""
