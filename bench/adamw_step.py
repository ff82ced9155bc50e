"""One training step's optimizer, timed: AdamW's three implementations under FSDP2 (not a test).

    .venv/bin/python bench/adamw_step.py [--size 34M|0.9M] [--steps 12]

A random Llama (34M: 8 x 512, MLP 2048; 0.9M: the embedded model's 4 x 128, MLP 384) sharded as
the stages shard it (`common.shard_model`, 1 process, gloo, 1 thread), SFT-sized batches (32
sequences of 12 tokens). Each step: forward, backward, `clip_grad_norm_`, `AdamW.step`. For each
implementation (`for-loop`, torch's default on CPU; `foreach`; `fused`, what the stages use since
2026-11-24, and the Trainer's default, so TRL's), in a fresh process each: the median seconds of
the whole step and of `AdamW.step` alone over the steps after the first three. Ends with a
`BENCH {json}` line.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {"34M": (512, 8, 2048), "0.9M": (128, 4, 384)}  # (hidden, layers, mlp)
IMPLEMENTATIONS = {
    "for-loop": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


def one(size, implementation, steps):
    """In this process: (median step s, median AdamW.step s) of one implementation."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561", RANK="0", WORLD_SIZE="1")
    sys.path.insert(0, REPO)
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM

    import common

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    hidden, layers, mlp = SIZES[size]
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 2),
        num_key_value_heads=max(hidden // 64, 2),
        max_position_embeddings=64,
    )
    model = common.shard_model(LlamaForCausalLM(config), torch.device("cpu"))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, **IMPLEMENTATIONS[implementation])
    step_s = []
    optim_s = []
    for _ in range(steps):
        ids = torch.randint(4, 100, (32, 12))
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t1 = time.perf_counter()
        optim.step()
        optim.zero_grad(set_to_none=True)
        optim_s.append(time.perf_counter() - t1)
        step_s.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return statistics.median(step_s[3:]), statistics.median(optim_s[3:])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", choices=sorted(SIZES), default="34M")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--one", choices=sorted(IMPLEMENTATIONS), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.steps < 4:  # the first three steps are dropped (warm-up): nothing would be left to time
        p.error(f"--steps {a.steps}: expected at least 4 (the first 3 are warm-up)")
    if a.one:
        print(json.dumps(one(a.size, a.one, a.steps)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rows = []
    for name in IMPLEMENTATIONS:
        cmd = [sys.executable, __file__, "--size", a.size, "--steps", str(a.steps), "--one", name]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        step, optim = json.loads(out.strip().splitlines()[-1])
        rows.append({"size": a.size, "adamw": name, "step_s": step, "adamw_step_s": optim})
        print(f"{a.size} AdamW {name:8s}: step {step:.3f} s, of it AdamW.step {optim:.4f} s")
    print("BENCH " + json.dumps(rows))


if __name__ == "__main__":
    main()
