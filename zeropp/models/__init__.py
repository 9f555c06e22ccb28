from .gpt import GPT, Block, GPTConfig
from .lora import LoRALinear, add_lora

__all__ = ["GPT", "Block", "GPTConfig", "LoRALinear", "add_lora"]
