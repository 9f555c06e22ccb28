"""RLHF: the PPO arithmetic against slow loops written from the formulas, and the pipeline
end to end on 2 nodes x 2 (short, on the tiny GPT)."""

import json
import math

import pytest
import torch

from zeropp_tools.cli.main import main
from zeropp_tools.rlhf import ppo


def reference_gae(rewards, values, gamma, lam):
    advantages = [[0.0] * len(row) for row in rewards]
    for b, (row_r, row_v) in enumerate(zip(rewards, values)):
        following_advantage = 0.0
        for t in reversed(range(len(row_r))):
            following_value = row_v[t + 1] if t + 1 < len(row_v) else 0.0
            delta = row_r[t] + gamma * following_value - row_v[t]
            following_advantage = delta + gamma * lam * following_advantage
            advantages[b][t] = following_advantage
    returns = [[a + v for a, v in zip(row_a, row_v)] for row_a, row_v in zip(advantages, values)]
    return advantages, returns


def reference_policy_loss(log_probs, old_log_probs, advantages, clip):
    terms = []
    for lp_row, old_row, adv_row in zip(log_probs, old_log_probs, advantages):
        for lp, old, adv in zip(lp_row, old_row, adv_row):
            ratio = math.exp(lp - old)
            terms.append(max(-adv * ratio, -adv * min(max(ratio, 1 - clip), 1 + clip)))
    return sum(terms) / len(terms)


def reference_value_loss(values, old_values, returns, clip):
    terms = []
    for v_row, old_row, ret_row in zip(values, old_values, returns):
        for v, old, ret in zip(v_row, old_row, ret_row):
            clipped = old + min(max(v - old, -clip), clip)
            terms.append(0.5 * max((v - ret) ** 2, (clipped - ret) ** 2))
    return sum(terms) / len(terms)


def random(shape, seed, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 1.0), (0.99, 0.0)])
def test_generalized_advantages_match_the_formula(gamma, lam):
    rewards, values = random((3, 7), 0), random((3, 7), 1)
    advantages, returns = ppo.generalized_advantages(rewards, values, gamma, lam)
    want_advantages, want_returns = reference_gae(rewards.tolist(), values.tolist(), gamma, lam)
    torch.testing.assert_close(advantages, torch.tensor(want_advantages, dtype=torch.float64))
    torch.testing.assert_close(returns, torch.tensor(want_returns, dtype=torch.float64))


def test_clipped_losses_match_the_formulas():
    log_probs, old = random((4, 6), 2, 0.3), random((4, 6), 3, 0.3)  # ratios on both sides of the clip
    advantages, values, old_values, returns = random((4, 6), 4), random((4, 6), 5), random((4, 6), 6), random((4, 6), 7)
    got = ppo.policy_loss(log_probs, old, advantages, 0.2).item()
    assert got == pytest.approx(reference_policy_loss(log_probs.tolist(), old.tolist(), advantages.tolist(), 0.2))
    got = ppo.value_loss(values, old_values, returns, 0.2).item()
    assert got == pytest.approx(reference_value_loss(values.tolist(), old_values.tolist(), returns.tolist(), 0.2))


def test_kl_shaped_rewards_and_token_log_probs():
    logits, tokens = random((2, 3, 5), 8), torch.tensor([[0, 4, 2], [1, 1, 3]])
    log_probs = ppo.token_log_probs(logits, tokens)
    for b in range(2):
        for t in range(3):
            row = logits[b, t].tolist()
            want = row[tokens[b, t]] - math.log(sum(math.exp(x) for x in row))
            assert log_probs[b, t].item() == pytest.approx(want, rel=1e-6)
    reference = random((2, 3), 9)
    rewards = ppo.kl_shaped_rewards(torch.tensor([1.0, -2.0], dtype=torch.float64), log_probs.double(), reference, 0.1)
    for b, score in enumerate((1.0, -2.0)):
        for t in range(3):
            want = -0.1 * (log_probs[b, t].item() - reference[b, t].item()) + (score if t == 2 else 0.0)
            assert rewards[b, t].item() == pytest.approx(want)


def test_the_pipeline_runs_all_stages_on_two_nodes(tmp_path):
    out = tmp_path / "rlhf"
    assert main(["rlhf", "all", "--out", str(out), "--model", "tiny", "--sft-steps", "10", "--reward-body-steps", "10",
                 "--reward-steps", "10", "--iterations", "3", "--rollouts-per-rank", "4", "--hpz", "2", "--qwz", "--two-hop-gather", "--mixz"]) == 0
    results = json.loads((out / "results.json").read_text())
    records = results["ppo"]["records"]
    assert len(records) == 3 and (out / "ppo.png").is_file()
    for key in ("reward", "kl", "bigram_log_prob", "generation_s", "scoring_s", "training_s"):
        assert all(math.isfinite(row[key]) for row in records), key
    # MixZ++: the frozen reference and reward models cross nodes in the first iteration only.
    for name in ("reference", "reward"):
        crossed = [row["inter_node_bytes"][name] for row in records]
        assert crossed[0] > 0 and crossed[1] == crossed[2] == 0, (name, crossed)
