"""A small GPT in the style of nanoGPT: byte vocabulary, pre-norm blocks, tied LM head."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


GPT_PRESETS = {
    "tiny": dict(num_layers=2, num_heads=2, embed_dim=64, block_size=64),
    "small": dict(num_layers=4, num_heads=4, embed_dim=128, block_size=128),
    "medium": dict(num_layers=6, num_heads=6, embed_dim=384, block_size=256),
}
"""The example GPT's sizes by name."""


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes
    block_size: int = 128  # longest sequence
    num_layers: int = 4
    num_heads: int = 4
    embed_dim: int = 128
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "num_layers", "num_heads", "embed_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.embed_dim % self.num_heads != 0:
            raise ValueError(
                f"embed_dim={self.embed_dim} must be divisible by num_heads={self.num_heads}"
            )

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        if name not in GPT_PRESETS:
            raise ValueError(f"model size {name!r} is unknown; allowed values: {list(GPT_PRESETS)}")
        return cls(**{**GPT_PRESETS[name], **overrides})


class KVCache:
    """Keys and values of the tokens decoded so far, one entry per layer, each
    [batch, heads, tokens, head_dim]; ``length`` tokens are cached."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.length = 0

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.keys:
            k, v = torch.cat([self.keys[layer], k], dim=2), torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.embed_dim, 3 * config.embed_dim)
        self.proj = nn.Linear(config.embed_dim, config.embed_dim)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        B, T, C = x.size()  # batch, sequence, embedding
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.num_heads, C // self.num_heads).transpose(1, 2) for t in (q, k, v))
        past = 0 if cache is None else cache.length
        if cache is not None:
            k, v = cache.extend(layer, k, v)  # (B, nh, past + T, hs)
        if past and T > 1:
            raise ValueError("with a filled KV cache, decode one token at a time")
        dropout = self.dropout if self.training else 0.0
        # The prompt attends causally; one new token attends to everything before it.
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=past == 0)  # (B, nh, T, hs)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.embed_dim, 4 * config.embed_dim)
        self.down = nn.Linear(4 * config.embed_dim, config.embed_dim)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.embed_dim)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.embed_dim)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x), cache, layer)
        return x + self.mlp(self.ln_mlp(x))


def _init_linear_and_embedding(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.embed_dim)
        self.position_embedding = nn.Embedding(config.block_size, config.embed_dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_final = nn.LayerNorm(config.embed_dim)
        self.lm_head = nn.Linear(config.embed_dim, config.vocab_size, bias=False)
        self.lm_head.weight = self.token_embedding.weight  # tied
        # Eager construction draws in this order (recorded runs and goldens depend on it);
        # ``_init_weights`` gives each module the same distribution on its own.
        self.apply(_init_linear_and_embedding)
        for name, param in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("down.weight"):
                nn.init.normal_(param, mean=0.0, std=self._residual_std())

    def _residual_std(self) -> float:
        return 0.02 / math.sqrt(2 * self.config.num_layers)  # GPT-2's scaled residual projections

    def _init_weights(self, module: nn.Module) -> None:
        """One module's initialisation, children visited before parents (as ``apply``): what
        meta-device construction runs unit by unit."""
        _init_linear_and_embedding(module)
        if isinstance(module, (CausalSelfAttention, MLP)):
            residual = module.proj if isinstance(module, CausalSelfAttention) else module.down
            nn.init.normal_(residual.weight, mean=0.0, std=self._residual_std())

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Decoding with a KV cache: ``idx`` [batch, prompt] -> [batch, prompt + new];
        greedy at temperature 0, else sampled from softmax(logits / temperature)."""
        cache = KVCache()
        logits = self(idx, cache=cache)
        tokens = [idx]
        for step in range(max_new_tokens):
            last = logits[:, -1].float()  # [batch, vocab]
            if temperature > 0:
                probabilities = torch.softmax(last / temperature, dim=-1)
                following = torch.multinomial(probabilities, 1, generator=generator)  # [batch, 1]
            else:
                following = last.argmax(dim=-1, keepdim=True)
            tokens.append(following)
            if step + 1 == max_new_tokens or cache.length >= self.config.block_size:
                break
            logits = self(following, cache=cache)
        return torch.cat(tokens, dim=1)

    def features(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """The final hidden states, [batch, seq, embed_dim] (what the LM head reads)."""
        B, T = idx.size()  # batch, sequence
        past = 0 if cache is None else cache.length
        if past + T > self.config.block_size:
            raise ValueError(f"sequence length {past + T} exceeds block_size={self.config.block_size}")
        positions = torch.arange(past, past + T, device=idx.device)
        x = self.token_embedding(idx) + self.position_embedding(positions)  # (B, T, C)
        for layer, block in enumerate(self.blocks):
            x = block(x, cache, layer)
        if cache is not None:
            cache.length += T
        return self.ln_final(x)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, cache: KVCache | None = None):
        logits = self.lm_head(self.features(idx, cache))  # (B, T, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
