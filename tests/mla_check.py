"""Run under torchrun by tests/test_families.py (a tiny DeepSeek-V2): a weight sync into vLLM's
multi-head latent attention. vLLM keeps the up-projections W_UK_T and W_UV, made from kv_b_proj
after every load, as parameters of their own that no checkpoint holds; a sync must be taken (its
"not loaded" warning names them: `rollout.DERIVED_AFTER_LOAD`), and the engine must make them
again from the synced kv_b_proj, else it would sample with the old attention. Argument: the model
folder. Every rank checks its own engine; a failed assert makes torchrun exit non-zero."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers import GenerationConfig  # noqa: E402

import common  # noqa: E402
import rollout  # noqa: E402


def latent_projections(worker):
    """Run on vLLM's worker: {layer: (kv_b_proj's weight, W_UK_T, W_UV)} of every MLA layer."""
    out = {}
    for name, module in worker.model_runner.get_model().named_modules():
        if hasattr(module, "W_UK_T") and hasattr(module, "kv_b_proj"):
            layer = int(name.split(".")[2])  # model.layers.<i>.self_attn.mla_attn...
            tensors = (module.kv_b_proj.weight, module.W_UK_T, module.W_UV)
            out[layer] = tuple(t.detach().cpu().clone() for t in tensors)
    return out


def split_as_vllm(kv_b_proj, config):
    """W_UK_T [N, P, L] and W_UV [N, L, V] of kv_b_proj [N * (P + V), L], as vLLM splits it."""
    n = config.num_attention_heads
    p = config.qk_nope_head_dim
    v = config.v_head_dim
    latent = kv_b_proj.T.reshape(config.kv_lora_rank, n, p + v)  # [L, N, P + V]
    return latent[..., :p].permute(1, 2, 0), latent[..., p:].transpose(0, 1)


def main(path):
    rank, _, device = common.init_distributed(0)
    model, tok = common.load_model_and_tokenizer(path, AutoModelForCausalLM)
    stop_ids = common.stop_token_ids(tok, GenerationConfig.from_pretrained(path))
    engine = rollout.build_engine("vllm", path, 64, 0, stop_ids)
    actor = common.shard_model(model.eval(), device)
    with torch.no_grad():
        torch.manual_seed(1)
        for p in actor.parameters():
            p.to_local().add_(torch.randn_like(p.to_local()) * 0.3)
    before = engine.llm.collective_rpc(latent_projections)[0]
    rollout.sync_weights(engine, actor)  # refused, before `DERIVED_AFTER_LOAD`
    after = engine.llm.collective_rpc(latent_projections)[0]
    actor_state = {k: v.full_tensor() for k, v in actor.state_dict().items()}
    assert sorted(after) == list(range(model.config.num_hidden_layers)), sorted(after)
    for layer, (kv_b_proj, w_uk_t, w_uv) in after.items():
        synced = actor_state[f"model.layers.{layer}.self_attn.kv_b_proj.weight"]
        assert torch.equal(kv_b_proj, synced), layer
        assert not torch.equal(w_uk_t, before[layer][1]), "W_UK_T unchanged by the sync"
        want_uk_t, want_uv = split_as_vllm(synced, model.config)
        assert torch.equal(w_uk_t, want_uk_t), (layer, (w_uk_t - want_uk_t).abs().max())
        assert torch.equal(w_uv, want_uv), (layer, (w_uv - want_uv).abs().max())
    dist.barrier()  # every rank is done before the engine tears vLLM (and the default group) down
    engine.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    common.release_collectives()  # as the stages end (common.run)
    print(f"MLA SYNC OK rank {rank}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
