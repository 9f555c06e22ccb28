"""Hugging Face causal LMs end to end: a local model folder (config, safetensors weights,
an offline tokenizer) fine-tuned on a text file by 2 nodes x 2 ranks, exported, and loaded
back by from_pretrained."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from make_hf_model import make_model_folder
from transformers import AutoModelForCausalLM, AutoTokenizer

from zeropp import ShardedModel, Topology, ZeroConfig
from zeropp.data import ByteCorpus
from zeropp.hf import load_causal_lm, load_tokenizer, tokenize_file
from zeropp.launch import spawn_ranks
from zeropp.train import TrainConfig, train

WORLD = 4
SETTINGS = dict(steps=3, batch_per_rank=2, seq_len=32, learning_rate=1e-3, warmup_steps=1, eval_every=3,
                eval_batches=2, ranks_per_node=2)


def text_file(folder: Path) -> Path:
    sources = sorted(Path(torch.__file__).parent.glob("nn/modules/*.py"))[:12]
    path = folder / "notes.txt"
    path.write_text("\n".join(source.read_text() for source in sources))
    return path


def loss_of(model, inputs, targets):
    logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1)).item()


def batches(folder, data, vocab_size, split, count, config):
    corpus = ByteCorpus(tokenize_file(data, load_tokenizer(folder, vocab_size)))
    return [corpus.global_batch(split, index, config.batch_per_rank * WORLD, config.seq_len,
                                config.seed if split == "train" else 0) for index in range(count)]


@pytest.mark.parametrize("arch,tokenizer", [("llama", True), ("gpt2", False)])
def test_fine_tune_export_and_from_pretrained(tmp_path, arch, tokenizer):
    data = text_file(tmp_path)
    folder = make_model_folder(arch, tmp_path / "model", data if tokenizer else None)
    config = TrainConfig(hf_model=str(folder), data_path=str(data), export_dir=str(tmp_path / "tuned"), **SETTINGS)
    summary = spawn_ranks(train, WORLD, (config,))[0]

    original = AutoModelForCausalLM.from_pretrained(folder)
    inputs, targets = batches(folder, data, original.config.vocab_size, "train", 1, config)[0]
    with torch.no_grad():  # step 0 on 4 ranks is the unsharded model's loss on the global batch
        assert abs(summary["losses"][0] - loss_of(original, inputs, targets)) <= 1e-5 * summary["losses"][0]

    tuned = AutoModelForCausalLM.from_pretrained(tmp_path / "tuned")
    validation = batches(folder, data, tuned.config.vocab_size, "validation", config.eval_batches, config)
    with torch.no_grad():
        want = sum(loss_of(tuned, i, t) for i, t in validation) / len(validation)
    assert abs(summary["validation_loss"] - want) <= 1e-5 * want  # the export is the trained model
    assert summary["losses"][-1] < summary["losses"][0]
    if tokenizer:
        assert AutoTokenizer.from_pretrained(tmp_path / "tuned").vocab_size == tuned.config.vocab_size


def random_start(rank, world_size, folder):
    topology = Topology.from_environment(ranks_per_node=min(2, world_size))
    model = load_causal_lm(folder, topology, ZeroConfig(), seed=3)
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # rotary tables (meta buffers) recomputed by the model's _init_weights
        assert torch.isfinite(torch.tensor(loss_of(model, tokens[:, :-1], tokens[:, 1:])))
    return model.full_state_dict(), len(model.units)


def test_a_folder_without_weights_starts_from_the_models_own_initialisation(tmp_path):
    folder = make_model_folder("llama", tmp_path / "model", None)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    one, units = spawn_ranks(random_start, 1, (str(folder),))[0]
    four = spawn_ranks(random_start, WORLD, (str(folder),))
    assert units == 1 + 4  # the root and one unit per decoder layer (_no_split_modules)
    for state, _ in four:
        assert all(torch.equal(state[name], one[name]) for name in one)
    norms = [name for name in one if "norm" in name]
    assert norms and all(torch.equal(one[name], torch.ones_like(one[name])) for name in norms)
    assert abs(one["model.layers.0.mlp.up_proj.weight"].std().item() - 0.02) < 0.002
