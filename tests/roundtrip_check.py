"""Run by tests/test_ppo.py: an exported folder loads with plain transformers and with plain vLLM
(each with its own tokenizer and generation config), and both decode the same greedy answers."""

import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from transformers import GenerationConfig  # noqa: E402


def main(folder):
    pairs = [(12, 34), (7, 58), (90, 9), (45, 45), (3, 4), (66, 21), (80, 80), (1, 99)]
    prompts = [f"{a}+{b}=" for a, b in pairs]
    tok = AutoTokenizer.from_pretrained(folder)
    gen_config = GenerationConfig.from_pretrained(folder)
    assert gen_config.eos_token_id == tok.eos_token_id
    assert tok.pad_token_id not in (None, tok.eos_token_id)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        # the folder's generation config
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
        hf.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))

    from vllm import LLM
    from vllm import SamplingParams

    llm = LLM(
        model=folder,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        max_model_len=64,
    )
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    vl = [o.outputs[0].text for o in outs]  # detokenized by vLLM, with the folder's tokenizer
    print("hf:", hf, "vllm:", vl, flush=True)
    assert [h.strip() for h in hf] == [v.strip() for v in vl], (hf, vl)
    print("ROUNDTRIP_OK", flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
