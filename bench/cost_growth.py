"""How a PPO iteration's cost grows with model size and response length (not a test).

    .venv/bin/python bench/cost_growth.py [--steps 3] [--lengths 8,64,256] [--sizes 0.9M,10M,40M]
                                          [--peer /tmp/trlpeer]

For each model size (random-weight Llamas of the shapes bench/rollout_speed.py uses, built offline
with the embedded tokenizer) and each response length, train_ppo.py runs under torchrun with 2
ranks: PPO with a critic (GAE), 16 prompts x 4 samples per iteration, 2 PPO epochs, the rule
reward, no evaluation or saves. Every response is exactly the length asked for: the models' EOS
row of the output layer is zeroed and the others scaled up, so EOS is never sampled (a random
model would otherwise end a response after ~128 tokens on average, and the length axis would
mean nothing). Reported: the median seconds per iteration over the iterations after the first
(its phases too), and the peak RSS of the largest process (GNU time), which includes the vLLM
engine. Ends with a `BENCH {json}` line.

With `--peer DIR` (the TRL harness's venvs, made by ../shared/peers/trl/setup_venv.sh), TRL 1.12's
PPOTrainer runs the same model, lengths and batches beside it: 64 rollouts, 2 PPO epochs of 2
minibatches of 32, KL 0.05 with a reference model, the rule reward, on 1 process with 2 threads
(the same 2 cores plainrlhf's 2 ranks use); its median step time from the harness's ppo_trl.py
(trainer steps only) and its peak RSS from GNU time.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name: (hidden, layers, mlp), as bench/rollout_speed.py
SIZES = {"0.9M": (128, 4, 384), "10M": (256, 8, 1024), "40M": (512, 8, 2048)}
PHASES = ["rollout", "score", "logprobs", "advantages", "train", "sync"]


def make_model(hidden, layers, mlp, folder):
    """A random Llama that never samples EOS, saved with the embedded tokenizer; its size."""
    sys.path.insert(0, REPO)
    import torch
    from transformers import AutoTokenizer
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM

    import common
    import task

    common.quiet_console(verbose=False)  # save_pretrained's "Writing model shards" bar, as stages
    tok = AutoTokenizer.from_pretrained(task.TINY_MODEL)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=320,  # prompts of <= 8 tokens + 256 new ones
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        # logits of std ~5: the largest of the others beats EOS's 0 by ~12 nats, every step
        model.lm_head.weight.mul_(20)
        model.lm_head.weight[tok.eos_token_id].zero_()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def timed_run(cmd, cwd, env):
    """Run cmd under GNU time; (its stdout, the peak RSS in MiB of its largest process)."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as t:
        timed = ["/usr/bin/time", "-v", "-o", t.name, *cmd]
        p = subprocess.run(timed, cwd=cwd, capture_output=True, text=True, env=env)
        if p.returncode != 0:
            sys.exit(f"error: {' '.join(cmd)} failed:\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
        found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", t.read())
    return p.stdout, int(found.group(1)) / 1024


def run_ppo(model, length, steps):
    """(median seconds per iteration, {phase: median s}, mean response length, peak RSS MiB)."""
    out = tempfile.mkdtemp()
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc_per_node=2", os.path.join(REPO, "train_ppo.py")]
    cmd += ["--model", model, "--out_dir", out, "--max_steps", str(steps)]
    cmd += ["--max_new_tokens", str(length), "--rollout_batch_size", "16"]
    cmd += ["--train_batch_size", "32", "--micro_batch_size", "16"]
    cmd += ["--eval_every", "0", "--eval_samples", "0", "--save_every", "1000000"]
    _, rss = timed_run(cmd, REPO, os.environ)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    rows = [r for r in rows if "time/rollout_s" in r][1:]  # the first pays one-time warm-ups
    phases = {k: statistics.median(r[f"time/{k}_s"] for r in rows) for k in PHASES}
    total = statistics.median(sum(r[f"time/{k}_s"] for k in PHASES) for r in rows)
    response_len = statistics.mean(r["objective/response_len"] for r in rows)
    return total, phases, response_len, rss


def run_trl_ppo(model, length, steps, peer):
    """TRL's PPOTrainer on the same model: (median seconds per step, peak RSS MiB)."""
    harness = os.path.join(os.path.dirname(REPO), "shared", "peers", "trl")
    work = tempfile.mkdtemp()
    write_prompts(os.path.join(work, "data"))
    cmd = [os.path.join(peer, "venv", "bin", "python"), os.path.join(harness, "ppo_trl.py")]
    cmd += ["--work", work, "--model", model, "--batch", "64", "--max-new-tokens", str(length)]
    cmd += ["--steps", str(steps), "--ppo-epochs", "2", "--minibatches", "2", "--threads", "2"]
    cmd += ["--eval-samples", "1"]
    env = {**os.environ, "PYTHONPATH": os.path.join(peer, "trl112")}  # TRL >= 1.13 has no PPO
    stdout, rss = timed_run(cmd, harness, env)
    median = re.search(r"RESULT ppo:.*?\(median ([0-9.]+)\)", stdout)
    return float(median.group(1)), rss


def write_prompts(folder):
    """The harness's data files from the embedded task's prompts (rl.jsonl to train on, and the
    test.jsonl its evaluation before and after reads)."""
    sys.path.insert(0, REPO)
    import task

    os.makedirs(folder)
    rows = [{"prompt": r["prompt"], "answer": r["response"]} for r in task.make_split("test")]
    for name in ["rl.jsonl", "test.jsonl"]:
        with open(os.path.join(folder, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3, help="iterations per run (the first is dropped)")
    p.add_argument("--lengths", default="8,64,256", help="response lengths, comma-separated")
    p.add_argument("--sizes", default=",".join(SIZES), help=f"of {', '.join(SIZES)}")
    p.add_argument("--peer", default="", help="the TRL harness's folder; empty: plainrlhf only")
    a = p.parse_args()
    results = []
    print(f"{'model':>8} {'params':>10} {'new tokens':>10} {'s/iter':>8} {'peak RSS MiB':>13}")
    for name in a.sizes.split(","):
        folder = tempfile.mkdtemp()
        params = make_model(*SIZES[name], folder)
        for length in map(int, a.lengths.split(",")):
            total, phases, response_len, rss = run_ppo(folder, length, a.steps)
            row = {"model": name, "params": params, "new_tokens": length, "s_per_iter": total}
            row |= {"response_len": response_len, "phases_s": phases, "peak_rss_mib": rss}
            if a.peer:
                row["trl_s_per_iter"], row["trl_peak_rss_mib"] = run_trl_ppo(
                    folder, length, a.steps, a.peer
                )
            results.append(row)
            print(f"{name:>8} {params:>10,} {length:>10} {total:>8.2f} {rss:>13.0f}", flush=True)
            print("ROW " + json.dumps(row), flush=True)  # what a stopped run has measured so far
    print("BENCH " + json.dumps({"cost_growth": results}), flush=True)


if __name__ == "__main__":
    main()
