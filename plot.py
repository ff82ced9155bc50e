"""Curves of a run, to PNG: score, KL and held-out accuracy (PPO), loss and accuracy (SFT), from the
run's metrics.jsonl. Needs matplotlib, an optional extra (`pip install matplotlib`).

    ./launch.sh plot runs/demo/ppo [out.png]      # default: <run>/curves.png
"""

import json
import os
import sys

KEYS = [
    "objective/score",
    "objective/gold_score",  # with --gold_reward_fn: the rule beside the learned reward
    "objective/kl",
    "eval/accuracy",
    "eval/gold_accuracy",
    "train/loss",
    "policy/clipfrac",
    "val/loss",
]


def main(run_dir, out=None):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        sys.exit(f"error: {path}: no such file (expected a run's --out_dir)")
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("error: plot needs matplotlib: pip install matplotlib")
    # whole lines only (a kill can cut the last line)
    rows = [json.loads(line) for line in open(path) if line.endswith("}\n")]
    keys = [k for k in KEYS if any(k in r for r in rows)]
    if not keys:
        sys.exit(f"error: {path}: none of {', '.join(KEYS)} logged yet")
    fig, axes = plt.subplots(1, len(keys), figsize=(3.6 * len(keys), 3.0), squeeze=False)
    for ax, key in zip(axes[0], keys):
        steps, values = zip(*[(r["step"], r[key]) for r in rows if key in r])
        ax.plot(steps, values, marker="o" if len(steps) <= 20 else None, markersize=3)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(os.path.normpath(run_dir), fontsize=10)
    fig.tight_layout()
    out = out or os.path.join(run_dir, "curves.png")
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python plot.py RUN_DIR [OUT.png]")
    main(*sys.argv[1:])
