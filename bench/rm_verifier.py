"""Can a reward model of the embedded task serve as a verifier ("is this answer right?")?

    python bench/rm_verifier.py RM_DIR POLICY_DIR [N_PROMPTS]

1. Calibration, from the reward model's own training pairs (no gold rule): the normalised scores
   (as PPO normalises them: reward_mean, reward_std of config.json) of the chosen and the rejected
   responses of `task.make_pairs("train", 4)`, the chosen one counted once per prompt; two
   thresholds from them: the midpoint of the two means, and the one that best separates them
   (the highest balanced accuracy, the mean of the chosen's and the rejected's shares classed
   right).
2. On-policy: 4 samples at T = 1 for each of N_PROMPTS (default 500) training prompts from
   POLICY_DIR; the share right (the rule), the within-prompt ranking of right over wrong (as
   bench/rm_kinds.py), the global AUC of right against wrong across prompts, and at each
   threshold the verifier's true- and false-positive rates, its accuracy, the share of accepted
   samples that are right (precision) and the share of groups of 4 whose verdicts differ (the
   groups GRPO learns from), against the rule's.
"""

import os
import sys

import torch
from transformers import AutoModelForCausalLM
from transformers import AutoModelForSequenceClassification
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rm_kinds  # noqa: E402

import common  # noqa: E402
import task  # noqa: E402


def normalised(model, tok, prompts, responses):
    """The reward model's scores [N], normalised as PPO's (--reward_norm), in chunks."""
    mean = model.config.reward_mean
    std = model.config.reward_std
    out = []
    for start in range(0, len(prompts), 512):
        chunk = slice(start, start + 512)
        out.append(rm_kinds.scores(model, tok, prompts[chunk], responses[chunk]))
    return (torch.cat(out).double() - mean) / std


def auc(pos, neg):
    """P(a random positive scores above a random negative), ties half. pos, neg: 1-D tensors."""
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    above = (pos[:, None] > neg[None, :]).double().mean()
    ties = (pos[:, None] == neg[None, :]).double().mean()
    return (above + 0.5 * ties).item()


def best_threshold(pos, neg):
    """The threshold of the highest balanced accuracy between pos (accepted) and neg."""
    candidates = torch.cat([pos, neg]).sort().values
    best = (0.0, 0.0)
    for tau in candidates.tolist():
        balanced = 0.5 * ((pos > tau).double().mean() + (neg <= tau).double().mean()).item()
        if balanced > best[0]:
            best = (balanced, tau)
    return best[1]


def calibrate(model, tok):
    """{name: tau} from the training pairs, and prints their score statistics."""
    pairs = task.make_pairs("train", 4)
    chosen = {p["prompt"]: p["chosen"] for p in pairs}
    pos = normalised(model, tok, list(chosen), list(chosen.values()))
    neg = normalised(model, tok, [p["prompt"] for p in pairs], [p["rejected"] for p in pairs])
    print(
        f"training pairs: chosen {pos.mean():.3f} +- {pos.std():.3f} ({len(pos)}), "
        f"rejected {neg.mean():.3f} +- {neg.std():.3f} ({len(neg)}), global AUC {auc(pos, neg):.3f}"
    )
    taus = {"midpoint": 0.5 * (pos.mean() + neg.mean()).item(), "best": best_threshold(pos, neg)}
    for name, tau in taus.items():
        tpr = (pos > tau).double().mean().item()
        fpr = (neg > tau).double().mean().item()
        print(f"  tau {name} = {tau:.3f}: chosen accepted {tpr:.1%}, rejected accepted {fpr:.1%}")
    taus["chosen"] = pos  # the chosen responses' scores, for a sweep of thresholds
    return taus


def draw(policy, tok, n_prompts):
    """(prompts [N], responses [N], gold [N]): N_SAMPLES samples at T = 1 per training prompt."""
    torch.manual_seed(0)
    examples = task.make_split("train")[:n_prompts]
    prompts = []
    responses = []
    for example in examples:
        responses += rm_kinds.sample(policy, tok, example["prompt"])
        prompts += [example["prompt"]] * rm_kinds.N_SAMPLES
    gold = torch.tensor([task.reward_fn(p, r) for p, r in zip(prompts, responses)])
    return prompts, responses, gold


def within_prompt(r, gold):
    """Prints how the scores r [N] rank a prompt's samples: (right, wrong) pairs ranked right,
    and the mean gap between two wrong ones (what a learned score ranks and a rule does not)."""
    ranked = []
    gaps = []
    for g, s in zip(gold.view(-1, rm_kinds.N_SAMPLES).tolist(), r.view(-1, rm_kinds.N_SAMPLES)):
        for i in range(rm_kinds.N_SAMPLES):
            for j in range(rm_kinds.N_SAMPLES):
                if g[i] == 1.0 and g[j] == 0.0:
                    ranked.append((s[i] > s[j]).item())
                if i < j and g[i] == 0.0 and g[j] == 0.0:
                    gaps.append(abs(s[i] - s[j]).item())
    print(
        f"  within a prompt: {sum(ranked) / max(1, len(ranked)):.1%} of {len(ranked)} (right, "
        f"wrong) ranked right; {len(gaps)} (wrong, wrong) pairs, mean |difference| "
        f"{sum(gaps) / max(1, len(gaps)):.3f}"
    )


def at_threshold(name, tau, r, right):
    """Prints the verifier r > tau against the rule (right [N], bool) on the policy's samples."""
    accept = r > tau
    tpr = accept[right].double().mean().item()
    fpr = accept[~right].double().mean().item()
    precision = (accept & right).sum().item() / max(1, accept.sum().item())
    verdicts = accept.double().view(-1, rm_kinds.N_SAMPLES)
    mixed = (verdicts.min(1).values != verdicts.max(1).values).double().mean().item()
    agree = (accept == right).double().mean().item()
    print(
        f"  tau {name} = {tau:.3f}: accepted {accept.double().mean():.1%}, TPR {tpr:.1%}, "
        f"FPR {fpr:.1%}, accuracy {agree:.1%}, precision {precision:.1%}, "
        f"mixed groups {mixed:.1%}"
    )


def on_policy(model, tok, policy, n_prompts, taus, chosen_scores):
    """Prints the verifier's numbers on the policy's own samples, at `taus` and at the
    thresholds that accept 90% to 10% of the chosen responses (chosen_scores)."""
    prompts, responses, gold = draw(policy, tok, n_prompts)
    r = normalised(model, tok, prompts, responses)
    right = gold == 1.0
    groups = gold.view(-1, rm_kinds.N_SAMPLES)
    mixed_rule = (groups.min(1).values != groups.max(1).values).double().mean().item()
    print(
        f"on-policy: {right.double().mean():.1%} of {len(gold)} samples right; right "
        f"{r[right].mean():.3f}, wrong {r[~right].mean():.3f}; global AUC "
        f"{auc(r[right], r[~right]):.3f}; groups of {rm_kinds.N_SAMPLES} mixed under the rule "
        f"{mixed_rule:.1%}"
    )
    within_prompt(r, gold)
    for name, tau in taus.items():
        at_threshold(name, tau, r, right)
    for share in (0.9, 0.75, 0.5, 0.25, 0.1):
        tau = torch.quantile(chosen_scores, 1 - share).item()
        at_threshold(f"accepting {share:.0%} of the chosen", tau, r, right)


def main(rm_dir, policy_dir, n_prompts="500"):
    common.quiet_console(verbose=False)
    # both cores of the 2-core machine the README's numbers come from, or OMP_NUM_THREADS where
    # it is set (two threads beside another busy process spin-wait: the tests run these at 1)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    tok = AutoTokenizer.from_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    model.config.pad_token_id = tok.pad_token_id  # as bench/rm_kinds.py
    taus = calibrate(model, tok)
    chosen_scores = taus.pop("chosen")
    policy = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    on_policy(model, tok, policy, int(n_prompts), taus, chosen_scores)


if __name__ == "__main__":
    if not 2 <= len(sys.argv) - 1 <= 3:
        sys.exit("usage: python bench/rm_verifier.py RM_DIR POLICY_DIR [N_PROMPTS]")
    main(*sys.argv[1:])
