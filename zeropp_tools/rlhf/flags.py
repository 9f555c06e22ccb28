"""The flags of ``zeropp rlhf`` (kept apart from the pipeline so ``--help`` stays light)."""

from __future__ import annotations

from ..cli.values import MODEL_SIZES, PRECISIONS, positive_float, positive_int

STAGES = ("sft", "reward", "ppo", "all")


def add_rlhf_arguments(parser) -> None:
    parser.add_argument("stage", choices=STAGES, help="one stage (each reads the previous one's weights), or all three")
    parser.add_argument("--out", default="runs/rlhf", help="folder for weights, metrics, plot")
    parser.add_argument("--weights", default=None,
                        help="folder with sft/ and reward/ weights from earlier stages (default: --out)")
    parser.add_argument("--model", default="small", choices=MODEL_SIZES, help="GPT size of all four models")
    parser.add_argument("--sft-steps", type=positive_int, default=200, help="supervised fine-tuning steps of the actor")
    parser.add_argument("--reward-body-steps", type=positive_int, default=2000,
                        help="language-model steps of the reward model's body before its head is trained")
    parser.add_argument("--reward-steps", type=positive_int, default=1500, help="training steps of the reward model")
    parser.add_argument("--iterations", type=positive_int, default=60, help="PPO iterations")
    parser.add_argument("--rollouts-per-rank", type=positive_int, default=16, help="prompts each rank rolls out per iteration")
    parser.add_argument("--kl", type=positive_float, default=0.3, help="KL penalty coefficient to the reference")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data order, sampling and initial weights")
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS,
                        help="compute dtype of PPO's gathered weights (SFT and the reward model train in fp32)")
    parser.add_argument("--qwz", action="store_true", help="INT8 weight gathers for all four models")
    parser.add_argument("--hpz", type=positive_int, default=1, help="hpZ partition size (2: the whole node)")
    parser.add_argument("--two-hop-gather", action="store_true",
                        help="weights of the trainable models cross nodes once per node (the two-hop gather; INT8 with --qwz)")
    parser.add_argument("--qgz", action="store_true", help="INT4 gradient reduce-scatter for actor and critic")
    parser.add_argument("--mixz", action="store_true", help="MixZ++: frozen models INT8 and resident in the node")
    parser.add_argument("--per-token-gathers", action="store_true",
                        help="generate without generation mode: every unit gathered again for every token")
