"""Curves of a run, to PNG: score (and each of several reward rules'), KL and held-out accuracy
(PPO), loss and accuracy (SFT), from the run's metrics.jsonl. Needs matplotlib, an optional
extra (`pip install matplotlib`).

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
# PPO with several --reward_fn rules logs each one's mean score under this prefix; drawn after
# objective/score
RULES = "objective/rule/"


def read_rows(path):
    """metrics.jsonl's whole lines (a kill can cut the last one), each a JSON object with an
    integer "step" and numbers for the keys plotted; anything else stops with one line naming
    the file and line (a file edited by hand, or not a run's)."""
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.endswith("\n"):  # the last line, cut by a kill or being written
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"error: {where}: not a JSON object ({e.msg})")
            if not isinstance(row, dict) or type(row.get("step")) is not int:
                sys.exit(f'error: {where}: expected a JSON object with an integer "step"')
            rule_keys = [k for k in row if k.startswith(RULES)]
            for key in KEYS + rule_keys:
                value = row.get(key, 0.0)
                if type(value) not in (int, float):
                    sys.exit(f"error: {where}: {key}: expected a number, got {value!r:.40}")
            rows.append(row)
    return rows


def main(run_dir, out=None):
    if "://" in run_dir:
        # A run on an object store appends its logs to a local folder and copies them up
        # (`common.local_dir`); that folder holds the newest lines, so plot reads it, not the store.
        local = os.path.join("runs", "store", run_dir.split("://", 1)[1])
        sys.exit(
            f"error: {run_dir}: plot reads a local folder; a run on an object store writes its "
            f"metrics.jsonl to its --local_dir (default {local}): plot that"
        )
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        sys.exit(f"error: {path}: no such file (expected a run's --out_dir)")
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("error: plot needs matplotlib: pip install matplotlib")
    rows = read_rows(path)
    rules = sorted({k for r in rows for k in r if k.startswith(RULES)})
    keys = [k for k in KEYS[:1] + rules + KEYS[1:] if any(k in r for r in rows)]
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
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        sys.exit(0)
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python plot.py RUN_DIR [OUT.png]")
    main(*sys.argv[1:])
