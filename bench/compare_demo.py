"""Does the demo still give the same numbers? Compare a demo run with a reference, tensor by tensor.

A change that is meant to keep behaviour (a rewrite, a refactor, a speed-up that should not touch
numerics) must leave `./launch.sh demo` bitwise the same: the SFT and PPO exports equal tensor for
tensor (`torch.equal`), and every metric but the timings equal.

    python bench/compare_demo.py record runs/demo bench/demo_reference.json   # before the change
    python bench/compare_demo.py check runs/demo bench/demo_reference.json    # after it
    python bench/compare_demo.py diff runs/demo /other/checkout/runs/demo     # two runs directly

The reference file holds, per stage, a digest of every tensor of the export (dtype, shape and the
sha256 of its bytes: equal digests mean torch.equal tensors) and the metrics rows without `time/*`.
The committed `bench/demo_reference.json` was recorded on the 2-core AMD EPYC machine the project
is developed on, re-recorded on 2026-11-24 after AdamW became `fused=True` (a change of numerics on
purpose: one kernel rounds differently from the loop of element-wise ops it replaced, and both
stages' numbers moved; README: the demo), and again the same day when PPO's logprobs began to
ask for the LM head at the response's columns only (the head's weight gradient, a sum over fewer
positions, rounds differently: PPO's numbers moved), and again when SFT's loss began to ask for
it from a micro-batch's shortest prompt on (both stages moved), and on 2026-11-25 on another
AMD EPYC machine (its kernels round differently; the code's numerics unchanged: its SFT is step
for step that of the previous recording's code there), with `train/lr` as the rate each step
trained at (the earlier file had the rate after the step), and on 2026-11-28 on an AMD EPYC
whose kernels round as that one's: SFT bitwise the same, PPO parted at step 1 by 4e-9 in
`val/loss`, bisected to the commit that set MKL_CBWR=AUTO,STRICT (a change of numerics on
purpose, made on an Intel Xeon that could not check against this file). Float results can differ on
another CPU (other SIMD kernels), so record your own reference before a change rather than
comparing with ours.
"""

import hashlib
import json
import os
import sys

import torch
from safetensors.torch import load_file

STAGES = ("sft", "ppo")


def tensors(run_dir, stage):
    return load_file(os.path.join(run_dir, stage, "hf", "model.safetensors"))


def digest(tensor):
    data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    return {
        "dtype": str(tensor.dtype),
        "shape": list(tensor.shape),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def metrics_rows(run_dir, stage):
    """metrics.jsonl without the timings, which differ from run to run."""
    rows = []
    for line in open(os.path.join(run_dir, stage, "metrics.jsonl")):
        row = json.loads(line)
        rows.append({k: v for k, v in row.items() if not k.startswith("time/")})
    return rows


def summary(run_dir):
    out = {}
    for stage in STAGES:
        state = tensors(run_dir, stage)
        out[stage] = {
            "tensors": {name: digest(t) for name, t in sorted(state.items())},
            "metrics": metrics_rows(run_dir, stage),
        }
    return out


def differences(got, want):
    """Readable lines for every difference between two summaries (empty: the same)."""
    lines = []
    for stage in STAGES:
        a = got[stage]["tensors"]
        b = want[stage]["tensors"]
        if a.keys() != b.keys():
            lines.append(f"{stage}: tensor names differ: {sorted(a.keys() ^ b.keys())}")
        unequal = [name for name in sorted(a.keys() & b.keys()) if a[name] != b[name]]
        if unequal:
            lines.append(f"{stage}: {len(unequal)} tensors differ, e.g. {unequal[:3]}")
        rows_a = got[stage]["metrics"]
        rows_b = want[stage]["metrics"]
        if len(rows_a) != len(rows_b):
            lines.append(f"{stage}: {len(rows_a)} metrics rows, reference {len(rows_b)}")
        for row_a, row_b in zip(rows_a, rows_b):
            if row_a != row_b:
                lines.append(f"{stage}: metrics differ at step {row_b.get('step')}")
                lines.append(f"  got       {row_a}")
                lines.append(f"  reference {row_b}")
                break
    return lines


def diff_runs(run_a, run_b):
    """Two run folders directly, with torch.equal on every tensor."""
    lines = []
    for stage in STAGES:
        a = tensors(run_a, stage)
        b = tensors(run_b, stage)
        unequal = [n for n in sorted(a) if n not in b or not torch.equal(a[n], b[n])]
        if unequal or a.keys() != b.keys():
            lines.append(f"{stage}: {len(unequal)} tensors differ, e.g. {unequal[:3]}")
    got = summary(run_a)
    want = summary(run_b)
    for line in differences(got, want):
        if "tensors differ" not in line:
            lines.append(line)
    return lines


def main(argv):
    if len(argv) != 3 or argv[0] not in ("record", "check", "diff"):
        sys.exit(__doc__.split("\n\n")[2])
    command, run_dir, other = argv
    if command == "record":
        with open(other, "w") as f:
            json.dump(summary(run_dir), f, indent=1)
        print(f"recorded {run_dir} -> {other}")
        return
    if command == "check":
        with open(other) as f:
            lines = differences(summary(run_dir), json.load(f))
    else:
        lines = diff_runs(run_dir, other)
    for line in lines:
        print(line)
    if lines:
        sys.exit(f"DIFFERENT: {run_dir} vs {other}")
    print(f"SAME: every tensor and every metric but the timings of {run_dir} equal {other}")


if __name__ == "__main__":
    main(sys.argv[1:])
