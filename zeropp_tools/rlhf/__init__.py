"""RLHF on zeropp: SFT, a reward model and PPO over four sharded models (``zeropp rlhf``)."""
