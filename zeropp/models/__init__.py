from .gpt import GPT, Block, GPTConfig

__all__ = ["GPT", "Block", "GPTConfig"]
