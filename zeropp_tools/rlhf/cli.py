"""``zeropp rlhf sft|reward|ppo|all``: the RLHF pipeline on 4 spawned CPU ranks (2 x 2)."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from zeropp import ZeroConfig
from zeropp.launch import finish_distributed, init_from_torchrun, spawn_ranks

from .pipeline import RLHFConfig, run_ppo, run_reward, run_sft, summarize, write_report

logger = logging.getLogger(__name__)
WORLD_SIZE = 4
STAGE_FUNCTIONS = {"sft": run_sft, "reward": run_reward, "ppo": run_ppo}


def rlhf_config(arguments) -> RLHFConfig:
    zero = ZeroConfig(quantized_weights=arguments.qwz, hpz_size=arguments.hpz, quantized_gradients=arguments.qgz,
                      two_hop_weight_gather=arguments.two_hop_gather, quantized_nontrainable_weights=arguments.mixz,
                      compute_dtype=arguments.precision)
    return RLHFConfig(out=arguments.out, weights=arguments.weights, model_size=arguments.model, sft_steps=arguments.sft_steps,
                      reward_body_steps=arguments.reward_body_steps,
                      reward_steps=arguments.reward_steps, ppo_iterations=arguments.iterations,
                      rollouts_per_rank=arguments.rollouts_per_rank, kl_coefficient=arguments.kl,
                      seed=arguments.seed, zero=zero, pinned_generation=not arguments.per_token_gathers)


def run_rlhf(arguments) -> int:
    config = rlhf_config(arguments)
    stages = ("sft", "reward", "ppo") if arguments.stage == "all" else (arguments.stage,)
    under_torchrun = "RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ
    if under_torchrun:
        rank, world_size = init_from_torchrun()
    results = {}
    for stage in stages:
        # SFT and the reward model train without ZeRO++ options: they are not what is compared.
        stage_config = config if stage == "ppo" else replace(config, zero=ZeroConfig())
        if under_torchrun:
            results[stage] = STAGE_FUNCTIONS[stage](rank, world_size, stage_config)
            continue
        logger.info("rlhf %s on %d ranks (2 nodes x 2)", stage, WORLD_SIZE)
        results[stage] = spawn_ranks(STAGE_FUNCTIONS[stage], WORLD_SIZE, (stage_config,), timeout_s=24 * 3600)[0]
        if stage == "reward":
            logger.info("reward model: held-out pair accuracy %s", results[stage]["held_out_accuracy_by_kind"])
        if stage == "sft":
            logger.info("sft: validation loss %.3f (reward body %.3f)", results[stage]["validation_loss"],
                        results[stage]["reward_body_validation_loss"])
    if under_torchrun:
        finish_distributed()
        if rank != 0:
            return 0
    if "ppo" in results:
        results["ppo"]["summary"] = summarize(results["ppo"]["records"])
        logger.info("ppo: %s", results["ppo"]["summary"])
    write_report(config, results)
    return 0
