"""SFT and PPO on one GPU at a ~0.5B-parameter Qwen2 shape: tokens/s, MFU and peak memory.

    python bench/gpu.py [--out /tmp/gpubench] [--size 0.5b]   # a CUDA machine, ~12 minutes

Not a test: numbers for bench/RESULTS.md's GPU rows and the README's memory notes. The model is
Qwen2.5-0.5B's shape (24 layers x 896, GQA 14/2 heads, MLP 4864, the full 151,936-row tied
embedding, so the head's matmul costs what it costs in the real model) with random weights, and the
byte-level BPE tokenizer that tests/test_families.py trains offline (no download). `--size tiny` is
the same pipeline at the test's 2-layer size, for a quick look on CPU.

- SFT: train_sft.py, 1 rank, bf16 compute (FSDP2 mixed precision, fp32 master weights), on
  examples of ~64 prompt + ~448 response tokens (random digit strings: the tokens are what costs,
  not what they say). tokens/s: the batches' real tokens over the median step time, steps after
  the first. MFU: model FLOPs over the GPU's dense bf16 peak; model FLOPs per token =
  6 * parameters + 12 * layers * hidden * sequence (Chowdhery et al. 2022, app. B: the matmuls,
  forward and backward, and attention's scores and values, no causal discount).
- PPO: train_ppo.py, 1 rank, HF engine (the lent machines have no vLLM), GAE with a critic of the
  same size, the embedded task's prompts, 16 prompts x 4 samples, 64 new tokens (a random model
  rarely stops early; 64 x 4 x 128 took 3 minutes per rollout while the HF engine generated
  prompt by prompt, before 2026-11-23). Seconds per phase (medians after the first iteration),
  generated tokens/s, and the update's MFU (actor and critic, forward and backward, over every
  PPO epoch).
- Memory: the same PPO run with `--offload_frozen true` (the reference under FSDP2 CPU offload),
  and with `--gradient_checkpointing true`: the peak GPU memory each run's summary line reports
  (`common.py: peak_gpu_memory`).
Ends with a `BENCH {json}` line.
"""

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

# Dense bf16 tensor-core peaks (no sparsity), from NVIDIA's data sheets: H100 SXM and H200 share the
# H100's compute.
# dense bf16 tensor-core peaks from NVIDIA's data sheets; the first key in a device's name wins
# (the PCIe H100 runs at 756 TFLOPS, the SXM one at 989)
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}
QWEN2_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
)
QWEN2_TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=320,
    max_position_embeddings=1024,
)


def build_model(path, shape):
    """A random-weight Qwen2 of `shape` with test_families.build_qwen2's tokenizer and settings."""
    import torch
    from test_families import build_qwen2
    from transformers import Qwen2Config
    from transformers import Qwen2ForCausalLM

    build_qwen2(path)  # tokenizer, chat template, generation config; its tiny weights replaced
    tiny = Qwen2Config.from_pretrained(path).to_dict()
    tiny.pop("layer_types", None)  # one per tiny layer: derived again for the new depth
    config = Qwen2Config(**{**tiny, **shape})
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters()), config


def sft_data(path, tok, n, prompt_chars, response_chars):
    """n random digit-string examples; returns the mean tokens per example (prompt, response, EOS),
    as train_sft.py encodes them."""
    import common

    rng = random.Random(0)
    lengths = []
    with open(path, "w") as f:
        for _ in range(n):
            prompt = "".join(rng.choice("0123456789+=") for _ in range(prompt_chars))
            response = "".join(rng.choice("0123456789") for _ in range(response_chars))
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
            n_prompt = len(common.encode_prompt(tok, prompt, "bench"))
            lengths.append(n_prompt + len(tok(response, add_special_tokens=False).input_ids) + 1)
    return statistics.mean(lengths)


def run(script, *args, wrapper=()):
    """One rank under torchrun; returns (its metrics rows, its peak GPU memory in GiB or None).
    wrapper: a script and its flags that run `script` (bench/profile_step.py)."""
    out = args[args.index("--out_dir") + 1]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc_per_node=1", *wrapper, os.path.join(REPO, script)]
    p = subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, cwd=REPO)
    if p.returncode != 0:
        sys.exit(f"error: {script} failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    peak = None
    if "peak GPU memory " in p.stdout:
        peak = float(p.stdout.split("peak GPU memory ")[1].split()[0])
    shutil.rmtree(out)  # a 0.5B PPO checkpoint is ~14 GB: four of them filled a 64 GB disk
    return rows, peak


def peak_flops():
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    found = [flops for key, flops in PEAK_BF16_FLOPS.items() if key in name]
    return found[0] if found else None


def mfu(flops_per_s):
    peak = peak_flops()
    if peak is None:
        return None
    return flops_per_s / peak


def bench_sft(work, model, n_params, config, steps, name="plain", extra=(), wrapper=()):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    data = os.path.join(work, "sft.jsonl")
    tokens = sft_data(data, tok, 64 * steps, prompt_chars=64, response_chars=440)
    out = os.path.join(work, f"sft-{name}")
    args = ("--model", model, "--data", data, "--out_dir", out, "--max_steps", steps)
    args += ("--train_batch_size", 64, "--micro_batch_size", 16, "--eval_every", 0)
    args += ("--save_every", 10**6, "--lr", 1e-4, "--warmup_steps", 2, *extra)
    rows, peak = run("train_sft.py", *args, wrapper=wrapper)
    timed = rows[1:]  # the first step pays one-time warm-ups
    step_s = statistics.median(r["time/step_s"] for r in timed)
    tok_s = 64 * tokens / step_s
    layers = config.num_hidden_layers
    flops_per_token = 6 * n_params + 12 * layers * config.hidden_size * tokens
    result = {"tokens_per_example": tokens, "step_s": step_s, "tokens_per_s": tok_s}
    result["steps_s"] = [round(r["time/step_s"], 3) for r in timed]  # the spread within a run
    result |= {"mfu": mfu(tok_s * flops_per_token), "peak_gpu_gib": peak}
    print(f"SFT ({name}): {tokens:.0f} tokens/example, {step_s:.3f} s/step, {result}")
    return result


def bench_ppo(work, model, n_params, steps, name, prompts, new_tokens, extra=()):
    out = os.path.join(work, f"ppo-{name}")
    args = ("--model", model, "--out_dir", out, "--max_steps", steps, "--rollout_engine", "hf")
    args += ("--rollout_batch_size", prompts, "--n_samples_per_prompt", 4)
    args += ("--max_new_tokens", new_tokens, "--train_batch_size", prompts)
    args += ("--micro_batch_size", min(prompts, 32), "--ppo_epochs", 2)
    args += ("--eval_every", 0, "--eval_samples", 0, "--save_every", 10**6, *extra)
    rows, peak = run("train_ppo.py", *args)
    rows = [r for r in rows if "time/rollout_s" in r][1:]  # skip the warm-up iteration
    names = ("rollout", "score", "logprobs", "advantages", "train", "sync")
    phases = {k: statistics.median(r[f"time/{k}_s"] for r in rows) for k in names}
    lengths = [r["objective/response_len"] for r in rows]
    generated = prompts * 4 * statistics.mean(lengths)
    # The update: actor and critic (about the same size), forward and backward, every epoch, on
    # prompt + response tokens (the embedded task's prompts are ~12 tokens).
    trained = prompts * 4 * (statistics.mean(lengths) + 12)
    update_flops = 2 * 6 * n_params * trained * 2
    result = {"phase_s": phases, "iteration_s": sum(phases.values()), "peak_gpu_gib": peak}
    result |= {"generated_tokens_per_s": generated / phases["rollout"]}
    result |= {"update_mfu": mfu(update_flops / phases["train"])}
    print(f"PPO ({name}): {result}")
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/gpubench")
    p.add_argument("--size", choices=["0.5b", "tiny"], default="0.5b")
    p.add_argument("--steps", type=int, default=8, help="SFT steps")
    p.add_argument("--prompts", type=int, default=16, help="PPO prompts (x 4 samples)")
    p.add_argument("--new_tokens", type=int, default=64, help="PPO: new tokens per response")
    p.add_argument(
        "--sft_runs",
        default="plain",
        help="which SFT runs, comma-separated (none: ''): plain, noreshard "
        "(--reshard_after_forward false), profile (plain, its 4th step under torch.profiler: "
        "the kernel table goes to OUT/sft_profile.txt, or the --out folder without OUT)",
    )
    p.add_argument(
        "--ppo_runs",
        default="plain,offload,gc",
        help="which PPO runs, comma-separated: plain, offload (--offload_frozen), gc (gradient "
        "checkpointing); a short device lease may afford only some",
    )
    a = p.parse_args()
    import torch

    import common

    common.quiet_console(False)  # no loading or "Writing model shards" bars in the logs

    os.makedirs(a.out, exist_ok=True)
    model = os.path.join(a.out, f"qwen2-{a.size}")
    shape = QWEN2_05B
    if a.size == "tiny":
        shape = QWEN2_TINY
    n_params, config = build_model(model, shape)
    where = "CPU"
    if torch.cuda.is_available():
        where = torch.cuda.get_device_name()
    print(f"{where}; torch {torch.__version__}; model {n_params / 1e6:.1f}M parameters")
    results = {"machine": where, "torch": torch.__version__, "parameters": n_params}
    sft_runs = a.sft_runs.split(",")
    if "plain" in sft_runs:
        results["sft"] = bench_sft(a.out, model, n_params, config, a.steps)
    if "noreshard" in sft_runs:
        # At world size 1 resharding after the forward frees and gathers again (copies) every
        # block's bf16 parameters for the backward; False keeps them gathered in between.
        extra = ("--reshard_after_forward", "false")
        sft = bench_sft(a.out, model, n_params, config, a.steps, "noreshard", extra)
        results["sft_no_reshard"] = sft
    if "profile" in sft_runs:
        table = os.path.join(os.environ.get("OUT", a.out), "sft_profile.txt")
        wrapper = (os.path.join(REPO, "bench", "profile_step.py"), "--step", "4", "--table", table)
        steps = max(a.steps, 5)
        sft = bench_sft(a.out, model, n_params, config, steps, "profile", wrapper=wrapper)
        results["sft_profiled"] = sft
    sizes = (a.prompts, a.new_tokens)
    runs = a.ppo_runs.split(",")
    if "plain" in runs:
        results["ppo"] = bench_ppo(a.out, model, n_params, 3, "plain", *sizes)
    if "offload" in runs:
        offload = ("--offload_frozen", "true")
        ppo = bench_ppo(a.out, model, n_params, 2, "offload", *sizes, offload)
        results["ppo_offload_frozen"] = ppo
    if "gc" in runs:
        ckpt = ("--gradient_checkpointing", "true")
        ppo = bench_ppo(a.out, model, n_params, 2, "gc", *sizes, ckpt)
        results["ppo_gradient_checkpointing"] = ppo
    print("BENCH " + json.dumps(results))


if __name__ == "__main__":
    main()
