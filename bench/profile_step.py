"""Where one training step's time goes: a stage's own run, with torch.profiler around one step.

    torchrun --standalone --nproc_per_node=1 bench/profile_step.py --step 4 \
        --table /tmp/sft_profile.txt train_sft.py --model ... --data ... [the stage's flags]

Not a test: the kernel table behind bench/RESULTS.md's notes on MFU. It imports the stage
(train_sft.py, train_rm.py or train_dpo.py: each has a `train_step` that `main` calls by name),
wraps that function so that the step numbered --step runs under torch.profiler (CPU, and CUDA
where there is one), and runs the stage's `main` unchanged, flags and all. The step's time is
taken with the device synchronised on both sides, so queued kernels are counted in it. Rank 0
writes the table of operators by self time on the device (the CPU's on a CPU-only machine),
the step's wall time, and the share of it that the device was busy.
"""

import argparse
import functools
import importlib
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import common  # noqa: E402

STAGES = ("train_sft.py", "train_rm.py", "train_dpo.py")


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_busy_s(prof):
    """Seconds in which the device ran at least one kernel or copy during the profile: the union
    of their time intervals (kernels on several streams may overlap; the GPU-side ranges of user
    annotations such as FSDP's and the optimizer's span other kernels and are left out). 0 on a
    CPU-only machine."""
    spans = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and not event.is_user_annotation:
            spans.append((event.time_range.start, event.time_range.end))
    busy_us = 0.0
    end_us = float("-inf")
    for start, end in sorted(spans):
        busy_us += max(0.0, end - max(start, end_us))  # the part not already counted
        end_us = max(end_us, end)
    return busy_us / 1e6


def profiled(train_step, at_step, table):
    """train_step, with its call number `at_step` (counting from 1) under torch.profiler."""
    calls = [0]

    @functools.wraps(train_step)
    def wrapper(*args, **kwargs):
        calls[0] += 1
        wrapper.calls = calls[0]
        if calls[0] != at_step:
            return train_step(*args, **kwargs)
        activities = [torch.profiler.ProfilerActivity.CPU]
        sort = "self_cpu_time_total"
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            sort = "self_device_time_total"
        synchronize()
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=activities) as prof:
            result = train_step(*args, **kwargs)
            synchronize()
        wall_s = time.perf_counter() - t0
        if dist.get_rank() == 0:
            busy_s = device_busy_s(prof)
            lines = [f"step {at_step}: {wall_s:.3f} s wall (profiler on)"]
            if busy_s:
                lines.append(f"device kernels: {busy_s:.3f} s ({busy_s / wall_s:.0%} of the wall)")
            averages = prof.key_averages()
            lines.append(averages.table(sort_by=sort, row_limit=30, max_name_column_width=60))
            text = "\n".join(lines)
            with open(table, "w") as f:
                f.write(text + "\n")
            print(text)
        return result

    wrapper.calls = 0
    return wrapper


def main():
    p = argparse.ArgumentParser(usage=__doc__)
    p.add_argument("--step", type=int, default=4, help="which step to profile (the first is 1)")
    p.add_argument("--table", default="profile.txt", help="where rank 0 writes the table")
    p.add_argument("stage", help="train_sft.py, train_rm.py or train_dpo.py")
    p.add_argument("stage_args", nargs=argparse.REMAINDER, help="the stage's own flags")
    a = p.parse_args()
    if a.stage not in STAGES:
        p.error(f"{a.stage}: expected one of {', '.join(STAGES)} (a stage with a train_step)")
    if a.step < 1:
        p.error(f"--step {a.step}: expected 1 or more (the first step is 1)")
    module = importlib.import_module(a.stage.removesuffix(".py"))
    wrapper = profiled(module.train_step, a.step, a.table)
    module.train_step = wrapper
    sys.argv = [a.stage, *a.stage_args]
    common.run(module.main, module.Args, module.LIMITS)
    if wrapper.calls < a.step:  # a resumed run counts from its first step after the checkpoint
        sys.exit(f"error: --step {a.step}: the run took {wrapper.calls} steps; nothing profiled")


if __name__ == "__main__":
    main()
