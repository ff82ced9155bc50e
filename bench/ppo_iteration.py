"""Seconds per PPO iteration, split into rollout, scoring, training and weight sync (not a test).

    .venv/bin/python bench/ppo_iteration.py [--model runs/demo/sft/hf] [--steps 12] [extra flags]

Runs train_ppo.py under torchrun with 2 ranks (the demo's batch settings unless extra train_ppo.py
flags override them) and reports medians over the iterations after the first (which pays one-time
warm-ups), from the `time/*` keys every iteration logs. Run it for each estimator to compare
PPO with GRPO/RLOO.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=os.path.join(REPO, "runs", "demo", "sft", "hf"))
    p.add_argument("--steps", type=int, default=12)
    a, extra = p.parse_known_args()
    if not os.path.isdir(a.model):
        sys.exit(
            f"error: --model {a.model}: no such folder "
            "(run ./launch.sh demo first, or pass an SFT export)"
        )
    out = tempfile.mkdtemp()
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc_per_node=2", os.path.join(REPO, "train_ppo.py")]
    cmd += ["--model", a.model, "--out_dir", out, "--max_steps", str(a.steps)]
    cmd += ["--eval_every", "0", "--eval_samples", "0", "--save_every", "1000000", *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    logged = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    rows = logged[2:]  # no evaluation row (--eval_samples 0): skip iterations 1 and 2, warm-up
    phases = ["rollout", "score", "logprobs", "advantages", "train", "sync"]
    med = {k: statistics.median(r[f"time/{k}_s"] for r in rows) for k in phases}
    total = sum(med.values())
    flags = " ".join(extra) or "default flags"
    print(f"PPO iteration on 2 ranks, median of {len(rows)} iterations ({flags}):")
    for k in phases:
        print(f"  {k:10} {med[k]:7.3f} s  {100 * med[k] / total:5.1f} %")
    print(f"  {'total':10} {total:7.3f} s")


if __name__ == "__main__":
    main()
