"""Held-out accuracy against training time, for runs of different stages on one figure: how the
README compares PPO and DPO from the same SFT start "at the same wall time".

    python bench/accuracy_vs_time.py OUT.png LABEL=RUN_DIR [LABEL=RUN_DIR ...]

Time is the sum of each step's `time/*` seconds up to that step (the training itself: PPO's
phases, or `time/step_s` for SFT/RM/DPO, which holds SFT's phase timings); start-up, evaluation
and saving are left out, so stages are compared on the work they do, not on how often they
evaluate. Accuracy is `eval/accuracy` (PPO with --gold_reward_fn: `eval/gold_accuracy`). Needs
matplotlib.
"""

import json
import os
import sys


def curve(run_dir):
    """[(seconds, accuracy)] at every evaluated step of a run's metrics.jsonl."""
    points = []
    seconds = 0.0
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        row = json.loads(line)
        step_seconds = sum(v for k, v in row.items() if k.startswith("time/"))
        if "time/step_s" in row:  # SFT's time/step_s holds its phases' time/* too
            step_seconds = row["time/step_s"]
        seconds += step_seconds
        accuracy = row.get("eval/gold_accuracy", row.get("eval/accuracy"))
        if accuracy is not None:
            points.append((seconds, accuracy))
    return points


def main(out, runs):
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    for spec in runs:
        label, run_dir = spec.split("=", 1)
        seconds, accuracy = zip(*curve(run_dir))
        ax.plot(seconds, [100 * a for a in accuracy], marker="o", markersize=3, label=label)
        print(label, " ".join(f"{s:.0f}s:{100 * a:.1f}%" for s, a in zip(seconds, accuracy)))
    ax.set_xlabel("training seconds (summed time/*)")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    specs = sys.argv[2:]
    if not specs or not all("=" in spec for spec in specs):
        sys.exit("usage: python bench/accuracy_vs_time.py OUT.png LABEL=RUN [LABEL=RUN ...]")
    main(sys.argv[1], specs)
