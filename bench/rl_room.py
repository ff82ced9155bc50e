"""How much room RL has on the embedded task: greedy accuracy against what the policy can sample.

    python bench/rl_room.py POLICY_DIR [K]

RL with a right-or-wrong reward can only reinforce right answers the policy already samples. So
for each of the first 256 held-out prompts (the set train_ppo.py's `eval/accuracy` decodes
greedily) this draws K samples (default 16) at T = 1, with no top-k or top-p, as PPO's rollouts
are drawn, and reports:
- greedy accuracy (train_ppo.py's `eval/accuracy` with the rule reward);
- pass@K: the share of prompts with at least one right sample;
- the mean share of right samples (PPO's `objective/score` with the rule reward, in expectation);
- the room: the share of prompts answered wrong greedily but right by at least one sample, the
  most a greedy accuracy could gain from reinforcing what the policy samples.
The README's "How much room RL has" holds its numbers. One process, HF `generate`.
"""

import os
import sys

import torch
from transformers import AutoModelForCausalLM
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import task  # noqa: E402

N_PROMPTS = 256  # train_ppo.py's default --eval_samples
MAX_NEW_TOKENS = 8  # the stages' default for the embedded task


def answers(policy, tok, prompt_ids, k, sample):
    """k decoded responses (EOS removed) to one prompt: sampled at T = 1, or greedy (k = 1)."""
    ids = torch.tensor([prompt_ids] * k)
    settings = dict(do_sample=False)
    if sample:
        settings = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    out = policy.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=MAX_NEW_TOKENS,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **settings,
    )
    return tok.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)


def main(policy_dir, k="16"):
    k = int(k)
    common.quiet_console(verbose=False)  # transformers' loading bar and reports, as the stages
    # both cores of the 2-core machine the README's numbers come from, or OMP_NUM_THREADS where
    # it is set (two threads beside another busy process spin-wait: the tests run these at 1)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(policy_dir)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    rows = task.make_split("test")[:N_PROMPTS]
    totals = {"greedy": 0.0, "pass": 0.0, "sampled": 0.0, "room": 0.0}
    for row in rows:
        prompt_ids = common.encode_prompt(tok, row["prompt"], "held out")
        greedy = task.reward_fn(row["prompt"], answers(policy, tok, prompt_ids, 1, False)[0])
        samples = answers(policy, tok, prompt_ids, k, True)
        right = [task.reward_fn(row["prompt"], text) for text in samples]  # [k] of 0/1
        totals["greedy"] += greedy
        totals["pass"] += max(right)
        totals["sampled"] += sum(right) / k
        if greedy == 0 and max(right) == 1:
            totals["room"] += 1
    share = {name: value / len(rows) for name, value in totals.items()}
    print(
        f"{policy_dir}: greedy {share['greedy']:.1%}, pass@{k} {share['pass']:.1%}, "
        f"samples right {share['sampled']:.1%}, greedy wrong but a sample right "
        f"{share['room']:.1%} (of {len(rows)} held-out prompts)"
    )


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)  # usage, not a model folder
        sys.exit(0)
    if not 1 <= len(sys.argv) - 1 <= 2:
        sys.exit("usage: python bench/rl_room.py POLICY_DIR [K]")
    main(*sys.argv[1:])
