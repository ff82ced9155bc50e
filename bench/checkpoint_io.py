"""Checkpoint save/load throughput next to the raw disk, measured in the same run (not a test).

    .venv/bin/torchrun --standalone --nproc_per_node=2 bench/checkpoint_io.py [flags]

A Llama of ~40M parameters, FSDP2-sharded, with AdamW state (~0.5 GB in all) is saved and loaded
through checkpoint.py (DCP + manifest + fsync + atomic rename), and the same number of bytes is
written (with fsync) and read back with plain file I/O by every rank at once: the physical limit.
Load is timed alone (checkpoint.load) and as a resume does it (every sha256 verified, then load).
Reads are from the page cache in both cases (dropping caches needs privileges CI does not have).
Flags: --hidden 512 --layers 6 (the model's size), --repeats 3, --dir (default: runs/bench-ckpt).

Then the training stall: the same steps (forward, backward, AdamW) timed without a save, with a
blocking save after the first step, and with --async_save's path (checkpoint.save(async_save=True),
committed by checkpoint.boundary() at a later step): stall = time beyond the save-free steps.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transformers import AutoTokenizer  # noqa: E402
from transformers import GenerationConfig  # noqa: E402
from transformers import LlamaConfig  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

import checkpoint  # noqa: E402
import common  # noqa: E402
import task  # noqa: E402


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        dist.barrier()  # all ranks start together; the slowest rank's time is what a run waits for
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir under runs/)")
    a = p.parse_args()
    rank, world, device = common.init_distributed(0)
    config = LlamaConfig(
        vocab_size=16000,
        hidden_size=a.hidden,
        intermediate_size=4 * a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.hidden // 64,
        num_key_value_heads=a.hidden // 64,
    )
    model = common.shard_model(LlamaForCausalLM(config), device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(input_ids=torch.zeros(1, 8, dtype=torch.long, device=device)).logits.sum().backward()
    optim.step()  # materialise AdamW's state
    # bytes of this rank's state: weights + 2 moments
    local = sum(t.to_local().numel() * t.element_size() for t in model.parameters()) * 3
    total = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(total)  # bytes of state over all ranks
    total = total.item()

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = a.dir or os.path.join(repo, "runs", "bench-ckpt")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    dist.barrier()  # the directory exists before anyone writes
    checkpoint.resolve(root, "")  # the run lock and run id, as a stage takes them
    tok = AutoTokenizer.from_pretrained(task.TINY_MODEL)
    roles = {"model": (model, optim)}
    meta = {"args": {"seed": 0, "max_steps": 10}}  # checkpoint.load refuses a step past it
    hf = (config, tok, GenerationConfig())
    save_s = timed(lambda: checkpoint.save(root, 1, roles, meta, hf, keep_last=1), a.repeats)
    path = os.path.join(root, "checkpoints", "step-00000001")
    load_s = timed(lambda: checkpoint.load(path, roles, meta["args"], []), a.repeats)

    def resume():
        """What `--resume PATH` does: every checksum verified (all ranks), then the load."""
        chosen, error = checkpoint._choose([path], path)
        assert error is None, error
        checkpoint.load(chosen, roles, meta["args"], [])

    resume_s = timed(resume, a.repeats)

    raw = os.path.join(root, f"raw-{rank}.bin")
    chunk = os.urandom(1 << 20)

    def raw_write():
        with open(raw, "wb") as f:
            for _ in range(local // len(chunk)):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())

    def raw_read():
        with open(raw, "rb") as f:
            while f.read(1 << 24):
                pass

    def train_steps(n, save=None):
        """n steps; `save` runs after the first; the last boundary() commits."""
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(n):
            ids = torch.ones(4, 64, dtype=torch.long, device=device)
            model(input_ids=ids).logits.float().mean().backward()
            optim.step()
            optim.zero_grad()
            if i == 0 and save:
                save()
            checkpoint.boundary(i, 0, 0, False, device)
        checkpoint.commit()  # an async save still in flight counts too
        dist.barrier()
        return time.perf_counter() - t0

    def save_blocking():
        checkpoint.save(root, 2, roles, meta, hf, 1)

    def save_async():
        checkpoint.save(root, 3, roles, meta, hf, 1, async_save=True)

    steps = 6
    base_s = statistics.median(train_steps(steps) for _ in range(a.repeats))
    block_s = statistics.median(train_steps(steps, save_blocking) for _ in range(a.repeats))
    async_s = statistics.median(train_steps(steps, save_async) for _ in range(a.repeats))
    write_s = timed(raw_write, a.repeats)
    read_s = timed(raw_read, a.repeats)
    if rank == 0:
        gb = total / 1e9
        block_stall = block_s - base_s
        async_stall = async_s - base_s
        print(
            f"\nstate: {gb:.2f} GB over {world} ranks (weights + AdamW moments), "
            f"median of {a.repeats}"
        )
        print(f"{'':28}{'GB/s':>8}{'raw disk GB/s':>15}{'ratio':>8}")
        save_row = f"{gb / save_s:8.2f}{gb / write_s:15.2f}{write_s / save_s:8.2f}"
        print(f"{'save (checkpoint.save)':28}{save_row}")
        load_row = f"{gb / load_s:8.2f}{gb / read_s:15.2f}{read_s / load_s:8.2f}"
        print(f"{'load (checkpoint.load)':28}{load_row}")
        resume_row = f"{gb / resume_s:8.2f}{gb / read_s:15.2f}{read_s / resume_s:8.2f}"
        print(f"{'resume (verify + load)':28}{resume_row}")
        print(
            f"\ntraining stall of one save, {steps} steps of {base_s / steps:.2f} s: "
            f"blocking {block_stall:.2f} s, async {async_stall:.2f} s "
            f"(async/blocking {async_stall / block_stall:.2f})"
        )
        result = {
            "state_gb": gb,
            "save_gb_s": gb / save_s,
            "raw_write_gb_s": gb / write_s,
            "load_gb_s": gb / load_s,
            "raw_read_gb_s": gb / read_s,
            "resume_gb_s": gb / resume_s,
            "step_s": base_s / steps,
            "stall_blocking_s": block_stall,
            "stall_async_s": async_stall,
        }
        print("BENCH " + json.dumps({"checkpoint": result}), flush=True)
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()  # rank 0 is done with the directory before the group goes away
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
