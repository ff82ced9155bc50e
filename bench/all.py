"""Every benchmark in one go, on this machine: a table of ratios, written to bench/RESULTS.md too.

    .venv/bin/python bench/all.py [--peer /tmp/trlpeer] [--steps 30]  # 16-20 minutes, 2 cores

Runs, one after the other (the machine has 2 cores: never two heavy jobs at once), each under GNU
time for its peak RSS: bench/vs_trl.py (SFT tokens/s and seconds per GRPO/PPO iteration against
Hugging Face TRL; the TRL side in its own venv; twice: the harness's model, and the same with a
32,000-row vocabulary), bench/rollout_speed.py (vLLM vs HF engine) and
bench/checkpoint_io.py (save/load against the raw disk; async vs blocking save stall). Each ends
with a `BENCH {json}` line. Ratios are plainrlhf's speedup: above 1, plainrlhf is faster.
RESULTS.md gets a new top table and raw numbers; its sections after them are kept as they are.
"""

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def run(cmd):
    """(the BENCH json, peak RSS MiB of the largest process) of one benchmark."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as t:
        timed = ["/usr/bin/time", "-v", "-o", t.name, *cmd]
        p = subprocess.run(timed, cwd=REPO, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"error: {' '.join(cmd)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
        found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", t.read())
        rss = int(found.group(1)) / 1024
    print(p.stdout, flush=True)
    bench_lines = [line for line in p.stdout.splitlines() if line.startswith("BENCH ")]
    return json.loads(bench_lines[-1][6:]), rss


def machine():
    models = (line for line in open("/proc/cpuinfo") if line.startswith("model name"))
    cpu = next((line.split(":", 1)[1].strip() for line in models), "?")
    totals = (line for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    mem = int(next(totals).split()[1]) / 2**20
    import torch

    try:
        import vllm

        v = vllm.__version__
    except ImportError:
        v = "not installed"
    today = datetime.date.today()
    if not torch.cuda.is_available():
        where = f"{today}, {cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, no GPU"
    else:
        where = f"{today}, {torch.cuda.get_device_name()}"
    versions = f"Python {platform.python_version()}, torch {torch.__version__}, vllm {v}"
    return where + "; " + versions


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--peer", default="/tmp/trlpeer")
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    vs_trl_cmd = [sys.executable, os.path.join(HERE, "vs_trl.py"), "--peer", a.peer]
    vs_trl_cmd += ["--steps", str(a.steps)]
    trl, _ = run(vs_trl_cmd)
    # The harness's model has a 16-token head; the same model with a real vocabulary's head
    # (Llama 2's 32,000 rows) shows where each trainer computes it (bench/vs_trl.py, --vocab).
    wide, _ = run([*vs_trl_cmd, "--vocab", "32000"])
    trl["vs_trl"] += wide["vs_trl"]
    roll, roll_rss = run([sys.executable, os.path.join(HERE, "rollout_speed.py")])
    checkpoint_io = os.path.join(HERE, "checkpoint_io.py")
    ck, ck_rss = run([TORCHRUN, "--standalone", "--nproc_per_node=2", checkpoint_io])
    raw = {**trl, **roll, **ck, "rollout_rss_mib": roll_rss, "checkpoint_rss_mib": ck_rss}
    raw["machine"] = machine()
    write(raw)


def write(raw):
    """The table (printed, and in bench/RESULTS.md with the raw numbers)
    from the benchmarks' results."""

    def num(x):
        return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"

    def vs_trl_label(r):
        if r["size"] == "tiny":
            return r["row"]
        return f"{r['row']}, {r['size']}"

    ck = raw["checkpoint"]
    rows = [
        (
            vs_trl_label(r),
            num(r["trl"]),
            num(r["ours"]),
            f"**{r['ratio']:.2f}**",
            f"TRL {r['trl_rss_mib']:.0f} / ours {r['ours_rss_mib']:.0f}",
        )
        for r in raw["vs_trl"]
    ]
    rows += [
        (
            f"rollout tokens/s, {r['params'] / 1e6:.1f}M-parameter Llama: vLLM engine vs HF engine",
            num(r["hf_tok_s"]),
            num(r["vllm_tok_s"]),
            f"**{r['vllm_tok_s'] / r['hf_tok_s']:.2f}**",
            f"{raw['rollout_rss_mib']:.0f} (both engines)",
        )
        for r in raw["rollout"]
    ]
    rows += [
        (
            f"checkpoint save GB/s ({ck['state_gb']:.2f} GB, 2 ranks) vs raw disk write",
            num(ck["raw_write_gb_s"]),
            num(ck["save_gb_s"]),
            f"**{ck['save_gb_s'] / ck['raw_write_gb_s']:.2f}**",
            f"{raw['checkpoint_rss_mib']:.0f} per rank",
        ),
        (
            "checkpoint load GB/s vs raw disk read (page cache)",
            num(ck["raw_read_gb_s"]),
            num(ck["load_gb_s"]),
            f"**{ck['load_gb_s'] / ck['raw_read_gb_s']:.2f}**",
            "",
        ),
        (
            "checkpoint resume GB/s (verify every sha256 + load) vs raw disk read",
            num(ck["raw_read_gb_s"]),
            num(ck["resume_gb_s"]),
            f"**{ck['resume_gb_s'] / ck['raw_read_gb_s']:.2f}**",
            "",
        ),
        (
            f"training stall of one save, s (steps of {ck['step_s']:.2f} s): blocking vs async",
            num(ck["stall_blocking_s"]),
            num(ck["stall_async_s"]),
            f"**{ck['stall_blocking_s'] / ck['stall_async_s']:.2f}**",
            "",
        ),
    ]
    table = [
        "| measurement | peer / limit | plainrlhf | ratio | peak RSS MiB |",
        "|---|---|---|---|---|",
    ]
    table += ["| " + " | ".join(r) + " |" for r in rows]
    header = (
        f"# Benchmark results\n\nMachine: {raw['machine']}.\n"
        "Command: `.venv/bin/python bench/all.py` (one run; "
        "ratio: plainrlhf's speedup, above 1 is faster; "
        "for the disk rows, the share of the physical limit).\n\n"
    )
    raw_numbers = "\n\nRaw numbers:\n\n```json\n" + json.dumps(raw, indent=1) + "\n```\n"
    text = header + "\n".join(table) + raw_numbers
    path = os.path.join(HERE, "RESULTS.md")
    # The sections after the raw numbers (the analyses written by hand beside other benches, and
    # the GPU section, from bench/gpu.py on a lent GPU machine) are not re-measured here: kept
    # as they are (this once dropped every section but the GPU one).
    if os.path.exists(path) and "\n## " in open(path).read():
        text += "\n## " + open(path).read().split("\n## ", 1)[1]
    open(path, "w").write(text)
    print("\n".join(table))
    print(f"\nwritten to {os.path.join(HERE, 'RESULTS.md')}")


if __name__ == "__main__":
    main()
