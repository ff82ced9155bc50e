"""The LM head on every column vs on the response's only, PPO's logprobs or SFT's loss (not a
test).

    .venv/bin/python bench/head_columns.py [--stage ppo|sft] [--prompt 128] [--response 32]
        [--rows 4] [--steps 3]

`train_ppo.py: logprobs_of` (the actor's and the reference's logprobs, and the update's forward)
asks the model for its head's logits at the last R + 1 columns only (`common.head_only_at_last`,
transformers' `logits_to_keep`). This times it against the same function on the same model with
the argument hidden (the head on all P + R columns, as before 2026-11-24), at a real vocabulary:
a random Qwen2.5-shaped model (151,936-token tied embedding, 4 x 256, 1 process, 1 thread), a
batch of `--rows` prompts of `--prompt` tokens and responses of `--response`. For each variant,
in a fresh process: the median seconds of forward + backward of `logprobs_of(...).sum()` over
`--steps`, and the process's peak RSS above what it held once the model was built. Ends with a
`BENCH {json}` line.

`--stage sft` times `train_sft.py: micro_batch_loss` instead (the head from the shortest prompt's
last column on; here every prompt has `--prompt` tokens, so that is the response's columns: the
saving on real data is bounded by a micro-batch's shortest prompt). `train_dpo.py: pair_logprobs`
keeps the same columns as SFT.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def forward_backward(stage, model, prompts, responses):
    """One forward and backward of the stage's own function on the batch."""
    import train_ppo
    import train_sft

    if stage == "ppo":
        batch = train_ppo.make_batch(prompts, responses, pad_id=0)
        train_ppo.logprobs_of(model, batch, temperature=1.0).sum().backward()
        return
    micro = [(p + r, len(p)) for p, r in zip(prompts, responses)]
    n_tokens = sum(len(r) for r in responses)
    train_sft.micro_batch_loss(model, micro, n_tokens, pad_id=0, device="cpu").backward()


def one(stage, variant, prompt, response, rows, steps):
    """In this process: (median s of forward + backward, peak RSS MiB above the model's)."""
    sys.path.insert(0, REPO)
    import torch
    from transformers import Qwen2Config
    from transformers import Qwen2ForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).eval()

    class EveryColumn(torch.nn.Module):  # the same model, its forward without logits_to_keep
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, use_cache, position_ids=None):
            return self.inner(input_ids, attention_mask, position_ids=position_ids)

    if variant == "every column":
        model = EveryColumn(model)
    prompts = torch.randint(0, 151936, (rows, prompt)).tolist()
    responses = torch.randint(0, 151936, (rows, response)).tolist()
    before = peak_rss_mib()
    seconds = []
    for _ in range(steps):
        t0 = time.perf_counter()
        forward_backward(stage, model, prompts, responses)
        seconds.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(seconds), peak_rss_mib() - before


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", choices=("ppo", "sft"), default="ppo")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--response", type=int, default=32)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # internal: run one variant
    args = p.parse_args()
    if args.one:
        seconds, rss = one(args.stage, args.one, args.prompt, args.response, args.rows, args.steps)
        print(json.dumps({"seconds": seconds, "rss_mib": rss}))
        return
    results = {}
    for variant in ("every column", "response columns"):
        cmd = [sys.executable, os.path.abspath(__file__), "--one", variant]
        cmd += [
            "--stage",
            args.stage,
            "--prompt",
            str(args.prompt),
            "--response",
            str(args.response),
        ]
        cmd += ["--rows", str(args.rows), "--steps", str(args.steps)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    print("| head on | s per forward + backward | peak RSS above the model, MiB |")
    print("|---|---|---|")
    for variant, r in results.items():
        print(f"| {variant} | {r['seconds']:.3f} | {r['rss_mib']:.0f} |")
    print("BENCH " + json.dumps({"args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
