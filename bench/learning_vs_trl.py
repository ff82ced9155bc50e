"""How much GRPO learns, plainrlhf vs Hugging Face TRL: same start, task, batches and settings.

    .venv/bin/python bench/learning_vs_trl.py SFT_MODEL [--peer /tmp/trlpeer] [--steps 200]
        [--lr 1e-4]

The speed benches (vs_trl.py) say nothing of learning. This one starts both trainers from the
same SFT export on the embedded task, with the rule reward (`task.reward_fn`, right sum or not),
64 prompts x 4 samples per iteration at T = 1, one optimizer step on all 256 per iteration, no KL
(beta 0), the learning rate decayed linearly to 0 over `--steps`; then it reports greedy accuracy
on the first 256 held-out sums before and after, and the share of right samples over the first and
the last 5 iterations. The README's pipeline section holds a run ("The peer learns it as slowly").

TRL's side is `grpo_trl.py` of the harness in ../shared/peers/trl (its own venv, made by its
setup_venv.sh if missing; TRL 1.16, 1 process, 2 threads), with one setting changed from outside:
its learning-rate schedule, constant there, linear here as in train_ppo.py. The harness scores
with its own rule (the completion, stripped, equal to the sum), evaluates with prompts it does not
tokenize with special tokens, so the held-out prompts it reads carry the tokenizer's BOS as text.
plainrlhf's side: train_ppo.py, 2 ranks, `--advantage_estimator grpo --kl_coef 0`.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

from transformers import AutoTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESS = os.path.join(os.path.dirname(REPO), "shared", "peers", "trl")
sys.path.insert(0, REPO)
import task  # noqa: E402

N_EVAL = 256  # held-out sums: train_ppo.py's default --eval_samples
# Runs the harness's grpo_trl.py with GRPOConfig's schedule set to linear (argv: script, args...).
LINEAR_SCHEDULE = """
import os
import runpy
import sys

import trl


class Linear(trl.GRPOConfig):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "lr_scheduler_type": "linear"})


trl.GRPOConfig = Linear
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
"""


def write_data(work, model):
    """The harness's data/rl.jsonl (training prompts) and data/test.jsonl (held-out, BOS as text
    where the tokenizer adds one: the harness evaluates without special tokens)."""
    tok = AutoTokenizer.from_pretrained(model)
    bos = ""
    if tok.bos_token and tok("1+1=").input_ids[0] == tok.bos_token_id:
        bos = tok.bos_token
    os.makedirs(os.path.join(work, "data"), exist_ok=True)
    with open(os.path.join(work, "data", "rl.jsonl"), "w") as f:
        for ex in task.make_split("train"):
            f.write(json.dumps({"prompt": ex["prompt"], "answer": ex["response"]}) + "\n")
    held_out = task.make_split("test")[:N_EVAL]
    with open(os.path.join(work, "data", "test.jsonl"), "w") as f:
        for ex in held_out:
            f.write(json.dumps({"prompt": bos + ex["prompt"], "answer": ex["response"]}) + "\n")


def trl(work, model, peer, steps, lr):
    """(greedy accuracy before, after, right samples first 5, last 5) of TRL's GRPOTrainer."""
    result = os.path.join(work, "trl.json")
    cmd = [os.path.join(peer, "venv", "bin", "python"), "-c", LINEAR_SCHEDULE]
    cmd += [os.path.join(HARNESS, "grpo_trl.py"), "--work", work, "--model", model]
    cmd += ["--prompts", "64", "--gens", "4", "--steps", str(steps), "--lr", str(lr)]
    cmd += ["--format-weight", "0", "--threads", "2", "--eval-samples", "1", "--result", result]
    subprocess.run(cmd, check=True, capture_output=True, cwd=HARNESS)
    r = json.load(open(result))
    before = r["eval_before"]["greedy_acc"]
    after = r["eval_after"]["greedy_acc"]
    return before, after, r["train_correct_first5_mean"], r["train_correct_last5_mean"]


def ours(work, model, steps, lr):
    """The same four numbers for train_ppo.py's GRPO, 2 ranks."""
    out = os.path.join(work, "ours")
    shutil.rmtree(out, ignore_errors=True)  # a fresh run: train_ppo.py refuses a used --out_dir
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc_per_node=2", os.path.join(REPO, "train_ppo.py")]
    cmd += ["--model", model, "--out_dir", out, "--advantage_estimator", "grpo", "--kl_coef", "0"]
    cmd += ["--rollout_batch_size", "64", "--n_samples_per_prompt", "4", "--ppo_epochs", "1"]
    cmd += ["--train_batch_size", "256", "--micro_batch_size", "128", "--max_new_tokens", "8"]
    cmd += ["--lr", str(lr), "--max_steps", str(steps), "--eval_every", str(steps)]
    cmd += ["--eval_samples", str(N_EVAL), "--save_every", str(steps)]
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    accuracy = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    scores = [r["objective/score"] for r in rows if "objective/score" in r]
    return accuracy[0], accuracy[-1], statistics.mean(scores[:5]), statistics.mean(scores[-5:])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model", help="an SFT export of the embedded task (e.g. runs/sft/hf)")
    p.add_argument("--peer", default="/tmp/trlpeer")
    p.add_argument("--work", default="/tmp/learning_vs_trl")
    p.add_argument("--steps", type=int, default=200, help="iterations on each side")
    p.add_argument("--lr", type=float, default=1e-4)
    a = p.parse_args()
    if not os.path.exists(os.path.join(a.peer, "venv", "bin", "python")):
        subprocess.run(["bash", os.path.join(HARNESS, "setup_venv.sh"), a.peer], check=True)
    model = os.path.abspath(a.model)
    write_data(a.work, model)
    results = {
        "TRL GRPOTrainer": trl(a.work, model, a.peer, a.steps, a.lr),
        "plainrlhf GRPO": ours(a.work, model, a.steps, a.lr),
    }
    print(f"{a.steps} iterations at lr {a.lr}: greedy held-out before -> after; right samples")
    for name, (before, after, first, last) in results.items():
        print(f"{name:17} {before:.1%} -> {after:.1%}; {first:.3f} -> {last:.3f}")
    print("BENCH " + json.dumps({"learning_vs_trl": results}))


if __name__ == "__main__":
    main()
