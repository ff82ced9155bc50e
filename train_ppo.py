"""PPO for language models: actor, critic, frozen reference, reward; GAE, clipped losses, KL.

Stage 3 of RLHF (Ziegler et al. 2019; Ouyang et al. 2022) with the details of Huang et al. 2023,
"The N Implementation Details of RLHF with PPO" ([N section #item] at each use), and of Huang et
al. 2022, "The 37 Implementation Details of Proximal Policy Optimization" ([37 section #item]).
PPO: Schulman et al. 2017, eq. 7; GAE: Schulman et al. 2016, eq. 16. `--advantage_estimator
grpo|rloo` drops the critic for group baselines over each prompt's samples (Shao et al. 2024,
DeepSeekMath; Ahmadian et al. 2024, RLOO).

    torchrun --nproc_per_node=2 train_ppo.py --model runs/sft/hf --out_dir runs/ppo
    torchrun --nproc_per_node=2 train_ppo.py --model runs/sft/hf --out_dir runs/ppo --resume latest

Reading order: `Args`; the math as in the papers (`compute_rewards`, `compute_gae`, `policy_loss`,
...); a rollout as tensors (`RolloutBatch`, `logprobs_of`, `values_of`); the six phases of one
iteration, numbered as in `main`: (1) `generate`, (2) `score`, (3) `old_logprobs_and_values`,
(4) `compute_advantages`, (5) `ppo_update` (the loss it optimises is formed in `ppo_loss`),
(6) `rollout.sync_weights`. The plumbing (process group, sharding, logging) is in common.py; the
engines in rollout.py.
"""

import copy
import dataclasses
import decimal
import functools
import hashlib
import importlib
import inspect
import json
import math
import os
import typing

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers import AutoModelForSequenceClassification
from transformers import AutoModelForTokenClassification
from transformers import get_linear_schedule_with_warmup

import checkpoint
import common
import rollout
import task


@dataclasses.dataclass
class Args(common.RunArgs):
    """train_ppo.py's flags. Those every stage has (resuming, saving, FSDP2, logging) come from
    `common.RunArgs`."""

    model: str = "runs/sft/hf"
    """the SFT export (HF folder or hub id): initialises actor, critic backbone and frozen
    reference"""
    data: str = ""
    """prompts JSONL, one {"prompt": ...} per line, a string or a conversation (a list of {"role",
    "content"} messages), with any other fields the reward function takes by name (an "answer",
    say) (default: the embedded addition task's train split)"""
    eval_data: str = ""
    """held-out prompts JSONL (default: the embedded task's held-out split; none with --data)"""
    out_dir: str = "runs/ppo"
    """checkpoints/, metrics.jsonl and the final hf/ export of the actor go here"""
    max_steps: int = 150
    """PPO iterations (rollout + scoring + ppo_epochs of updates + weight sync)"""
    save_every: int = 50
    """save a full checkpoint every this many iterations (and at the end)"""
    seed: int = 42
    """seeds prompt order, sampling and every RNG"""
    rollout_batch_size: int = 64
    """prompts per iteration, over all ranks"""
    n_samples_per_prompt: int = 4
    """responses sampled per prompt (the group for grpo/rloo)"""
    train_batch_size: int = 64
    """responses per optimizer step, over all ranks (rollout_batch_size * n / this = updates per
    epoch)"""
    micro_batch_size: int = 32
    """at most this many responses per forward/backward on one rank (a rank's share of a
    --train_batch_size smaller than it is one); grad accumulation makes up the rest"""
    ppo_epochs: int = 2
    """passes over each iteration's rollouts, reshuffled every pass [N policy #7]"""
    lr: float = 1e-4
    """actor learning rate (AdamW, eps 1e-5 [37 core #3], linear decay to 0 [N general #5])"""
    critic_lr: float = 1e-3
    """critic learning rate"""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay, actor and critic: torch's default, which every measured run
    here used ([37 core #3] and TRL's PPO use none: 0)"""
    warmup_steps: int = 0
    """iterations over which both learning rates rise linearly from 0 before their decay (the
    first iteration's rate is 0: it only fills AdamW's moments); a fresh AdamW's first steps move
    every weight by about the learning rate, whatever its gradient"""
    max_grad_norm: float = 1.0
    """clip each model's global gradient norm to this"""
    advantage_estimator: typing.Literal["gae", "grpo", "rloo"] = "gae"
    """gae (critic + GAE), grpo (group mean/std baseline, no critic) or rloo (leave-one-out, no
    critic)"""
    scale_rewards: typing.Literal["group", "batch", "none"] = "group"
    """grpo only: what a group's centred scores are divided by: group, the group's std (Shao et
    al. 2024, sec. 4.1.2); batch, the whole batch's std (Liu et al. 2025, "Tricks or Traps"); none,
    nothing (Dr. GRPO, Liu et al. 2025). As TRL's scale_rewards"""
    gamma: float = 1.0
    """GAE discount [N policy #6]"""
    lam: float = 0.95
    """GAE lambda (Schulman et al. 2016, eq. 16; 0.95 as N+'s and TRL's)"""
    cliprange: float = 0.2
    """PPO ratio clip epsilon: the ratio is clipped to [1 - eps, 1 + eps]"""
    cliprange_high: float = 0.0
    """the upper clip's epsilon where it differs from --cliprange's, [1 - eps, 1 + this] (DAPO's
    clip-higher, Yu et al. 2025, eq. 10: 0.28 with --cliprange 0.2 there, so that a rare token
    can gain more probability in one step; a narrower one is taken too); 0: --cliprange, the
    symmetric clip"""
    cliprange_value: float = 0.2
    """value clip around the old values; 0: no value clipping [N policy #10]"""
    kl_coef: float = 0.05
    """beta of the per-token KL penalty in the reward (gae, rloo), or of the KL loss term (grpo,
    Shao et al. 2024, eq. 4) (initial value when adaptive); 0 (and no --target_kl): no reference
    model is loaded or run"""
    target_kl: float = 0.0
    """> 0: adaptive KL controller aiming at this KL per response, horizon 10k responses; 0: fixed
    beta. The controller scales beta by a factor, so from --kl_coef 0 it stays 0"""
    kl_estimator: typing.Literal["k1", "k3"] = "k1"
    """gae and rloo: the per-token KL in the reward (Schulman 2020, "Approximating KL
    divergence"; TRL's kl_estimator): k1, log pi - log pi_ref; k3, r - 1 - log r with r = pi_ref /
    pi, never negative, less variance. Both estimate the KL's value without bias, but only k1,
    as a reward, has the policy gradient of KL(pi || pi_ref); k3's is biased (Tang and Munos
    2025, arXiv 2506.09477). objective/kl logs k1 either way. grpo's KL is its k3 loss term
    (eq. 4)"""
    missing_eos_penalty: float = 1.0
    """subtracted from the score of a response cut at max_new_tokens without EOS, as TRL's
    missing_eos_penalty (N23 replaces the score by -1 instead) [N policy #5]"""
    whiten_rewards: bool = False
    """whiten the per-token rewards before GAE, their mean kept: (r - mean) / std + mean, as
    OpenAI's whiten(shift_mean=False) (a biased std; TRL's is unbiased) [N policy #9]"""
    reward_fn: str = "task:reward_fn"
    """module:function(prompt, response) -> float, the rule reward (used unless --reward_model);
    parameters after those two get the data row's fields of their names (`answer`, say), or all
    of them with **kwargs (never the row's prompt or response). Several, comma-separated, are
    summed (weighted by --reward_weights) and each logged, as TRL's reward_funcs"""
    reward_weights: str = ""
    """the weights of the --reward_fn rules in the sum, comma-separated floats in their order
    (TRL's reward_weights); '': 1 each"""
    reward_model: str = ""
    """HF AutoModelForSequenceClassification folder (train_rm.py's export); its score at the last
    real token is the reward"""
    reward_norm: bool = True
    """normalise the reward model's score to (score - reward_mean) / reward_std with the two
    numbers its config.json records (train_rm.py writes them; absent: the raw score), so that a
    --kl_coef means the same for any reward model; false: the raw score"""
    gold_reward_fn: str = ""
    """with --reward_model: module:function(prompt, response) -> float (the row's fields as for
    --reward_fn), a rule logged beside the learned score (objective/gold_score,
    eval/gold_accuracy), never trained on"""
    max_new_tokens: int = 8
    """response length limit"""
    temperature: float = 1.0
    """sampling temperature, applied to the logits of every logprob too [N policy #1]"""
    rollout_engine: typing.Literal["auto", "vllm", "hf"] = "auto"
    """vllm, hf, or auto (vllm when installed and it takes the family's new weights)"""
    gpu_memory_utilization: float = 0.3
    """GPU only: share of GPU memory vLLM may take (the trainer needs the rest)"""
    enforce_eager: bool = False
    """GPU only: no CUDA graphs in vLLM (slower decoding, faster start, less memory)"""
    logprob_diff_warn: float = 0.0
    """warn when the sampled tokens' logprobs under the engine and under the actor differ by more
    than this on average (rollout/logprob_diff_mean): the policy trained is not the one sampled.
    0: 1e-3 on CPU (both in fp32: a right engine agrees to ~1e-7), 0.05 on GPU (bf16)"""
    eval_every: int = 25
    """greedy-decode the held-out prompts every this many iterations and at both ends; sample rows
    (samples.jsonl) at the same iterations but step 0, and the last"""
    eval_samples: int = 256
    """held-out prompts per evaluation"""
    offload_frozen: bool = False
    """FSDP2 CPU offload for the frozen models (reference and reward model): their weights live in
    host memory and each block is copied to the GPU for its forward (less GPU memory, a copy per
    block)"""


# What each number may be, checked when the flags are parsed (`common.check_limits`); every float
# must also be finite; 0 turns the *_every flags off. RunArgs' flags: `common.RUN_LIMITS`.
LIMITS = {
    "max_steps": ">= 1",
    "save_every": ">= 0",
    "rollout_batch_size": ">= 1",
    "n_samples_per_prompt": ">= 1",
    "train_batch_size": ">= 1",
    "micro_batch_size": ">= 1",
    "ppo_epochs": ">= 1",
    "lr": ">= 0",
    "critic_lr": ">= 0",
    "weight_decay": ">= 0",
    "warmup_steps": ">= 0",
    "max_grad_norm": "> 0",
    "gamma": ">= 0, <= 1",
    "lam": ">= 0, <= 1",
    "cliprange": "> 0, < 1",  # at 1 or more the lower clip, 1 - eps <= 0, never applies
    "cliprange_high": ">= 0",  # 0: --cliprange
    "cliprange_value": ">= 0",  # 0: no value clipping
    "kl_coef": ">= 0",
    "target_kl": ">= 0",
    "missing_eos_penalty": ">= 0",
    "max_new_tokens": ">= 1",
    # Every logprob divides the logits by the temperature [N policy #1], and PPO trains on sampled
    # responses: 0 (greedy) is for evaluation, which decodes greedily by itself. vLLM raises a
    # temperature below 0.01 to 0.01 with a warning (SamplingParams): it would sample a policy
    # other than the one every logprob here divides by.
    "temperature": ">= 0.01",
    "gpu_memory_utilization": "> 0, <= 1",
    "logprob_diff_warn": ">= 0",
    "eval_every": ">= 0",
    "eval_samples": ">= 0",
}


# ---- the math, as in the papers ----------------------------------------------------------------
# B: responses on this rank, R: the longest response's length. The [B, R] tensors a phase keeps
# (old and reference logprobs, values, rewards, advantages, returns) are zero past a response's
# end (`mask`); a forward's own outputs (`logprobs_of`, `values_of`, the ratio) are not, so every
# mean over tokens multiplies by `mask` and divides by the count of real tokens.
def masked_mean(x, mask, n=None):
    """Mean of x over mask == 1 (x, mask [B, R] -> a scalar); n: the count to divide by, when it
    spans more than this tensor (the global batch's tokens)."""
    if n is None:
        n = mask.sum()
    return (x * mask).sum() / n


def global_mean_var(x, mask):
    """(mean, variance, count) of x's masked entries over all ranks, float64 scalars; the
    variance biased (divided by the count). x, mask: any shape, the same.

    Two passes: the mean first, then the mean squared deviation from it. The one-pass
    E[x^2] - E[x]^2 cancels catastrophically when the mean is large against the spread (it was
    off by up to 1.65 on such inputs, and NaN when it came out negative). Collective: two
    all_reduces, so every rank gets the same global statistics."""
    x64 = x.double()
    mask64 = mask.double()
    sum_and_count = torch.stack([(x64 * mask64).sum(), mask64.sum()])
    dist.all_reduce(sum_and_count)  # the global batch's sum and count, in one collective
    total, count = sum_and_count.unbind()
    mean = total / count
    squared_deviations = (((x64 - mean) * mask64) ** 2).sum()
    dist.all_reduce(squared_deviations)  # summed over the global batch
    return mean, squared_deviations / count, count


def masked_whiten(x, mask, shift_mean=True):
    """(x - mean) / std over the masked entries of all ranks [N policy #9] (`global_mean_var`).
    x, mask [B, R]. Collective."""
    x64 = x.double()
    mean, var, _ = global_mean_var(x, mask)
    white = (x64 - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        white = white + mean
    return white.to(x.dtype) * mask


def kl_k1(logprobs, ref_logprobs, mask):
    """The per-token KL to the reference, k1 estimator: log pi(y_t) - log pi_ref(y_t) at each
    sampled token, whose sum over a response is an unbiased sample of KL(pi || pi_ref) (Schulman
    2020, "Approximating KL divergence"; Ziegler et al. 2019 eq. 2). All [B, R]."""
    return (logprobs - ref_logprobs) * mask


def kl_k3(logprobs, ref_logprobs, mask):
    """The per-token KL to the reference, k3 estimator: r - 1 - log r at each sampled token, with
    r = pi_ref(y_t) / pi(y_t) (Schulman 2020): unbiased as k1 (E[r] = 1 under pi), never
    negative (a token pi_ref likes more is not a negative penalty, as under k1), and of less
    variance while the two policies are close. Unbiased for the KL's value only: its gradient is
    not the KL's (Tang and Munos 2025; Liu et al. 2025, arXiv 2510.01555): as a reward it is
    biased, and as GRPO's loss (`kl_loss`) it pulls, on-policy, by the gradient of
    KL(pi_ref || pi), the other direction. Not clamped, as TRL's: OpenRLHF clamps each token's
    estimate to [-10, 10] and verl its log r to [-20, 20] and the estimate to [-10, 10], so a
    sampled token pi_ref likes far more (log r = 15: k3 = 3.3e6, k1 = -15) is penalised here
    by far more than there. All [B, R]."""
    # Masked before exp: at padding columns logprobs can be very negative, exp overflows to inf,
    # and inf * 0 is NaN.
    log_ratio = (ref_logprobs - logprobs) * mask
    return (torch.exp(log_ratio) - log_ratio - 1) * mask


# --kl_estimator's choices: the per-token KL that the reward is penalised by (gae, rloo)
KL_ESTIMATORS = {"k1": kl_k1, "k3": kl_k3}


def compute_rewards(scores, logprobs, ref_logprobs, mask, kl_coef, kl_estimator="k1"):
    """Per-token reward r_t = -beta * KL_t, KL_t = log pi(y_t) - log pi_ref(y_t) (k1; or k3,
    `kl_k3`), plus the score at the last response token (Ziegler et al. 2019 eq. 2; [N policy
    #8]). scores [B]; the rest [B, R]. Returns (rewards, kl), both [B, R]."""
    kl = KL_ESTIMATORS[kl_estimator](logprobs, ref_logprobs, mask)  # [B, R]
    rewards = -kl_coef * kl
    last = mask.sum(1).long() - 1  # index of each response's last token  [B]
    rewards[torch.arange(len(scores)), last] += scores
    return rewards, kl


def compute_gae(rewards, values, mask, gamma, lam):
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16) over response tokens:
        delta_t = r_t + gamma V_{t+1} - V_t,    A_t = delta_t + gamma lam A_{t+1},
    with V and A zero past the last token. returns = A + V, the value targets. All [B, R]."""
    R = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    next_advantage = torch.zeros_like(rewards[:, 0])  # [B]
    for t in reversed(range(R)):
        if t + 1 < R:
            alive = mask[:, t + 1]  # 1 while the response goes on past t, else 0
            next_value = values[:, t + 1] * alive
        else:
            alive = torch.zeros_like(next_advantage)
            next_value = alive
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = delta + gamma * lam * alive * next_advantage
        advantages[:, t] = next_advantage
    advantages = advantages * mask
    returns = (advantages + values) * mask
    return advantages, returns


def sequence_rewards(scores, kl, kl_coef):
    """RLOO's reward of a whole response, its score less beta times its summed KL,
        R(x, y) = r(x, y) - beta sum_t KL_t
    (Ahmadian et al. 2024, sec. 3.3: the whole response is one action, so its KL penalty is one
    number too; TRL's RLOO). scores [B], kl [B, R] -> [B]."""
    return scores - kl_coef * kl.sum(1)


def group_advantages(scores, kind, scale="group", batch_std=None):
    """Critic-free baselines over each prompt's n samples, scores [G, n] -> advantages [G, n].
    grpo: (s - mean) / (std + 1e-4) of the group (Shao et al. 2024, sec. 4.1.2, outcome
    supervision: the advantage of every token of the response in eq. 3's objective);
    the std unbiased (n - 1), as TRL's (OpenRLHF adds 1e-9): at n = 2, scores {1, 0} give
    +-0.707, not the +-1 a biased std gives. `scale` (--scale_rewards, as TRL's scale_rewards)
    says which std: "group", each group's own (sec. 4.1.2); "batch", one std of the whole batch's
    scores, `batch_std` (these G * n when not given) (Liu et al. 2025, "Tricks or Traps", arXiv
    2508.08221: the group's mean, the batch's std; a group whose samples nearly agree has a std
    near 0, and dividing by it magnifies their small differences, a learned reward's noise among
    wrong answers above all); "none", no division (Dr. GRPO, Liu et al. 2025, arXiv 2503.20783,
    sec. 3.1: the division weighs most the prompts the policy nearly always or never gets right;
    Dr. GRPO's other change, a constant in place of the token count in the loss's mean, is not
    made: `policy_loss` averages over the global batch's tokens, as DAPO and TRL's default).
    rloo: s - mean of the other n-1 samples (Ahmadian et al. 2024, sec. 2.3, after Kool et al.
    2019)."""
    n = scores.shape[1]
    if kind == "rloo":
        return scores - (scores.sum(1, keepdim=True) - scores) / (n - 1)
    if kind != "grpo":  # a choice added to --advantage_estimator without its baseline here
        raise ValueError(f"group_advantages: no baseline for {kind!r}")
    centred = scores - scores.mean(1, keepdim=True)  # [G, n]
    if scale == "none":
        return centred
    std = scores.std(1, keepdim=True)  # [G, 1]
    if scale == "batch" and batch_std is None:
        std = scores.std()
    elif scale == "batch":
        std = batch_std
    return centred / (std + 1e-4)


def batch_std(scores):
    """Collective: the unbiased std of the global batch's scores, every rank's [B] together, as
    TRL's scale_rewards="batch" takes it (over the rewards gathered from every process). Each
    rank holds its prompts' groups whole, but the batch is all of them (`global_mean_var`)."""
    _, var, count = global_mean_var(scores, torch.ones_like(scores))
    return math.sqrt(var.item() * count.item() / max(count.item() - 1, 1))  # unbiased: n - 1


def policy_loss(logprobs, old_logprobs, advantages, mask, cliprange, n_tokens, cliprange_high=None):
    """Clipped surrogate (Schulman et al. 2017, eq. 7), as a loss: the mean over tokens of
        max(-A ratio, -A clip(ratio, 1 - eps_low, 1 + eps_high)),
    eps_low = cliprange, eps_high = cliprange_high (DAPO's clip-higher, Yu et al. 2025, eq. 10;
    by default the same as eps_low, Schulman's symmetric clip). As TRL's: neither OpenRLHF's and
    verl's clamp of log ratio to [-20, 20] nor verl's default dual clip (Ye et al. 2020: a loss
    of at most -3 A where A < 0). All [B, R]; n_tokens: the global token count. Returns
    (pg_loss, clipfrac, approxkl, ratio)."""
    if cliprange_high is None:
        cliprange_high = cliprange
    ratio = torch.exp(logprobs - old_logprobs)  # [B, R]
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * ratio.clamp(1 - cliprange, 1 + cliprange_high)
    pg_loss = masked_mean(torch.max(pg_losses, pg_losses2), mask, n_tokens)
    clipfrac = masked_mean((pg_losses2 > pg_losses).float(), mask, n_tokens)
    approxkl = 0.5 * masked_mean((logprobs - old_logprobs) ** 2, mask, n_tokens)
    return pg_loss, clipfrac, approxkl, ratio


def kl_loss(logprobs, ref_logprobs, mask, n_tokens):
    """GRPO's KL term (Shao et al. 2024, eq. 4), the non-negative k3 estimator, unbiased for the
    KL's value: pi_ref/pi - log(pi_ref/pi) - 1 per token (`kl_k3`), averaged over tokens. Its
    gradient, on-policy, is that of KL(pi_ref || pi), not of the KL(pi || pi_ref) eq. 4 names
    (Liu et al. 2025, arXiv 2510.01555): as in TRL and the paper, kept. [B, R]."""
    return masked_mean(kl_k3(logprobs, ref_logprobs, mask), mask, n_tokens)


def value_loss(values, old_values, returns, mask, cliprange_value, n_tokens):
    """0.5 (V - returns)^2: half the squared-error value loss L^VF = (V - V^targ)^2 of Schulman
    et al. 2017 (eq. 9), the half as their baselines code has it; optionally clipped around the
    old values like the policy ([N policy #10]; baselines too). All [B, R]. Returns (vf_loss,
    vf_clipfrac)."""
    vf_losses = (values - returns) ** 2
    if cliprange_value <= 0:
        return 0.5 * masked_mean(vf_losses, mask, n_tokens), torch.zeros(())
    clipped = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    vf_losses2 = (clipped - returns) ** 2
    vf_clipfrac = masked_mean((vf_losses2 > vf_losses).float(), mask, n_tokens)
    return 0.5 * masked_mean(torch.max(vf_losses, vf_losses2), mask, n_tokens), vf_clipfrac


def normalised_scores(scores, mean, std):
    """(score - mean) / std, with the reward model's mean and std over reference responses (recorded
    by train_rm.py: the chosen responses of training pairs, where Ziegler et al. 2019 use samples of
    the initial policy [N RM #3], and Stiennon et al. 2020 set the mean of their dataset's reference
    summaries to 0, sec. 3.4) so that such responses score mean 0 and variance 1. A --kl_coef then
    weighs the KL against a score of unit scale, whatever the reward model's own scale. Under GAE
    the offset from the policy's own samples lands on the last token, where the critic absorbs it;
    grpo and rloo subtract a group baseline, which cancels it. scores [B]."""
    return (scores - mean) / std


def eos_penalized(scores, finished, penalty):
    """A response cut at max_new_tokens without EOS loses `penalty` [N policy #5]. scores [B]."""
    return scores - penalty * (1 - torch.tensor(finished, dtype=scores.dtype))


def update_kl_coef(kl_coef, kl, target, n_responses, horizon=10000):
    """Adaptive KL controller (Ziegler et al. 2019, sec. 2.2): beta <- beta (1 + K_beta e), the
    proportional error e clipped to +-0.2, in the horizon form of lm-human-preferences'
    AdaptiveKLController [N policy #11]: K_beta = n_responses / horizon (0.0256 at the defaults,
    64 x 4 / 10000; the paper's is 0.1)."""
    error = min(max(kl / target - 1, -0.2), 0.2)
    return kl_coef * (1 + error * n_responses / horizon)


# ---- a rollout as tensors ----------------------------------------------------------------------
@dataclasses.dataclass
class RolloutBatch:
    """Prompts and responses as tensors. Prompts are left-padded and responses right-padded, so
    every response starts at the same column, `response_start` (P) [N general #3]:

        input_ids       [B, P + R]   pad .. pad prompt | response pad .. pad
        attention_mask  [B, P + R]   1 on real tokens
        position_ids    [B, P + R]   counted from the mask, so left padding shifts nothing
        response_mask   [B, R]       1 on response tokens (EOS included), 0 on padding
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    response_start: int

    def select(self, rows):
        """The rows `rows` (an index tensor or slice) of every tensor."""
        return RolloutBatch(
            self.input_ids[rows],
            self.attention_mask[rows],
            self.position_ids[rows],
            self.response_mask[rows],
            self.response_start,
        )


def make_batch(prompts, responses, pad_id, device="cpu"):
    """A RolloutBatch from token-id lists: prompts [B][len_i], responses [B][len_j]."""
    P = max(len(p) for p in prompts)
    R = max(len(r) for r in responses)
    input_ids = []
    attention_mask = []
    for prompt, response in zip(prompts, responses):
        left = P - len(prompt)
        right = R - len(response)
        input_ids.append([pad_id] * left + prompt + response + [pad_id] * right)
        attention_mask.append([0] * left + [1] * (len(prompt) + len(response)) + [0] * right)
    input_ids = torch.tensor(input_ids)
    attention_mask = torch.tensor(attention_mask)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    response_mask = attention_mask[:, P:].float()
    return RolloutBatch(
        input_ids.to(device),
        attention_mask.to(device),
        position_ids.to(device),
        response_mask.to(device),
        P,
    )


def at_responses(outputs, batch):
    """The outputs that belong to the response tokens, [B, P + R, ...] -> [B, R, ...]; or
    [B, R + 1, ...] -> [B, R, ...] when the model computed only the last R + 1 columns
    (`logprobs_of`): counted from the right, both are the same columns.

    The one place the shift by one is made: the output at position t predicts token t + 1, so
    response token k (at column P + k) is predicted, and its state valued, at column P + k - 1.
    The last column predicts past the end and is dropped."""
    R = batch.input_ids.shape[1] - batch.response_start
    return outputs[:, -(R + 1) : -1]


def logprobs_of(model, batch, temperature):
    """log pi(y_k | prompt, y_<k) of every response token under model(logits / temperature):
    [B, R]. Temperature as when sampling [N policy #1]: without it, the KL to the reference and
    the PPO ratio are computed for another distribution than the one sampled from."""
    R = batch.input_ids.shape[1] - batch.response_start
    outputs = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,  # no KV cache in a scoring/training forward (cf. checkpoint_activations)
        # The LM head only on the R + 1 columns that predict the response (and the one past it):
        # at a real vocabulary its logits are the forward's largest tensor, and over a prompt
        # they would predict prompt tokens no loss reads. The same numbers (`at_responses`).
        **common.head_only_at_last(model, R + 1),
    )
    # [B, R, V]. The fp32 cast is not kept in a name: freed once divided, it is not held beside
    # the log-probabilities (at a real vocabulary each is a forward's largest tensor)
    logp = (at_responses(outputs.logits, batch).float() / max(temperature, 1e-7)).log_softmax(-1)
    responses = batch.input_ids[:, batch.response_start :]  # [B, R]
    return logp.gather(-1, responses[..., None])[..., 0]


def values_of(critic, batch):
    """V(s_k) for every response token k: the critic's output where y_k is predicted. [B, R]"""
    outputs = critic(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,  # no KV cache in a scoring/training forward (cf. checkpoint_activations)
    )
    return at_responses(outputs.logits, batch)[..., 0].float()


def hash_responses(items):
    """A short digest of a list of responses: equal runs sample equal tokens (checked on resume)."""
    return hashlib.sha256(repr(items).encode()).hexdigest()[:16]


# ---- setup -------------------------------------------------------------------------------------
def uses_reference(args):
    """Whether the run loads and runs the frozen reference: a KL to weigh (--kl_coef > 0) or to
    adapt beta to (--target_kl > 0, which logs it even from --kl_coef 0). Without one, no KL is
    computed at all (as TRL's GRPO at beta 0)."""
    return args.kl_coef > 0 or args.target_kl > 0


def kl_in_loss(args):
    """Whether the KL to the reference is a loss term (grpo: Shao et al. 2024, eq. 4), not a
    per-token penalty in the reward (gae, rloo: `compute_rewards`)."""
    return args.advantage_estimator == "grpo"


@dataclasses.dataclass
class Models:
    """The four roles. Only actor and critic train; their optimizers live in `roles`."""

    actor: torch.nn.Module
    ref: torch.nn.Module | None  # frozen: the KL anchor; None when no KL is asked for
    critic: torch.nn.Module | None  # gae only
    reward_model: torch.nn.Module | None  # --reward_model only; else --reward_fn scores
    reward_tokenizer: object = None  # the reward model's own tokenizer
    reward_norm: tuple | None = None  # (mean, std) of the reward model's score, or None: raw
    reward_context: int = 0  # the longest sequence the reward model takes (its own tokens)


def build_models(args, device):
    """(Models, tokenizer, roles = {name: (model, optimizer)} for the trained ones). Each model is
    sharded as soon as it is loaded (`place_model`): a rank holds one whole model in host memory
    at a time, not all four (at 7B parameters in fp32, 28 GB each, on each of 8 ranks)."""
    attention = args.attn_implementation
    actor, tok = common.load_model_and_tokenizer(args.model, AutoModelForCausalLM, attention)
    common.record_template_kwargs(tok, args.model)  # so the export renders as this run did
    place_model(actor, args, device, trained=True)
    ref = None
    if uses_reference(args):
        ref, _ = common.load_model_and_tokenizer(args.model, AutoModelForCausalLM, attention)
        ref.requires_grad_(False)
        place_model(ref, args, device, trained=False)
    models = Models(actor, ref, None, None)
    if args.advantage_estimator == "gae":
        # The critic: the SFT backbone and a value head; a zero head gives zero initial values
        # [N policy #2]; a separate network from the actor [37 core #13].
        critic, _ = common.load_model_and_tokenizer(
            args.model, AutoModelForTokenClassification, attention, new_head=True, num_labels=1
        )
        head = common.value_head(critic)
        torch.nn.init.zeros_(head.weight)
        if head.bias is not None:
            torch.nn.init.zeros_(head.bias)
        place_model(critic, args, device, trained=True)
        models.critic = critic
    if args.reward_model:
        load_reward_model(args, models)
        place_model(models.reward_model, args, device, trained=False)
    roles = {"actor": (actor, adamw(actor, args.lr, args.weight_decay))}
    if models.critic is not None:
        roles["critic"] = (models.critic, adamw(models.critic, args.critic_lr, args.weight_decay))
    return models, tok, roles


def place_model(model, args, device, trained):
    """Shard a model just loaded (`common.shard_model`), in eval mode: dropout off, so the first
    ratio is exactly 1 and the KL is reproducible [N policy #4]; gradients flow all the same.
    Activation checkpointing (set before sharding) for the trained models, whose activations the
    backward needs; --offload_frozen for the frozen ones (reference, reward model) only."""
    if trained and args.gradient_checkpointing:
        common.checkpoint_activations(model)
    offload = args.offload_frozen and not trained
    common.shard_model(model.eval(), device, offload, args.reshard_after_forward)


def load_reward_model(args, models):
    """--reward_model into `models`: the frozen model, its own tokenizer and context, and the
    statistics its score is normalised with (--reward_norm)."""
    reward_model, reward_tok = common.load_model_and_tokenizer(
        args.reward_model,
        AutoModelForSequenceClassification,
        args.attn_implementation,
        flag="--reward_model",
        num_labels=1,
    )
    # A token classifier (a PPO critic's export: a value per token, its head with a bias) loads
    # as a sequence classifier without complaint, its head's bias left out: refused, as it is no
    # reward model (train_rm.py's export is a sequence classifier).
    names = reward_model.config.architectures or []
    if isinstance(names, str):
        names = [names]
    if names and all(name.endswith("ForTokenClassification") for name in names):
        raise SystemExit(
            f"error: --reward_model {args.reward_model}: a token classifier ({names[0]}: a "
            "value model, such as a PPO critic's export), not a reward model; give a sequence "
            "classifier (train_rm.py's export)"
        )
    # transformers' own pooling refuses batches when the config has no pad id; the score is
    # read by `reward_model_scores` from the lengths, whatever this id is.
    common.set_pad_token_id(reward_model.config, reward_tok.pad_token_id)
    models.reward_model = reward_model.requires_grad_(False)
    models.reward_tokenizer = reward_tok
    models.reward_context = common.context_length(
        args.reward_model, reward_model.config, "--reward_model"
    )
    if args.reward_norm:
        models.reward_norm = reward_normalisation(reward_model.config, args.reward_model)


def frozen_fingerprints(models, device):
    """Collective: {flag: common.weights_fingerprint} of the frozen models, kept in meta.json: a
    resume loads them from those flags' folders again, and `checkpoint.load` checks they are the
    ones the run began with."""
    frozen = {}
    if models.ref is not None:
        frozen["model"] = common.weights_fingerprint(models.ref, device)
    if models.reward_model is not None:
        frozen["reward_model"] = common.weights_fingerprint(models.reward_model, device)
    return frozen


def note_another_engine(meta, engine, where):
    """A warning when a resume samples with another engine than the run began with (--rollout_engine
    auto on a machine where vLLM does not import, say): the two engines draw other samples from
    the same seeds, so from here on the run is not the one an uninterrupted run would have been.
    Allowed: a run may move to a machine without vLLM; said, not silent."""
    began = meta.get("engine")
    if began is not None and began != engine.kind:
        common.print0(
            f"WARNING: {where} was trained with the {began} rollout engine, this resume samples "
            f"with {engine.kind}: other samples from the same seeds, so the run is no longer "
            "the one it would have been uninterrupted"
        )


def rule_digests(args):
    """{module:function: the sha256 of its module's file} of the rules this run calls, kept in
    meta.json: a rule edited between a run's start and its resume scores the rest of the run
    by other arithmetic (`note_changed_rules`)."""
    return {spec: common.module_digest(load_rule(spec, flag)) for spec, flag in rules_in_use(args)}


def note_changed_rules(meta, digests, where):
    """A note for each rule whose module's file is not the one the checkpoint's run scored with.
    Allowed (a fix of a rule is a reason to go on): said, not silent. A meta.json without them
    (before this, or crafted) says nothing."""
    saved = meta.get("rules")
    if not isinstance(saved, dict):
        return
    for spec, digest in digests.items():
        if spec in saved and saved[spec] != digest:
            common.print0(
                f"note: {spec}: its module's file changed since {where} was saved; the run goes "
                "on scoring with it as it is now, not as it would have"
            )


def folder_identities(args):
    """{flag: common.folder_identity} of every folder this run loads a model from, kept in
    meta.json: a resume builds the models from those folders' config.json again, tokenises with
    their tokenizers and normalises the reward with --reward_model's reward_mean/reward_std, and
    `checkpoint.load` checks all of it is what the run began with."""
    folders = {"model": common.folder_identity(args.model)}
    if args.reward_model:
        folders["reward_model"] = common.folder_identity(args.reward_model, "--reward_model")
    return folders


def logprob_diff_threshold(flag, device):
    """The mean gap between the engine's and the actor's logprobs above which PPO warns: the
    flag, or by default what a right engine stays well under. On CPU engine and actor compute in
    fp32 and agree to ~1e-7 (the families checked by hand; Apertus 6e-5, vLLM keeping two of its
    activation's constants in bf16); an engine sampling from another model showed 0.048 (vLLM-
    CPU's rotary kernel on LFM2's 3-D queries), under the 0.05 that bf16 on a GPU needs."""
    if flag > 0:
        return flag
    if device.type == "cpu":
        return 1e-3
    return 0.05


def adamw(model, lr, weight_decay):
    """AdamW with eps 1e-5 [37 core #3] and --weight_decay. fused: its element-wise math in one
    kernel for all parameters, on CPU and CUDA (README: Benchmarks)."""
    return torch.optim.AdamW(
        model.parameters(), lr=lr, eps=1e-5, weight_decay=weight_decay, fused=True
    )


def reward_normalisation(config, where):
    """(reward_mean, reward_std) from a reward model's config.json, checked, or None: use the raw
    score. train_rm.py writes both; a folder from elsewhere may have neither (said once, then the
    raw score), or crafted ones (a one-line error, not a NaN reward three phases later)."""
    mean = getattr(config, "reward_mean", None)
    std = getattr(config, "reward_std", None)
    if mean is None and std is None:
        common.print0(
            f"note: --reward_model {where}: config.json has no reward_mean/reward_std; using the "
            "raw score"
        )
        return None
    for name, value in (("reward_mean", mean), ("reward_std", std)):
        if common.finite_number(value) is None:
            raise SystemExit(
                f"error: --reward_model {where}: config.json: {name} must be a number finite in "
                f"float32, got {value!r:.200}"
            )
    mean = common.finite_number(mean)
    std = common.finite_number(std)
    if std < 0:
        raise SystemExit(
            f"error: --reward_model {where}: config.json: reward_std must be >= 0, got {std!r}"
        )
    if std == 0:
        # every reference response scored alike: there is no scale to divide by
        common.print0(
            f"note: --reward_model {where}: config.json has reward_std 0; using the raw score"
        )
        return None
    return (mean, std)


def load_prompts(rows, tok, max_new_tokens, context, reward_tok=None):
    """[(prompt token ids, row)] (a `common.TokenRows`) of [(where, {"prompt", ...})] rows, each
    row as the data gives it: its prompt (a string, or a conversation:
    `common.check_conversation`), which the reward function and the reward model get, and any
    other fields, which a reward function may take (`rule_parameters`). A prompt with no room for
    a response is an error naming its row, and so is one the reward model's chat template
    (`reward_tok`, if it has its own) fails on: found now, not at the rollout that samples it."""
    if max_new_tokens >= context:  # no prompt fits: say so, not that the first prompt is long
        raise SystemExit(
            f"error: --max_new_tokens {max_new_tokens}: the model's context holds {context} "
            "tokens, prompt and response together"
        )
    encode = functools.partial(
        encode_row,
        tok,
        max_new_tokens=max_new_tokens,
        context=context,
        reward_tok=reward_tok,
    )
    # int32 ids (a list of lists of ints takes ~10x more), each rank encoding a share of the rows
    return common.encode_rows(rows, encode)


def encode_row(tok, row, max_new_tokens, context, reward_tok, where):
    """One row's (prompt token ids, row) (`load_prompts`)."""
    prompt = row["prompt"]
    text = common.prompt_content(tok, prompt, where)
    common.check_fits(tok, text, context - max_new_tokens, where)
    common.check_special_text(tok, where, prompt)  # a turn faked inside the prompt
    ids = common.encode_prompt(tok, prompt, where)
    common.check_prompt_ids(ids, where)
    if reward_tok is not None:
        common.check_special_text(reward_tok, f"{where} (--reward_model)", prompt)
        with common.own_template_variables():  # as `reward_model_inputs` renders it
            common.encode_prompt(reward_tok, prompt, f"{where} (--reward_model)")
    if len(ids) + max_new_tokens > context:
        raise SystemExit(
            f"error: {where}: prompt of {len(ids)} tokens + --max_new_tokens "
            f"{max_new_tokens} exceeds the model's context ({context})"
        )
    return ids, row


def load_data(args, tok, context, reward_tok):
    """(training prompts, held-out prompts), each [(token ids, row as the data gives it)];
    reward_tok: the reward model's tokenizer, or None. Each row must give the fields the rules in
    use require (`check_rule_fields`)."""
    if args.data:
        train_rows = common.load_jsonl(args.data, ("prompt",))
    else:
        train_rows = common.numbered("embedded task", task.make_split("train"))
    if args.eval_data:
        held_out_rows = common.load_jsonl(args.eval_data, ("prompt",))
    elif args.data:
        held_out_rows = []  # a user's data has no held-out split unless --eval_data gives one
    else:
        held_out_rows = common.numbered("embedded task", task.make_split("test"))
    held_out_rows = held_out_rows[: args.eval_samples]
    for spec, flag in rules_in_use(args):
        check_rule_fields(spec, flag, train_rows + held_out_rows)
    new = args.max_new_tokens
    train = load_prompts(train_rows, tok, new, context, reward_tok)
    held_out = load_prompts(held_out_rows, tok, new, context, reward_tok)
    for spec, flag in rules_in_use(args):  # (after the prompts' own checks: their length)
        check_task_prompts(spec, flag, train_rows + held_out_rows)
    if len(train) < args.rollout_batch_size:
        raise SystemExit(
            f"error: {args.data or 'embedded task'}: too few prompts for "
            f"--rollout_batch_size {args.rollout_batch_size} (it has {len(train)})"
        )
    return train, held_out


def check_task_prompts(spec, flag, rows):
    """The embedded task's rule (the default --reward_fn) scores its own "a+b=" prompts only: on
    a --data of other prompts it raised at the first scoring, after every model had loaded."""
    if spec != "task:reward_fn":
        return
    for where, row in rows:
        try:
            task.sum_operands(row["prompt"])
        except ValueError:
            instead = f"a {flag} of your own (module:function)"
            if flag == "--reward_fn":
                instead += " or a --reward_model"
            raise SystemExit(
                f"error: {where}: {flag} task:reward_fn, the embedded task's rule, scores 'a+b=' "
                f"prompts, not {row['prompt']!r:.60}; give {instead}"
            )


# What gae and rloo divide their advantages by, for --scale_rewards' refusal (grpo's flag)
SCALED_BY = {
    "gae": "gae whitens its advantages over the batch (`masked_whiten`)",
    "rloo": "rloo divides its advantages by no std",
}


def check_args(args, world):
    check_rollout_batch_sizes(args, world)
    n = args.n_samples_per_prompt
    check_reward_flags(args)
    check_engine_flags(args)
    if args.advantage_estimator != "gae" and n < 2:
        raise SystemExit(
            f"error: --advantage_estimator {args.advantage_estimator} compares the samples of a "
            f"prompt: expected --n_samples_per_prompt >= 2, got {n}"
        )
    check_gae_only_flags(args)
    check_kl_estimator(args)
    if args.offload_frozen and not uses_reference(args) and not args.reward_model:
        raise SystemExit(
            "error: --offload_frozen offloads the frozen models (reference, reward model), and "
            "this run has none: --kl_coef 0, no --target_kl, no --reward_model"
        )
    if common.flag_given(args, "scale_rewards") and args.advantage_estimator != "grpo":
        raise SystemExit(
            f"error: --scale_rewards {args.scale_rewards} applies to --advantage_estimator grpo "
            f"only; {SCALED_BY.get(args.advantage_estimator, 'it divides by no group std')}"
        )


def check_rollout_batch_sizes(args, world):
    """The rollout's prompts split evenly over the ranks, its responses into whole minibatches of
    --train_batch_size, that minibatch evenly over the ranks, and each rank's share of it into
    whole micro-batches (a share no larger than --micro_batch_size is one): the line names the
    first that fails."""
    rollout = args.rollout_batch_size
    responses = rollout * args.n_samples_per_prompt
    if rollout % world:
        raise SystemExit(
            f"error: batch sizes do not divide: --rollout_batch_size {rollout} by world size "
            f"{world}"
        )
    if responses % args.train_batch_size:
        raise SystemExit(
            f"error: batch sizes do not divide: --rollout_batch_size {rollout} x "
            f"--n_samples_per_prompt {args.n_samples_per_prompt} = {responses} responses by "
            f"--train_batch_size {args.train_batch_size}"
        )
    if args.train_batch_size % world:
        raise SystemExit(
            f"error: batch sizes do not divide: --train_batch_size {args.train_batch_size} by "
            f"world size {world}"
        )
    if (args.train_batch_size // world) % common.micro_batch(args, world):
        raise SystemExit(
            f"error: batch sizes do not divide: --train_batch_size {args.train_batch_size} by "
            f"--micro_batch_size {args.micro_batch_size} x world size {world}"
        )


def check_engine_flags(args):
    """vLLM 0.32 samples at temperatures up to rollout.VLLM_MAX_TEMPERATURE: its SamplingParams
    refuses more, at the first rollout, in a traceback per rank. --rollout_engine vllm with a
    higher one is one line before anything loads; auto takes the HF engine for it. vLLM's own
    settings under --rollout_engine hf would do nothing: one line too."""
    for name in ("gpu_memory_utilization", "enforce_eager"):
        if args.rollout_engine == "hf" and common.flag_given(args, name):
            raise SystemExit(
                f"error: --{name} is a setting of the vLLM engine; --rollout_engine hf has none"
            )
    if args.rollout_engine == "vllm" and args.temperature > rollout.VLLM_MAX_TEMPERATURE:
        raise SystemExit(
            f"error: --temperature {args.temperature}: vLLM samples at temperatures up to "
            f"{rollout.VLLM_MAX_TEMPERATURE:g}; use --rollout_engine hf for a higher one"
        )


def check_kl_estimator(args):
    """--kl_estimator picks the KL in the reward: grpo's KL is a loss term (k3, eq. 4), and at
    --kl_coef 0 the reward weighs no KL (a --target_kl's controller scales beta by a factor, so
    from 0 it stays 0: the KL is only logged, as k1); there it would do nothing, so it is
    refused in one line."""
    if kl_in_loss(args) and common.flag_given(args, "kl_estimator"):
        raise SystemExit(
            f"error: --kl_estimator {args.kl_estimator} picks the KL in the reward (gae, rloo); "
            "grpo's KL is a loss term, k3 already (Shao et al. 2024, eq. 4)"
        )
    if args.kl_estimator != "k1" and args.kl_coef == 0:
        raise SystemExit(
            f"error: --kl_estimator {args.kl_estimator}: --kl_coef 0 weighs no KL in the reward "
            "(a --target_kl scales beta from 0 to 0: it only logs the KL, as k1)"
        )


def check_reward_flags(args):
    """The reward is --reward_fn's rule or --reward_model's score, never both: a flag of the one
    not in use is refused in one line, not silently ignored (a --reward_fn beside a
    --reward_model was never called). The rules in use are imported here (`load_rule`)."""
    if args.gold_reward_fn and not args.reward_model:
        raise SystemExit(
            f"error: --gold_reward_fn {args.gold_reward_fn} is logged beside --reward_model's "
            "score: give --reward_model too (without one, --reward_fn is the reward)"
        )
    # a flag spelt out at its default is the user's too: it would be as silently ignored
    if args.reward_model and common.flag_given(args, "reward_fn"):
        raise SystemExit(
            f"error: --reward_fn {args.reward_fn} is not used with --reward_model, whose score "
            "is the reward: to log a rule beside it, give it as --gold_reward_fn"
        )
    if args.reward_model and args.reward_weights:
        raise SystemExit(
            f"error: --reward_weights {args.reward_weights} weigh --reward_fn rules, and "
            "--reward_model's score is the reward"
        )
    if not args.reward_model and common.flag_given(args, "reward_norm"):
        raise SystemExit(
            "error: --reward_norm applies to --reward_model's score only; the --reward_fn rule "
            "is used as it returns"
        )
    # Imported now, and compared between the ranks: a node with another copy of the rule's file
    # would pay its samples by another rule
    if "," in args.gold_reward_fn:  # (--reward_fn's list has no gold counterpart)
        raise SystemExit(
            f"error: --gold_reward_fn {args.gold_reward_fn}: expected one module:function"
        )
    if args.gold_reward_fn:
        gold = functools.partial(load_rule, args.gold_reward_fn, "--gold_reward_fn")
        common.import_on_every_rank(f"--gold_reward_fn {args.gold_reward_fn}", gold)
    if args.reward_model:
        return
    specs = rule_specs(args.reward_fn)
    rule_weights(args.reward_weights, len(specs))
    # one spelling of each list, so that a resume compares what they say, not their spaces
    args.reward_fn = ",".join(specs)
    if args.reward_weights:
        args.reward_weights = ",".join(w.strip() for w in args.reward_weights.split(","))
    for spec in specs:
        rule = functools.partial(load_rule, spec, "--reward_fn")
        common.import_on_every_rank(f"--reward_fn {spec}", rule)


# Flags of GAE and its critic, which grpo and rloo have none of: set there, they would do nothing.
GAE_ONLY = ("gamma", "lam", "whiten_rewards", "critic_lr", "cliprange_value")


def check_gae_only_flags(args):
    """With --advantage_estimator grpo or rloo, a GAE or critic flag given (its default spelt out
    too) is refused in one line, not silently ignored."""
    if args.advantage_estimator == "gae":
        return
    # a flag spelt out at its default is the user's too (as --reward_fn's): it would do nothing
    given = [f"--{name}" for name in GAE_ONLY if common.flag_given(args, name)]
    verb = "applies"
    if len(given) > 1:
        verb = "apply"
    if given:
        raise SystemExit(
            f"error: {', '.join(given)} {verb} to --advantage_estimator gae (GAE and its critic) "
            f"only; {args.advantage_estimator} has no critic and uses neither"
        )


# ---- the phases of one iteration ---------------------------------------------------------------
def generate(args, engine, prompts, step, positions):
    """(1) Rollout: n samples for each of this rank's prompts, each prompt seeded by its position
    in the global batch (so a resumed step samples the same tokens). Returns a Generation of
    len(prompts) * n responses, prompt-major."""
    seeds = [rollout.prompt_seed(args.seed, step, j) for j in positions]
    prompt_ids = [ids for ids, _ in prompts]
    gen = engine.generate(
        prompt_ids, args.n_samples_per_prompt, args.max_new_tokens, args.temperature, 1.0, seeds
    )
    engine.sleep()  # GPU: the engine's memory goes back to the trainer until the next rollout
    return gen


def load_rule(spec, flag):
    """The function `flag` names (module:function), imported; one line if there is none. Called
    by check_args too, so a misspelt rule stops the run before the models load and the engine
    starts, not at the first scoring minutes later (the import is cached after that)."""
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    # a user's module: a SyntaxError in it, an error or a sys.exit() at its import, all one line
    except (Exception, SystemExit) as e:
        raise SystemExit(
            f"error: {flag} {spec}: expected module:function importable from the Python path "
            f"(the repository, PYTHONPATH; not the working directory) ({type(e).__name__}: {e})"
        )
    if not callable(fn):
        raise SystemExit(f"error: {flag} {spec}: a {type(fn).__name__}, not a function")
    return fn


def rule_specs(text):
    """The --reward_fn rules, [module:function], from its comma-separated list; an empty entry
    (a stray comma) or one named twice (its scores would be logged under one name) is refused."""
    specs = [spec.strip() for spec in text.split(",")]
    if "" in specs:
        raise SystemExit(f"error: --reward_fn {text}: an empty entry; expected module:function,...")
    twice = sorted({spec for spec in specs if specs.count(spec) > 1})
    if twice:
        raise SystemExit(f"error: --reward_fn {text}: {twice[0]} named twice")
    return specs


def rule_weights(text, n):
    """--reward_weights as n floats ('' is 1 each); one line if they are not n finite numbers."""
    if not text:
        return [1.0] * n
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise SystemExit(f"error: --reward_weights {text}: expected comma-separated numbers")
    if len(weights) != n or not all(math.isfinite(w) for w in weights):
        raise SystemExit(
            f"error: --reward_weights {text}: expected one finite number per --reward_fn rule ({n})"
        )
    return weights


# A row's fields a rule never gets by name: its first two arguments are the prompt and the sampled
# response, and a "response" field (SFT data's, the embedded task's right answer) would stand
# for the second. A reference answer goes in a field of another name ("answer", "solution").
NOT_RULE_FIELDS = ("prompt", "response")


# The names TRL's reward functions give their batched arguments, (prompts, completions, ...) or
# (completions, **kwargs): a rule here takes one (prompt, response) per call
TRL_BATCH_NAMES = ("prompts", "completions", "completion_ids")


class RuleParameters(typing.NamedTuple):
    names: tuple  # the parameters after (prompt, response) that a keyword can give
    required: tuple  # those of them without a default: every row must have the field
    every: bool  # it takes **kwargs: every field of the row not in `never`
    never: tuple  # its first two parameters' names, and a partial's bound keywords
    signature: inspect.Signature | None  # None: none to read, or only (*args, **kwargs)


def rule_parameters(fn):
    """What a rule takes beside (prompt, response), read from its signature: a data row's other
    fields go to it as keywords, those it names (or all, if it takes **kwargs), as TRL gives a
    dataset's other columns to its reward functions. So a verifiable reward reads its reference,
    `def reward(prompt, response, answer)` with rows {"prompt": ..., "answer": ...}; a rule of
    two parameters gets nothing more. A callable whose signature says nothing (a builtin, or a
    wrapper of (*args, **kwargs) such as a decorator without functools.wraps or an nn.Module)
    gets (prompt, response): its **kwargs would hand every field to what it wraps."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return RuleParameters((), (), False, (), None)
    params = list(signature.parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    first = [p for p in params if p.kind in positional][:2]
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if not first and not any(p.kind in by_name for p in params):  # (*args, **kwargs)
        return RuleParameters((), (), False, (), None)
    bound = ()
    if isinstance(fn, functools.partial):  # its bound keywords are the user's, not the row's
        bound = tuple(fn.keywords)
    named = [p for p in params if p.kind in by_name and p not in first and p.name not in bound]
    return RuleParameters(
        names=tuple(p.name for p in named),
        required=tuple(p.name for p in named if p.default is inspect.Parameter.empty),
        every=any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params),
        never=tuple(p.name for p in first) + bound,
        signature=signature,
    )


def rule_fields(params, row):
    """The keywords a rule (`rule_parameters`) gets from a data row, copied: a rule that changes
    a list it is given would change the run's rows from then on."""
    skip = NOT_RULE_FIELDS + params.never
    if params.every:
        fields = {key: value for key, value in row.items() if key not in skip}
    else:
        fields = {key: row[key] for key in params.names if key in row and key not in skip}
    return copy.deepcopy(fields)


def rules_in_use(args):
    """[(spec, flag)] of the rules this run calls: --reward_fn unless a reward model scores, and
    --gold_reward_fn."""
    rules = []
    if not args.reward_model:
        rules += [(spec, "--reward_fn") for spec in rule_specs(args.reward_fn)]
    if args.gold_reward_fn:
        rules.append((args.gold_reward_fn, "--gold_reward_fn"))
    return rules


def check_rule_fields(spec, flag, rows):
    """The rule can be called as (prompt, response, its required fields), and every row gives
    those fields (`rule_parameters`): a rule that cannot, or a row without one, is one line as
    the data loads, not a TypeError at the rollout that samples it."""
    params = rule_parameters(load_rule(spec, flag))
    if params.signature is None:
        return
    if set(params.never + params.names) & set(TRL_BATCH_NAMES):
        raise SystemExit(
            f"error: {flag} {spec}{params.signature}: a TRL reward function, over lists of "
            "prompts and completions; here a rule scores one response per call, (prompt, "
            "response, **fields): wrap it (README, train_ppo.py: a reward that checks against "
            "the data)"
        )
    try:
        params.signature.bind(None, None, **dict.fromkeys(params.required))
    except TypeError as e:
        raise SystemExit(
            f"error: {flag} {spec}{params.signature}: cannot be called as (prompt, response, "
            f"the row's fields it names as keywords) ({e})"
        )
    for name in params.required:
        if name in NOT_RULE_FIELDS:
            raise SystemExit(
                f"error: {flag} {spec}{params.signature}: a parameter {name!r} after its first "
                f"two, which no data field gives (a row's {name!r} is never passed by name: "
                "give the field another name, or the parameter a default)"
            )
    for where, row in rows:
        missing = [name for name in params.required if name not in row]
        if missing:
            raise SystemExit(
                f"error: {where}: {flag} {spec} takes {missing[0]!r}, a field this row lacks"
            )


def rule_scores(spec, rows, responses, flag="--reward_fn"):
    """Scores [B] from `flag` (--reward_fn or --gold_reward_fn) module:function(prompt, response,
    **fields) -> float, for data rows [B] and decoded responses [B]; the fields are the row's
    others that the function takes (`rule_parameters`). A failure of the user's function is one
    clear line."""
    fn = load_rule(spec, flag)
    params = rule_parameters(fn)
    scores = []
    for row, response in zip(rows, responses):
        prompt = row["prompt"]
        try:
            # a copy: a conversation is a list, and a function that appends the response to it
            # (a common way to build the dialogue) would change the run's prompts from then on
            s = fn(copy.deepcopy(prompt), response, **rule_fields(params, row))
        # a user's function: any failure becomes one clear line, a sys.exit() in it too (it
        # ended the run with exit 0, nothing saved)
        except (Exception, SystemExit) as e:
            raise SystemExit(
                f"error: {flag} {spec} raised {e!r} on prompt {prompt!r}, response {response!r}"
            )
        if isinstance(s, (np.ndarray, torch.Tensor)) and s.ndim == 0:
            s = s.item()  # one number, as a rule computed with torch or numpy returns it
        number = s
        if isinstance(s, decimal.Decimal):
            # a number, though no numbers.Real (NaN or 1e400 stay refused below, by their own
            # spelling in the line; float() of a signalling NaN raises)
            number = float("nan") if s.is_snan() else float(s)
        if isinstance(s, (bool, np.bool_)):  # `response == answer`: 0/1, as TRL takes it too
            number = float(s)
        value = common.finite_number(number)
        if value is None:
            several = ""
            if isinstance(s, (list, tuple, np.ndarray, torch.Tensor)):  # not 0-d: several
                several = " (one score: a rule scores one response per call)"
            raise SystemExit(
                f"error: {flag} {spec} returned {s!r:.200} for prompt {prompt!r}; expected a "
                f"number finite in float32{several}"
            )
        scores.append(value)
    return torch.tensor(scores)


def rule_reward(args, rows, texts):
    """(scores [B], {"rule/<module.function>": [B]}): the --reward_fn rules' weighted sum, and
    with several rules each one's own scores, logged as objective/rule/... and eval/rule/...,
    and written to samples.jsonl as rule/... (what a sum hides: a format reward that climbs
    while the answers' does not)."""
    specs = rule_specs(args.reward_fn)
    weights = rule_weights(args.reward_weights, len(specs))
    terms = []
    parts = {}
    for spec, weight in zip(specs, weights):
        scores = rule_scores(spec, rows, texts)
        terms.append(weight * scores)
        # one rule under a weight other than 1 is logged on its own too: the sum is not its score
        if len(specs) > 1 or weight != 1:
            parts[f"rule/{spec.replace(':', '.')}"] = scores
    # summed from the first term, not from zeros: one rule of weight 1 is its scores exactly
    # (a -0.0 too, which 0.0 + -0.0 would turn into 0.0)
    total = functools.reduce(torch.add, terms)
    weighed = f"--reward_weights {args.reward_weights or '(1 each)'}"
    line = f"--reward_fn {args.reward_fn}: the rules' sum ({weighed}) overflows float32"
    check_finite_scores(total, line)
    return total, parts


@torch.no_grad()
def score(args, tok, models, rows, prompt_ids, responses, finished, device):
    """(2) (scores [B] before the EOS penalty, {logged name: [B]} of the rules' own): the rule
    reward on the decoded text (with the data row's fields it takes: `rule_reward`), or the
    reward model's score of its own tokenisation of it, normalised with its config's
    reward_mean and reward_std unless --reward_norm false. Collective with a reward model (a
    sharded forward). rows [B]: each sample's data row; prompt_ids [B]: the ids it answers."""
    if models.reward_model is None:
        texts = tok.batch_decode(responses, skip_special_tokens=True)
        return common.on_every_rank(f"--reward_fn {args.reward_fn}", rule_reward, args, rows, texts)
    where = f"--reward_model {args.reward_model}"
    # each rank encodes and checks its own responses (the templates' renders, time- and
    # memory-limited, may stop it too): agreed before the sharded forward, which a rank that
    # stopped alone would leave the others waiting in
    sequences = common.on_every_rank(
        where, reward_model_sequences, args, tok, models, rows, prompt_ids, responses, finished
    )
    scores = reward_model_scores(
        models.reward_model,
        sequences,
        models.reward_tokenizer.pad_token_id,
        args.micro_batch_size,
        device,
    )
    return common.on_every_rank(where, finite_reward_model_scores, models, scores, where)


def reward_model_sequences(args, tok, models, rows, prompt_ids, responses, finished):
    """The reward model's token ids [B][len] for the responses (`reward_model_inputs`), each
    within its context (`check_reward_context`)."""
    data_prompts = [row["prompt"] for row in rows]
    texts = written_texts(tok, data_prompts, prompt_ids, responses, finished)
    sequences = reward_model_inputs(models.reward_tokenizer, data_prompts, texts, finished)
    check_reward_context(args.reward_model, models.reward_context, sequences, data_prompts)
    return sequences


def finite_reward_model_scores(models, scores, where):
    """(scores [B], normalised unless --reward_norm false, {}); one line if one is not finite."""
    check_finite_scores(scores, f"{where}: its score is not finite (NaN or inf in its weights?)")
    if models.reward_norm is None:
        return scores, {}
    mean, std = models.reward_norm
    normalised = normalised_scores(scores, mean, std)
    problem = f"reward_mean {mean!r} and reward_std {std!r} take a score out of float32's range"
    check_finite_scores(normalised, f"{where}/config.json: {problem}")
    return normalised, {}


def written_texts(tok, data_prompts, prompt_ids, responses, finished):
    """The responses' texts for the reward model: decoded with their special tokens, less the stop
    id a finished one ends with (`reward_model_inputs` puts the reward model's own end there).
    A chat template's turn may open with a special token (its channel header): kept, the
    template's rendering finds it in place (`common.response_text`) and does not add it again,
    where a text decoded without it got the header's words twice. data_prompts [B]: the rows'
    prompts; prompt_ids [B]: their ids, which the responses continue."""
    texts = []
    for data_prompt, prompt, ids, ended in zip(data_prompts, prompt_ids, responses, finished):
        if ended:
            ids = ids[:-1]
        texts.append(written_text(tok, data_prompt, prompt, ids))
    return texts


def written_text(tok, data_prompt, prompt_ids, ids):
    """The text the policy wrote, as training would encode it back into `ids` (as a response to
    `data_prompt`: `common.encode_response`): decoded alone where that does, else decoded after its
    prompt. Decoded alone, a SentencePiece tokenizer (Llama 2, Mistral) drops the space its first
    token opens with ("▁8" "2" is "82"), which is right where the template puts a space before the
    answer (Mistral v0.1's ' ' + content) and wrong where nothing does (no template: the reward
    model read "8" "2", not the "▁8" "2" its pairs trained). Decoded after its prompt, the space
    stays. The two agree for most tokenizers, and then nothing is encoded to choose."""
    alone = tok.decode(ids, skip_special_tokens=False)
    head = tok.decode(prompt_ids, skip_special_tokens=False)
    whole = tok.decode(list(prompt_ids) + list(ids), skip_special_tokens=False)
    if not whole.startswith(head):  # a decoder that joins otherwise: only the response's own
        return alone
    after = whole[len(head) :]
    if after == alone or common.encode_response(tok, data_prompt, alone) == list(ids):
        return alone
    return after


def check_finite_scores(scores, line):
    """One line (`line`) unless every score is finite: a NaN or inf reward would surface two
    phases later as a diverged gradient norm, blaming --lr. scores [B]."""
    if not scores.isfinite().all():
        raise SystemExit(f"error: {line}")


def gold_scores(args, tok, rows, responses):
    """Scores [B] from --gold_reward_fn: the rule a learned reward stands in for, logged beside it
    and never trained on (the proxy/gold picture of Gao et al. 2022). rows [B]: the data rows."""
    texts = tok.batch_decode(responses, skip_special_tokens=True)
    what = f"--gold_reward_fn {args.gold_reward_fn}"
    return common.on_every_rank(
        what, rule_scores, args.gold_reward_fn, rows, texts, "--gold_reward_fn"
    )


def reward_model_inputs(reward_tok, data_prompts, response_texts, finished):
    """The reward model's own token ids for each (prompt, response), [B][len]: the prompt (through
    its chat template when it has one), the response, and its end (`common.response_end_id`) when
    the response ended there. The reward model never sees the policy's ids: its vocabulary and pad
    id may differ. This is the format `common.encode_pair` trains the reward model on
    (prompt, response, end), with the template variables it was trained with, recorded in its
    export, not the policy's --chat_template_kwargs (`common.own_template_variables`)."""
    sequences = []
    with common.own_template_variables():
        for prompt, response, ended in zip(data_prompts, response_texts, finished):
            ids = common.encode_prompt(reward_tok, prompt, "--reward_model")  # load_prompts did
            ids = ids + common.encode_response(reward_tok, prompt, response)
            if ended:
                ids = ids + [common.response_end_id(reward_tok)]
            sequences.append(ids)
    return sequences


def check_reward_context(where, context, sequences, data_prompts):
    """The reward model's input, re-encoded by its own tokenizer, must fit its context: the
    policy's limit (prompt + --max_new_tokens, checked at start) counts the policy's tokens, and
    another tokenizer may need more. Past its context a model with learned positions (GPT-2)
    fails with an IndexError, and a rotary one scores positions it never saw; so one line here."""
    for ids, prompt in zip(sequences, data_prompts):
        if len(ids) > context:
            text = prompt
            if not isinstance(prompt, str):  # a conversation: its last turn, the question
                text = prompt[-1]["content"]
            raise SystemExit(
                f"error: --reward_model {where} takes at most {context} tokens; the prompt "
                f"{text[:60]!r} and its response come to {len(ids)} in its tokenizer "
                "(lower --max_new_tokens, or shorten the prompts)"
            )


def reward_model_scores(reward_model, sequences, pad_id, micro_batch_size, device):
    """The reward model's score of each token-id list [B] -> [B] on the CPU, in micro-batches
    (`common.sequence_scores`: the head's output at the last real token, found from the lengths,
    not from pad ids, which may equal EOS or be missing; the same reading train_rm.py trains).
    Collective (a sharded forward)."""
    scores = []
    for start in range(0, len(sequences), micro_batch_size):
        chunk = sequences[start : start + micro_batch_size]
        scores.append(common.sequence_scores(reward_model, chunk, pad_id, device).cpu())
    return torch.cat(scores)


@dataclasses.dataclass
class Experience:
    """One iteration's rollouts as PPO trains on them (this rank's B responses, shuffled)."""

    batch: RolloutBatch
    old_logprobs: torch.Tensor | None  # [B, R] log pi_old(y_t), the policy that sampled (None
    # until the update's forward fills them, when `old_logprobs_from_update`)
    ref_logprobs: torch.Tensor | None  # [B, R] log pi_ref(y_t), the frozen reference (if any)
    old_values: torch.Tensor | None  # [B, R] V_old(s_t) (critic only)
    advantages: torch.Tensor | None = None  # [B, R]
    returns: torch.Tensor | None = None  # [B, R] the value targets (critic only)


def old_logprobs_from_update(args):
    """Whether step (3) can leave the actor's forward out and let the update's own forward give
    the 'old' logprobs. It can when the update is one optimizer step on the whole rollout
    (--ppo_epochs 1, --train_batch_size = every response): its micro-batches then all run on the
    weights that sampled, in the rows and micro-batches step (3) would use, so their detached
    logprobs are the ones step (3) would compute, bit for bit on CPU (ratio == 1; the gradient is
    the plain policy gradient's). And when the advantages do not need them first: grpo keeps its
    KL a loss term, and without a reference (--kl_coef 0) there is no KL reward. It saves one
    forward of the actor over the rollout per iteration; TRL's GRPOTrainer takes the same
    shortcut (num_iterations 1)."""
    all_responses = args.rollout_batch_size * args.n_samples_per_prompt
    one_update = args.ppo_epochs == 1 and args.train_batch_size == all_responses
    return one_update and (kl_in_loss(args) or not uses_reference(args))


@torch.no_grad()
def old_logprobs_and_values(args, models, tok, prompt_ids, responses, order, device, from_update):
    """(3) The actor's and the reference's logprobs and the critic's values of the sampled tokens,
    computed by the training models themselves in micro-batches; zero on padding. The actor's are
    the 'old' logprobs of the PPO ratio, recomputed rather than taken from the engine (whose
    numerics differ slightly): the first micro-batch of the update then sees ratio == 1.
    from_update: leave the actor's out, for the update to fill (`old_logprobs_from_update`).
    The rows go in the shuffled order `order`, which the first PPO epoch keeps."""
    prompts = [prompt_ids[i] for i in order]
    batch = make_batch(prompts, [responses[i] for i in order], tok.pad_token_id, device)
    # the update's micro-batches (`ppo_update`: at most a rank's share of a minibatch): a
    # --micro_batch_size above the share chunked step (3) wider than the update's forwards, and
    # the first micro-batch's ratio was no longer 1 bit for bit where kernels are not
    # batch-invariant (a GPU's), nor the run the one at --micro_batch_size = the share
    micro = common.micro_batch(args, dist.get_world_size())
    chunks = []
    for start in range(0, len(batch.input_ids), micro):
        chunks.append(batch.select(slice(start, start + micro)))
    mask = batch.response_mask
    old_logprobs = None
    if not from_update:
        old_logprobs = torch.cat([logprobs_of(models.actor, c, args.temperature) for c in chunks])
        old_logprobs = old_logprobs * mask
    ref_logprobs = None
    if models.ref is not None:
        ref_logprobs = torch.cat([logprobs_of(models.ref, c, args.temperature) for c in chunks])
        ref_logprobs = ref_logprobs * mask
    old_values = None
    if models.critic is not None:
        old_values = torch.cat([values_of(models.critic, c) for c in chunks]) * mask
    # padding masked out of every loss and statistic
    return Experience(batch, old_logprobs, ref_logprobs, old_values)


def logprob_gap(exp, engine_logprobs, order):
    """|log pi_engine(y_t) - log pi_old(y_t)| for every sampled token, [B, R], zero on padding:
    the engine's logprobs (sampling distribution, temperature applied) against the actor's own.
    It proves, every step, that PPO trains the policy the responses were sampled from: 1e-7 to
    1e-6 on average on CPU (fp32 both). On a GPU both sides compute in bf16 with kernels of their
    own, and bf16's rounding alone moves a logprob by ~8e-3 on average, ~5e-3 of it the head's
    (measured on the CPU: bench/RESULTS.md, "The LM head in bf16"; tests/test_gpu.py allows
    5e-2). A stale weight sync, a sampling setting the trainer does not apply or a mismatched
    attention kernel shows up here first."""
    mask = exp.batch.response_mask
    R = mask.shape[1]
    rows = []
    for i in order.tolist():
        rows.append(engine_logprobs[i] + [0.0] * (R - len(engine_logprobs[i])))
    engine = torch.tensor(rows, device=mask.device)  # [B, R], the rows in the order of exp
    return (engine - exp.old_logprobs).abs() * mask


def compute_advantages(args, exp, scores, order, kl_coef):
    """(4) Advantages [B, R] (and, with a critic, the value targets `returns`), filled into `exp`.

    gae: per-token rewards (KL penalty, the score at the last token), GAE over them, whitened.
    grpo / rloo: one advantage per response from its group, spread over its tokens. Groups need
    the rollout's prompt-major order back: the rows of `exp` are in the shuffled order `order`."""
    mask = exp.batch.response_mask
    logprobs = exp.old_logprobs
    ref_logprobs = exp.ref_logprobs
    if ref_logprobs is None:  # no reference (--kl_coef 0): a KL of 0, weighed by 0; the old
        # logprobs may not be there yet (`old_logprobs_from_update`), and are not needed
        logprobs = torch.zeros_like(mask)
        ref_logprobs = logprobs
    if args.advantage_estimator == "gae":
        rewards, _ = compute_rewards(
            scores, logprobs, ref_logprobs, mask, kl_coef, args.kl_estimator
        )
        if args.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False)  # [N policy #9]
        advantages, exp.returns = compute_gae(rewards, exp.old_values, mask, args.gamma, args.lam)
        exp.advantages = masked_whiten(advantages, mask)  # [N policy #9]
        return
    # rloo folds the KL into the sequence reward (Ahmadian et al.; TRL's RLOO), then takes the
    # baseline (OpenRLHF baselines the score alone and adds the per-token KL after); grpo keeps it
    # a loss term (`ppo_loss`), as dividing by a group's std would blow up the KL's noise.
    rewards = scores  # [B]
    if args.advantage_estimator == "rloo":
        kl = KL_ESTIMATORS[args.kl_estimator](logprobs, ref_logprobs, mask)  # [B, R]
        rewards = sequence_rewards(scores, kl, kl_coef)
    prompt_major = torch.empty_like(scores)
    prompt_major[order] = rewards
    groups = prompt_major.view(-1, args.n_samples_per_prompt)  # [prompts, n]
    std = None
    if args.scale_rewards == "batch":
        std = batch_std(rewards)  # over every rank's groups
    advantages = group_advantages(groups, args.advantage_estimator, args.scale_rewards, std)
    advantages = advantages.flatten()[order]  # [B], back in the rows' order
    exp.advantages = advantages[:, None] * mask


def ppo_loss(args, models, exp, rows, n_tokens, kl_coef, fill_old):
    """The loss that one micro-batch (`rows` of `exp`) optimises, and its statistics, keyed by
    their logged names (fill_old: this forward gives the rows' old logprobs too, see
    `old_logprobs_from_update`):

        loss = pg_loss                  clipped surrogate (PPO eq. 7)
             + kl_coef * kl_loss        grpo only: the KL to the reference as a loss term (eq. 4)
             + vf_loss                  with a critic: the (clipped) value loss

    Each term is a token mean over the global minibatch (n_tokens), for GRPO too: GRPO's eq. 3
    averages each response's tokens first, (1/G) sum_i (1/|o_i|) sum_t, which weighs a token of a
    short response more (Liu et al. 2025, "Dr. GRPO"); the token mean is DAPO's (Yu et al. 2025)
    and TRL's default. Actor and critic are separate networks, so one backward of the sum sends
    each term's gradient to its own parameters; hence no vf_coef (TRL's 0.1, one optimizer and one
    gradient-norm clip over both): --critic_lr sets the critic's step, and each model's gradient
    norm is clipped on its own (`optimizer_step`), as OpenRLHF's and verl's separate critics.
    Returns (loss, stats, ratio [b, R])."""
    batch = exp.batch.select(rows)
    mask = batch.response_mask  # [b, R]
    logprobs = logprobs_of(models.actor, batch, args.temperature)  # [b, R]
    if fill_old:  # the weights that sampled, before any step: these are the old logprobs
        exp.old_logprobs[rows] = logprobs.detach() * mask
    clip_high = args.cliprange_high if args.cliprange_high > 0 else args.cliprange
    pg_loss, clipfrac, approxkl, ratio = policy_loss(
        logprobs,
        exp.old_logprobs[rows],
        exp.advantages[rows],
        mask,
        args.cliprange,
        n_tokens,
        clip_high,
    )
    stats = {
        "policy/pg_loss": pg_loss.detach(),
        "policy/clipfrac": clipfrac,
        "policy/approxkl": approxkl.detach(),
    }
    kl_term = torch.zeros((), device=mask.device)
    if kl_in_loss(args) and exp.ref_logprobs is not None:
        kl = kl_loss(logprobs, exp.ref_logprobs[rows], mask, n_tokens)
        kl_term = kl_coef * kl
        stats["policy/kl_loss"] = kl.detach()
    vf_loss, value_stats = value_term(args, models, exp, batch, rows, n_tokens)
    stats.update(value_stats)
    loss = pg_loss + kl_term + vf_loss
    return loss, stats, ratio


def value_term(args, models, exp, batch, rows, n_tokens):
    """ppo_loss's third term, the critic's (clipped) value loss on the micro-batch `batch` (`rows`
    of `exp`), and its statistics; 0 and none without a critic (grpo, rloo)."""
    mask = batch.response_mask  # [b, R]
    if models.critic is None:
        return torch.zeros((), device=mask.device), {}
    values = values_of(models.critic, batch)  # [b, R]
    vf_loss, vf_clipfrac = value_loss(
        values, exp.old_values[rows], exp.returns[rows], mask, args.cliprange_value, n_tokens
    )
    return vf_loss, {"val/loss": vf_loss.detach(), "val/clipfrac": vf_clipfrac.to(mask.device)}


def ppo_update(args, models, roles, exp, kl_coef):
    """(5) --ppo_epochs passes over this rank's rollouts; each minibatch of --train_batch_size
    responses (over all ranks) is one optimizer step, with gradient accumulation over
    micro-batches. Returns (this rank's statistics averaged over the optimizer steps, its maxima:
    "policy/first_ratio_dev", the largest |ratio - 1| of the first micro-batch, 0 unless the old
    logprobs are off)."""
    world = dist.get_world_size()
    mask = exp.batch.response_mask
    n_rows = len(mask)
    fill_old = exp.old_logprobs is None  # `old_logprobs_from_update`: one step, filled below
    if fill_old:
        exp.old_logprobs = torch.zeros_like(mask)
    rows_per_step = args.train_batch_size // world
    sums = {}
    first_ratio_dev = None
    n_updates = 0
    for ppo_epoch in range(args.ppo_epochs):
        # The first epoch keeps the order of step (3), so its first micro-batch sees ratio == 1
        # exactly; later epochs reshuffle [N policy #7].
        perm = torch.arange(n_rows)
        if ppo_epoch > 0:
            perm = torch.randperm(n_rows)
        for start in range(0, n_rows, rows_per_step):
            rows = perm[start : start + rows_per_step].to(mask.device)
            n_tokens = mask[rows].sum()
            dist.all_reduce(n_tokens)  # a token mean over the global minibatch, as in SFT
            for micro_start in range(0, len(rows), args.micro_batch_size):
                micro = rows[micro_start : micro_start + args.micro_batch_size]
                loss, stats, ratio = ppo_loss(args, models, exp, micro, n_tokens, kl_coef, fill_old)
                # FSDP averages gradients over ranks; n_tokens already counts all ranks: undo it
                (loss * world).backward()
                if first_ratio_dev is None:
                    first_ratio_dev = ((ratio - 1).abs() * mask[micro]).max().item()
                for name, value in stats.items():
                    sums[name] = sums.get(name, 0.0) + value
            optimizer_step(roles, args.max_grad_norm)
            n_updates += 1
    averages = {name: total / n_updates for name, total in sums.items()}
    return averages, {"policy/first_ratio_dev": first_ratio_dev}


def optimizer_step(roles, max_grad_norm):
    """Clip each model's global gradient norm [37 core #11], step, and clear the gradients."""
    for role, (model, optim) in roles.items():
        common.clip_grad_norm(model, max_grad_norm, role)  # a norm that is not finite: stop
        optim.step()
        optim.zero_grad(set_to_none=True)


# ---- evaluation and logging --------------------------------------------------------------------
@torch.no_grad()
def evaluate(args, engine, tok, models, items, device):
    """{"eval/accuracy": mean score of greedy responses to held-out prompts (= accuracy for a
    0/1 reward)}, with --gold_reward_fn "eval/gold_accuracy", the gold rule's mean score, and
    with several --reward_fn rules "eval/rule/<module.function>", each rule's own mean score.
    Collective: every rank decodes and scores an equal share (scoring may be collective)."""
    mine, counted = common.eval_share(items)  # equal shares: scoring may be collective
    prompt_ids = [ids for ids, _ in mine]
    gen = engine.generate(prompt_ids, 1, args.max_new_tokens, 0.0, 1.0, [0] * len(mine))
    rows = [row for _, row in mine]  # as the data gives them (reward functions)
    scores, parts = score(
        args, tok, models, rows, prompt_ids, gen.response_ids, gen.finished, device
    )
    gold_sum = 0.0
    if args.gold_reward_fn:
        gold = gold_scores(args, tok, rows, gen.response_ids)
        gold_sum = gold[:counted].double().sum().item()
    # every rank scored a share: the means are over all of them
    local = {"score": scores[:counted].double().sum().item(), "count": counted, "gold": gold_sum}
    # the rules' own scores, under their evaluation names ("objective/rule/..." in training)
    rules = {f"eval/{name}": part for name, part in parts.items()}
    for name, part in rules.items():
        local[name] = part[:counted].double().sum().item()
    totals = common.global_sums(local, device)
    metrics = {"eval/accuracy": totals["score"] / totals["count"]}
    if args.gold_reward_fn:
        metrics["eval/gold_accuracy"] = totals["gold"] / totals["count"]
    for name in rules:
        metrics[name] = totals[name] / totals["count"]
    return metrics


def eval_line(args, step, metrics):
    """The console line of an evaluation. eval/accuracy is the mean score of the greedy answers:
    the accuracy under the embedded task's right-or-wrong rule, not under a reward model or a
    rule of the user's (a shaped one printed "held-out accuracy -0.097")."""
    name = "held-out score"
    if args.reward_model:
        name = "held-out reward-model score"
    elif args.reward_fn == "task:reward_fn" and rule_weights(args.reward_weights, 1) == [1.0]:
        name = "held-out accuracy"
    line = f"step {step}: {name} {metrics['eval/accuracy']:.3f}"
    gold = "gold score"
    if args.gold_reward_fn == "task:reward_fn":
        gold = "gold accuracy"
    if "eval/gold_accuracy" in metrics:
        line += f", {gold} {metrics['eval/gold_accuracy']:.3f}"
    return line


def rollout_sums(raw_scores, gen, exp, gap, gold, rule_parts):
    """This rank's sums behind the objective/* and rollout/* metrics (global_sums adds the
    ranks). gold: the --gold_reward_fn scores [B], or None; rule_parts: {"rule/...": [B]},
    each rule's own scores where --reward_fn names several (logged as objective/rule/...)."""
    mask = exp.batch.response_mask
    sums = {
        "logprob_gap": gap.sum().item(),
        "score": raw_scores.double().sum().item(),  # float32 sums of finite scores overflow
        "finished": float(sum(gen.finished)),
        "responses": len(raw_scores),
        "nll": (-exp.old_logprobs * mask).sum().item(),
        "tokens": mask.sum().item(),
    }
    if exp.ref_logprobs is not None:  # else no reference, and no KL to it is measured
        sums["kl"] = kl_k1(exp.old_logprobs, exp.ref_logprobs, mask).sum().item()
    if gold is not None:
        sums["gold_score"] = gold.double().sum().item()
    for name, scores in rule_parts.items():
        sums[f"objective/{name}"] = scores.double().sum().item()
    return sums


def iteration_metrics(update_stats, rollout_stats, maxima, device):
    """The objective/*, policy/*, val/* and rollout/* metrics of one iteration, over all ranks;
    maxima: {logged name: this rank's largest value}.

    Collective: one all_reduce carries every sum, one every maximum. The update's losses were
    normalised by global token counts, so their sums over ranks are the minibatch values."""
    totals = common.global_sums({**update_stats, **rollout_stats}, device)
    n = totals["responses"]
    metrics = {
        # the reward before the EOS penalty (a reward model's normalised: `score`)
        "objective/score": totals["score"] / n,
        "objective/entropy": totals["nll"] / totals["tokens"],  # of the sampled tokens, per token
        "objective/no_eos_frac": 1 - totals["finished"] / n,
        "objective/response_len": totals["tokens"] / n,
        "rollout/logprob_diff_mean": totals["logprob_gap"] / totals["tokens"],
    }
    if "kl" in totals:  # sum over a response's tokens, mean over responses
        metrics["objective/kl"] = totals["kl"] / n
    if "gold_score" in totals:  # the rule beside the learned reward, never trained on
        metrics["objective/gold_score"] = totals["gold_score"] / n
    for name in rollout_stats:
        if name.startswith("objective/rule/"):  # each of several rules: its mean score
            metrics[name] = totals[name] / n
    for name in update_stats:
        metrics[name] = totals[name]
    metrics.update(common.global_maxima(maxima, device))
    return metrics


def warn_if_off_policy(args, step, metrics, device):
    """A warning line when the engine's logprobs of the sampled tokens differ from the actor's by
    more than --logprob_diff_warn on average: PPO then trains a policy other than the one that
    sampled (a stale weight sync, an engine kernel that computes another model)."""
    warn_above = logprob_diff_threshold(args.logprob_diff_warn, device)
    if metrics["rollout/logprob_diff_mean"] > warn_above:
        common.print0(
            f"WARNING: step {step}: the engine's logprobs differ from the actor's by "
            f"{metrics['rollout/logprob_diff_mean']:.3g} on average (--logprob_diff_warn "
            f"{warn_above}): the policy trained is not the one that sampled"
        )


def sample_scores(raw_scores, gold, rule_parts):
    """samples.jsonl's scores of each response: {"score", "gold_score" (with --gold_reward_fn),
    "rule/<module.function>" (with several --reward_fn rules)}, each [B]."""
    scores = {"score": raw_scores}
    if gold is not None:
        scores["gold_score"] = gold
    scores.update(rule_parts)
    return scores


def write_samples(out_dir, step, prompts, scores, gen, tok, n):
    """Rank 0: a few (prompt, response, scores) rows to read, appended to samples.jsonl. scores:
    {name: [B]}, the "score" before the EOS penalty (a reward model's normalised) and, where
    logged, "gold_score" and each rule's ("rule/..."). The response is its text without special
    tokens, as the rules read it (a reward model reads them: `written_text`); "finished" says
    whether it ended at a stop token (`reward_model_inputs` adds the reward model's end then)."""
    with checkpoint.open_regular(os.path.join(out_dir, "samples.jsonl"), "a") as f:
        for i in range(min(4, len(gen.response_ids))):
            row = {"step": step, "prompt": prompts[i // n][1]["prompt"]}
            for name, values in scores.items():
                row[name] = values[i].item()
            row["response"] = tok.decode(gen.response_ids[i], skip_special_tokens=True)
            row["finished"] = gen.finished[i]
            f.write(json.dumps(row) + "\n")


def restore_schedules(meta, scheds, where, args):
    """The learning-rate schedulers' states and the KL coefficient from a checkpoint's meta.json,
    checked: a crafted one gets one line, not a traceback from deep in the scheduler. Returns
    kl_coef: the adaptive controller's state with --target_kl; a fixed beta is this run's
    --kl_coef (a flag a resume may change)."""
    states = meta.get("scheduler")
    if not isinstance(states, dict) or sorted(states) != sorted(scheds):
        raise checkpoint.CheckpointError(f"{where}: expected scheduler states of {sorted(scheds)}")
    for name, sched in scheds.items():
        checkpoint.restore_scheduler(sched, states[name], where)
    kl_coef = common.finite_number(meta.get("kl_coef"))  # None: no number, or 10**400
    if kl_coef is None or kl_coef < 0:
        saved = f"{meta.get('kl_coef')!r:.40}"
        raise checkpoint.CheckpointError(f"{where}: kl_coef {saved}, expected a number >= 0")
    if args.target_kl == 0:
        return args.kl_coef
    return kl_coef


# Settings a resumed run must share with its checkpoint (others, like --lr, may change).
MUST_MATCH = [
    "model",
    "data",
    "seed",
    "rollout_batch_size",
    "n_samples_per_prompt",
    "train_batch_size",
    "advantage_estimator",
    "reward_fn",
    "reward_weights",
    "reward_model",
    "reward_norm",
    *common.RUN_MUST_MATCH,
]
# What a checkpoint written before a MUST_MATCH flag existed ran with, where that is not the
# flag's default (`common.arg_defaults`): the reward model's raw score, before --reward_norm
BEFORE_FLAGS = {"reward_norm": False}


def main(args):
    rank, world, device = common.init_distributed(args.seed, args.timeout_minutes)
    common.make_local_dir(args)
    check_args(args, world)
    n = args.n_samples_per_prompt
    per_rank = args.rollout_batch_size // world
    metrics_log = common.MetricsLog(common.local_dir(args), args.tensorboard, args.out_dir)

    models, tok, roles = build_models(args, device)
    frozen = frozen_fingerprints(models, device)
    folders = folder_identities(args)
    rules = rule_digests(args)
    scheds = {}
    for name, (_, optim) in roles.items():
        scheds[name] = get_linear_schedule_with_warmup(optim, args.warmup_steps, args.max_steps)
    context = common.context_length(args.model, models.actor.config)
    train, held_out = load_data(args, tok, context, models.reward_tokenizer)
    per_step = args.rollout_batch_size
    common.print_plan(args, "prompts", len(train), len(held_out), per_step, "iterations")

    stop_ids = common.stop_token_ids(tok, models.actor.generation_config)
    # the export stops where responses end (a chat template's end of turn may not be listed)
    export_generation_config = common.stopping_at(models.actor.generation_config, stop_ids)
    # The engine before the checkpoint: vLLM seeds the global RNGs while it starts.
    longest_prompt = max(len(ids) for rows in (train, held_out) for ids, _ in rows)
    longest = longest_prompt + args.max_new_tokens  # its KV cache
    engine = rollout.build_engine(
        args.rollout_engine,
        args.model,
        longest,
        args.seed,
        stop_ids,
        args.gpu_memory_utilization,
        args.enforce_eager,
        common.attention_implementation(args.model, args.attn_implementation),
        args.temperature,
    )
    start = 0
    kl_coef = args.kl_coef  # beta; the adaptive controller moves it [N policy #11]
    final = checkpoint.resolve(args.out_dir, args.resume)
    if final:  # the RNG is restored last, inside load
        identity = common.run_identity(args)
        defaults = {**common.arg_defaults(args), **BEFORE_FLAGS}
        meta = checkpoint.load(
            final, roles, vars(args), MUST_MATCH, frozen, folders, identity, defaults
        )
        note_another_engine(meta, engine, final)
        note_changed_rules(meta, rules, final)
        kl_coef = restore_schedules(meta, scheds, f"{final}/meta.json", args)
        start = meta["step"]
        rollout.sync_weights(engine, models.actor)  # the engine started from --model: resume it
        common.print0(f"resumed from {final} at step {start}")
    # the rows a killed run logged after the checkpoint go (all of them on a fresh start)
    metrics_log.truncate(start if final else None)
    if not final and held_out:
        eval_metrics = evaluate(args, engine, tok, models, held_out, device)
        common.print0(eval_line(args, 0, eval_metrics))
        metrics_log.log(eval_metrics, 0)

    from_update = old_logprobs_from_update(args)  # step (3) leaves the actor's to step (5)
    step = start
    pbar = common.progress_bar(args.max_steps, start, "ppo")
    for step in range(start + 1, args.max_steps + 1):
        clock = common.Stopwatch()
        idx, epoch = common.batch_indices(step - 1, len(train), args.rollout_batch_size, args.seed)
        positions = range(rank * per_rank, (rank + 1) * per_rank)  # mine, in the global batch
        prompts = [train[idx[j]] for j in positions]
        # (1) Rollout: this rank's share of the step's prompts, n samples each.
        gen = generate(args, engine, prompts, step, positions)
        prompt_ids = [ids for ids, _ in prompts for _ in range(n)]  # [B], prompt-major
        rows = [row for _, row in prompts for _ in range(n)]  # [B], each sample's data row
        clock.lap("time/rollout_s")
        # (2) Score; a response cut without EOS is penalised [N policy #5].
        raw_scores, rule_parts = score(
            args, tok, models, rows, prompt_ids, gen.response_ids, gen.finished, device
        )
        scores = eos_penalized(raw_scores, gen.finished, args.missing_eos_penalty)
        gold = None  # the rule beside a learned reward: logged, never trained on
        if args.gold_reward_fn:
            gold = gold_scores(args, tok, rows, gen.response_ids)
        clock.lap("time/score_s")  # reward function or model, gold scores
        # (3) Old and reference logprobs, values: in a random order, which the first PPO epoch
        # keeps (its first micro-batch then sees ratio == 1 exactly).
        order = torch.randperm(len(prompt_ids))
        exp = old_logprobs_and_values(
            args, models, tok, prompt_ids, gen.response_ids, order, device, from_update
        )
        clock.lap("time/logprobs_s")  # old and reference logprobs, values
        # (4) Advantages: GAE over per-token rewards, or group baselines.
        scores = scores[order].to(device)
        compute_advantages(args, exp, scores, order.to(device), kl_coef)
        clock.lap("time/advantages_s")
        # (5) PPO epochs over shuffled minibatches.
        update_stats, update_maxima = ppo_update(args, models, roles, exp, kl_coef)
        gap = logprob_gap(exp, gen.logprobs, order)  # [B, R]: engine vs actor, every token
        lr = scheds["actor"].get_last_lr()[0]  # the actor's rate this iteration trained at
        for sched in scheds.values():
            sched.step()
        clock.lap("time/train_s")
        # (6) Push the new actor weights into the engine.
        rollout.sync_weights(engine, models.actor)
        clock.lap("time/sync_s")

        sums = rollout_sums(raw_scores, gen, exp, gap, gold, rule_parts)
        maxima = {"rollout/logprob_diff_max": gap.max(), **update_maxima}
        metrics = iteration_metrics(update_stats, sums, maxima, device)
        warn_if_off_policy(args, step, metrics, device)
        metrics.update(clock.times)
        metrics["objective/kl_coef"] = kl_coef
        metrics["train/epoch"] = epoch
        metrics["train/lr"] = lr
        if args.target_kl > 0:
            n_responses = args.rollout_batch_size * n
            kl_coef = update_kl_coef(kl_coef, metrics["objective/kl"], args.target_kl, n_responses)
        # rank 0's responses, to check that a resumed run samples the same tokens
        metrics["rollout/responses_sha"] = hash_responses(gen.response_ids)
        eval_due = common.eval_due(args, step)
        if held_out and eval_due:
            metrics.update(evaluate(args, engine, tok, models, held_out, device))
            common.print0(eval_line(args, step, metrics))
        metrics_log.log(metrics, step)
        if rank == 0 and eval_due:  # with a held-out set or without one (a user's --data alone)
            named_scores = sample_scores(raw_scores, gold, rule_parts)
            write_samples(common.local_dir(args), step, prompts, named_scores, gen, tok, n)
        pbar.update(1)
        score_text = f"{metrics['objective/score']:.3f}"
        postfix = {"score": score_text}
        if "objective/kl" in metrics:
            postfix["kl"] = f"{metrics['objective/kl']:.3f}"
        pbar.set_postfix(postfix)

        meta = {
            "scheduler": {name: sched.state_dict() for name, sched in scheds.items()},
            "kl_coef": kl_coef,
            "epoch": epoch,
            "consumed_prompts": step * args.rollout_batch_size,
            "frozen": frozen,
            "folders": folders,
            "rules": rules,  # the rules' files (note_changed_rules)
            "engine": engine.kind,  # what --rollout_engine auto chose (note_another_engine)
        }
        hf_objs = (models.actor.config, tok, export_generation_config)
        saved, stop = common.end_of_step(args, step, device, roles, meta, hf_objs)
        if step == args.max_steps:
            final = saved
        if stop:
            break
    common.close_progress_bar(pbar)

    common.finish(args, step, final, "actor")  # the final actor as an HF folder; a summary
    # Every rank is done before the engine shuts down: vLLM's shutdown ends the process group.
    dist.barrier()
    engine.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    common.run(main, Args, LIMITS)
