"""plainrlhf's RL math vs Hugging Face TRL's code, on the same float64 inputs (not a test).

    .venv/bin/python bench/math_vs_trl.py [--peer /tmp/trlpeer]

Fixed-seed inputs (6 PPO responses of R = 7 columns, one filling R and one of a single token;
3 prompts x 4 samples for GRPO and RLOO, in plainrlhf's shuffled row order; 8 DPO and reward
pairs) go through plainrlhf's functions (train_ppo.py, train_dpo.py, train_rm.py, this venv, a
1-process gloo group for `masked_whiten`'s all_reduce) and through TRL's lines, in the peer's
venv (made by ../shared/peers/trl/setup_venv.sh if missing): PPO is TRL 1.12's
`trl.experimental.ppo` (the last TRL with a PPOTrainer, `--peer`/trl112 first on PYTHONPATH),
the rest TRL 1.16. TRL's module-level functions are imported; its code inside methods is copied
verbatim (up to ruff's line wrapping) into the `trl_*` functions below, each naming its source.
The sides exchange inputs and outputs through a temporary folder (torch.save, and torch.load with
weights_only=True).

Prints a markdown table: plainrlhf's function (and TRL's counterpart), the largest absolute
difference from TRL's code as TRL writes it, the same with the convention matched (TRL's lines
with the edits, each marked "not TRL", that make them follow plainrlhf's convention), and what the
convention is. PPO's rows compare on response tokens (TRL fills padding later). Ends with a
`BENCH {json}` line.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import types

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESS = os.path.join(os.path.dirname(REPO), "shared", "peers", "trl")
GAE_SETTINGS = [(1.0, 0.95), (0.99, 0.95), (1.0, 1.0)]  # (gamma, lam)
# the rows of `compute_advantages` with gae: key -> whiten_rewards
PIPELINES = {"advantages_gae": False, "advantages_gae_whiten_rewards": True}
# (key, plainrlhf's function and TRL's counterpart, the convention); "none": the same math
ROWS = [
    (
        "rewards",
        "`compute_rewards` (PPOTrainer.train)",
        "TRL adds the score one column past the last response token (`actual_end`; at the last "
        "column where a response fills R). Matched: at the last token",
    ),
    (
        "gae",
        "`compute_gae` (PPOTrainer.train)",
        "TRL keeps V one column past the last token (`padding_mask_p1`), so the last token's "
        "delta bootstraps from it. Matched: V = 0 past the response",
    ),
    (
        "whiten",
        "`masked_whiten` (ppo_trainer.masked_whiten)",
        "TRL's `masked_var` is unbiased (x N/(N-1)); plainrlhf divides by N. Matched: "
        "`unbiased=False`",
    ),
    (
        "advantages_gae",
        "`compute_advantages`, gae (PPOTrainer.train)",
        "the three above",
    ),
    (
        "advantages_gae_whiten_rewards",
        "`compute_advantages`, gae, whiten_rewards (PPOTrainer.train)",
        "the three above, and TRL whitens the rewards over `~padding_mask_p1` (the response "
        "and one column). Matched: over the response",
    ),
    ("pg", "`policy_loss`: pg_loss, clipfrac (PPOTrainer.train)", "none (TRL: clipfrac float32)"),
    (
        "approxkl",
        "`policy_loss`: approxkl (PPOTrainer.train)",
        "TRL's is a `.mean()` over all R columns, padding counted as 0. Matched: over the "
        "response tokens",
    ),
    (
        "vf",
        "`value_loss` (PPOTrainer.train)",
        "TRL averages over the response and one column past it (`~padding_mask_p1`). Matched: "
        "over the response (TRL: clipfrac float32)",
    ),
    ("eos", "`eos_penalized` (PPOTrainer.train)", "none"),
    (
        "grpo_advantages",
        "`group_advantages`, `compute_advantages`, grpo (GRPOTrainer)",
        "none (TRL's `nanstd` takes count/(count-1) in float32)",
    ),
    ("kl", "`kl_loss` (GRPOTrainer._compute_loss)", "none at TRL's default loss_type dapo"),
    (
        "grpo_loss",
        "`policy_loss` + kl_coef `kl_loss`, grpo (GRPOTrainer._compute_loss)",
        "none at loss_type dapo (token ratio, a token mean); the advantages' rounding above",
    ),
    (
        "rloo_advantages",
        "`group_advantages`, `compute_advantages`, rloo (RLOOTrainer)",
        "none (k1 KL summed into the reward)",
    ),
    (
        "rloo_loss",
        "`policy_loss`, rloo (RLOOTrainer._compute_loss)",
        "TRL clips one ratio per sequence (of the summed log-ratio), a mean over sequences; "
        "plainrlhf per token, over tokens. Matched: GRPOTrainer's loss (dapo, beta 0)",
    ),
    ("dpo", "`dpo_loss`, sigmoid (DPOTrainer._compute_loss)", "none"),
    (
        "cdpo",
        "`dpo_loss`, sigmoid, label_smoothing 0.1 (DPOTrainer._compute_loss)",
        "TRL's sigmoid ignores label_smoothing (cDPO). Matched: the smoothed sigmoid of TRL's "
        "`aot` branch, on the unsorted delta",
    ),
    (
        "ipo",
        "`dpo_loss`, ipo (DPOTrainer._compute_loss)",
        "TRL divides each log-ratio by its completion's token count; plainrlhf: summed "
        "logprobs (Azar et al. eq. 17). Matched: counts of 1",
    ),
    ("dpo_statistics", "`dpo_statistics` / n pairs (DPOTrainer's metrics)", "none"),
    ("bradley_terry", "`bradley_terry_loss` (RewardTrainer.compute_loss)", "none (3 margins)"),
]


def flat(*tensors):
    """The values of several tensors (or numbers) as one float64 vector, to compare."""
    parts = [torch.as_tensor(t, dtype=torch.float64).flatten() for t in tensors]
    return torch.cat(parts)


def ppo_inputs(inp):
    """6 responses of R = 7 columns: one fills R, one is a single token."""
    B = 6
    R = 7
    D = torch.float64
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])
    inp["mask"] = (torch.arange(R)[None, :] < lengths[:, None]).to(D)  # [B, R]
    inp["logprobs_raw"] = -torch.rand(B, R, dtype=D) * 3  # old logprobs, on all columns
    inp["ref_logprobs_raw"] = inp["logprobs_raw"] + 0.3 * torch.randn(B, R, dtype=D)
    inp["new_logprobs_raw"] = inp["logprobs_raw"] + 0.3 * torch.randn(B, R, dtype=D)
    inp["values_raw"] = torch.randn(B, R, dtype=D)  # the critic's old values, on all columns
    inp["vpred_raw"] = inp["values_raw"] + 0.4 * torch.randn(B, R, dtype=D)
    inp["scores"] = torch.randn(B, dtype=D) * 2
    inp["finished"] = [True, False, True, True, False, True]
    inp["advantages"] = torch.randn(B, R, dtype=D)
    inp["whiten_x"] = torch.randn(B, R, dtype=D) * 3 + 5
    inp["gae_rewards"] = torch.randn(B, R, dtype=D) * inp["mask"]
    inp["returns"] = torch.randn(B, R, dtype=D) * inp["mask"]
    inp["kl_coef"] = 0.05
    inp["cliprange"] = 0.2
    inp["cliprange_value"] = 0.2
    inp["penalty"] = 1.5


def group_and_pair_inputs(inp):
    """3 prompts x 4 samples of R = 5 columns (prompt-major); 8 DPO and reward pairs."""
    D = torch.float64
    lengths = torch.tensor([5, 2, 4, 3, 1, 5, 3, 4, 2, 5, 5, 1])
    mask = (torch.arange(5)[None, :] < lengths[:, None]).to(D)  # [12, 5]
    inp["n"] = 4
    inp["mask_g"] = mask
    inp["scores_g"] = torch.randn(12, dtype=D)
    inp["old_lp_g"] = -torch.rand(12, 5, dtype=D) * 2 * mask
    inp["ref_lp_g"] = (inp["old_lp_g"] + 0.2 * torch.randn(12, 5, dtype=D)) * mask
    inp["new_lp_g"] = inp["old_lp_g"] + 0.25 * torch.randn(12, 5, dtype=D)  # on all columns
    inp["order"] = torch.randperm(12)  # plainrlhf's shuffled row order
    inp["beta_g"] = 0.04
    inp["pi_c"] = -torch.rand(8, dtype=D) * 40  # summed response logprobs
    inp["pi_r"] = -torch.rand(8, dtype=D) * 40
    inp["ref_c"] = inp["pi_c"] + 3 * torch.randn(8, dtype=D)
    inp["ref_r"] = inp["pi_r"] + 3 * torch.randn(8, dtype=D)
    inp["len_c"] = torch.randint(3, 30, (8,))  # response lengths, for TRL's IPO
    inp["len_r"] = torch.randint(3, 30, (8,))
    inp["dpo_beta"] = 0.1
    inp["dpo_eps"] = 0.1
    inp["r_c"] = torch.randn(8, dtype=D)
    inp["r_r"] = torch.randn(8, dtype=D)
    inp["margin_scalar"] = 0.5
    inp["margin_pairs"] = torch.rand(8, dtype=D)


# ---- plainrlhf's side (this venv) --------------------------------------------------------------
def plain_gae_pipeline(P, inp, whiten_rewards, gamma, lam):
    """`compute_advantages` with the gae estimator: (advantages, returns) [B, R]."""
    mask = inp["mask"]
    # the stage's own Args (its defaults for what is not set here), so a flag the function reads
    # later is there: a SimpleNamespace of these few fields broke when --scale_rewards came
    args = P.Args(advantage_estimator="gae", whiten_rewards=whiten_rewards, gamma=gamma, lam=lam)
    exp = types.SimpleNamespace(batch=types.SimpleNamespace(response_mask=mask))
    exp.old_logprobs = inp["logprobs_raw"] * mask  # zero on padding, as the rollout leaves them
    exp.ref_logprobs = inp["ref_logprobs_raw"] * mask
    exp.old_values = inp["values_raw"] * mask
    order = torch.arange(len(inp["scores"]))
    P.compute_advantages(args, exp, inp["scores"].clone(), order, inp["kl_coef"])
    return exp.advantages, exp.returns


def plain_ppo(P, inp):
    mask = inp["mask"]
    bm = mask.bool()
    n_tokens = mask.sum()
    lp = inp["logprobs_raw"] * mask
    ref = inp["ref_logprobs_raw"] * mask
    values = inp["values_raw"] * mask
    rewards = P.compute_rewards(inp["scores"].clone(), lp, ref, mask, inp["kl_coef"])
    out = {"rewards": flat(*rewards)}
    gae = []
    pipelines = {key: [] for key in PIPELINES}
    for gamma, lam in GAE_SETTINGS:
        advantages, returns = P.compute_gae(inp["gae_rewards"], values, mask, gamma, lam)
        gae.extend([advantages[bm], returns[bm]])
        for key, whiten_rewards in PIPELINES.items():
            advantages, returns = plain_gae_pipeline(P, inp, whiten_rewards, gamma, lam)
            pipelines[key].extend([advantages[bm], returns[bm]])
    out["gae"] = flat(*gae)
    for key, parts in pipelines.items():
        out[key] = flat(*parts)
    x = inp["whiten_x"]
    out["whiten"] = flat(P.masked_whiten(x, mask)[bm], P.masked_whiten(x, mask, False)[bm])
    new = inp["new_logprobs_raw"]  # on all columns, as the update's forward gives them
    pg = P.policy_loss(new, lp, inp["advantages"], mask, inp["cliprange"], n_tokens)
    out["pg"] = flat(pg[0], pg[1])
    out["approxkl"] = flat(pg[2])
    vpred = inp["vpred_raw"]
    vf = P.value_loss(vpred, values, inp["returns"], mask, inp["cliprange_value"], n_tokens)
    out["vf"] = flat(*vf)
    out["eos"] = flat(P.eos_penalized(inp["scores"].clone(), inp["finished"], inp["penalty"]))
    return out


def plain_group_advantages(P, inp, kind):
    """`compute_advantages` on the shuffled rows, put back in prompt-major order: ([12], [12, 5])
    as `group_advantages` gives them and as spread over the tokens."""
    order = inp["order"]
    n = inp["n"]
    args = P.Args(advantage_estimator=kind, n_samples_per_prompt=n)
    exp = types.SimpleNamespace(batch=types.SimpleNamespace(response_mask=inp["mask_g"][order]))
    exp.old_logprobs = inp["old_lp_g"][order]
    exp.ref_logprobs = inp["ref_lp_g"][order]
    P.compute_advantages(args, exp, inp["scores_g"][order], order, inp["beta_g"])
    per_token = torch.empty_like(exp.advantages)
    per_token[order] = exp.advantages
    return P.group_advantages(inp["scores_g"].view(-1, n), kind).flatten(), per_token


def plain_groups(P, inp):
    mask = inp["mask_g"]
    n_tokens = mask.sum()
    new = inp["new_lp_g"]
    old = inp["old_lp_g"]
    clip = inp["cliprange"]
    out = {}
    grpo = plain_group_advantages(P, inp, "grpo")
    out["grpo_advantages"] = flat(*grpo)
    kl = P.kl_loss(new, inp["ref_lp_g"], mask, n_tokens)
    out["kl"] = flat(kl)
    pg = P.policy_loss(new, old, grpo[1], mask, clip, n_tokens)[0]
    out["grpo_loss"] = flat(pg + inp["beta_g"] * kl)  # as `ppo_loss` sums them
    rloo = plain_group_advantages(P, inp, "rloo")
    out["rloo_advantages"] = flat(*rloo)
    out["rloo_loss"] = flat(P.policy_loss(new, old, rloo[1], mask, clip, n_tokens)[0])
    return out


def plain_pairs(inp, train_dpo, train_rm):
    pairs = (inp["pi_c"], inp["pi_r"], inp["ref_c"], inp["ref_r"])
    n = len(inp["pi_c"])
    out = {}
    for key, loss_type, eps in [
        ("dpo", "sigmoid", 0.0),
        ("cdpo", "sigmoid", 0.1),
        ("ipo", "ipo", 0),
    ]:
        loss = train_dpo.dpo_loss(*pairs, n, beta=inp["dpo_beta"], loss_type=loss_type, eps=eps)
        out[key] = flat(loss)
    stats = train_dpo.dpo_statistics(*pairs, inp["dpo_beta"])
    out["dpo_statistics"] = flat([stats[k] / n for k in sorted(stats)])
    bt = []
    for margin in [inp["margin_scalar"], inp["margin_pairs"], 0.0]:
        bt.append(train_rm.bradley_terry_loss(inp["r_c"], inp["r_r"], margin, n))
    out["bradley_terry"] = flat(*bt)
    return out


def plain_side(work):
    import torch.distributed as dist

    sys.path.insert(0, REPO)
    import train_dpo
    import train_ppo
    import train_rm

    # masked_whiten all_reduces: a 1-process gloo group
    store = os.path.join(work, "gloo_store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    inp = torch.load(os.path.join(work, "inputs.pt"), weights_only=True)
    out = plain_ppo(train_ppo, inp)
    out.update(plain_groups(train_ppo, inp))
    out.update(plain_pairs(inp, train_dpo, train_rm))
    dist.destroy_process_group()
    torch.save(out, os.path.join(work, "plainrlhf.pt"))


# ---- TRL 1.12's PPO (the peer's venv, trl112 first on PYTHONPATH) ------------------------------
def trl112_masks(ppo, inp, matched):
    """TRL 1.12.0, trl/experimental/ppo/ppo_trainer.py, PPOTrainer.train: the response processing
    before "4. compute rewards"; `sequence_length` as TRL computes it, pad id 0."""
    INVALID_LOGPROB = ppo.INVALID_LOGPROB
    responses = inp["mask"].long()  # token 1 on the response, pad 0 after it
    t = types.SimpleNamespace(responses=responses)
    t.sequence_lengths = ppo.first_true_indices(responses == 0) - 1
    logprobs = inp["logprobs_raw"].clone()
    ref_logprobs = inp["ref_logprobs_raw"].clone()
    values = inp["values_raw"].clone()
    sequence_lengths = t.sequence_lengths
    # verbatim from here
    response_idxs = torch.arange(responses.shape[1], device=responses.device).repeat(
        responses.shape[0], 1
    )
    padding_mask = response_idxs > sequence_lengths.unsqueeze(1)
    logprobs = torch.masked_fill(logprobs, padding_mask, INVALID_LOGPROB)
    ref_logprobs = torch.masked_fill(ref_logprobs, padding_mask, INVALID_LOGPROB)
    sequence_lengths_p1 = sequence_lengths + 1
    padding_mask_p1 = response_idxs > (sequence_lengths_p1.unsqueeze(1))
    values = torch.masked_fill(values, padding_mask_p1, 0)
    # to here
    if matched:  # not TRL: V = 0 past the response
        values = torch.masked_fill(values, padding_mask, 0)
    t.padding_mask = padding_mask
    t.padding_mask_p1 = padding_mask_p1
    t.sequence_lengths_p1 = sequence_lengths_p1
    t.logprobs = logprobs
    t.ref_logprobs = ref_logprobs
    t.values = values
    return t


def trl112_rewards(t, args, scores, matched):
    """TRL 1.12.0, ppo_trainer.py, PPOTrainer.train: "4. compute rewards" -> (rewards, kl)."""
    logprobs = t.logprobs
    ref_logprobs = t.ref_logprobs
    sequence_lengths = t.sequence_lengths
    sequence_lengths_p1 = t.sequence_lengths_p1
    # verbatim from here
    logr = ref_logprobs - logprobs
    kl = -logr if args.kl_estimator == "k1" else (logr.exp() - 1) - logr  # Else statement is k3
    non_score_reward = -args.kl_coef * kl
    rewards = non_score_reward.clone()
    actual_start = torch.arange(rewards.size(0), device=rewards.device)
    actual_end = torch.where(
        sequence_lengths_p1 < rewards.size(1), sequence_lengths_p1, sequence_lengths
    )
    # to here
    if matched:  # not TRL: the score at the last token
        actual_end = sequence_lengths
    rewards[actual_start, actual_end] += scores  # verbatim
    return rewards, kl


def trl112_gae(rewards, values, args):
    """TRL 1.12.0, ppo_trainer.py, PPOTrainer.train: "6. compute advantages and returns", up to
    the whitening -> (advantages, returns)."""
    gen_length = rewards.shape[1]  # TRL: responses.shape[1]
    # verbatim from here
    lastgaelam = 0
    advantages_reversed = []
    for t in reversed(range(gen_length)):
        nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
        delta = rewards[:, t] + args.gamma * nextvalues - values[:, t]
        lastgaelam = delta + args.gamma * args.lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], axis=1)
    returns = advantages + values
    return advantages, returns


def trl112_biased_whiten(ppo):
    """Not TRL: TRL 1.12.0's ppo_trainer.masked_whiten with `masked_var(..., unbiased=False)`."""

    def masked_whiten(values, mask, shift_mean=True):
        mean = ppo.masked_mean(values, mask)
        var = ppo.masked_var(values, mask, unbiased=False)  # TRL: masked_var(values, mask)
        whitened = (values - mean) * torch.rsqrt(var + 1e-8)
        if not shift_mean:
            whitened += mean
        return whitened

    return masked_whiten


def trl112_advantages(ppo, inp, args, matched):
    """TRL 1.12.0, ppo_trainer.py, PPOTrainer.train: steps 4 to 6 -> (advantages, returns)."""
    t = trl112_masks(ppo, inp, matched)
    rewards = trl112_rewards(t, args, inp["scores"].clone(), matched)[0]
    masked_whiten = ppo.masked_whiten
    padding_mask_p1 = t.padding_mask_p1
    if matched:  # not TRL: no Bessel correction; the rewards whitened over the response
        masked_whiten = trl112_biased_whiten(ppo)
        padding_mask_p1 = t.padding_mask
    # "5. whiten rewards", verbatim
    if args.whiten_rewards:
        rewards = masked_whiten(rewards, mask=~padding_mask_p1, shift_mean=False)
        rewards = torch.masked_fill(rewards, padding_mask_p1, 0)
    advantages, returns = trl112_gae(rewards, t.values, args)
    padding_mask = t.padding_mask
    # verbatim
    advantages = masked_whiten(advantages, ~padding_mask)
    advantages = torch.masked_fill(advantages, padding_mask, 0)
    return advantages, returns


def trl112_value_loss(ppo, inp, args, mb_values, padding_mask_p1):
    """TRL 1.12.0, ppo_trainer.py, PPOTrainer.train: the value loss of a micro-batch (all rows,
    so without `[micro_batch_inds]`) -> (vf_loss, vf_clipfrac)."""
    masked_mean = ppo.masked_mean
    mb_return = inp["returns"]
    vpred = inp["vpred_raw"]
    # verbatim from here
    vpred = torch.masked_fill(vpred, padding_mask_p1, 0)
    vpredclipped = torch.clamp(
        vpred,
        mb_values - args.cliprange_value,
        mb_values + args.cliprange_value,
    )
    vf_losses1 = torch.square(vpred - mb_return)
    vf_losses2 = torch.square(vpredclipped - mb_return)
    vf_loss_max = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * masked_mean(vf_loss_max, ~padding_mask_p1)
    vf_clipfrac = masked_mean((vf_losses2 > vf_losses1).float(), ~padding_mask_p1)
    return vf_loss, vf_clipfrac


def trl112_policy_loss(ppo, inp, args, t):
    """TRL 1.12.0, ppo_trainer.py, PPOTrainer.train: the policy loss of a micro-batch (all rows)
    -> (pg_loss, pg_clipfrac, approxkl, approxkl over the response tokens (not TRL))."""
    INVALID_LOGPROB = ppo.INVALID_LOGPROB
    masked_mean = ppo.masked_mean
    padding_mask = t.padding_mask
    mb_logprobs = t.logprobs
    mb_advantage = inp["advantages"]
    new_logprobs = inp["new_logprobs_raw"]
    # verbatim from here
    new_logprobs = torch.masked_fill(new_logprobs, padding_mask, INVALID_LOGPROB)
    logprobs_diff = new_logprobs - mb_logprobs
    ratio = torch.exp(logprobs_diff)
    pg_losses = -mb_advantage * ratio
    pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - args.cliprange, 1.0 + args.cliprange)
    pg_loss_max = torch.max(pg_losses, pg_losses2)
    pg_loss = masked_mean(pg_loss_max, ~padding_mask)
    pg_clipfrac = masked_mean((pg_losses2 > pg_losses).float(), ~padding_mask)
    approxkl = 0.5 * (logprobs_diff**2).mean()
    # to here
    approxkl_masked = 0.5 * masked_mean(logprobs_diff**2, ~padding_mask)  # not TRL
    return pg_loss, pg_clipfrac, approxkl, approxkl_masked


def trl112_args(inp, gamma=1.0, lam=0.95, whiten_rewards=False):
    """PPOConfig's fields that the copied lines read (kl_estimator: its default)."""
    args = types.SimpleNamespace(kl_coef=inp["kl_coef"], kl_estimator="k1")
    args.gamma = gamma
    args.lam = lam
    args.whiten_rewards = whiten_rewards
    args.cliprange = inp["cliprange"]
    args.cliprange_value = inp["cliprange_value"]
    return args


def trl112_advantage_rows(ppo, inp, out):
    bm = inp["mask"].bool()
    for matched in [False, True]:
        suffix = "|matched" if matched else ""
        t = trl112_masks(ppo, inp, matched)
        out["rewards" + suffix] = flat(*trl112_rewards(t, trl112_args(inp), inp["scores"], matched))
        gae = []
        pipelines = {key: [] for key in PIPELINES}
        for gamma, lam in GAE_SETTINGS:
            args = trl112_args(inp, gamma, lam)
            advantages, returns = trl112_gae(inp["gae_rewards"], t.values, args)
            gae.extend([advantages[bm], returns[bm]])
            for key, whiten_rewards in PIPELINES.items():
                args = trl112_args(inp, gamma, lam, whiten_rewards)
                advantages, returns = trl112_advantages(ppo, inp, args, matched)
                pipelines[key].extend([advantages[bm], returns[bm]])
        out["gae" + suffix] = flat(*gae)
        for key, parts in pipelines.items():
            out[key + suffix] = flat(*parts)
        whiten = ppo.masked_whiten
        if matched:
            whiten = trl112_biased_whiten(ppo)
        x = inp["whiten_x"]
        out["whiten" + suffix] = flat(whiten(x, bm)[bm], whiten(x, bm, shift_mean=False)[bm])


def trl112_side(work):
    import trl
    import trl.experimental.ppo.ppo_trainer as ppo

    if trl.__version__ != "1.12.0":
        raise SystemExit(f"TRL 1.12.0 expected first on PYTHONPATH, found {trl.__version__}")
    inp = torch.load(os.path.join(work, "inputs.pt"), weights_only=True)
    out = {}
    trl112_advantage_rows(ppo, inp, out)
    args = trl112_args(inp)
    t = trl112_masks(ppo, inp, False)
    pg = trl112_policy_loss(ppo, inp, args, t)
    out["pg"] = flat(pg[0], pg[1])
    out["approxkl"] = flat(pg[2])
    out["approxkl|matched"] = flat(pg[3])
    out["vf"] = flat(*trl112_value_loss(ppo, inp, args, t.values, t.padding_mask_p1))
    t = trl112_masks(ppo, inp, True)
    out["vf|matched"] = flat(*trl112_value_loss(ppo, inp, args, t.values, t.padding_mask))
    # TRL 1.12.0, ppo_trainer.py, PPOTrainer.train: "Response Processing 3", verbatim but for
    # contain_eos_token, here given (TRL: an EOS token anywhere in the response)
    scores = inp["scores"].clone()
    contain_eos_token = torch.tensor(inp["finished"])
    scores[~contain_eos_token] -= inp["penalty"]
    out["eos"] = flat(scores)
    torch.save(out, os.path.join(work, "trl-1.12.pt"))


# ---- TRL 1.16 (the peer's venv) ----------------------------------------------------------------
def trl116_grpo_advantages(nanstd, rewards, num_generations):
    """TRL 1.16.0, trl/trainer/grpo_trainer.py, GRPOTrainer._generate_and_score_completions:
    the advantages at its defaults (sum_then_normalize, scale_rewards "group") -> [B]."""
    self = types.SimpleNamespace(scale_rewards="group")
    # verbatim from here, the branches taken
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if self.scale_rewards in ["group", "none"]:
        std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
        std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
    advantages = rewards - mean_grouped_rewards
    if self.scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return advantages


def trl116_grpo_loss(inp, advantages, beta):
    """TRL 1.16.0, grpo_trainer.py, GRPOTrainer._compute_loss at its defaults (token-level
    importance sampling, loss_type "dapo"), 1 process, no accumulation, so that the normalizer
    `num_items_in_batch` is the batch's token count -> (loss, the KL term alone)."""
    self = types.SimpleNamespace(beta=beta, epsilon_low=inp["cliprange"])
    self.epsilon_high = inp["cliprange"]
    mask = inp["mask_g"]
    per_token_logps = inp["new_lp_g"]
    old_per_token_logps = inp["old_lp_g"]
    ref_per_token_logps = inp["ref_lp_g"]
    advantages = advantages.unsqueeze(1)
    normalizer = mask.sum()
    kl_term = torch.zeros(())
    # verbatim from here, the branches taken
    log_ratio = per_token_logps - old_per_token_logps
    log_importance_weights = log_ratio
    coef_1 = torch.exp(log_importance_weights)
    if self.beta != 0.0:
        per_token_kl = (
            torch.exp(ref_per_token_logps - per_token_logps)
            - (ref_per_token_logps - per_token_logps)
            - 1
        )
    coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
    per_token_loss1 = coef_1 * advantages
    per_token_loss2 = coef_2 * advantages
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    if self.beta != 0.0:
        per_token_loss = per_token_loss + self.beta * per_token_kl
        kl_term = (per_token_kl * mask).sum() / normalizer  # not TRL: the KL term alone
    loss = (per_token_loss * mask).sum() / normalizer  # verbatim
    return loss, kl_term


def trl116_rloo(inp, beta):
    """TRL 1.16.0, trl/trainer/rloo_trainer.py, RLOOTrainer: the advantages
    (_generate_and_score_completions, normalize_advantages False) and the loss (_compute_loss)
    -> (advantages [B], loss)."""
    self = types.SimpleNamespace(beta=beta, epsilon_low=inp["cliprange"])
    self.epsilon_high = inp["cliprange"]
    num_generations = inp["n"]
    completion_mask = inp["mask_g"]
    rewards = inp["scores_g"].clone()
    old_per_token_logps = inp["old_lp_g"]
    ref_per_token_logps = inp["ref_lp_g"]
    # verbatim from here, the branches taken (gather: 1 process)
    if self.beta != 0.0:
        per_token_kl = old_per_token_logps - ref_per_token_logps
        kl = (per_token_kl * completion_mask).sum(-1)
        rewards = rewards - self.beta * kl
    grouped_rewards = rewards.view(-1, num_generations)
    scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)
    grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)
    baselines = (grouped_sum - grouped_rewards) / (scorable_counts - 1)
    baselines = baselines.view(-1)
    advantages = rewards - baselines
    advantages = torch.nan_to_num(advantages, nan=0.0)
    # _compute_loss, verbatim from here
    per_token_logps = inp["new_lp_g"]
    old_logps = (old_per_token_logps * completion_mask).sum(1)  # TRL: inputs["old_logps"]
    logps = (per_token_logps * completion_mask).sum(1)  # mask out padding and tokens after EOS
    log_ratio = logps - old_logps
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
    per_sequence_loss1 = coef_1 * advantages
    per_sequence_loss2 = coef_2 * advantages
    per_sequence_loss = -torch.min(per_sequence_loss1, per_sequence_loss2)
    loss = per_sequence_loss.mean()
    return advantages, loss


def trl116_dpo(inp, loss_type, label_smoothing, completion_mask):
    """TRL 1.16.0, trl/trainer/dpo_trainer.py, DPOTrainer._compute_loss, f_divergence_type
    reverse_kl (the default), one loss type of weight 1 -> the loss."""
    F = torch.nn.functional
    self = types.SimpleNamespace(beta=inp["dpo_beta"], label_smoothing=label_smoothing)
    chosen_logps = inp["pi_c"]
    rejected_logps = inp["pi_r"]
    ref_chosen_logps = inp["ref_c"]
    ref_rejected_logps = inp["ref_r"]
    # verbatim from here, the branches taken
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    chosen_scores = chosen_logratios
    rejected_scores = rejected_logratios
    delta_score = chosen_scores - rejected_scores
    if loss_type == "sigmoid":
        per_sequence_loss = -F.logsigmoid(self.beta * delta_score)
    elif loss_type == "ipo":
        chosen_mask, rejected_mask = completion_mask.chunk(2, dim=0)
        chosen_avg_score = chosen_scores / chosen_mask.sum(dim=1).clamp(min=1.0)
        rejected_avg_score = rejected_scores / rejected_mask.sum(dim=1).clamp(min=1.0)
        ipo_delta = chosen_avg_score - rejected_avg_score
        per_sequence_loss = (ipo_delta - 1 / (2 * self.beta)) ** 2
    else:  # not TRL: the "aot" branch's smoothed sigmoid, on delta_score instead of sorted ones
        delta = delta_score
        per_sequence_loss = (
            -F.logsigmoid(self.beta * delta) * (1 - self.label_smoothing)
            - F.logsigmoid(-self.beta * delta) * self.label_smoothing
        )
    return per_sequence_loss.mean()


def trl116_dpo_statistics(inp):
    """TRL 1.16.0, dpo_trainer.py, DPOTrainer._compute_loss: the logged rewards/* and logps/*
    (gather: 1 process), in sorted key order."""
    beta = inp["dpo_beta"]
    chosen_logratios = inp["pi_c"] - inp["ref_c"]
    rejected_logratios = inp["pi_r"] - inp["ref_r"]
    # verbatim from here
    chosen_rewards = beta * chosen_logratios.detach()
    rejected_rewards = beta * rejected_logratios.detach()
    reward_accuracies = (chosen_rewards > rejected_rewards).float()
    margins = chosen_rewards - rejected_rewards
    # to here
    logged = {
        "logps/chosen": inp["pi_c"].mean().item(),
        "logps/rejected": inp["pi_r"].mean().item(),
        "rewards/accuracies": reward_accuracies.mean().item(),
        "rewards/chosen": chosen_rewards.mean().item(),
        "rewards/margins": margins.mean().item(),
        "rewards/rejected": rejected_rewards.mean().item(),
    }
    return [logged[k] for k in sorted(logged)]


def trl116_bradley_terry(inp, margin):
    """TRL 1.16.0, trl/trainer/reward_trainer.py, RewardTrainer.compute_loss -> the loss."""
    nn = torch.nn
    rewards_chosen = inp["r_c"]
    rewards_rejected = inp["r_r"]
    inputs = {}
    if margin is not None:
        inputs["margin"] = margin
    # verbatim from here
    if "margin" in inputs:
        loss = -nn.functional.logsigmoid(
            rewards_chosen - rewards_rejected - inputs["margin"]
        ).mean()
    else:
        loss = -nn.functional.logsigmoid(rewards_chosen - rewards_rejected).mean()
    return loss


def trl116_side(work):
    import trl
    from trl.trainer.utils import nanstd

    if trl.__version__ != "1.16.0":
        raise SystemExit(f"TRL 1.16.0 expected in the peer's venv, found {trl.__version__}")
    inp = torch.load(os.path.join(work, "inputs.pt"), weights_only=True)
    mask = inp["mask_g"]
    out = {}
    grpo = trl116_grpo_advantages(nanstd, inp["scores_g"].clone(), inp["n"])
    out["grpo_advantages"] = flat(grpo, grpo[:, None] * mask)
    loss, kl = trl116_grpo_loss(inp, grpo, inp["beta_g"])
    out["kl"] = flat(kl)
    out["grpo_loss"] = flat(loss)
    rloo, loss = trl116_rloo(inp, inp["beta_g"])
    scores_alone = trl116_rloo(inp, 0.0)[0]  # as `group_advantages` gets them: no KL
    out["rloo_advantages"] = flat(scores_alone, rloo[:, None] * mask)
    out["rloo_loss"] = flat(loss)
    out["rloo_loss|matched"] = flat(trl116_grpo_loss(inp, rloo, 0.0)[0])
    lengths = torch.cat([inp["len_c"], inp["len_r"]])
    completion_mask = (torch.arange(int(lengths.max()))[None] < lengths[:, None]).double()
    out["dpo"] = flat(trl116_dpo(inp, "sigmoid", 0.0, completion_mask))
    out["cdpo"] = flat(trl116_dpo(inp, "sigmoid", inp["dpo_eps"], completion_mask))
    out["cdpo|matched"] = flat(trl116_dpo(inp, "smoothed", inp["dpo_eps"], completion_mask))
    out["ipo"] = flat(trl116_dpo(inp, "ipo", 0.0, completion_mask))
    ones = torch.ones(len(lengths), 1, dtype=torch.float64)
    out["ipo|matched"] = flat(trl116_dpo(inp, "ipo", 0.0, ones))
    out["dpo_statistics"] = flat(trl116_dpo_statistics(inp))
    margins = [torch.full_like(inp["r_c"], inp["margin_scalar"]), inp["margin_pairs"], None]
    out["bradley_terry"] = flat(*[trl116_bradley_terry(inp, m) for m in margins])
    torch.save(out, os.path.join(work, "trl-1.16.pt"))


# ---- the comparison (this venv) ----------------------------------------------------------------
SIDES = {"plainrlhf": plain_side, "trl-1.12": trl112_side, "trl-1.16": trl116_side}


def run_sides(work, peer):
    """Each side in a process of its own; their outputs {key: float64 vector}."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    env.pop("PYTHONPATH", None)
    peer_python = os.path.join(peer, "venv", "bin", "python")
    commands = {
        "plainrlhf": (sys.executable, env),
        "trl-1.12": (peer_python, {**env, "PYTHONPATH": os.path.join(peer, "trl112")}),
        "trl-1.16": (peer_python, env),
    }
    outputs = {}
    for side, (python, side_env) in commands.items():
        cmd = [python, os.path.abspath(__file__), "--side", side, "--work", work]
        subprocess.run(cmd, env=side_env, check=True, capture_output=True, cwd=REPO)
        outputs[side] = torch.load(os.path.join(work, f"{side}.pt"), weights_only=True)
    return outputs


def max_abs_difference(a, b):
    return (a - b).abs().max().item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--peer", default="/tmp/trlpeer")
    p.add_argument("--side", choices=sorted(SIDES), help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.side:
        torch.set_num_threads(1)
        SIDES[a.side](a.work)
        return
    if not os.path.exists(os.path.join(a.peer, "venv", "bin", "python")):
        subprocess.run(["bash", os.path.join(HARNESS, "setup_venv.sh"), a.peer], check=True)
    torch.manual_seed(1234)
    inp = {}
    ppo_inputs(inp)
    group_and_pair_inputs(inp)
    with tempfile.TemporaryDirectory() as work:
        torch.save(inp, os.path.join(work, "inputs.pt"))
        outputs = run_sides(work, a.peer)
    trl = {**outputs["trl-1.12"], **outputs["trl-1.16"]}
    print(
        "| plainrlhf function (TRL's counterpart) | as TRL writes it | convention matched | "
        "the convention |"
    )
    print("|---|---:|---:|---|")
    results = []
    for key, function, convention in ROWS:
        ours = outputs["plainrlhf"][key]
        as_written = max_abs_difference(ours, trl[key])
        matched = max_abs_difference(ours, trl.get(key + "|matched", trl[key]))
        print(f"| {function} | {as_written:.1e} | {matched:.1e} | {convention} |")
        results.append({"function": function, "as_written": as_written, "matched": matched})
    print("BENCH " + json.dumps({"math_vs_trl": results}))


if __name__ == "__main__":
    main()
