"""What a reward model of the embedded task can tell apart: the README's numbers for train_rm.py.

    python bench/rm_kinds.py RM_DIR [POLICY_DIR]

1. Held-out, by kind: for every prompt of the held-out split, the right sum against each near
   miss of each kind `task.near_miss` draws from (every digit off by one either way, every dropped
   and every repeated digit, the carry forgotten): the share the reward model ranks below the
   right sum. The held-out pairs of `eval/accuracy` are one random near miss per prompt; this
   counts all of them, so the hard kind (a digit off by one, which needs the sum to judge) is seen
   apart from the easy ones.
2. On-policy (with POLICY_DIR, e.g. the SFT export PPO starts from): 4 samples at T = 1 for each of
   200 training prompts, and the share of (right, wrong) sample pairs of a prompt that the reward
   model ranks right. This is the ranking PPO's advantages come from: the policy's own mistakes,
   not the near misses the reward model was trained on.

Responses are scored as PPO scores them (`train_ppo.py: reward_model_inputs`, then
`reward_model_scores`), in one process on the CPU.
"""

import os
import sys

import torch
from transformers import AutoModelForCausalLM
from transformers import AutoModelForSequenceClassification
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import task  # noqa: E402
import train_ppo  # noqa: E402

N_PROMPTS = 200  # training prompts sampled for the on-policy ranking
N_SAMPLES = 4  # samples per prompt, as PPO's default --n_samples_per_prompt
MAX_NEW_TOKENS = 8  # PPO's default


def near_misses(a, b):
    """{kind: [wrong answers]} of a+b: every near miss of each kind `task.near_miss` draws."""
    right = str(a + b)
    kinds = {"off by one": set(), "dropped": set(), "repeated": set(), "carry": set()}
    for i, digit in enumerate(right):
        for step in (-1, 1):
            if 0 <= int(digit) + step <= 9:
                kinds["off by one"].add(right[:i] + str(int(digit) + step) + right[i + 1 :])
        kinds["dropped"].add(right[:i] + right[i + 1 :])
        kinds["repeated"].add(right[:i] + digit + right[i:])
    kinds["carry"].add(str(task.carry_forgotten(a, b)))
    return {kind: sorted(w for w in wrong if w and w != right) for kind, wrong in kinds.items()}


def scores(model, tok, prompts, responses):
    """The reward model's score of each finished (prompt, response) [B], as PPO computes it."""
    sequences = train_ppo.reward_model_inputs(tok, prompts, responses, [True] * len(prompts))
    with torch.no_grad():
        return train_ppo.reward_model_scores(model, sequences, tok.pad_token_id, 512, "cpu")


def by_kind(model, tok):
    """{kind: (share ranked right, pairs)} over every near miss of every held-out prompt."""
    prompts = []
    rights = []
    wrongs = []
    kinds = []
    for example in task.make_split("test"):
        a, b = example["prompt"].rstrip("=").split("+")
        for kind, answers in near_misses(int(a), int(b)).items():
            prompts += [example["prompt"]] * len(answers)
            rights += [example["response"]] * len(answers)
            wrongs += answers
            kinds += [kind] * len(answers)
    r_right = scores(model, tok, prompts, rights)  # [N]
    r_wrong = scores(model, tok, prompts, wrongs)  # [N]
    ranked_right = (r_right > r_wrong).tolist()
    table = {}
    for kind in dict.fromkeys(kinds):
        mine = [ok for ok, k in zip(ranked_right, kinds) if k == kind]
        table[kind] = (sum(mine) / len(mine), len(mine))
    return table


def sample(policy, tok, prompt):
    """N_SAMPLES responses to a prompt at T = 1 (text, EOS removed)."""
    ids = torch.tensor([tok(prompt).input_ids] * N_SAMPLES)
    out = policy.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=MAX_NEW_TOKENS,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return tok.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)


def on_policy(model, tok, policy):
    """(share of the policy's samples that are right, share of a prompt's (right, wrong) sample
    pairs ranked right, pairs)."""
    torch.manual_seed(0)
    n_right = 0
    ranked = []
    examples = task.make_split("train")[:N_PROMPTS]
    prompts = [ex["prompt"] for ex in examples]
    for prompt in prompts:
        responses = sample(policy, tok, prompt)
        gold = [task.reward_fn(prompt, r) for r in responses]
        r = scores(model, tok, [prompt] * N_SAMPLES, responses).tolist()
        n_right += sum(gold)
        for i in range(N_SAMPLES):
            for j in range(N_SAMPLES):
                if gold[i] == 1.0 and gold[j] == 0.0:
                    ranked.append(r[i] > r[j])
    return n_right / (len(prompts) * N_SAMPLES), sum(ranked) / max(1, len(ranked)), len(ranked)


def main(rm_dir, policy_dir=None):
    common.quiet_console(verbose=False)  # transformers' loading bar and reports, as the stages
    # both cores of the 2-core machine the README's numbers come from, or OMP_NUM_THREADS where
    # it is set (two threads beside another busy process spin-wait: the tests run these at 1)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    tok = AutoTokenizer.from_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    # transformers refuses batches without a pad id, which an export whose PAD ends every
    # sequence leaves out (train_rm.py: SavedConfig); the scores here read the mask, as PPO's
    model.config.pad_token_id = tok.pad_token_id
    for kind, (share, n) in by_kind(model, tok).items():
        print(f"held-out, {kind}: {share:.1%} of {n} pairs ranked right")
    if policy_dir:
        policy = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
        right, share, n = on_policy(model, tok, policy)
        print(f"on-policy: {right:.1%} of samples right; {share:.1%} of {n} (right, wrong) ranked")


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)  # usage, not a model folder
        sys.exit(0)
    if not 1 <= len(sys.argv) - 1 <= 2:
        sys.exit("usage: python bench/rm_kinds.py RM_DIR [POLICY_DIR]")
    main(*sys.argv[1:])
