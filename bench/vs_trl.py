"""SFT tokens/s and seconds per RL iteration, plainrlhf vs Hugging Face TRL:
same task, model and batches.

    .venv/bin/python bench/vs_trl.py [--peer /tmp/trlpeer] [--steps 30] [--size tiny|34M]
                                     [--vocab 32000]

The TRL side is the harness in ../shared/peers/trl (its own venv, made by its setup_venv.sh if
missing; plainrlhf does not depend on TRL). It builds a random-init 4x256 Llama with a character
tokenizer and addition data (`--size 34M`: an 8x512 Llama, MLP 2048, 33.6M parameters, where
compute rather than per-call overhead dominates), SFTs it (SFTTrainer: `--sft_steps` steps of 32,
completion-only loss), then runs GRPOTrainer (16 prompts x 4 samples, <= 8 new tokens, 1 update per
step, beta 0) and PPOTrainer (64 rollouts, 1 epoch, 1 minibatch, beta 0.05), 1 thread, no vLLM.
plainrlhf's train_sft.py trains the same initial model on the same examples, batch size and steps
(tokens/s: non-pad tokens of the batches, as TRL counts them, over the median step time); then
train_ppo.py starts from TRL's SFT model and the same prompts with the same batch settings:
`--advantage_estimator grpo` for the like-for-like GRPO row, GAE with a critic for the PPO row, on 1
process with 1 thread (rollouts by vLLM), and on 2 ranks for reference. Medians over iterations
after the first. At beta 0 neither computes reference logprobs (`--kl_coef 0` loads no reference).
Peak RSS: GNU time's maximum resident set size of the largest process. Ends with a
`BENCH {json}` line.

`--vocab N` gives the harness's model an embedding and LM head of N rows (Llama 2's 32,000, say)
before either side trains it; the character tokenizer keeps its 16 tokens, so the other rows are
never fed in, as a real model's spare rows are not (Qwen2's 151,936 for 151,665 tokens). The
harness's own model has a 16-row head, which costs nothing; at a real vocabulary the head is a
large share of a small model's work, and where each trainer computes it then shows.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESS = os.path.join(os.path.dirname(REPO), "shared", "peers", "trl")
# --size: the harness's model shape (its LAYERS, HIDDEN, HEADS, INTER knobs)
SIZES = {
    "tiny": {"LAYERS": "4", "HIDDEN": "256", "HEADS": "4", "INTER": "688"},
    "34M": {"LAYERS": "8", "HIDDEN": "512", "HEADS": "8", "INTER": "2048"},
}


def rss_run(cmd, env):
    """Run cmd under GNU time; return the peak RSS in MiB of its largest process."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as t:
        timed = ["/usr/bin/time", "-v", "-o", t.name, *cmd]
        subprocess.run(
            timed,
            check=True,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", t.read())
        return int(found.group(1)) / 1024


def widen_vocab(model_dir, vocab):
    """Resize the harness's initial model to `vocab` rows of embedding and LM head, in place. The
    new rows are initialised as the model initialises its weights (not transformers' default mean
    of the old rows, which would make every spare token as likely as an average real one)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # the same widened model on every run
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = model.config.vocab_size
    if vocab < rows:
        raise SystemExit(f"--vocab {vocab}: the harness's model has {rows} rows; ask for more")
    model.resize_token_embeddings(vocab, mean_resizing=False)
    model.save_pretrained(model_dir)


def ours_sft(work, steps, batch):
    """train_sft.py, 1 process and 1 thread, on TRL's initial model and examples:
    (tokens/s, RSS MiB)."""
    from transformers import AutoTokenizer

    rows = [json.loads(line) for line in open(os.path.join(work, "data", "train.jsonl"))]
    data = tempfile.mktemp(suffix=".jsonl")
    out = tempfile.mkdtemp()
    with open(data, "w") as f:
        for r in rows:
            f.write(json.dumps({"prompt": r["prompt"], "response": r["completion"]}) + "\n")
    model = os.path.join(work, "model_init")
    cmd = [sys.executable, os.path.join(REPO, "train_sft.py")]
    cmd += ["--model", model, "--data", data, "--out_dir", out, "--max_steps", str(steps)]
    cmd += ["--train_batch_size", str(batch), "--micro_batch_size", str(batch), "--lr", "1e-3"]
    cmd += ["--warmup_steps", "10", "--eval_every", "0", "--save_every", str(10**6)]
    cmd += ["--weight_decay", "0"]  # TRL's default (ours is 1.0, for the embedded task)
    rss = rss_run(cmd, {**os.environ, "OMP_NUM_THREADS": "1"})
    tok = AutoTokenizer.from_pretrained(model)

    def n_tokens(r):
        prompt = common.encode_prompt(tok, r["prompt"], "bench")
        response = tok(r["completion"], add_special_tokens=False).input_ids
        return len(prompt) + len(response) + 1  # prompt, response, EOS

    n = [n_tokens(r) for r in rows]  # the tokens of each example, no padding
    metrics_path = os.path.join(out, "metrics.jsonl")
    times = [json.loads(line)["time/step_s"] for line in open(metrics_path)][1:]

    def batch_tokens(s):
        return sum(n[i] for i in common.batch_indices(s, len(rows), batch, 42)[0])

    tokens = statistics.mean(batch_tokens(s) for s in range(steps))
    return tokens / statistics.median(times), rss


def ours(work, steps, nproc, extra):
    out = tempfile.mkdtemp()
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [
        torchrun,
        "--standalone",
        f"--nproc_per_node={nproc}",
        os.path.join(REPO, "train_ppo.py"),
    ]
    cmd += [
        "--model",
        os.path.join(work, "model_sft"),
        "--data",
        os.path.join(work, "data", "rl.jsonl"),
    ]
    cmd += ["--out_dir", out, "--max_steps", str(steps), "--max_new_tokens", "8"]
    cmd += ["--train_batch_size", "64", "--micro_batch_size", str(64 // nproc), "--ppo_epochs", "1"]
    cmd += ["--eval_samples", "0", "--save_every", "1000000", "--lr", "1e-5", *extra]
    rss = rss_run(cmd, {**os.environ, "OMP_NUM_THREADS": "1"})
    metrics_path = os.path.join(out, "metrics.jsonl")
    rows = [json.loads(line) for line in open(metrics_path)][1:]
    return statistics.median(sum(r[k] for k in r if k.startswith("time/")) for r in rows), rss


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--peer", default="/tmp/trlpeer")
    p.add_argument("--steps", type=int, default=30, help="RL iterations on each side")
    p.add_argument("--sft_steps", type=int, default=200, help="SFT steps of 32 on each side")
    p.add_argument("--size", default="tiny", choices=list(SIZES))
    p.add_argument("--vocab", type=int, default=0, help="LM head rows (0: the harness's 16)")
    a = p.parse_args()
    common.quiet_console(verbose=False)  # transformers' loading bar (widen_vocab)
    if not os.path.exists(os.path.join(a.peer, "venv", "bin", "python")):
        subprocess.run(["bash", os.path.join(HARNESS, "setup_venv.sh"), a.peer], check=True)
    size = a.size
    work = os.path.join(a.peer, f"run-{a.size}")
    if a.vocab:
        size = f"{a.size}, vocab {a.vocab}"
        work = os.path.join(a.peer, f"run-{a.size}-vocab{a.vocab}")
    env = {
        **os.environ,
        **SIZES[a.size],
        "SFT_STEPS": str(a.sft_steps),
        "PY": os.path.join(a.peer, "venv", "bin", "python"),
        "TRL112": os.path.join(a.peer, "trl112"),
        "THREADS": "1",
        "RL_STEPS": str(a.steps),
        "RL_PROMPTS": "16",
        "RL_GENS": "4",
        "RL_MAX_NEW": "8",
    }
    cmd = ["bash", os.path.join(HARNESS, "run.sh"), work]
    # make the model and data first, so that --vocab can widen the model both sides start from
    made = {**env, "STAGES": "make"}
    subprocess.run(cmd, env=made, capture_output=True, text=True, check=True)
    if a.vocab:
        widen_vocab(os.path.join(work, "model_init"), a.vocab)
    trained = {**env, "STAGES": "sft grpo ppo"}
    trl = subprocess.run(cmd, env=trained, capture_output=True, text=True, check=True).stdout

    def median(stage):
        return float(re.search(rf"RESULT {stage}:.*?\(median ([0-9.]+)\)", trl).group(1))

    def rss(stage):
        pattern = rf"RESULT {stage}:.*?peak_rss\(time -v\)=([0-9.]+)MiB"
        return float(re.search(pattern, trl).group(1))

    trl_sft_tok_s = float(re.search(r"RESULT sft:.*? tok/s=([0-9.]+)", trl).group(1))
    sft_tok_s, sft_rss = ours_sft(work, a.sft_steps, 32)
    sft_row = {
        "row": f"SFT tokens/s, {a.sft_steps} steps of 32 (higher is better)",
        "trl": trl_sft_tok_s,
        "ours": sft_tok_s,
        "ratio": sft_tok_s / trl_sft_tok_s,
        "trl_rss_mib": rss("sft"),
        "ours_rss_mib": sft_rss,
    }
    results = [sft_row]
    print(
        f"SFT tokens/s: TRL {trl_sft_tok_s:.0f}, ours {sft_tok_s:.0f} "
        f"({sft_tok_s / trl_sft_tok_s:.2f}x); "
        f"peak RSS TRL {rss('sft'):.0f} MiB, ours {sft_rss:.0f} MiB"
    )
    grpo_flags = ["--rollout_batch_size", "16", "--n_samples_per_prompt", "4"]
    grpo_flags += ["--advantage_estimator", "grpo", "--kl_coef", "0"]
    ppo_flags = ["--rollout_batch_size", "64", "--n_samples_per_prompt", "1"]
    rows = [
        ("GRPO, 16 prompts x 4", "grpo", grpo_flags),
        ("PPO + critic, 64 x 1", "ppo", ppo_flags),
    ]
    print(
        f"{'s per iteration':24}{'TRL 1 thread':>13}{'ours 1 proc':>12}{'TRL/ours':>9}"
        f"{'ours 2 ranks':>13}"
    )
    for name, stage, extra in rows:
        one, one_rss = ours(work, a.steps, 1, extra)
        two, _ = ours(work, a.steps, 2, extra)
        print(f"{name:24}{median(stage):13.3f}{one:12.3f}{median(stage) / one:9.2f}{two:13.3f}")
        row = {
            "row": f"{name}: s per iteration (lower is better)",
            "trl": median(stage),
            "ours": one,
            "ratio": median(stage) / one,
            "ours_2_ranks": two,
            "trl_rss_mib": rss(stage),
            "ours_rss_mib": one_rss,
        }
        results.append(row)
    for row in results:
        row["size"] = size
    print("BENCH " + json.dumps({"vs_trl": results}))


if __name__ == "__main__":
    main()
