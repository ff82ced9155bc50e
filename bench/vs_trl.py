"""Seconds per RL iteration, plainrlhf vs Hugging Face TRL, same task, model and batches (not a test).

    .venv/bin/python bench/vs_trl.py [--peer /tmp/trlpeer] [--steps 30]

The TRL side is the harness in ../shared/peers/trl (its own venv, made by its setup_venv.sh if missing;
plainrlhf does not depend on TRL). It builds a random-init 4x256 Llama with a character tokenizer and
addition data, SFTs it, then runs GRPOTrainer (16 prompts x 4 samples, <= 8 new tokens, 1 update per
step, beta 0) and PPOTrainer (64 rollouts, 1 epoch, 1 minibatch, beta 0.05), 1 thread, no vLLM.
plainrlhf then starts from the same SFT model and prompts with the same batch settings:
`--advantage_estimator grpo` for the like-for-like GRPO row, GAE with a critic for the PPO row, on 1
process with 1 thread (rollouts by vLLM), and on 2 ranks for reference. Medians over iterations after
the first. plainrlhf always computes reference logprobs (TRL's GRPO skips them at beta 0).
"""
import argparse, json, os, re, statistics, subprocess, sys, tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESS = os.path.join(os.path.dirname(REPO), "shared", "peers", "trl")


def ours(work, steps, nproc, extra):
    out = tempfile.mkdtemp()
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(REPO, "train_ppo.py"), "--model", os.path.join(work, "model_sft"), "--data",
           os.path.join(work, "data", "rl.jsonl"), "--out_dir", out, "--max_steps", str(steps), "--max_new_tokens", "8",
           "--train_batch_size", "64", "--micro_batch_size", str(64 // nproc), "--ppo_epochs", "1", "--eval_samples", "0",
           "--save_every", "1000000", "--lr", "1e-5", *extra]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))][1:]
    return statistics.median(sum(r[k] for k in r if k.startswith("time/")) for r in rows)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--peer", default="/tmp/trlpeer")
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    if not os.path.exists(os.path.join(a.peer, "venv", "bin", "python")):
        subprocess.run(["bash", os.path.join(HARNESS, "setup_venv.sh"), a.peer], check=True)
    work = os.path.join(a.peer, "run")
    env = {**os.environ, "PY": os.path.join(a.peer, "venv", "bin", "python"), "TRL112": os.path.join(a.peer, "trl112"),
           "THREADS": "1", "RL_STEPS": str(a.steps), "RL_PROMPTS": "16", "RL_GENS": "4", "RL_MAX_NEW": "8"}
    trl = subprocess.run(["bash", os.path.join(HARNESS, "run.sh"), work], env=env, capture_output=True, text=True, check=True).stdout
    median = lambda stage: float(re.search(rf"RESULT {stage}:.*?\(median ([0-9.]+)\)", trl).group(1))
    rows = [("GRPO, 16 prompts x 4", median("grpo"), ["--rollout_batch_size", "16", "--n_samples_per_prompt", "4",
                                                     "--advantage_estimator", "grpo", "--kl_coef", "0"]),
            ("PPO + critic, 64 x 1", median("ppo"), ["--rollout_batch_size", "64", "--n_samples_per_prompt", "1"])]
    print(f"{'s per iteration':24}{'TRL 1 thread':>13}{'ours 1 proc':>12}{'TRL/ours':>9}{'ours 2 ranks':>13}")
    for name, t_trl, extra in rows:
        one, two = ours(work, a.steps, 1, extra), ours(work, a.steps, 2, extra)
        print(f"{name:24}{t_trl:13.3f}{one:12.3f}{t_trl / one:9.2f}{two:13.3f}")


if __name__ == "__main__":
    main()
