"""Run by tests/test_ppo.py, tests/test_families.py and tests/test_dpo.py: an exported folder
loads with plain transformers and with plain vLLM (each with the folder's own tokenizer and
config), and both decode the same greedy answers, token for token.

Both get the same prompt ids (the chat template's user turn when the folder has one, as training
used) and stop at the same ids (the tokenizer's EOS and the generation config's). Greedy with no
repetition penalty on either side: the folder's sampling defaults (Qwen ships a repetition penalty
that `generate` would apply even to greedy search) are a deployment choice, not the model."""

import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

import common  # noqa: E402

NEW = 6


def until_stop(ids, stop_ids):
    """ids up to and including the first stop id (HF pads after it, vLLM ends there)."""
    for i, token_id in enumerate(ids):
        if token_id in stop_ids:
            return ids[: i + 1]
    return ids


def hf_greedy(folder, prompts, stop_ids, pad_id):
    attention = common.attention_implementation(folder, "auto")  # eager for Gemma 2
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation=attention
    )
    config = common.neutral_generation_config(stop_ids, pad_id)
    config.max_new_tokens = NEW
    config.do_sample = False
    out = []
    for ids in prompts:
        generated = model.generate(torch.tensor([ids]), generation_config=config)
        out.append(until_stop(generated[0, len(ids) :].tolist(), stop_ids))
    return out


def vllm_greedy(folder, prompts, stop_ids):
    from vllm import LLM
    from vllm import SamplingParams

    llm = LLM(
        model=folder,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        max_model_len=64,
    )
    params = SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=stop_ids)
    requests = [{"prompt_token_ids": ids} for ids in prompts]
    outs = llm.generate(requests, params, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    return [until_stop(list(o.outputs[0].token_ids), stop_ids) for o in outs]


def main(folder):
    pairs = [(12, 34), (7, 58), (90, 9), (45, 45), (3, 4), (66, 21), (80, 80), (1, 99)]
    tok = AutoTokenizer.from_pretrained(folder)
    stop_ids = common.stop_token_ids(tok, GenerationConfig.from_pretrained(folder))
    pad_id = tok.pad_token_id
    if pad_id is None:  # as training does (common.load_model_and_tokenizer)
        pad_id = tok.eos_token_id
    prompts = [common.encode_prompt(tok, f"{a}+{b}=", "test") for a, b in pairs]
    hf = hf_greedy(folder, prompts, stop_ids, pad_id)
    vl = vllm_greedy(folder, prompts, stop_ids)
    print("hf:", hf, "vllm:", vl, flush=True)
    assert hf == vl, (hf, vl)
    print("texts:", [tok.decode(ids, skip_special_tokens=True) for ids in hf], flush=True)
    print("ROUNDTRIP_OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
