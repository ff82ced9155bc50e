"""The embedded default task and tiny model: two-digit addition, "37+45=" -> "82</s>".

Everything here is generated offline and deterministically, so the demo and the tests need no
download. The task is verifiable, which gives PPO a rule reward (`reward_fn`, the default
`--reward_fn task:reward_fn`) and SFT an exact-match accuracy.

    python task.py make-assets   # (re)write assets/tiny-llama/{config,tokenizer}.json (committed)

A user's data comes in the same shape ({"prompt", "response"} rows); common.py reads it.

The tiny model's weights are not committed: `ensure_tiny_model()` initialises them from the
committed config with a fixed seed the first time the default `--model` is used, and saves an
ordinary HF folder, so it loads through `from_pretrained` exactly like a user's model.
"""

import json
import os
import random
import socket
import sys
import uuid

import torch

TINY_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tiny-llama")
DIGITS = 2  # operands in [0, 10**DIGITS)
N_HELD_OUT = 1000  # pairs kept out of training, for eval
SPLIT_SEED = 1234  # fixed: the split must not depend on --seed, or runs would not be comparable


def _pairs():
    pairs = [(a, b) for a in range(10**DIGITS) for b in range(10**DIGITS)]
    random.Random(SPLIT_SEED).shuffle(pairs)
    return pairs


def make_split(split):
    """Examples {"prompt": "37+45=", "response": "82"} of split "train" or "test" (held out)."""
    pairs = _pairs()
    pairs = pairs[N_HELD_OUT:] if split == "train" else pairs[:N_HELD_OUT]
    return [{"prompt": f"{a}+{b}=", "response": str(a + b)} for a, b in pairs]


# ---- preference pairs, for the reward model (train_rm.py) ----------------------------------------
PAIR_SEED = 4321  # fixed, like SPLIT_SEED: every run and machine gets the same pairs
EASY_SHARE = 0.1  # this share of the rejected answers is a random number, easy to tell apart


def carry_forgotten(a, b):
    """The digit-wise sum without carries: 37+45 -> 72 (7 ones, 7 tens). Equal to a+b when the
    sum has no carry."""
    total = 0
    place = 1
    while a or b:
        total += ((a % 10 + b % 10) % 10) * place
        a //= 10
        b //= 10
        place *= 10
    return total


def near_miss(a, b, rng):
    """A wrong answer to a+b that a model could plausibly give: a digit off by one, a dropped or
    repeated digit, the carry forgotten; or (EASY_SHARE of the time) a random number."""
    right = str(a + b)
    if rng.random() < EASY_SHARE:
        candidates = [str(rng.randrange(2 * 10**DIGITS))]
    else:
        i = rng.randrange(len(right))
        digit = int(right[i])
        step = rng.choice([-1, 1])
        if not 0 <= digit + step <= 9:
            step = -step
        candidates = [
            right[:i] + str(digit + step) + right[i + 1 :],  # a digit off by one
            right[:i] + right[i + 1 :],  # a dropped digit
            right[:i] + right[i] + right[i:],  # a repeated digit
            str(carry_forgotten(a, b)),  # the carry forgotten
        ]
        rng.shuffle(candidates)
    # the first that is a wrong, non-empty answer; the off-by-one always is
    wrong = [c for c in candidates if c and c != right]
    if not wrong:
        return str(a + b + 1)
    return wrong[0]


def make_pairs(split, per_prompt=1):
    """Preference pairs {"prompt": "37+45=", "chosen": "82", "rejected": "72"} of split "train" or
    "test": the same prompts as `make_split`, the right sum chosen, a near miss rejected;
    `per_prompt` distinct near misses for each prompt (fewer where a few draws find no more: 0+1
    has few), the pairs of a prompt together. One per prompt (the held-out pairs, DPO's) draws once
    per prompt, as this function always did: those pairs never change with the option."""
    rng = random.Random(f"{PAIR_SEED}-{split}")
    pairs = []
    for example in make_split(split):
        a, b = example["prompt"].rstrip("=").split("+")
        rejected = []
        # bounded, so that a prompt with fewer near misses than asked ends the search
        for _ in range(3 * per_prompt):
            wrong = near_miss(int(a), int(b), rng)
            if wrong not in rejected:
                rejected.append(wrong)
            if len(rejected) == per_prompt:
                break
        for wrong in rejected:
            pairs.append(
                {"prompt": example["prompt"], "chosen": example["response"], "rejected": wrong}
            )
    return pairs


def reward_fn(prompt, response):
    """1.0 when the response is the right sum, else 0.0. `response` is the decoded text, EOS
    removed; `prompt` the data's, "a+b=" or a conversation whose last turn is that."""
    a, b = sum_operands(prompt)
    return 1.0 if response.strip() == str(a + b) else 0.0


def sum_operands(prompt):
    """(a, b) of a prompt "a+b=" (or a conversation whose last turn is that); a ValueError for
    any other prompt."""
    if not isinstance(prompt, str):
        prompt = prompt[-1]["content"]
    a, b = prompt.strip().rstrip("=").split("+")
    return int(a), int(b)


# ---- the tiny model's assets ---------------------------------------------------------------------
# A character-level tokenizer: one token per printable ASCII character, and four specials. PAD is
# its own token, distinct from EOS, as OpenAI's lm-human-preferences pads (Huang et al. 2023, "N
# implementation details", general #2). plainrlhf builds every mask from lengths, so PAD == EOS
# is safe too (a real model's base tokenizer often has it); a collator that masked by id would
# drop the EOS, and the model would never learn to stop.
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = [chr(c) for c in range(32, 127)]


def make_assets(path=TINY_MODEL):
    """Write the tiny model's tokenizer, config and generation config (not its weights)."""
    from transformers import GenerationConfig

    make_tokenizer(path)
    make_config(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(path)


def make_tokenizer(path):
    from tokenizers import Regex
    from tokenizers import Tokenizer
    from tokenizers import decoders
    from tokenizers import models
    from tokenizers import pre_tokenizers
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every char a token
    tok.decoder = decoders.Fuse()  # join the characters back without spaces
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="left",
    )
    hf_tok.model_max_length = 64
    hf_tok.save_pretrained(path)
    # A tokenizer class name that transformers 4.x knows too.
    cfg_path = os.path.join(path, "tokenizer_config.json")
    cfg = json.load(open(cfg_path))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)


def make_config(path):
    from transformers import LlamaConfig

    # head_dim 64: a size every attention backend (vLLM's CPU one included) supports.
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        dtype="float32",
    )
    config.save_pretrained(path)


def ensure_tiny_model(path=TINY_MODEL, seed=0):
    """Write the tiny model's initial weights once (fixed seed, so every machine gets the same)."""
    weights = os.path.join(path, "model.safetensors")
    if os.path.exists(weights):
        return
    from safetensors.torch import save_model
    from transformers import AutoConfig
    from transformers import AutoModelForCausalLM

    # fork_rng: the caller's RNG streams (a stage's seed + rank, already set) are left as they were
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    # a name of this process's own: ranks of several nodes on a shared filesystem may run this at
    # once, and containers on two nodes may give them the same pid
    tmp = f"{weights}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    save_model(model, tmp, metadata={"format": "pt"})
    os.replace(tmp, weights)  # atomic: concurrent callers each write a full file, one wins


if __name__ == "__main__":
    if sys.argv[1:] != ["make-assets"]:
        sys.exit("usage: python task.py make-assets")
    make_assets()
