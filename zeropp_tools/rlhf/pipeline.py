"""``zeropp rlhf``: supervised fine-tuning, a reward model, then PPO with the actor and
critic trained and the reference and reward models frozen, all four sharded by zeropp.

Each stage is a function run on every rank; each reads the previous stage's weights from
``out`` (safetensors) straight into its shards.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from zeropp import ShardedModel, ShardedOptimizer, Topology, ZeroConfig
from zeropp.checkpoint import export_model
from zeropp.data import ByteCorpus, load_stdlib_corpus
from zeropp.engine.generation import gathered_bytes
from zeropp.memory import process_resources, trimmed_rss_bytes
from zeropp.models import Block, GPTConfig
from zeropp.train import TrainConfig, train

from . import data, ppo
from .models import ScalarHead, load_sharded

@dataclass(frozen=True)
class RLHFConfig:
    out: str = "runs/rlhf"
    weights: str | None = None  # where the sft/ and reward/ weights are (default: out)
    model_size: str = "small"
    ranks_per_node: int = 2
    seed: int = 0
    prompt_length: int = 16
    continuation_length: int = 16
    sft_steps: int = 200
    # The reward model's body trains longer than the actor: a judge that models the corpus
    # better than the policy can tell the policy's own text from real text.
    reward_body_steps: int = 2000
    reward_steps: int = 1500
    reward_batch_per_rank: int = 16
    reward_lr: float = 1e-3
    ppo_iterations: int = 60
    rollouts_per_rank: int = 16
    ppo_epochs: int = 2
    actor_lr: float = 2e-4
    critic_lr: float = 1e-3
    kl_coefficient: float = 0.3
    clip: float = 0.2
    value_clip: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    temperature: float = 1.0
    pinned_generation: bool = True  # generation mode (each unit gathered once per generate call)
    zero: ZeroConfig = field(default_factory=ZeroConfig)

    def gpt_config(self) -> GPTConfig:
        return GPTConfig.preset(self.model_size)

    def path(self, stage: str) -> Path:
        return Path(self.weights or self.out) / stage / "model.safetensors"


def run_sft(rank: int, world_size: int, config: RLHFConfig) -> dict:
    """The actor learns the corpus (a short run: PPO has room to improve it); then, from
    scratch, the reward model's body (a longer run)."""
    result = {}
    for stage, steps in (("sft", config.sft_steps), ("reward_body", config.reward_body_steps)):
        settings = TrainConfig(model_size=config.model_size, steps=steps, batch_per_rank=8, seq_len=64,
                               learning_rate=2e-3, warmup_steps=10, eval_every=steps, seed=config.seed,
                               ranks_per_node=config.ranks_per_node, export_dir=str(config.path(stage).parent),
                               zero=config.zero)
        summary = train(rank, world_size, settings)
        prefix = "" if stage == "sft" else "reward_body_"
        result.update({f"{prefix}validation_loss": summary["validation_loss"],
                       f"{prefix}final_train_loss": summary["final_train_loss"]})
    return result


def run_reward(rank: int, world_size: int, config: RLHFConfig) -> dict:
    """A scalar head on the reward body, trained so the real continuation outscores a
    shuffled one, a repeated byte, or (every third row) the SFT model's own sample."""
    topology = Topology.from_environment(config.ranks_per_node)
    sampler = load_sharded("gpt", config.gpt_config(), config.path("sft"), topology, config.zero, trainable=False)
    generator = torch.Generator(device=topology.device).manual_seed(config.seed * 1000 + rank)
    torch.manual_seed(config.seed)
    module = ScalarHead(config.gpt_config())
    module.gpt.load_state_dict(load_file(config.path("reward_body")))
    model = ShardedModel(module.to(topology.device), topology, config.zero, unit_classes=(Block,))
    optimizer = ShardedOptimizer(model, lambda params: torch.optim.AdamW(params, lr=config.reward_lr))
    corpus = ByteCorpus(load_stdlib_corpus())
    losses = []
    for step in range(config.reward_steps):
        chosen, rejected = _rank_rows(config, corpus, "train", step, rank, world_size)
        rejected = _with_samples(sampler, chosen, rejected, config, generator)
        chosen_scores, rejected_scores = _scores(model, torch.cat([chosen, rejected])).chunk(2)
        loss = -torch.nn.functional.logsigmoid(chosen_scores - rejected_scores).mean()  # Bradley-Terry
        loss.backward()
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_mean_over_ranks(loss.detach()))
    accuracy = _pair_accuracy(model, config, corpus, rank, world_size, sampler, generator)
    export_model(model, config.path("reward"))
    return {"losses": losses, "held_out_accuracy": accuracy["overall"], "held_out_accuracy_by_kind": accuracy}


def _with_samples(sampler, chosen: torch.Tensor, rejected: torch.Tensor, config, generator) -> torch.Tensor:
    """``rejected`` with every third row's continuation replaced by the SFT model's sample
    for the same prompt: the reward model learns real text over the model's own."""
    rows = torch.arange(2, chosen.shape[0], 3)
    prompt = chosen[rows, : config.prompt_length].to(sampler.topology.device)
    samples = sampler.generate(prompt, config.continuation_length, temperature=config.temperature, generator=generator)
    rejected = rejected.clone()
    rejected[rows] = samples.to(rejected.device)
    return rejected


def _rank_rows(config, corpus, split, index, rank, world_size):
    count = config.reward_batch_per_rank
    chosen, rejected = data.preference_pairs(corpus, split, index, count * world_size, config.prompt_length,
                                             config.continuation_length, config.seed)
    rows = slice(rank * count, (rank + 1) * count)
    return chosen[rows], rejected[rows]


def _scores(model, sequences: torch.Tensor) -> torch.Tensor:
    return model(sequences.to(model.topology.device))[:, -1]  # the score is read at the last token


@torch.no_grad()
def _pair_accuracy(model, config, corpus, rank, world_size, sampler, generator, batches: int = 8) -> dict:
    """Held-out share of pairs the reward model orders right, overall and by kind of rejection."""
    kinds = {"shuffled": [], "repeated": [], "model_sample": []}
    for index in range(batches):
        chosen, rejected = _rank_rows(config, corpus, "validation", index, rank, world_size)
        rejected = _with_samples(sampler, chosen, rejected, config, generator)
        chosen_scores, rejected_scores = _scores(model, torch.cat([chosen, rejected])).chunk(2)
        for row, right in enumerate((chosen_scores > rejected_scores).tolist()):
            kind = "model_sample" if row % 3 == 2 else "shuffled" if row % 2 == 0 else "repeated"
            kinds[kind].append(float(right))
    counts = torch.tensor([[sum(v), len(v)] for v in kinds.values()], dtype=torch.float64, device=model.topology.device)
    dist.all_reduce(counts)
    result = {kind: (counts[i, 0] / counts[i, 1]).item() for i, kind in enumerate(kinds)}
    result["overall"] = (counts[:, 0].sum() / counts[:, 1].sum()).item()
    return result


def _mean_over_ranks(value: torch.Tensor) -> float:
    total = value.detach().float().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def run_ppo(rank: int, world_size: int, config: RLHFConfig) -> dict:
    topology = Topology.from_environment(config.ranks_per_node)
    gpt = config.gpt_config()
    actor = load_sharded("gpt", gpt, config.path("sft"), topology, config.zero, trainable=True)
    reference = load_sharded("gpt", gpt, config.path("sft"), topology, config.zero, trainable=False)
    critic = load_sharded("scalar", gpt, config.path("reward"), topology, config.zero, trainable=True)
    reward = load_sharded("scalar", gpt, config.path("reward"), topology, config.zero, trainable=False)
    actor_optimizer = ShardedOptimizer(actor, lambda params: torch.optim.AdamW(params, lr=config.actor_lr))
    critic_optimizer = ShardedOptimizer(critic, lambda params: torch.optim.AdamW(params, lr=config.critic_lr))
    corpus = ByteCorpus(load_stdlib_corpus())
    bigrams = data.bigram_log_probs(corpus)
    generator = torch.Generator(device=topology.device).manual_seed(config.seed * 1000 + rank)
    models = (actor, reference, critic, reward)
    records = []
    for iteration in range(config.ppo_iterations):
        for model in models:
            model.comm_log.reset()
        record = _ppo_iteration(config, corpus, bigrams, generator, models, (actor_optimizer, critic_optimizer),
                                iteration, rank, world_size)
        record["inter_node_bytes"] = {name: _crossed(model) for name, model in zip(
            ("actor", "reference", "critic", "reward"), models)}
        records.append(record)
    return {"records": records}


def _crossed(model) -> int:
    totals = torch.tensor(float(model.comm_log.totals().get("received_inter_node", 0)), device=model.topology.device)
    dist.all_reduce(totals)
    return int(totals.item())


def _ppo_iteration(config, corpus, bigrams, generator, models, optimizers, iteration, rank, world_size) -> dict:
    actor, reference, critic, reward = models
    device = actor.topology.device
    count, start = config.rollouts_per_rank, config.prompt_length
    prompt = data.prompts(corpus, "train", iteration, count * world_size, start, config.seed)
    prompt = prompt[rank * count : (rank + 1) * count].to(device)
    # Resting and released memory are read with the allocator's free pages handed back, outside
    # the timed phases: what the models hold, not what glibc kept for reuse.
    resting = trimmed_rss_bytes()
    began = time.perf_counter()
    with actor.generation_mode() if config.pinned_generation else torch.no_grad():
        sequences = actor.module.generate(prompt, config.continuation_length, temperature=config.temperature,
                                          generator=generator)  # [count, prompt + continuation]
        pinned = gathered_bytes(actor)  # what generation mode holds at its end: every unit
        in_generation = process_resources()["rss_bytes"]
    generated = time.perf_counter()
    memory = {"resting_rss": resting, "generation_rss": in_generation, "released_rss": trimmed_rss_bytes(),
              "pinned_gathered_bytes": pinned, "released_gathered_bytes": gathered_bytes(actor)}
    scoring_began = time.perf_counter()
    with torch.no_grad():
        old_log_probs = _generated_log_probs(actor, sequences, start)
        reference_log_probs = _generated_log_probs(reference, sequences, start)
        old_values = critic(sequences)[:, start - 1 : -1]
        score = reward(sequences)[:, -1]
    rewards = ppo.kl_shaped_rewards(score, old_log_probs, reference_log_probs, config.kl_coefficient)
    advantages, returns = ppo.generalized_advantages(rewards, old_values, config.gamma, config.lam)
    advantages = ppo.whiten(advantages)
    scored = time.perf_counter()
    for _ in range(config.ppo_epochs):
        loss = ppo.policy_loss(_generated_log_probs(actor, sequences, start), old_log_probs, advantages, config.clip)
        loss.backward()
        values = critic(sequences)[:, start - 1 : -1]
        ppo.value_loss(values, old_values, returns, config.value_clip).backward()
        for model, optimizer in zip((actor, critic), optimizers):
            optimizer.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad()
    trained = time.perf_counter()
    kl = (old_log_probs - reference_log_probs).sum(dim=1).mean()
    gain = data.order_gain(bigrams, sequences, start, seed=iteration)
    return {
        "iteration": iteration, "reward": _mean_over_ranks(score.mean()), "kl": _mean_over_ranks(kl),
        "order_gain": _mean_over_ranks(gain.mean().to(device)),
        "bigram_log_prob": _mean_over_ranks(data.bigram_score(bigrams, sequences, start).mean().to(device)),
        "generation_s": generated - began, "scoring_s": scored - scoring_began, "training_s": trained - scored,
        "tokens_generated": count * world_size * config.continuation_length, "memory": memory,
        "sample": bytes(sequences[0].tolist()).decode("utf-8", errors="replace") if rank == 0 else None,
    }


def _generated_log_probs(model, sequences: torch.Tensor, start: int) -> torch.Tensor:
    """log pi(token) of each generated token, [batch, continuation]."""
    logits = model(sequences[:, :-1])[:, start - 1 :]
    return ppo.token_log_probs(logits, sequences[:, start:])


def summarize(records: list[dict]) -> dict:
    """The PPO run's verdict inputs: first and last fifth of the iterations."""
    fifth = max(1, len(records) // 5)
    first, last = records[:fifth], records[-fifth:]

    def mean(rows, key):
        return statistics.fmean(row[key] for row in rows)

    return {
        "reward_first": mean(first, "reward"), "reward_last": mean(last, "reward"),
        "bigram_first": mean(first, "bigram_log_prob"), "bigram_last": mean(last, "bigram_log_prob"),
        "order_gain_first": mean(first, "order_gain"), "order_gain_last": mean(last, "order_gain"),
        "kl_last": mean(last, "kl"), "kl_max": max(row["kl"] for row in records),
        "generation_s": statistics.median(row["generation_s"] for row in records),
        "scoring_s": statistics.median(row["scoring_s"] for row in records),
        "training_s": statistics.median(row["training_s"] for row in records),
        "rss_in_generation_over_resting": statistics.median(
            row["memory"]["generation_rss"] / row["memory"]["resting_rss"] for row in records),
        "rss_released_over_resting": statistics.median(
            row["memory"]["released_rss"] / row["memory"]["resting_rss"] for row in records),
        "pinned_gathered_bytes": max(row["memory"]["pinned_gathered_bytes"] for row in records),
        "released_gathered_bytes": max(row["memory"]["released_gathered_bytes"] for row in records),
    }


def write_report(config: RLHFConfig, results: dict) -> None:
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(replace(config)), indent=2, default=str) + "\n")
    previous = out / "results.json"  # stages run one at a time add to it
    merged = {**(json.loads(previous.read_text()) if previous.is_file() else {}), **results}
    previous.write_text(json.dumps(merged, indent=2) + "\n")
    if "ppo" in results:
        with open(out / "ppo.jsonl", "w") as handle:
            for record in results["ppo"]["records"]:
                handle.write(json.dumps(record) + "\n")
        _plot(results["ppo"]["records"], out / "ppo.png")


def _plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    iterations = [row["iteration"] for row in records]
    figure, axes = plt.subplots(1, 5, figsize=(20, 3.5))
    for axis, key, title in zip(axes, ("reward", "kl", "order_gain", "bigram_log_prob"),
                                ("reward model score", "KL to reference (nats / rollout)",
                                 "order gain (independent, nats / byte)", "bigram log-prob / byte")):
        axis.plot(iterations, [row[key] for row in records])
        axis.set_title(title)
        axis.set_xlabel("PPO iteration")
    for key in ("generation_s", "scoring_s", "training_s"):
        axes[4].plot(iterations, [row[key] for row in records], label=key.removesuffix("_s"))
    axes[4].set_title("seconds per iteration (rank 0)")
    axes[4].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
