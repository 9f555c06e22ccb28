"""What a training run trains on what: the built-in GPT or a Hugging Face model folder, the
built-in corpus or the user's text file, and how each computes its loss and is exported."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint.export import export_model
from ..data import ByteCorpus, load_stdlib_corpus
from ..engine import ShardedModel
from ..models import GPT, Block
from ..topology import Topology


@dataclass
class Job:
    model: ShardedModel
    corpus: ByteCorpus
    loss: Callable[[ShardedModel, torch.Tensor, torch.Tensor], torch.Tensor]  # (model, inputs, targets)
    export: Callable[[str], None]  # collective: write the trained model to a folder


def model_name(config) -> str:
    return f"Hugging Face {config.hf_model}" if config.hf_model else f"GPT {config.model_size}"


def build_job(config, topology: Topology) -> Job:
    if config.hf_model:
        return _hugging_face_job(config, topology)
    model = ShardedModel(GPT(config.model_config()).to(topology.device), topology, config.zero, unit_classes=(Block,))
    tokens = _file_bytes(config.data_path) if config.data_path else load_stdlib_corpus()
    return Job(model, _checked_corpus(tokens, config.seq_len), lambda m, inputs, targets: m(inputs, targets),
               lambda folder: _export_gpt(model, folder))


def _hugging_face_job(config, topology: Topology) -> Job:
    from .. import hf  # transformers is optional: imported only for Hugging Face runs

    model = hf.load_causal_lm(config.hf_model, topology, config.zero, seed=config.seed)
    hf_config = model.module.config
    positions = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)
    if positions is not None and config.seq_len > positions:
        raise ValueError(f"seq_len={config.seq_len} exceeds the model's max_position_embeddings={positions}")
    tokenizer = hf.load_tokenizer(config.hf_model, hf_config.vocab_size)
    tokens = hf.tokenize_file(config.data_path, tokenizer) if config.data_path else load_stdlib_corpus().long()
    if tokens.numel() and int(tokens.max()) >= hf_config.vocab_size:
        raise ValueError(f"token id {int(tokens.max())} is outside the model's vocab_size={hf_config.vocab_size}")
    return Job(model, _checked_corpus(tokens, config.seq_len), hf.causal_lm_loss,
               lambda folder: hf.export_pretrained(model, folder, tokenizer))


def _file_bytes(path: str) -> torch.Tensor:
    """A file's bytes, the built-in GPT's tokens, [num_bytes] uint8."""
    data = Path(path)
    if not data.is_file():
        raise ValueError(f"data file {data} does not exist")
    return torch.frombuffer(bytearray(data.read_bytes()), dtype=torch.uint8)


def _checked_corpus(tokens: torch.Tensor, seq_len: int) -> ByteCorpus:
    corpus = ByteCorpus(tokens)
    shortest = min(corpus.split("train").numel(), corpus.split("validation").numel())
    if shortest <= seq_len + 1:
        raise ValueError(f"the data has {tokens.numel():,} tokens: its validation tenth needs more than "
                         f"seq_len + 1 = {seq_len + 1}; give a longer file or a shorter --seq-len")
    return corpus


def _export_gpt(model: ShardedModel, folder: str) -> None:
    """The built-in GPT as ``folder/model.safetensors``."""
    export_model(model, Path(folder) / "model.safetensors")
