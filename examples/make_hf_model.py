"""Write a small Hugging Face causal LM folder to fine-tune with zeropp, offline.

    python examples/make_hf_model.py --arch llama --data notes.txt --out tiny-llama

The folder is what ``save_pretrained`` writes: config.json, model.safetensors (random
weights standing in for a pretrained model) and a byte-level BPE tokenizer trained on
``--data`` (tokenizer.json), so nothing is downloaded. ``zeropp train --hf-config DIR``
takes any such folder, including a real pretrained model saved locally.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PreTrainedTokenizerFast

ARCHITECTURES = ("llama", "gpt2")


def train_tokenizer(text_file: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(text_file)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def model_config(arch: str, vocab_size: int, width: int, layers: int):
    if arch == "llama":
        return LlamaConfig(vocab_size=vocab_size, hidden_size=width, intermediate_size=4 * width,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=512, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    # No dropout: fine-tuning runs stay reproducible and comparable with the unsharded model.
    return GPT2Config(vocab_size=vocab_size, n_embd=width, n_layer=layers, n_head=4, n_positions=512,
                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def make_model_folder(arch: str, out: Path, data: Path | None, vocab_size: int = 512, width: int = 64,
                      layers: int = 4, seed: int = 0) -> Path:
    """``data`` None: no tokenizer files (zeropp then uses bytes; vocab_size must be >= 256)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch={arch!r}; allowed values: {list(ARCHITECTURES)}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(arch, vocab_size, width, layers))
    model.save_pretrained(out)  # config.json + model.safetensors
    if data is not None:
        train_tokenizer(data, vocab_size).save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="llama", choices=ARCHITECTURES)
    parser.add_argument("--data", type=Path, required=True, help="text file the tokenizer is trained on")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    arguments = parser.parse_args()
    folder = make_model_folder(arguments.arch, arguments.out, arguments.data, width=arguments.width,
                               layers=arguments.layers)
    print(f"wrote {folder}: {sorted(p.name for p in folder.iterdir())}")


if __name__ == "__main__":
    main()
