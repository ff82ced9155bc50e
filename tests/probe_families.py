"""Helper 62's probe: families the suite had not run (OPT, BLOOM, Falcon, GPT-J, SmolLM3, OLMoE,
GraniteMoE, EXAONE 4, ERNIE 4.5, Seed-OSS, Hunyuan dense) through SFT, PPO on both engines,
resume, export and both loaders, RM and DPO. Builders as tests/test_families.py's."""

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file
from test_families import EOS
from test_families import SHAPE
from test_families import char_tokenizer
from test_families import family_case
from test_families import gpt2_style_tokenizer
from test_families import newline_char_tokenizer
from test_families import save_tokenizer

from conftest import metrics
from conftest import run
from conftest import run_py

pytestmark = pytest.mark.slow
SHAPE_MHA = {k: v for k, v in SHAPE.items() if k != "num_key_value_heads"}


def build_opt(path):
    """A 2-layer OPT-125m: learned positions offset by 2 (from the attention mask in
    transformers), a tied head, dropout 0.1 as shipped, </s> (2) prepended as BOS, <pad> 1."""
    from tokenizers import processors
    from transformers import OPTConfig
    from transformers import OPTForCausalLM
    from transformers import PreTrainedTokenizerFast

    tok = char_tokenizer(["<s>", "<pad>", "</s>", "<unk>"], unk="<unk>")
    tok.post_processor = processors.TemplateProcessing(
        single="</s> $A", special_tokens=[("</s>", 2)]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="</s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    save_tokenizer(hf_tok, path)
    config = OPTConfig(
        vocab_size=128,
        hidden_size=128,
        num_hidden_layers=2,
        ffn_dim=256,
        num_attention_heads=2,
        max_position_embeddings=128,
        word_embed_proj_dim=128,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
    )
    assert config.dropout == 0.1
    torch.manual_seed(0)
    OPTForCausalLM(config).save_pretrained(path)


def build_opt350(path):
    """OPT-350m's odd shape: post-LayerNorm (do_layer_norm_before False, no final norm) and
    embeddings of another width than the hidden one (project_in / project_out)."""
    from transformers import OPTConfig
    from transformers import OPTForCausalLM

    build_opt(path)
    config = OPTConfig(
        vocab_size=128,
        hidden_size=128,
        num_hidden_layers=2,
        ffn_dim=256,
        num_attention_heads=2,
        max_position_embeddings=128,
        word_embed_proj_dim=64,
        do_layer_norm_before=False,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    OPTForCausalLM(config).save_pretrained(path)


def build_bloom(path):
    """A 2-layer BLOOM: ALiBi (no rotary), fused query_key_value, embedding LayerNorm, a tied
    head; BLOOM's <unk> <s> </s> <pad> ids, no BOS added."""
    from transformers import BloomConfig
    from transformers import BloomForCausalLM
    from transformers import PreTrainedTokenizerFast

    tok = char_tokenizer(["<unk>", "<s>", "</s>", "<pad>"], unk="<unk>")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    save_tokenizer(hf_tok, path)
    config = BloomConfig(
        vocab_size=128,
        hidden_size=128,
        n_layer=2,
        n_head=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    torch.manual_seed(0)
    BloomForCausalLM(config).save_pretrained(path)


def build_falcon(path):
    """A 2-layer Falcon-7B: multi-query (one K/V head) fused query_key_value, attention and MLP
    in parallel off one LayerNorm, rotary, a tied head, GPT-2's tokenizer."""
    from transformers import FalconConfig
    from transformers import FalconForCausalLM

    gpt2_style_tokenizer(path)
    config = FalconConfig(
        vocab_size=128,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        multi_query=True,
        parallel_attn=True,
        new_decoder_architecture=False,
        bias=False,
        ffn_hidden_size=512,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    FalconForCausalLM(config).save_pretrained(path)


def build_falcon_new(path):
    """A 2-layer Falcon-40B/180B: the new decoder architecture (two LayerNorms, ln_attn and
    ln_mlp, K/V heads grouped in the fused query_key_value), one K/V head."""
    from transformers import FalconConfig
    from transformers import FalconForCausalLM

    gpt2_style_tokenizer(path)
    config = FalconConfig(
        vocab_size=128,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_kv_heads=1,
        new_decoder_architecture=True,
        bias=False,
        ffn_hidden_size=512,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    FalconForCausalLM(config).save_pretrained(path)


def build_gptj(path):
    """A 2-layer GPT-J: rotary on half of each head (rotary_dim 32 of 64), interleaved (GPT-J's
    rotate_every_two), parallel attention and MLP, an untied head with a bias; GPT-2's
    tokenizer."""
    from transformers import GPTJConfig
    from transformers import GPTJForCausalLM

    gpt2_style_tokenizer(path)
    config = GPTJConfig(
        vocab_size=128,
        n_positions=128,
        n_embd=128,
        n_layer=2,
        n_head=2,
        rotary_dim=32,
        n_inner=256,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = GPTJForCausalLM(config)
    with torch.no_grad():
        model.lm_head.bias.normal_(0, 0.5)
    model.save_pretrained(path)


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_smollm3(path):
    """A 2-layer SmolLM3: its second layer has no rotary at all (NoPE, no_rope_layers [1, 0]),
    GQA, a tied head; ChatML with <|im_end|> as EOS and PAD; vLLM 0.32 serves it through its
    Transformers backend."""
    from transformers import PreTrainedTokenizerFast
    from transformers import SmolLM3Config
    from transformers import SmolLM3ForCausalLM

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
    tok = newline_char_tokenizer(specials, unk="<|end_of_text|>")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    hf_tok.chat_template = CHATML
    save_tokenizer(hf_tok, path)
    config = SmolLM3Config(
        **SHAPE, no_rope_layer_interval=2, bos_token_id=0, eos_token_id=3, pad_token_id=3
    )
    assert config.no_rope_layers == [1, 0], config.no_rope_layers
    torch.manual_seed(0)
    SmolLM3ForCausalLM(config).save_pretrained(path)


TULU = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '\n' }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def build_olmoe(path):
    """A 2-layer OLMoE: 4 experts, 2 a token (softmax router, no renormalisation), q/k norms
    over the whole projection, an untied head; GPT-NeoX's <|endoftext|> and <|padding|>, the
    Tulu template."""
    from transformers import OlmoeConfig
    from transformers import OlmoeForCausalLM
    from transformers import PreTrainedTokenizerFast

    turns = ["<|user|>", "<|assistant|>", "<|system|>"]
    tok = newline_char_tokenizer(["<|endoftext|>", "<|padding|>", *turns], unk="<|endoftext|>")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token="<|padding|>",
        additional_special_tokens=turns,
    )
    hf_tok.chat_template = TULU
    save_tokenizer(hf_tok, path)
    shape = {**SHAPE_MHA, "intermediate_size": 64}
    config = OlmoeConfig(
        **shape,
        num_experts=4,
        num_experts_per_tok=2,
        pad_token_id=1,
        eos_token_id=0,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    OlmoeForCausalLM(config).save_pretrained(path)


GRANITE_TEMPLATE = (
    "{% for m in messages %}{{ '<|start_of_role|>' + m['role'] + '<|end_of_role|>' }}"
    "{{ m['content'] + '<|end_of_text|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_of_role|>assistant<|end_of_role|>' }}{% endif %}"
)


def build_granitemoe(path):
    """A 2-layer Granite 3 MoE (1b-a400m's kind): 4 experts, 2 a token, fused input_linear /
    output_linear experts, Granite's multipliers, a tied head; one <|end_of_text|> for BOS,
    EOS and PAD, Granite's roles template."""
    from transformers import GraniteMoeConfig
    from transformers import GraniteMoeForCausalLM
    from transformers import PreTrainedTokenizerFast

    roles = ["<|start_of_role|>", "<|end_of_role|>"]
    tok = newline_char_tokenizer(["<|end_of_text|>", *roles], unk="<|end_of_text|>")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|end_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|end_of_text|>",
        additional_special_tokens=roles,
    )
    hf_tok.chat_template = GRANITE_TEMPLATE
    save_tokenizer(hf_tok, path)
    multipliers = dict(embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=6.0)
    config = GraniteMoeConfig(
        **{**SHAPE, "intermediate_size": 64},
        **multipliers,
        attention_multiplier=0.015625,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    GraniteMoeForCausalLM(config).save_pretrained(path)


EXAONE_TEMPLATE = (
    "{% for m in messages %}{{ '[|' + m['role'] + '|]' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ '[|endofturn|]' }}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '[|assistant|]' }}{% endif %}"
)


def build_exaone4(path):
    """A 2-layer EXAONE 4.0: a sliding-window layer (window 8, shorter than a prompt) then a
    global one (the global one without rotary in 32B: NoPE there), q/k norms, norms after
    attention and MLP (post-norm), an untied head; [|endofturn|] as EOS."""
    from transformers import Exaone4Config
    from transformers import Exaone4ForCausalLM
    from transformers import PreTrainedTokenizerFast

    turns = ["[|system|]", "[|user|]", "[|assistant|]", "[|endofturn|]"]
    tok = newline_char_tokenizer(["[PAD]", "[BOS]", "[UNK]", *turns], unk="[UNK]")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="[BOS]",
        eos_token="[|endofturn|]",
        pad_token="[PAD]",
        unk_token="[UNK]",
        additional_special_tokens=turns[:3],
    )
    hf_tok.chat_template = EXAONE_TEMPLATE
    save_tokenizer(hf_tok, path)
    config = Exaone4Config(
        **SHAPE,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        bos_token_id=1,
        eos_token_id=6,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    Exaone4ForCausalLM(config).save_pretrained(path)


ERNIE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{{ 'User: ' + m['content'] + '\n' }}{% elif m['role'] == 'assistant' %}"
    "{{ 'Assistant: ' + m['content'] + '<|end_of_sentence|>' }}{% else %}"
    "{{ m['content'] + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}"
)


def build_ernie4_5(path):
    """A 2-layer ERNIE 4.5 dense (0.3B's kind): head_dim given, GQA, a tied head; <unk> as PAD,
    <s> BOS from the template, </s> and <|end_of_sentence|> as EOS ids."""
    from transformers import Ernie4_5Config
    from transformers import Ernie4_5ForCausalLM
    from transformers import GenerationConfig
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|end_of_sentence|>"]
    tok = newline_char_tokenizer(specials, unk="<unk>")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
        unk_token="<unk>",
        additional_special_tokens=specials[3:],
    )
    hf_tok.chat_template = ERNIE_TEMPLATE
    save_tokenizer(hf_tok, path)
    config = Ernie4_5Config(
        **SHAPE,
        head_dim=64,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    Ernie4_5ForCausalLM(config).save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0).save_pretrained(path)


SEED_TEMPLATE = (
    "{% for m in messages %}{{ '<seed:bos>' + m['role'] + '\n' + m['content'] + '<seed:eos>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<seed:bos>assistant\n' }}{% endif %}"
)


def build_seed_oss(path):
    """A 2-layer Seed-OSS: q/k/v biases, no o bias, attention and residual dropout 0.1 as shipped,
    an untied head; <seed:bos>/<seed:eos>/<seed:pad>; vLLM 0.32 serves it through its
    Transformers backend."""
    from transformers import PreTrainedTokenizerFast
    from transformers import SeedOssConfig
    from transformers import SeedOssForCausalLM

    specials = ["<seed:bos>", "<seed:pad>", "<seed:eos>"]
    tok = newline_char_tokenizer(specials, unk="<seed:pad>")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<seed:bos>",
        eos_token="<seed:eos>",
        pad_token="<seed:pad>",
    )
    hf_tok.chat_template = SEED_TEMPLATE
    save_tokenizer(hf_tok, path)
    config = SeedOssConfig(**SHAPE, head_dim=64, bos_token_id=0, pad_token_id=1, eos_token_id=2)
    assert config.attention_dropout == 0.1 and config.residual_dropout == 0.1
    torch.manual_seed(0)
    model = SeedOssForCausalLM(config)
    with torch.no_grad():  # random biases, large enough to matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    model.save_pretrained(path)


HUNYUAN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{{ '<|extra_0|>' + m['content'] + eos_token }}{% else %}{{ m['content'] }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|extra_0|>' }}{% endif %}"
)


def build_hunyuan(path):
    """A 2-layer Hunyuan dense V1 (Hunyuan-0.5B/7B): q/k layernorms after rotary, GQA, a tied
    head; vLLM 0.32 serves it through its Transformers backend."""
    from transformers import HunYuanDenseV1Config
    from transformers import HunYuanDenseV1ForCausalLM
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|startoftext|>", "<|eos|>", "<|extra_0|>"]
    tok = newline_char_tokenizer(specials, unk="<|pad|>")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|startoftext|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=specials[3:],
    )
    hf_tok.chat_template = HUNYUAN_TEMPLATE
    save_tokenizer(hf_tok, path)
    config = HunYuanDenseV1Config(
        **SHAPE,
        head_dim=64,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        eod_token_id=3,
    )
    torch.manual_seed(0)
    HunYuanDenseV1ForCausalLM(config).save_pretrained(path)


def build_falcon_rw(path):
    """A 2-layer Falcon-RW-1B: ALiBi instead of rotary, sequential attention then MLP (two
    LayerNorms, not parallel), full multi-head attention, biases, a tied head."""
    from transformers import FalconConfig
    from transformers import FalconForCausalLM

    gpt2_style_tokenizer(path)
    config = FalconConfig(
        vocab_size=128,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        alibi=True,
        multi_query=False,
        parallel_attn=False,
        new_decoder_architecture=False,
        bias=True,
        ffn_hidden_size=512,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = FalconForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and "ln" not in name:
                p.normal_(0, 0.2)
    model.save_pretrained(path)


BUILDERS = {
    b.__name__[6:]: b
    for b in [
        build_opt,
        build_opt350,
        build_bloom,
        build_falcon,
        build_falcon_new,
        build_gptj,
        build_smollm3,
        build_olmoe,
        build_granitemoe,
        build_exaone4,
        build_ernie4_5,
        build_seed_oss,
        build_hunyuan,
        build_falcon_rw,
    ]
}
FAMILY = os.environ.get("PROBE_FAMILY", "opt")
_sft = {}


@pytest.fixture(scope="module")
def sft_folder(tmp_path_factory):
    if FAMILY not in _sft:
        base = str(tmp_path_factory.mktemp(FAMILY))
        BUILDERS[FAMILY](base)
        out = str(tmp_path_factory.mktemp(FAMILY + "-sft"))
        args = ("--model", base, "--out_dir", out, "--max_steps", 40, "--eval_every", 0)
        run("train_sft.py", *args, "--eval_samples", 16, "--save_every", 100, "--lr", 1e-3)
        rows = metrics(out)
        print("SFT rows", rows[0], rows[-1])
        _sft[FAMILY] = os.path.join(out, "hf")
    return _sft[FAMILY]


def test_1_sft(sft_folder):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(sft_folder, output_loading_info=True)
    assert not any(info.values()), info


def test_2_ppo_vllm_resume_export_roundtrip(tmp_path, sft_folder):
    family_case(tmp_path, sft_folder, "vllm")
    print("PPO vllm rows", metrics(str(tmp_path / "ppo"))[1:])


def test_3_ppo_hf(tmp_path, sft_folder):
    family_case(tmp_path, sft_folder, "hf")
    print("PPO hf rows", metrics(str(tmp_path / "ppo"))[1:])


def test_4_rm(tmp_path, sft_folder):
    from transformers import AutoModelForSequenceClassification

    import common

    rm = str(tmp_path / "rm")
    args = ("--model", sft_folder, "--out_dir", rm, "--max_steps", 4, "--train_batch_size", 16)
    run("train_rm.py", *args, "--micro_batch_size", 8, "--eval_every", 0, "--eval_samples", 16)
    config = json.load(open(os.path.join(rm, "hf", "config.json")))
    print("RM", config["architectures"], metrics(rm)[-1])
    saved = load_file(os.path.join(rm, "hf", "model.safetensors"))
    model, _ = common.load_model_and_tokenizer(
        os.path.join(rm, "hf"), AutoModelForSequenceClassification, num_labels=1
    )
    head = common.value_head(model)
    assert any(torch.equal(head.weight, v) for v in saved.values() if v.shape == head.weight.shape)
    # PPO with this reward model (GRPO, HF engine)
    out = str(tmp_path / "ppo")
    args = ("--model", sft_folder, "--out_dir", out, "--rollout_engine", "hf")
    args += ("--reward_model", os.path.join(rm, "hf"), "--advantage_estimator", "grpo")
    args += ("--rollout_batch_size", 8, "--n_samples_per_prompt", 2, "--train_batch_size", 16)
    args += ("--micro_batch_size", 8, "--max_steps", 2, "--eval_samples", 8, "--eval_every", 0)
    run("train_ppo.py", *args)
    scores = [row["objective/score"] for row in metrics(out) if "objective/score" in row]
    assert len(scores) == 2, scores


def test_5_dpo(tmp_path, sft_folder):
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "dpo")
    args = ("--model", sft_folder, "--out_dir", out, "--max_steps", 4, "--eval_every", 4)
    args += ("--train_batch_size", 16, "--micro_batch_size", 8, "--eval_samples", 16)
    run("train_dpo.py", *args)
    rows = metrics(out)
    print("DPO rows", rows)
    assert abs(rows[1]["train/loss"] - math.log(2)) < 1e-6, rows[1]  # the policy is the reference
    model, info = AutoModelForCausalLM.from_pretrained(
        os.path.join(out, "hf"), output_loading_info=True
    )
    assert not any(info.values()), info
    p = run_py("tests/roundtrip_check.py", os.path.join(out, "hf"))
    assert p.returncode == 0 and "ROUNDTRIP_OK" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]


def test_6_sft_resume(tmp_path):
    """SFT stopped at step 4 (--stop_at_step) and resumed (--resume latest) ends bitwise where a
    straight 8-step run ends, metrics too."""
    from conftest import assert_same_tensors
    from conftest import latest

    base = str(tmp_path / "base")
    BUILDERS[FAMILY](base)
    args = ("--model", base, "--max_steps", 8, "--eval_every", 0, "--eval_samples", 8)
    args += ("--save_every", 4, "--lr", 1e-3, "--train_batch_size", 16, "--micro_batch_size", 8)
    straight = str(tmp_path / "straight")
    resumed = str(tmp_path / "resumed")
    run("train_sft.py", *args, "--out_dir", straight)
    run("train_sft.py", *args, "--out_dir", resumed, "--stop_at_step", 4)
    run("train_sft.py", *args, "--out_dir", resumed, "--resume", "latest")
    assert_same_tensors(latest(straight), latest(resumed))
    assert metrics(straight) == metrics(resumed)
