"""The four models of RLHF on the built-in GPT: the actor and its frozen reference are
GPTs; the reward model and the critic are GPTs whose final hidden state feeds a scalar head."""

from __future__ import annotations

import torch
from torch import nn

from zeropp import ShardedModel, Topology, ZeroConfig
from zeropp.init import LoadSafetensors
from zeropp.models import GPT, Block, GPTConfig


class ScalarHead(nn.Module):
    """A GPT body with a linear head giving one number per position, [batch, seq]. The
    reward model reads it at the last token; the critic at every generated one."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gpt = GPT(config)
        self.head = nn.Linear(config.embed_dim, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def _init_weights(self, module: nn.Module) -> None:
        self.gpt._init_weights(module)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.gpt.features(idx)).squeeze(-1)


def load_sharded(kind: str, config: GPTConfig, weights: str, topology: Topology, zero: ZeroConfig,
                 trainable: bool) -> ShardedModel:
    """Build ``kind`` ("gpt" or "scalar") on the meta device and read ``weights`` into its
    shards; frozen models get ``requires_grad=False`` (MixZ++ then keeps them INT8 in the node)."""
    with torch.device("meta"):
        module = GPT(config) if kind == "gpt" else ScalarHead(config)
    for param in module.parameters():
        param.requires_grad_(trainable)
    return ShardedModel(module, topology, zero, unit_classes=(Block,), init=LoadSafetensors(weights))
