"""The PPO arithmetic of RLHF (InstructGPT / DeepSpeed-Chat step 3), vectorized over a batch
of rollouts. tests/test_rlhf.py holds each function to a slow loop written from the formula.

Shapes: ``[batch, steps]`` over the generated tokens of each rollout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens[t] | ...) from ``logits`` [batch, steps, vocab] -> [batch, steps]."""
    return torch.gather(F.log_softmax(logits.float(), dim=-1), 2, tokens.unsqueeze(-1)).squeeze(-1)


def kl_shaped_rewards(score: torch.Tensor, log_probs: torch.Tensor, reference_log_probs: torch.Tensor,
                      kl_coefficient: float) -> torch.Tensor:
    """Per-token reward: -beta * (log pi - log pi_ref), plus the reward model's ``score``
    [batch] on the last token."""
    rewards = -kl_coefficient * (log_probs - reference_log_probs)
    rewards[:, -1] += score
    return rewards


def generalized_advantages(rewards: torch.Tensor, values: torch.Tensor, gamma: float,
                           lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE: delta_t = r_t + gamma V_{t+1} - V_t (V after the last token is 0),
    A_t = delta_t + gamma lam A_{t+1}; returns (advantages, returns = A + V)."""
    steps = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(steps)):
        following = values[:, t + 1] if t + 1 < steps else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * following - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    return advantages, advantages + values


def whiten(values: torch.Tensor) -> torch.Tensor:
    return (values - values.mean()) / (values.std() + 1e-8)


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                clip: float) -> torch.Tensor:
    """Clipped surrogate: mean of max(-A r, -A clip(r, 1 - eps, 1 + eps)), r = pi / pi_old."""
    ratio = torch.exp(log_probs - old_log_probs)
    return torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip, 1 + clip)).mean()


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float) -> torch.Tensor:
    """Clipped value loss: 0.5 mean of max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2)."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2).mean()
