"""Rollout throughput, vLLM engine vs HF engine, and weight-sync time vs model size (not a test).

    .venv/bin/python bench/rollout_speed.py            # all sizes, one subprocess each
Same model, prompts and sampling settings for both engines, measured in one run: 64 prompts x 32 new
tokens at temperature 1, medians of 3 after a warm-up; tokens/s counts the tokens actually generated
(EOS is id 127, which the random models rarely pick). One process per size: vLLM's shutdown tears
down the process group. The HF engine decodes every prompt in one batched `generate` (until
2026-11-23 it decoded prompt by prompt, then most of the gap).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name: (hidden, layers, mlp)
SIZES = {"0.9M (embedded)": (128, 4, 384), "10M": (256, 8, 1024), "40M": (512, 8, 2048)}


def measure(hidden, layers, mlp):
    sys.path.insert(0, REPO)
    import torch
    from transformers import AutoTokenizer
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM

    import common
    import rollout
    import task

    rank, world, device = common.init_distributed(0)
    tok = AutoTokenizer.from_pretrained(task.TINY_MODEL)
    d = tempfile.mkdtemp()
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    params = sum(p.numel() for p in model.parameters())
    examples = task.make_split("test")[:64]
    prompts = [tok(e["prompt"]).input_ids for e in examples]
    # EOS: 127, an unused id
    engines = {k: rollout.build_engine(k, d, 128, 0, [127]) for k in ("vllm", "hf")}

    def tps(eng):
        eng.generate(prompts, 1, 32, 1.0, 1.0, list(range(64)))  # warm-up
        times = []
        for r in range(3):
            t0 = time.perf_counter()
            g = eng.generate(prompts, 1, 32, 1.0, 1.0, [r * 64 + i for i in range(64)])
            times.append(time.perf_counter() - t0)
        return sum(map(len, g.response_ids)) / statistics.median(times)

    out = {"params": params, **{f"{k}_tok_s": tps(e) for k, e in engines.items()}}
    actor = common.shard_model(model, device)
    sync = []
    for _ in range(3):
        t0 = time.perf_counter()
        rollout.sync_weights(engines["vllm"], actor)
        sync.append(time.perf_counter() - t0)
    out["sync_s"] = statistics.median(sync)
    print("RESULT " + json.dumps(out), flush=True)
    engines["vllm"].close()


def main():
    if len(sys.argv) == 4:
        return measure(*map(int, sys.argv[1:]))
    print(
        f"{'model':>16} {'params':>8} {'vLLM tok/s':>11} {'HF tok/s':>9} {'vLLM/HF':>8} "
        f"{'sync s':>7} {'sync GB/s':>9}"
    )
    results = []
    for name, (hidden, layers, mlp) in SIZES.items():
        cmd = [sys.executable, __file__, str(hidden), str(layers), str(mlp)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            print(f"{name:>16} failed:\n{p.stderr[-2000:]}")
            continue
        r = json.loads(line[0][7:])
        speedup = r["vllm_tok_s"] / r["hf_tok_s"]
        sync_gb_s = r["params"] * 4 / 1e9 / r["sync_s"]
        print(
            f"{name:>16} {r['params'] / 1e6:7.1f}M {r['vllm_tok_s']:11.0f} {r['hf_tok_s']:9.0f} "
            f"{speedup:8.2f} {r['sync_s']:7.3f} {sync_gb_s:9.2f}"
        )
        results.append({"model": name, **r})
    print("BENCH " + json.dumps({"rollout": results}))


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)  # usage, not a run
        sys.exit(0)
    main()
