"""One rank of ``zeropp bench memory``: build a Llama-style model with one engine, train
three steps, and report this rank's peak memory.

Engines, each as its users set it up:

- ``zeropp-zero3``: ``ShardedModel(meta model, ZeroConfig())``, weights initialised into shards.
- ``zeropp-zero++``: the same with qwZ, hpZ over the node and qgZ.
- ``fsdp2``: ``fully_shard`` per decoder layer and on the root, built on the meta device,
  ``to_empty`` on the CPU, then initialised.
- ``ddp``: the whole model on every rank, ``DistributedDataParallel``.

All use ``torch.optim.AdamW(model.parameters())`` and fp32. Two figures per rank: the
peak resident set above the process's baseline (``VmHWM``; the parent sets
``MALLOC_MMAP_THRESHOLD_`` so that freed blocks go back to the system and RSS follows live
memory) and the peak of live tensor bytes counted at the dispatcher.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

ENGINES = ("zeropp-zero3", "zeropp-zero++", "fsdp2", "ddp")
VOCABULARY = 32_000


@dataclass(frozen=True)
class LlamaShape:
    """A Llama-style decoder: RMSNorm, SwiGLU, SDPA attention, untied head."""

    hidden: int
    layers: int

    @property
    def intermediate(self) -> int:  # 8/3 of the hidden size, rounded up to 256 (Llama's rule)
        return -(-self.hidden * 8 // 3 // 256) * 256

    @property
    def parameters(self) -> int:
        per_layer = 4 * self.hidden * self.hidden + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * per_layer + 2 * VOCABULARY * self.hidden + self.hidden

    def hf_config(self):
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=VOCABULARY, hidden_size=self.hidden, intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=self.hidden // 64,
                           num_key_value_heads=self.hidden // 64, tie_word_embeddings=False,
                           attn_implementation="sdpa", max_position_embeddings=256)


@dataclass(frozen=True)
class MemoryRun:
    engine: str
    shape: LlamaShape
    ranks_per_node: int = 2
    steps: int = 3
    tokens: int = 64


def run_rank(rank: int, world_size: int, run: MemoryRun) -> dict:
    """One rank's peaks (bytes) and losses; called through ``spawn_ranks``."""
    from zeropp.memory import peak_rss_increase, process_resources
    from zeropp.memory_tracker import LiveTensorTracker

    torch.manual_seed(0)
    gc.collect()
    baseline = process_resources()["rss_bytes"]  # the interpreter, torch and the process group
    tracker = LiveTensorTracker()

    def build_and_train() -> list[float]:
        with tracker:
            model, optimizer = _build(run, rank)
            return _train(model, optimizer, run, rank, tracker)

    losses, peak_rss = peak_rss_increase(build_and_train)
    phases = {name: tracker.phase_peak_total(name) for name in tracker.phase_peaks}
    return {"rank": rank, "baseline_rss_bytes": baseline, "peak_rss_bytes": peak_rss, "peak_live_bytes": tracker.peak_total(), "phase_peak_live_bytes": phases,
            "losses": losses, "parameters": run.shape.parameters}


def _build(run: MemoryRun, rank: int):
    from transformers import LlamaForCausalLM

    config = run.shape.hf_config()
    if run.engine == "ddp":
        module = LlamaForCausalLM(config)
        model = torch.nn.parallel.DistributedDataParallel(module)
    else:
        with torch.device("meta"):
            module = LlamaForCausalLM(config)
        model = _zeropp(module, run) if run.engine.startswith("zeropp") else _fsdp2(module)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _zeropp(module, run: MemoryRun):
    from zeropp import ShardedModel, Topology, ZeroConfig
    from zeropp.init import RunInitializers

    config = ZeroConfig()
    if run.engine == "zeropp-zero++":
        config = ZeroConfig(quantized_weights=True, hpz_size=run.ranks_per_node, quantized_gradients=True)
    topology = Topology.from_environment(ranks_per_node=run.ranks_per_node)
    return ShardedModel(module, topology, config, unit_classes="auto", init=RunInitializers(seed=0))


def _fsdp2(module):
    from torch.distributed.fsdp import fully_shard

    for layer in module.model.layers:
        fully_shard(layer)
    fully_shard(module)
    module.to_empty(device="cpu")
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if "norm" in name:
                parameter.fill_(1.0)
            else:
                parameter.normal_(0.0, 0.02)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    module.model.rotary_emb = LlamaRotaryEmbedding(module.config)  # its buffers were left empty
    return module


def _train(model, optimizer, run: MemoryRun, rank: int, tracker) -> list[float]:
    generator = torch.Generator().manual_seed(1000 + rank)
    losses = []
    for _ in range(run.steps):
        tokens = torch.randint(0, VOCABULARY, (1, run.tokens), generator=generator)
        # The model shifts the labels itself.
        loss = tracker.training_step(lambda: model(input_ids=tokens, labels=tokens).loss, optimizer)
        losses.append(loss.item())
    return losses
