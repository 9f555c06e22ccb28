"""Hugging Face causal language models (``transformers`` is an optional dependency).

A model folder as ``save_pretrained`` writes it (``config.json``, ``model.safetensors`` or a
sharded index, tokenizer files) is built on the meta device and materialized straight into
shards: each rank reads only its shards' bytes, or, without weights, runs the model's own
initialisation unit by unit. ``export_pretrained`` writes a folder ``from_pretrained`` loads.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from .checkpoint.export import write_safetensors
from .config import ZeroConfig
from .engine import ShardedModel
from .init import LoadSafetensors, RunInitializers
from .topology import Topology

logger = logging.getLogger(__name__)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _transformers():
    try:
        import transformers
    except ImportError as error:
        raise ImportError("Hugging Face models need transformers: pip install 'zeropp[hf]'") from error
    return transformers


def load_causal_lm(folder: str | Path, topology: Topology, config: ZeroConfig | None = None,
                   seed: int = 0) -> ShardedModel:
    """Collective. An ``AutoModelForCausalLM`` from ``folder`` (offline), sharded, units by
    its ``_no_split_modules``; pretrained weights when the folder has safetensors files."""
    transformers = _transformers()
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} has no config.json: give a Hugging Face model folder (save_pretrained's output)")
    hf_config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    with torch.device("meta"):
        module = transformers.AutoModelForCausalLM.from_config(hf_config)
    pretrained = any(folder.glob("*.safetensors"))
    init = LoadSafetensors(folder) if pretrained else RunInitializers(seed=seed)
    if topology.rank == 0:
        logger.info("%s from %s: %s", type(module).__name__, folder,
                    "pretrained weights" if pretrained else f"random initialisation (seed {seed})")
    return ShardedModel(module, topology, config, unit_classes="auto", init=init)


def causal_lm_loss(model: ShardedModel, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; ``inputs`` and ``targets`` [batch, seq] are already
    shifted by one, as the built-in GPT takes them."""
    logits = model(input_ids=inputs).logits  # [batch, seq, vocab]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def export_pretrained(model: ShardedModel, folder: str | Path, tokenizer=None) -> Path:
    """Collective. Rank 0 writes ``config.json`` and ``model.safetensors`` (fp32, tied weights
    once, one unit's weights in memory at a time), and the tokenizer when given."""
    folder = Path(folder)
    layout = [(slot.names[0], list(slot.shape)) for flat in model.flat_params() for slot in flat.slots]

    def values():
        for flat in model.flat_params():
            gathered = model.gather_master(flat, "export")
            for slot in flat.slots:
                yield gathered[slot.offset : slot.offset + slot.numel]

    if model.topology.rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        model.module.config.save_pretrained(folder)
        write_safetensors(folder / "model.safetensors", layout, values(), {"format": "pt"})
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(folder)
    else:
        for _ in values():  # the same gathers as rank 0
            pass
    torch.distributed.barrier(group=model.topology.group("world").handle)
    return folder


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255: for model folders without tokenizer files."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def load_tokenizer(folder: str | Path, vocab_size: int):
    """The folder's own tokenizer (offline), else bytes when the vocabulary has room."""
    folder = Path(folder)
    if any((folder / name).is_file() for name in TOKENIZER_FILES):
        return _transformers().AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if vocab_size < ByteTokenizer.vocab_size:
        raise ValueError(f"{folder} has no tokenizer files ({', '.join(TOKENIZER_FILES)}) and its vocab_size="
                         f"{vocab_size} is too small for byte tokens (needs >= 256)")
    return ByteTokenizer()


def tokenize_file(path: str | Path, tokenizer) -> torch.Tensor:
    """A text file as one stream of token ids, [num_tokens] int64."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data file {path} does not exist")
    ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
    return torch.tensor(ids, dtype=torch.int64)
