"""Tier 1: small pieces checked against hand-computed values, in-process (no torchrun)."""

import hashlib
import json
import math
import os
import pickle
import random
import shutil
import types

import numpy as np
import pytest
import torch

import checkpoint
import common
import rollout
import task
import train_dpo
import train_ppo
import train_rm
import train_sft
from conftest import REPO
from conftest import THINKING_TEMPLATE
from conftest import NoKeep
from conftest import run
from conftest import tiny_llama
from conftest import write_small_checkpoint


def test_task_split_is_deterministic_and_disjoint():
    train = task.make_split("train")
    test = task.make_split("test")
    assert len(test) == task.N_HELD_OUT and len(train) == 100 * 100 - task.N_HELD_OUT
    assert train == task.make_split("train")
    assert not {e["prompt"] for e in train} & {e["prompt"] for e in test}
    ex = train[0]
    a, b = map(int, ex["prompt"][:-1].split("+"))
    assert ex["response"] == str(a + b)


def test_reward_fn():
    assert task.reward_fn("37+45=", "82") == 1.0
    assert task.reward_fn("37+45=", " 82 ") == 1.0
    assert task.reward_fn("37+45=", "83") == 0.0
    assert task.reward_fn("37+45=", "") == 0.0
    assert task.reward_fn("0+0=", "0") == 1.0


def test_tokenizer_and_tiny_model(tmp_path):
    from transformers import AutoModelForCausalLM
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(task.TINY_MODEL)
    ids = tok("37+45=").input_ids
    assert ids[0] == tok.bos_token_id and len(ids) == 7
    assert tok.decode(ids, skip_special_tokens=True) == "37+45="
    assert len({tok.pad_token_id, tok.eos_token_id, tok.bos_token_id}) == 3  # PAD distinct from EOS
    # The initial weights are a pure function of the committed config and a fixed seed.
    for d in ("a", "b"):
        for f in os.listdir(task.TINY_MODEL):
            if f != "model.safetensors":
                os.makedirs(tmp_path / d, exist_ok=True)
                (tmp_path / d / f).write_bytes(open(os.path.join(task.TINY_MODEL, f), "rb").read())
        task.ensure_tiny_model(str(tmp_path / d))
    a, b = (AutoModelForCausalLM.from_pretrained(tmp_path / d).state_dict() for d in ("a", "b"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_collate_masks_prompt_and_padding():
    ids, mask, labels = train_sft.collate([([1, 5, 6, 7, 2], 3), ([1, 8, 2], 1)], pad_id=0)
    assert ids.tolist() == [[1, 5, 6, 7, 2], [1, 8, 2, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert labels.tolist() == [[-100, -100, -100, 7, 2], [-100, 8, 2, -100, -100]]


def test_sft_loss_by_hand():
    # Vocabulary of 2, T=3: logits favour token 1 at position 0 by log(3) (p=3/4),
    # uniform at position 1.
    logits = torch.tensor([[[0.0, math.log(3)], [0.0, 0.0], [5.0, 5.0]]])
    labels = torch.tensor([[-100, 1, 0]])  # targets for positions 0 and 1 are labels[1:]
    want = (-math.log(3 / 4) - math.log(1 / 2)) / 4  # summed over 2 tokens, divided by n_tokens=4
    assert train_sft.sft_loss(logits, labels, n_tokens=4).item() == pytest.approx(want, rel=1e-6)


def test_sft_loss_needs_the_head_only_from_the_shortest_prompt_on():
    """`micro_batch_loss` asks for the head's logits from the shortest prompt's last column on
    (`common.head_only_at_last`): the same loss as sft_loss over the full [B, T, V] logits, and
    the same from a model whose forward has no `logits_to_keep`."""
    model = tiny_llama(vocab_size=300)
    micro = [([5, 6, 7, 8, 9, 1, 2], 5), ([10, 11, 3, 4, 5, 2], 2), ([12, 13, 14, 6], 3)]
    head_columns = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: head_columns.append(i[0].shape[1]))
    with torch.no_grad():
        loss = train_sft.micro_batch_loss(model, micro, n_tokens=9, pad_id=0, device="cpu")
        input_ids, attention_mask, labels = train_sft.collate(micro, pad_id=0)
        full = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [3, 7, V]
    hook.remove()
    assert head_columns == [6, 7]  # T - 2 + 1 (the shortest prompt: 2 tokens), then T
    want = train_sft.sft_loss(full, labels, n_tokens=9)
    assert torch.equal(loss, want)
    with torch.no_grad():
        nokeep = train_sft.micro_batch_loss(NoKeep(model), micro, 9, pad_id=0, device="cpu")
    assert torch.equal(nokeep, want)


def test_batch_indices_cover_each_epoch_once_and_are_pure():
    # 50 examples in batches of 8: 6 full batches per epoch, 2 examples dropped
    n = 50
    bs = 8
    seed = 3
    epoch0 = [i for s in range(6) for i in common.batch_indices(s, n, bs, seed)[0]]
    assert len(set(epoch0)) == 48
    assert common.batch_indices(6, n, bs, seed)[1] == 1  # step 6 starts epoch 1
    assert common.batch_indices(6, n, bs, seed)[0] != common.batch_indices(0, n, bs, seed)[0]
    assert common.batch_indices(4, n, bs, seed) == common.batch_indices(4, n, bs, seed)
    assert common.batch_indices(4, n, bs, seed + 1) != common.batch_indices(4, n, bs, seed)


def test_token_rows_give_back_the_rows_appended():
    """common.TokenRows stores the ids as int32 and gives every row back as it was appended:
    ragged and empty lists, ids at int32's ends, nested tuples (DPO's pairs), NamedTuples with a
    float (RM's Pair), a data row (PPO's prompts); indexing, negative indices, slices
    (`eval_share`) and iteration."""
    top = 2**31 - 1
    sft = [([1, 2, 3], 1), ([], 0), ([top, 0, top - 1], 2), ([300] * 1000, 999), ([-(2**31)], 0)]
    rows = common.TokenRows(iter(sft))  # a generator: filled as rows come
    assert len(rows) == 5 and list(rows) == sft and rows[-2] == sft[-2] and rows[1:4] == sft[1:4]
    assert type(rows[0]) is tuple and type(rows[0][0]) is list and type(rows[0][1]) is int
    with pytest.raises(IndexError):
        rows[5]
    dpo = [(([5, top], 1), ([5], 1)), (([], 0), ([7, 8, 9], 2))]
    assert list(common.TokenRows(dpo)) == dpo
    pairs = common.TokenRows()
    pairs.append(train_rm.Pair([1, top], [1], 0.5))
    pairs.append(train_rm.Pair([], [2, 3], -1.0))
    assert type(pairs[1]) is train_rm.Pair and pairs[1] == train_rm.Pair([], [2, 3], -1.0)
    assert pairs[0].margin == 0.5 and [p.chosen for p in pairs] == [[1, top], []]
    row = {"prompt": [{"role": "user", "content": "1+2="}], "answer": 3}  # PPO's: kept as it is
    assert common.TokenRows([([40000, 40001], row)])[0] == ([40000, 40001], row)
    # an id int32 cannot hold is refused, and nothing of its row is kept
    for bad in (2**31, -(2**31) - 1):
        with pytest.raises(ValueError, match="row 5 has a token id outside int32"):
            rows.append(([1, bad], 0))
    assert len(rows) == 5 and list(rows) == sft and len(rows.ids) == 1007
    with pytest.raises(ValueError, match="row 5 is laid out as"):
        rows.append((([1], 0), ([2], 0)))  # a pair among single sequences


@pytest.mark.slow
def test_ranks_encode_shares_of_the_rows_and_all_get_every_row(tmp_path):
    """common.encode_rows on 2 ranks (tests/encode_check.py): each rank encodes half the rows,
    and every rank ends with the ids, lists and other fields one process makes (SFT's examples,
    the reward model's Pair, PPO's prompt rows), for fewer rows than ranks too; a bad row in
    either half, or one on each side of the split, is named as one process names it; a dialogue
    too long for the context likewise (`common.check_rows`)."""
    task.make_tokenizer(str(tmp_path))
    p = run("tests/encode_check.py", tmp_path)
    assert "encode_rows: ok" in p.stdout


def test_a_tokenizer_that_panics_on_a_row_is_one_line_naming_it():
    """A crafted tokenizer.json's pre-tokenizer regex that Oniguruma gives up on panics inside
    the Rust tokenizers library; pyo3 raises PanicException, a BaseException no `except
    Exception` takes: a traceback from every rank. One line naming the row now (Rust's own
    panic message still goes to stderr before it)."""
    from tokenizers import Regex
    from tokenizers import Tokenizer
    from tokenizers import models
    from tokenizers import pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "1": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(1|1)*y"), behavior="isolated")

    def encode(row, where):
        return tok.encode(row).ids

    assert common.encode_rows([("data.jsonl:3", "1+1=")], encode)[0] == [0]  # one word, unknown
    with pytest.raises(SystemExit) as exit_info:
        common.encode_rows([("data.jsonl:4", "1" * 26 + "xy=")], encode)
    line = exit_info.value.code
    assert line.startswith("error: data.jsonl:4: the tokenizer fails on this row (Onig"), line


def test_encode_appends_eos_and_rejects_overlong():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(task.TINY_MODEL)
    ids, n_prompt = train_sft.encode(tok, {"prompt": "1+2=", "response": "3"}, 64, "x")
    assert n_prompt == 5 and ids[-1] == tok.eos_token_id and tok.decode(ids[n_prompt:-1]) == "3"
    with pytest.raises(SystemExit, match=r"data.jsonl:7: prompt\+response is 9 tokens"):
        train_sft.encode(tok, {"prompt": "11+22=", "response": "3"}, 8, "data.jsonl:7")


@pytest.mark.parametrize(
    "content,message",
    [
        (
            '{"prompt": "1+1=", "response": "2"}\n{"prompt": "1+1=", \n',
            r"data.jsonl:2: not valid JSON",
        ),
        (
            '{"prompt": "1+1=", "response": "2"}\n\n{"prompt": "1+1="}\n',
            r"data.jsonl:3: expected a string field 'response'",
        ),
        ('["prompt"]\n', r"data.jsonl:1: expected a string field 'prompt' \(or a conversation"),
        ("\n\n", r"data.jsonl: no examples"),
        (
            '{"text": "1+1=2"}\n',
            r"data.jsonl:1: expected a string field 'prompt': a \{'text'\} row",
        ),
        ('{"prompt": [], "response": "2"}\n', r"data.jsonl:1: field 'prompt' is an empty conv"),
        (
            '{"messages": [{"role": "user", "content": "1+1="}]}\n',
            r"data.jsonl:1: expected a string field 'prompt': 'messages' rows are read by",
        ),
        (
            '{"prompt": ["1+1="], "response": "2"}\n',
            r"data.jsonl:1: field 'prompt', message 0: expected a string 'role'",
        ),
        (
            '{"prompt": [{"role": "user", "content": 2}], "response": "2"}\n',
            r"data.jsonl:1: field 'prompt', message 0: expected a string 'content'",
        ),
        (
            '{"prompt": [{"role": "user", "content": "\\ud800"}], "response": "2"}\n',
            r"data.jsonl:1: field 'prompt', message 0's 'content' holds a lone surrogate",
        ),
        (
            '{"prompt": [{"role": "user", "content": "1+1="}, {"role": "assistant", '
            '"content": "2"}], "response": "2"}\n',
            r"data.jsonl:1: field 'prompt' ends with an assistant turn",
        ),
        (
            '{"prompt": [{"role": "user", "content": "1+1="}], "response": ["2"]}\n',
            r"data.jsonl:1: field 'response', message 0: expected a string 'role'",
        ),
        (
            '{"prompt": [{"role": "user", "content": "1+1="}, {"role": "Model", '
            '"content": "2"}], "response": "2"}\n',
            r"data.jsonl:1: field 'prompt' ends with an assistant turn \(role 'Model'\)",
        ),
        (
            '{"prompt": [{"role": "user", "content": "1", "name": "\\udc00"}], "response": "2"}\n',
            r"data.jsonl:1: field 'prompt', message 0's 'name' holds a lone surrogate",
        ),
    ],
)
def test_load_jsonl_errors_name_file_and_line(tmp_path, content, message):
    (tmp_path / "data.jsonl").write_text(content)
    with pytest.raises(SystemExit, match=message):
        common.load_jsonl(str(tmp_path / "data.jsonl"), ("prompt", "response"))
    with pytest.raises(SystemExit, match="nope.jsonl: no such file$"):
        common.load_jsonl(str(tmp_path / "nope.jsonl"), ("prompt",))
    # launch.sh reads relative paths from the repository: the line says from where
    with pytest.raises(
        SystemExit, match=r"^error: nope.jsonl: no such file \(a relative path, read"
    ):
        common.load_jsonl("nope.jsonl", ("prompt",))


def test_a_conversation_as_prompt_is_rendered_by_the_chat_template(tmp_path):
    """A prompt may be a conversation so far (a system turn, earlier turns), as TRL's
    conversational datasets give it: each stage renders it with the chat template and the
    generation prompt, and the response continues that rendering. A tokenizer without a
    template cannot render one (one line), and a template that refuses a role is one line too."""
    from transformers import AutoTokenizer

    conversation = [
        {"role": "system", "content": "Add."},
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "1+2="},
    ]
    data = tmp_path / "data.jsonl"
    data.write_text(
        json.dumps({"prompt": conversation, "response": "3"})
        + "\n"
        + json.dumps({"prompt": "2+2=", "response": "4"})
        + "\n"
    )
    rows = common.load_jsonl(str(data), ("prompt", "response"))
    assert [row["prompt"] for _, row in rows] == [conversation, "2+2="]
    tok = gemma_style_tokenizer()
    ids, n_prompt = train_sft.encode(tok, rows[0][1], 128, rows[0][0])
    whole = conversation + [{"role": "assistant", "content": "3"}]
    rendered = tok.apply_chat_template(whole, tokenize=False)
    assert tok.decode(ids) == rendered.removesuffix("\n")  # the whole dialogue, as the template
    assert tok.convert_ids_to_tokens(ids[n_prompt:]) == ["3", "<end_of_turn>"]
    prompt_ids = tok.apply_chat_template(conversation, add_generation_prompt=True)["input_ids"]
    assert ids[:n_prompt] == prompt_ids
    # PPO keeps the prompt as given (its reward function gets it); the pair stages encode it so
    loaded = train_ppo.load_prompts([(w, {"prompt": r["prompt"]}) for w, r in rows], tok, 4, 128)
    assert loaded[0] == (prompt_ids, {"prompt": conversation})
    pair = {"prompt": conversation, "chosen": "3", "rejected": "4"}
    (chosen, n_chosen), _ = common.encode_pair(tok, pair, 128, "p.jsonl:1")
    assert chosen == ids and n_chosen == n_prompt
    # and PPO gives a reward model the sequence it was trained on
    assert train_ppo.reward_model_inputs(tok, [conversation], ["3"], [True]) == [ids]
    plain = AutoTokenizer.from_pretrained(task.TINY_MODEL)
    with pytest.raises(
        SystemExit, match=r"data.jsonl:1: a conversation \(a prompt, or a dialogue's turns\), and"
    ):
        train_sft.encode(plain, rows[0][1], 128, rows[0][0])
    no_system = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}"
    tok.chat_template = no_system + "{% endif %}" + GEMMA_TEMPLATE
    with pytest.raises(SystemExit, match=r"data.jsonl:1: the chat template fails .*no system"):
        train_sft.encode(tok, rows[0][1], 128, rows[0][0])
    assert train_sft.encode(tok, rows[1][1], 128, rows[1][0])  # a string prompt: a user turn


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def test_a_messages_row_is_an_example_per_assistant_turn(tmp_path):
    """TRL's conversational SFT rows, {"messages": [...]}: one example per assistant turn, the
    turns before it as a conversation prompt; a file may mix them with {"prompt", "response"}
    rows. Each example is encoded as the chat template renders that turn's context."""
    dialogue = [{"role": "system", "content": "Add."}, user("1+1="), assistant("2")]
    dialogue += [user("1+2="), assistant("3")]
    data = tmp_path / "data.jsonl"
    rows = [{"prompt": "2+2=", "response": "4"}, {"messages": dialogue}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tok = gemma_style_tokenizer()
    examples = common.load_examples(str(data), tok, 128)
    assert [where.removeprefix(str(data)) for where, _ in examples] == [
        ":1",
        ":2 (message 2)",
        ":2 (message 4)",
    ]
    assert [row for _, row in examples] == [
        {"prompt": "2+2=", "response": "4"},
        {"prompt": dialogue[:2], "response": "2"},
        {"prompt": dialogue[:4], "response": "3"},
    ]
    ids, n_prompt = train_sft.encode(tok, examples[2][1], 128, examples[2][0])
    rendered = tok.apply_chat_template(dialogue, tokenize=False)
    assert tok.decode(ids) == rendered.removesuffix("\n")  # the whole dialogue, as the template
    assert tok.convert_ids_to_tokens(ids[n_prompt:]) == ["3", "<end_of_turn>"]


@pytest.mark.parametrize(
    "row,message",
    [
        ({"messages": "hi"}, r"d.jsonl:1: field 'messages': expected a list of messages"),
        ({"messages": []}, r"d.jsonl:1: field 'messages' is an empty conversation"),
        ({"messages": [user("1+1="), {"role": "assistant"}]}, r"'messages', message 1: exp"),
        ({"messages": [user("1+1=")]}, r"d.jsonl:1: field 'messages' ends with a 'user' turn"),
        ({"messages": [assistant("2")]}, r"'messages', message 0: an assistant turn that ans"),
        (
            {"messages": [user("1+1="), assistant("2"), assistant("2")]},
            r"d.jsonl:1: field 'messages', message 2: an assistant turn that answers no other",
        ),
        (
            {"messages": [user("1+1="), assistant("2")], "response": "2"},
            r"d.jsonl:1: 'messages' beside 'prompt', 'response' or 'completion'; give one",
        ),
        (
            {"prompt": "1+1=", "completion": "2", "response": "2"},
            r"d.jsonl:1: 'completion' beside 'response'; give one",
        ),
        ({"prompt": "1+1=", "completion": 2}, r"d.jsonl:1: expected a string field 'completion'"),
        (
            {"prompt": "1+1=", "completion": [user("2")]},
            r"d.jsonl:1: field 'completion': a response given as messages is one assistant",
        ),
        ({"completion": "2"}, r"d.jsonl:1: expected a string field 'prompt'"),
        (
            {"prompt": "1+1="},
            r"d.jsonl:1: expected a string field 'response' \(or 'completion', or a \{'messa",
        ),
        (
            {"prompt": "1+1=", "chosen": "2", "rejected": "3"},
            r"d.jsonl:1: expected a string field 'response': a preference pair; this file",
        ),
        (["1+1="], r"d.jsonl:1: expected a string field 'prompt'"),
        (
            {
                "messages": [
                    user("1+1="),
                    {**assistant(""), "tool_calls": []},
                    user("."),
                    assistant("2"),
                ]
            },
            r"d.jsonl:1: field 'messages', message 1: an assistant turn with \['tool_calls'\]",
        ),
        # a dialogue longer than the context: refused before its 8,000 prompts are made
        ({"messages": [user("1"), assistant("2")] * 4000}, r"d.jsonl:1: \d+ characters, more"),
        (
            {"messages": [user("1"), assistant("2")] * 9},
            r"d.jsonl:1: the dialogue is \d+ tokens to its",
        ),
    ],
)
def test_a_malformed_messages_row_is_one_line(tmp_path, row, message):
    (tmp_path / "d.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(SystemExit, match=message):
        common.load_examples(str(tmp_path / "d.jsonl"), gemma_style_tokenizer(), 128)


def test_a_response_as_one_assistant_message_is_its_content(tmp_path):
    """TRL's conversational preference rows give "chosen" and "rejected" (and its prompt-
    completion rows the completion) as [{"role": "assistant", "content": ...}]: read as that
    turn's content; several turns, another role or a tool call are one line."""
    rows = [
        {"prompt": [user("1+2=")], "chosen": [assistant("3")], "rejected": "4"},
        {"prompt": "1+1=", "chosen": "2", "rejected": [assistant("3")]},
    ]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    loaded = common.load_jsonl(str(tmp_path / "p.jsonl"), ("prompt", "chosen", "rejected"))
    assert [(row["chosen"], row["rejected"]) for _, row in loaded] == [("3", "4"), ("2", "3")]
    (tmp_path / "s.jsonl").write_text(json.dumps({"prompt": "1+1=", "response": [assistant("2")]}))
    assert common.load_examples(str(tmp_path / "s.jsonl"), None, 64)[0][1]["response"] == "2"
    for bad, got in (
        ([assistant("3"), assistant("4")], r"got 2 message\(s\)"),
        ([user("3")], r"of role 'user'"),
        ([{**assistant(""), "tool_calls": []}], r"\['content', 'role', 'tool_calls'\]"),
    ):
        row = {"prompt": "1+2=", "chosen": bad, "rejected": "4"}
        (tmp_path / "p.jsonl").write_text(json.dumps(row) + "\n")
        line = r"p.jsonl:1: field 'chosen': a response given as messages is one assistant .*"
        with pytest.raises(SystemExit, match=line + got):
            common.load_jsonl(str(tmp_path / "p.jsonl"), ("prompt", "chosen", "rejected"))
    kto = {"prompt": "1+1=", "completion": "2", "label": False}  # TRL's unpaired preference row
    (tmp_path / "k.jsonl").write_text(json.dumps(kto) + "\n")
    with pytest.raises(SystemExit, match=r"'chosen': a row of one 'completion' and its 'label'"):
        common.load_pairs(str(tmp_path / "k.jsonl"))
    with pytest.raises(SystemExit, match=r"k.jsonl:1: a 'completion' with a 'label' is TRL's"):
        common.load_examples(str(tmp_path / "k.jsonl"), None, 64)  # SFT would learn the bad ones
    del kto["label"]
    (tmp_path / "k.jsonl").write_text(json.dumps(kto) + "\n")
    with pytest.raises(SystemExit, match=r"'chosen': a \{'prompt', 'completion'\} row is an SFT"):
        common.load_pairs(str(tmp_path / "k.jsonl"))
    for bad, line in (
        ([], r"p.jsonl:1: field 'chosen' is an empty list of messages"),
        (assistant("3"), r"p.jsonl:1: expected a string field 'chosen' \(or a list of one mes"),
    ):
        (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "1", "chosen": bad}) + "\n")
        with pytest.raises(SystemExit, match=line):
            common.load_jsonl(str(tmp_path / "p.jsonl"), ("prompt", "chosen", "rejected"))


def test_a_prompt_completion_row_is_an_sft_example(tmp_path):
    """TRL's prompt-completion rows, {"prompt", "completion"} (the completion its text or one
    assistant message), are SFT examples as {"prompt", "response"} rows are, and may share a
    file with them and with dialogues."""
    rows = [
        {"prompt": "1+1=", "completion": "2"},
        {"prompt": [user("1+2=")], "completion": [assistant("3")]},
        {"prompt": "2+2=", "response": "4"},
        {"messages": [user("3+3="), assistant("6")]},
    ]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    loaded = common.load_examples(str(tmp_path / "s.jsonl"), gemma_style_tokenizer(), 128)
    assert [row for _, row in loaded] == [
        {"prompt": "1+1=", "response": "2"},
        {"prompt": [user("1+2=")], "response": "3"},
        {"prompt": "2+2=", "response": "4"},
        {"prompt": [user("3+3=")], "response": "6"},
    ]


def test_the_readmes_data_rows_load_as_it_says(tmp_path):
    """The README's rows by example ("Running") load: the preference row as a pair, the others
    as SFT examples, one per assistant turn."""
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    block = readme.split("The data are JSONL", 1)[1].split("```json\n", 1)[1].split("```", 1)[0]
    lines = block.splitlines()
    pairs = [line for line in lines if '"chosen"' in line]
    examples = [line for line in lines if '"chosen"' not in line]
    assert len(pairs) == 1 and len(examples) == 4
    (tmp_path / "p.jsonl").write_text("\n".join(pairs) + "\n")
    assert len(common.load_pairs(str(tmp_path / "p.jsonl"))) == 1
    (tmp_path / "s.jsonl").write_text("\n".join(examples) + "\n")
    loaded = common.load_examples(str(tmp_path / "s.jsonl"), gemma_style_tokenizer(), 256)
    assert [row["response"] for _, row in loaded] == ["4", "4", "4", "4", "6"]


def test_an_implicit_prompt_pair_is_split_as_trl_splits_it(tmp_path):
    """TRL's implicit-prompt preference rows: "chosen" and "rejected" whole conversations that
    share every turn but their last, no "prompt"; the shared turns become the prompt. Ones that
    part earlier (responses of several turns) or hold one turn are one line."""
    system = {"role": "system", "content": "Add."}
    rows = [
        {
            "chosen": [system, user("1+2="), assistant("3")],
            "rejected": [system, user("1+2="), assistant("4")],
        },
        {"prompt": "1+1=", "chosen": "2", "rejected": "3"},
    ]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    loaded = [row for _, row in common.load_pairs(str(tmp_path / "p.jsonl"))]
    assert loaded == [
        {"prompt": [system, user("1+2=")], "chosen": "3", "rejected": "4"},
        {"prompt": "1+1=", "chosen": "2", "rejected": "3"},
    ]
    for row, line in (
        (
            {
                "chosen": [user("1"), assistant("2"), user("3"), assistant("4")],
                "rejected": [user("1"), assistant("5"), user("3"), assistant("4")],
            },
            r"p.jsonl:1: no 'prompt', and 'chosen' and 'rejected' are not conversations that share",
        ),
        ({"chosen": [assistant("3")], "rejected": [assistant("4")]}, r"are not conversations"),
        (
            {"chosen": [user("1"), assistant("2")], "rejected": [user("1"), user("2")]},
            r"p.jsonl:1: field 'rejected': a response given as messages is one assistant",
        ),
        ({"chosen": [user("1"), 2], "rejected": []}, r"field 'chosen', message 1: expected a"),
        (
            # TRL's implicit prompt in its text form: said so, not "a conversation" as the hint
            {"chosen": "1+1=2", "rejected": "1+1=3"},
            r"p.jsonl:1: expected a string field 'prompt': an implicit prompt is split from conv",
        ),
    ):
        (tmp_path / "p.jsonl").write_text(json.dumps(row) + "\n")
        with pytest.raises(SystemExit, match=line):
            common.load_pairs(str(tmp_path / "p.jsonl"))


def test_config_values_are_checked_in_nested_configs_and_lists_of_them():
    """`common.check_config_values` walks a VLM's text_config and a hybrid model's list of
    per-block configs (a dropout of 5 there was passed over); strings and numbers in lists are
    left to transformers."""
    good = {"text_config": {"attention_dropout": 0.1}, "blocks": [{"eps": 1e-5}, "mamba", 3]}
    common.check_config_values(good, "m", "--model")
    for config, line in (
        ({"text_config": {"rope_theta": 0}}, "text_config.rope_theta 0, expected a positive"),
        ({"blocks": ["x", {"attn_pdrop": 5}]}, "blocks.1.attn_pdrop 5, expected a probability"),
        ({"blocks": [{"norm": {"layer_norm_eps": -1}}]}, "blocks.0.norm.layer_norm_eps -1, exp"),
    ):
        with pytest.raises(SystemExit, match=rf"^error: --model m: config.json: {line}"):
            common.check_config_values(config, "m", "--model")


def test_ultrafeedback_binarized_rows_split_at_the_prompt_they_repeat(tmp_path):
    """UltraFeedback-binarized's rows (HuggingFaceH4's): a "prompt" beside "chosen" and
    "rejected" that are whole conversations repeating it. Split as an implicit prompt once the
    prompt is seen to be their shared turns (a lone user turn stays the text; a system turn
    before it keeps the conversation); a prompt they do not share, or conversations that part
    earlier, are one line each (they were refused as "a response ... is one assistant")."""
    system = {"role": "system", "content": "Add."}
    rows = [
        {
            "prompt": "1+2=",
            "chosen": [user("1+2="), assistant("3")],
            "rejected": [user("1+2="), assistant("4")],
            "score_chosen": 8.0,
        },
        {
            "prompt": "1+2=",
            "chosen": [system, user("1+2="), assistant("3")],
            "rejected": [system, user("1+2="), assistant("4")],
        },
        {
            "prompt": [system, user("1+2=")],
            "chosen": [system, user("1+2="), assistant("3")],
            "rejected": [system, user("1+2="), assistant("4")],
        },
        # TRL's explicit conversational rows, one assistant turn each: as they were
        {"prompt": [user("1+1=")], "chosen": [assistant("2")], "rejected": [assistant("3")]},
    ]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    loaded = [row for _, row in common.load_pairs(str(tmp_path / "p.jsonl"))]
    assert loaded == [
        {"prompt": "1+2=", "chosen": "3", "rejected": "4", "score_chosen": 8.0},
        {"prompt": [system, user("1+2=")], "chosen": "3", "rejected": "4"},
        {"prompt": [system, user("1+2=")], "chosen": "3", "rejected": "4"},
        {"prompt": [user("1+1=")], "chosen": "2", "rejected": "3"},
    ]
    shape = r"'prompt' is given beside whole conversations \(UltraFeedback-binarized's shape\), and"
    for row, line in (
        (
            {
                "prompt": "2+2=",
                "chosen": [user("1+2="), assistant("3")],
                "rejected": [user("1+2="), assistant("4")],
            },
            rf"p.jsonl:1: {shape} it is not the turns they share \(expected",
        ),
        (
            {
                "prompt": [user("1+2=")],
                "chosen": [system, user("1+2="), assistant("3")],
                "rejected": [system, user("1+2="), assistant("4")],
            },
            rf"p.jsonl:1: {shape} it is not the turns they share",
        ),
        (
            {
                "prompt": "1",
                "chosen": [user("1"), assistant("2"), user("3"), assistant("4")],
                "rejected": [user("1"), assistant("5"), user("3"), assistant("4")],
            },
            rf"p.jsonl:1: {shape} 'chosen' and 'rejected' are not conversations that share",
        ),
    ):
        (tmp_path / "p.jsonl").write_text(json.dumps(row) + "\n")
        with pytest.raises(SystemExit, match=line):
            common.load_pairs(str(tmp_path / "p.jsonl"))


def test_a_bad_row_is_named_before_a_later_one():
    """Rows are checked as they are read: the first bad line is the one named (the SFT rows'
    check once ran after the whole file was parsed, naming a later malformed line first)."""
    lines = [b'{"prompt": 1, "response": "2"}\n', b"{oops\n"]
    with pytest.raises(SystemExit, match=r"d.jsonl:1: expected a string field 'prompt'"):
        common._check_rows("d.jsonl", common.check_sft_row, iter(lines), hashlib.sha256())


def test_a_conversation_reaches_a_reward_function_as_a_copy(tmp_path, monkeypatch):
    """The rule gets the conversation as the data gives it, a copy each call: a function that
    appends the response to it (a common way to build the dialogue) changed the run's stored
    prompts, the n samples of one prompt each seeing the others' answers. The embedded rule
    reads a conversation's last turn."""
    (tmp_path / "appends.py").write_text(
        "def f(prompt, response):\n"
        "    prompt.append({'role': 'assistant', 'content': response})\n"
        "    return float(len(prompt))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    conversation = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2="}]
    row = {"prompt": conversation}
    rows = [row, row]  # one prompt's two samples, as score gets them
    assert train_ppo.rule_scores("appends:f", rows, ["3", "4"]).tolist() == [3.0, 3.0]
    assert conversation == [
        {"role": "system", "content": "Add."},
        {"role": "user", "content": "1+2="},
    ]
    assert train_ppo.rule_scores("task:reward_fn", rows, ["3", "4"]).tolist() == [1.0, 0.0]


REFERENCE_RULES = """
def exact(prompt, response, answer):
    return float(response == answer)

def every(text, reply, **fields):
    return float(len(fields)) + 10 * ('text' in fields) + 100 * ('response' in fields)

def optional(prompt, response, answer="9", *, bonus=0.0):
    return float(response == answer) + bonus

def changes(prompt, response, tests):
    tests.append(response)
    return float(len(tests))

def shadows(prompt, answer, response):
    return 0.0

def positional(prompt, response, answer, /):
    return 0.0

def one(text):
    return 0.0

def wrapper(*args, **kwargs):  # a decorator without functools.wraps
    return exact(*args, **kwargs) if len(args) == 3 else float(len(args) + len(kwargs))

import functools
fixed = functools.partial(exact, answer="fixed")

def trl(prompts, completions, **kwargs):  # TRL's batched shape
    return [0.0 for _ in completions]

def right(prompt, response, answer):  # a bool: a 0/1 reward
    return response == answer

def np_right(prompt, response, answer):  # a NumPy bool
    import numpy
    return numpy.isclose(float(response), float(answer))

def many(prompt, response):
    return [1.0]

def trl_keywords(*, prompts, completions, **kwargs):
    return [0.0 for _ in completions]

# the README's wrapper of a TRL reward function, on TRL's two documented shapes
def trl_len(completions, **kwargs):
    return [float(len(c)) for c in completions]

def trl_accuracy(completions, ground_truth, **kwargs):
    return [float(c == g) for c, g in zip(completions, ground_truth)]

def as_rule(trl_fn):
    def score(prompt, response, **fields):
        lists = {k: [v] for k, v in fields.items()}
        return trl_fn(prompts=[prompt], completions=[response], **lists)[0]
    return score

wrapped_len = as_rule(trl_len)
wrapped_accuracy = as_rule(trl_accuracy)
"""


def test_several_reward_rules_are_summed_with_their_weights(tmp_path, monkeypatch):
    """--reward_fn a,b with --reward_weights (TRL's reward_funcs and reward_weights): the score is
    the weighted sum, each rule's own scores are logged under its name; one rule of weight 1 is
    its scores exactly, and nothing more is logged."""
    (tmp_path / "reference_rules.py").write_text(REFERENCE_RULES)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"prompt": "q", "answer": "42"}, {"prompt": "q", "answer": "7"}]
    args = train_ppo.Args(
        reward_fn="reference_rules:right, reference_rules:wrapped_len", reward_weights="2,0.5"
    )
    total, parts = train_ppo.rule_reward(args, rows, ["42", "2"])
    assert total.tolist() == [2 * 1 + 0.5 * 2, 2 * 0 + 0.5 * 1]
    assert {name: p.tolist() for name, p in parts.items()} == {
        "rule/reference_rules.right": [1.0, 0.0],
        "rule/reference_rules.wrapped_len": [2.0, 1.0],
    }
    args = train_ppo.Args(reward_fn="reference_rules:wrapped_len")
    total, parts = train_ppo.rule_reward(args, rows, ["42", "2"])
    assert torch.equal(
        total, train_ppo.rule_scores("reference_rules:wrapped_len", rows, ["42", "2"])
    )
    assert parts == {}


def test_a_reward_rule_gets_the_rows_fields_it_names(tmp_path, monkeypatch):
    """A verifiable reward reads its reference from the data: a rule's parameters after (prompt,
    response) get the row's fields of their names (all of them with **kwargs, never the row's
    `prompt`, `response` or a name of its own first two), copied; a field some row lacks that the
    rule requires is one line naming the row, before any rollout."""
    (tmp_path / "reference_rules.py").write_text(REFERENCE_RULES)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [
        {"prompt": "6*7=", "answer": "42", "response": "42", "text": "t", "id": 3},
        {"prompt": "1+1=", "answer": "3", "tests": ["a"]},
    ]
    scores = train_ppo.rule_scores("reference_rules:exact", rows, ["42", "2"])
    assert scores.tolist() == [1.0, 0.0]
    scores = train_ppo.rule_scores("reference_rules:every", rows, ["", ""])
    assert scores.tolist() == [2.0, 2.0]  # answer and id; answer and tests
    scores = train_ppo.rule_scores("reference_rules:optional", [{"prompt": "x"}], ["9"])
    assert scores.tolist() == [1.0]
    scores = train_ppo.rule_scores("reference_rules:optional", [{"prompt": "x", "bonus": 2}], ["9"])
    assert scores.tolist() == [3.0]
    twice = [rows[1], rows[1]]
    assert train_ppo.rule_scores("reference_rules:changes", twice, ["a", "b"]).tolist() == [2, 2]
    assert rows[1]["tests"] == ["a"]
    check = train_ppo.check_rule_fields
    check("reference_rules:exact", "--reward_fn", [("d.jsonl:1", rows[0])])
    with pytest.raises(SystemExit, match=r"^error: d.jsonl:2: --reward_fn reference_rules:exa"):
        check("reference_rules:exact", "--reward_fn", [("d.jsonl:1", rows[0]), ("d.jsonl:2", {})])
    line = r"reference_rules:shadows\(prompt, answer, response\): a parameter 'response' after"
    with pytest.raises(SystemExit, match=line):
        check("reference_rules:shadows", "--gold_reward_fn", [("d.jsonl:1", rows[0])])
    check("task:reward_fn", "--reward_fn", [("d.jsonl:1", {"prompt": "1+1="})])
    # rules that cannot be called so are one line before any rollout, not a TypeError at one
    for rule in ("positional", "one"):
        line = rf"^error: --reward_fn reference_rules:{rule}\(.*\): cannot be called as \(prompt"
        with pytest.raises(SystemExit, match=line):
            check(f"reference_rules:{rule}", "--reward_fn", [("d.jsonl:1", rows[0])])
    # a signature that says nothing, (*args, **kwargs), gets (prompt, response) only
    check("reference_rules:wrapper", "--reward_fn", [("d.jsonl:1", rows[0])])
    assert train_ppo.rule_scores("reference_rules:wrapper", rows, ["", ""]).tolist() == [2, 2]
    # a partial's bound keyword is the user's: a row's field of that name does not replace it
    check("reference_rules:fixed", "--reward_fn", [("d.jsonl:1", rows[0])])
    scores = train_ppo.rule_scores("reference_rules:fixed", rows, ["42", "fixed"])
    assert scores.tolist() == [0.0, 1.0]
    # TRL's batched reward functions are told to be wrapped, before any rollout
    with pytest.raises(SystemExit, match=r"reference_rules:trl\(prompts, .*a TRL reward function"):
        check("reference_rules:trl", "--reward_fn", [("d.jsonl:1", rows[0])])
    assert train_ppo.rule_scores("reference_rules:right", rows, ["42", "2"]).tolist() == [1, 0]
    assert train_ppo.rule_scores("reference_rules:np_right", rows, ["42", "2"]).tolist() == [1, 0]
    with pytest.raises(SystemExit, match=r"returned \[1.0\] for prompt .* \(one score: a rule"):
        train_ppo.rule_scores("reference_rules:many", rows, ["", ""])
    with pytest.raises(SystemExit, match=r"reference_rules:trl_keywords\(.*a TRL reward function"):
        check("reference_rules:trl_keywords", "--reward_fn", [("d.jsonl:1", rows[0])])
    truth = [{"prompt": "x", "ground_truth": "ab"}]
    assert train_ppo.rule_scores("reference_rules:wrapped_len", truth, ["abc"]).tolist() == [3]
    assert train_ppo.rule_scores("reference_rules:wrapped_accuracy", truth, ["ab"]).tolist() == [1]
    with open(os.path.join(REPO, "README.md")) as f:
        readme = " ".join(f.read().split())
    assert "lists = {k: [v] for k, v in fields.items()}" in readme
    assert "return trl_fn(prompts=[prompt], completions=[response], **lists)[0]" in readme


def test_a_conversation_is_bounded_by_its_rendering_before_it_is_tokenised():
    """check_fits bounds a prompt's tokens by its text before tokenising it (a 20 MB prompt took
    59 s and 8.4 GB per rank); a conversation's contents alone do not bound its rendering (a role
    of 2,000,000 characters, 200,000 empty turns), so its rendered text is what is measured."""
    tok = gemma_style_tokenizer()
    for conversation in (
        [{"role": "u" * 2_000_000, "content": ""}],
        [{"role": "user", "content": ""}] * 200_000,
    ):
        with pytest.raises(SystemExit, match=r"d.jsonl:1: \d+ characters, more than 124 tokens"):
            train_ppo.load_prompts([("d.jsonl:1", {"prompt": conversation})], tok, 4, 128)


def test_rng_state_round_trips_through_json():
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    state = json.loads(json.dumps(checkpoint.rng_state()))
    want = (random.random(), np.random.randn(), np.random.rand(), torch.rand(3))
    random.seed(2)
    np.random.seed(2)
    torch.manual_seed(2)
    checkpoint.set_rng_state(state)
    got = (random.random(), np.random.randn(), np.random.rand(), torch.rand(3))
    assert want[:3] == got[:3] and torch.equal(want[3], got[3])


def test_safe_unpickler_refuses_code():
    import io

    payload = pickle.dumps(os.system)  # any global outside the DCP metadata classes
    with pytest.raises(checkpoint.CheckpointError, match="refusing to unpickle posix.system"):
        checkpoint._SafeUnpickler(io.BytesIO(payload)).load()


def test_verify_names_the_bad_file(tmp_path):
    write_small_checkpoint(tmp_path)
    assert checkpoint.verify(str(tmp_path))["step"] == 1
    (tmp_path / "sub" / "b.bin").write_bytes(b"World")
    with pytest.raises(checkpoint.CheckpointError, match=r"sub/b.bin: checksum mismatch"):
        checkpoint.verify(str(tmp_path))
    (tmp_path / "a.bin").unlink()
    with pytest.raises(checkpoint.CheckpointError, match=r"a.bin: missing"):
        checkpoint.verify(str(tmp_path))
    with pytest.raises(checkpoint.CheckpointError, match=r"manifest.json: missing"):
        checkpoint.verify(REPO)


def test_verification_shares_files_by_size():
    """checkpoint._owners, by hand: the largest file first, each to the least-loaded rank (the
    lower rank on a tie), so ranks hash about equal bytes at a resume."""
    # sizes 10, 1, 5, 5, 4: 10 -> r0; 5 -> r1 (0 bytes); 5 -> r1 (5 < 10); 4 -> r0 (10 = 10, the
    # lower rank); 1 -> r1 (10 < 14)
    assert checkpoint._owners([10, 1, 5, 5, 4], 2) == [0, 1, 1, 1, 0]
    assert checkpoint._owners([3, 3, 3], 1) == [0, 0, 0]
    assert checkpoint._owners([], 4) == []
    assert checkpoint._owners([7, 7], 4) == [0, 1]


def test_encode_prompt_uses_the_chat_template_when_there_is_one():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(task.TINY_MODEL)
    assert (
        common.encode_prompt(tok, "1+2=", "test") == tok("1+2=").input_ids
    )  # no template: the raw prompt
    tok.chat_template = (
        "{% for m in messages %}U:{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}A:{% endif %}"
    )
    ids = common.encode_prompt(tok, "1+2=", "test")
    assert tok.decode(ids, skip_special_tokens=True) == "U:1+2=A:"


@pytest.mark.parametrize("script", ["checkpoint.py", "train_sft.py"])
def test_a_store_url_without_its_client_is_one_line(script):
    """s3fs is optional: without it, an s3:// --out_dir or checkpoint is one line saying what to
    install (here s3fs is made unimportable in the child)."""
    import subprocess
    import sys

    args = {"checkpoint.py": ["verify", "s3://b/x"], "train_sft.py": ["--out_dir", "s3://b/x"]}
    code = (
        "import runpy, sys; sys.modules['s3fs'] = None; "
        f"sys.argv = {[script, *args[script]]!r}; runpy.run_path({script!r}, run_name='__main__')"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p.stderr[-2000:]
    assert lines[0].startswith("error: ") and "pip install s3fs" in lines[0]


def sampler_draw(probs, u, temperature=1.0, top_p=1.0):
    """InverseCDFSampler's token for one row with the given uniform, and its logprob."""
    sampler = rollout.InverseCDFSampler([0], 1, temperature, top_p)
    sampler.uniforms = torch.tensor([[u]], dtype=torch.float64)
    scores = sampler(torch.zeros(1, 1, dtype=torch.long), torch.tensor([probs]).log())
    token = int(scores.argmax())
    assert scores[0, token] == 0 and torch.isinf(scores).sum() == len(probs) - 1
    return token, float(sampler.logprobs()[0, 0])


def test_inverse_cdf_sampler_by_hand():
    """probs [0.5, 0, 0.25, 0.25]: cdf [0.5, 0.5, 0.75, 1]; u picks the first token whose cdf
    exceeds it (token 1, of probability 0, has an empty interval)."""
    probs = [0.5, 0.0, 0.25, 0.25]
    assert sampler_draw(probs, 0.0)[0] == 0
    assert sampler_draw(probs, 0.4999)[0] == 0
    assert sampler_draw(probs, 0.5001)[0] == 2
    assert sampler_draw(probs, 0.74)[0] == 2
    assert sampler_draw(probs, 0.76)[0] == 3
    assert sampler_draw(probs, 0.999)[0] == 3
    token, logprob = sampler_draw(probs, 0.6)
    assert token == 2 and math.isclose(logprob, math.log(0.25), rel_tol=1e-6)
    # temperature 2: probs ~ sqrt(p) = [0.707, 0, 0.5, 0.5] / 1.707 -> cdf [0.414, 0.414, 0.707, 1]
    token, logprob = sampler_draw(probs, 0.45, temperature=2.0)
    assert token == 2 and math.isclose(logprob, math.log(0.5 / 1.70710678), rel_tol=1e-6)
    # temperature 0: greedy, the untempered logprob
    token, logprob = sampler_draw([0.2, 0.7, 0.1], 0.01, temperature=0.0)
    assert token == 1 and math.isclose(logprob, math.log(0.7), rel_tol=1e-6)


def test_nucleus_matches_transformers_top_p():
    """Top-p 0.7 of [0.5, 0.3, 0.2]: 0.5 and 0.3 stay (0.3 crosses 0.7), renormalised to 0.625 and
    0.375; the same tokens as transformers' TopPLogitsWarper keeps, on random rows too."""
    from transformers import TopPLogitsWarper

    kept = rollout.nucleus(torch.tensor([[0.5, 0.3, 0.2]]).log(), 0.7).exp()
    assert torch.allclose(kept, torch.tensor([[0.625, 0.375, 0.0]]))
    assert sampler_draw([0.5, 0.3, 0.2], 0.99, top_p=0.7)[0] == 1
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 3
    for top_p in (0.3, 0.8, 0.95):
        ours = torch.isfinite(rollout.nucleus(logits.log_softmax(-1), top_p))
        theirs = torch.isfinite(TopPLogitsWarper(top_p)(None, logits.clone()))
        assert torch.equal(ours, theirs), top_p


def test_inverse_cdf_sampler_draws_the_distribution_and_its_seeds():
    """20,000 rows of one distribution: frequencies within 0.015 of the probabilities, never the
    token of probability 0; a row's draws depend on its own seed only (the same seed in another
    batch, the same tokens)."""
    probs = torch.tensor([0.1, 0.6, 0.0, 0.3])
    n = 20000
    sampler = rollout.InverseCDFSampler(list(range(n)), 1, 1.0, 1.0)
    tokens = sampler(None, probs.log().expand(n, 4)).argmax(-1)
    frequencies = torch.bincount(tokens, minlength=4) / n
    assert (frequencies - probs).abs().max() < 0.015 and frequencies[2] == 0, frequencies
    # a row's draws are its own seed's, whatever rows are beside it: 20 rows drawn again in
    # another batch (one row alone would match a sampler that ignores its seed by chance, 46%)
    rows = [7, 123, 4567, 19999, *range(300, 316)]
    again = rollout.InverseCDFSampler(rows, 1, 1.0, 1.0)
    drawn = again(None, probs.log().expand(len(rows), 4)).argmax(-1)
    assert torch.equal(drawn, tokens[rows]) and len(set(drawn.tolist())) > 1, drawn


def test_every_small_file_of_a_save_is_fsynced(tmp_path, fsynced):
    """save_pretrained does not fsync; `_write_small_files` fsyncs each file it wrote (hf/,
    meta.json, the RNG state), so that a power loss after the commit cannot leave a committed
    checkpoint with a file the disk never got."""
    import torch.distributed as dist
    from transformers import AutoConfig
    from transformers import AutoTokenizer

    task.ensure_tiny_model()
    hf_objs = (
        AutoConfig.from_pretrained(task.TINY_MODEL),
        AutoTokenizer.from_pretrained(task.TINY_MODEL),
    )
    # a process group of one rank, in-process (an earlier test's is used and left as it was)
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        checkpoint._write_small_files(str(tmp_path), 1, {"model": None}, {}, hf_objs)
    finally:
        if owned:
            dist.destroy_process_group()
    written = sorted(str(p) for p in tmp_path.rglob("*") if p.is_file())
    assert any("/hf/" in path for path in written) and len(written) > 4, written
    assert sorted(set(fsynced)) == written


def test_a_classifier_of_a_family_transformers_has_none_for(tmp_path):
    """Granite has no token or sequence classifier in transformers: common.classifier_class
    builds them as transformers writes Llama's; loaded from the causal LM folder, the backbone is
    the causal LM's own (the same hidden states), only the head is new. A folder without the head
    (a causal LM given as a reward model) is one line, not a random head."""
    from test_families import build_granite
    from transformers import AutoConfig
    from transformers import AutoModelForCausalLM
    from transformers import AutoModelForSequenceClassification
    from transformers import AutoModelForTokenClassification

    build_granite(str(tmp_path))
    config = AutoConfig.from_pretrained(tmp_path)
    critic_class = common.classifier_class(config, AutoModelForTokenClassification)
    assert critic_class.__name__ == "GraniteForTokenClassification"
    lm, _ = common.load_model_and_tokenizer(str(tmp_path), AutoModelForCausalLM)
    ids = torch.tensor([[5, 6, 7, 8]])
    expected = lm.model(ids).last_hidden_state
    for cls in (AutoModelForTokenClassification, AutoModelForSequenceClassification):
        model, _ = common.load_model_and_tokenizer(str(tmp_path), cls, new_head=True, num_labels=1)
        assert type(model).__name__ == "Granite" + cls.__name__.removeprefix("AutoModel")
        assert torch.equal(model.model(ids).last_hidden_state, expected)
        assert common.value_head(model).out_features == 1
    with pytest.raises(SystemExit) as e:
        common.load_model_and_tokenizer(str(tmp_path), AutoModelForSequenceClassification)
    assert str(e.value).startswith(f"error: --model {tmp_path}: the folder has no weights for")
    assert "score.weight" in str(e.value) and "\n" not in str(e.value)


def test_a_built_critic_reads_opts_projected_output(tmp_path):
    """OPT (opt-350m's shape) projects its last hidden states from hidden_size down to
    word_embed_proj_dim; transformers has no OPT token classifier, and the built one's head read
    hidden_size features: PPO's critic failed at its first forward."""
    from transformers import AutoModelForTokenClassification
    from transformers import OPTConfig
    from transformers import OPTForCausalLM

    config = OPTConfig(
        vocab_size=128,
        hidden_size=128,
        word_embed_proj_dim=64,
        ffn_dim=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    OPTForCausalLM(config).save_pretrained(tmp_path)  # a causal LM folder, as an SFT export
    critic_class = common.classifier_class(config, AutoModelForTokenClassification)
    critic = critic_class.from_pretrained(tmp_path, num_labels=1)
    assert common.value_head(critic).in_features == 64
    values = critic(input_ids=torch.tensor([[5, 6, 7, 8]])).logits
    assert values.shape == (1, 4, 1)


def sentencepiece_like_tokenizer():
    """Llama 2's conventions, built offline: BPE over characters with byte fallback and
    Metaspace's "▁" prefix on the first word of a text; "▁8" one token."""
    from tokenizers import Tokenizer
    from tokenizers import decoders
    from tokenizers import models
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "▁8": 4}
    for i in range(256):
        vocab[f"<0x{i:02X}>"] = len(vocab)
    for c in "0123456789+=:abc":
        vocab[c] = len(vocab)
    bpe = models.BPE(vocab, [("▁", "8")], unk_token="<unk>", byte_fallback=True)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>")


def bpe_merging_tokenizer():
    """GPT-2's conventions (byte-level BPE), with " 82" one token: a prompt ending in a space then
    "82" tokenizes as "Answer:" + " 82", across the join."""
    from tokenizers import Tokenizer
    from tokenizers import models
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab["Ġ8"] = len(vocab)
    vocab["Ġ82"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [("Ġ", "8"), ("Ġ8", "2")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="!")


def test_a_response_is_tokenized_as_it_continues_its_prompt():
    tok = sentencepiece_like_tokenizer()
    assert tok.convert_ids_to_tokens(tok("82", add_special_tokens=False).input_ids) == ["▁8", "2"]
    # SFT trains the tokens of the whole text "37+45=82" after the prompt's: no "▁" of its own
    ids, n_prompt = train_sft.encode(tok, {"prompt": "37+45=", "response": "82"}, 64, "x")
    assert tok.convert_ids_to_tokens(ids[n_prompt:]) == ["8", "2", "</s>"]
    assert tok.decode(ids) == "37+45=82</s>"
    # a space the data has is kept; a newline the prompt ends with starts no word of the response
    assert tok.convert_ids_to_tokens(common.encode_response(tok, "a:", " 82")) == ["▁8", "2"]
    assert tok.convert_ids_to_tokens(common.encode_response(tok, "a:\n", "82")) == ["8", "2"]

    bpe = bpe_merging_tokenizer()
    assert bpe.convert_ids_to_tokens(bpe("a: 82").input_ids) == ["a", ":", "Ġ82"]
    assert bpe.convert_ids_to_tokens(common.encode_response(bpe, "a:", " 82")) == ["Ġ82"]
    # "a: " + "82" merges across the join: the response is tokenized after a newline instead
    assert bpe.convert_ids_to_tokens(common.encode_response(bpe, "a: ", "82")) == ["8", "2"]


def test_an_empty_prompt_without_a_bos_is_refused():
    """GPT-2's tokenizer adds no BOS: an empty prompt leaves the response's first token nothing
    to be predicted from (SFT counted it in its loss's denominator all the same)."""
    tok = bpe_merging_tokenizer()
    with pytest.raises(SystemExit, match="x.jsonl:3: the prompt has no tokens"):
        train_sft.encode(tok, {"prompt": "", "response": "82"}, 64, "x.jsonl:3")
    # DPO's first response logprob likewise; a reward model reads the whole sequence, so takes it
    row = {"prompt": "", "chosen": "82", "rejected": "81"}
    with pytest.raises(SystemExit, match="x.jsonl:2: the prompt has no tokens"):
        first = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}
        train_dpo.encode_pairs(tok, [("x.jsonl:1", first), ("x.jsonl:2", row)], 64)
    assert len(train_rm.encode_pairs(tok, [("x.jsonl:2", row)], 64)) == 1


def test_a_pair_that_prefers_neither_response_is_refused():
    """chosen == rejected (as tokens): the Bradley-Terry and DPO losses are log 2 whatever the
    model, and the pair was counted as ranked wrong in the accuracies. Both preference stages
    encode through common.encode_pair, which refuses it."""
    tok = bpe_merging_tokenizer()
    row = {"prompt": "1+1=", "chosen": "2", "rejected": "2"}
    with pytest.raises(SystemExit, match="x.jsonl:5: 'chosen' and 'rejected' are the same"):
        train_rm.encode_pairs(tok, [("x.jsonl:5", row)], 64)
    with pytest.raises(SystemExit, match="prefers neither"):
        train_dpo.encode_pairs(tok, [("x.jsonl:5", row)], 64)


def test_a_token_across_the_join_is_never_dropped():
    """Unknown characters fuse into one <unk> (the tests' character tokenizers have no "\\n"):
    after a prompt ending in one, a response starting with one keeps its <unk>."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(task.TINY_MODEL)  # one token per printable character
    assert tok.convert_ids_to_tokens(tok("x\n\nab").input_ids) == ["<s>", "x", "<unk>", "a", "b"]
    ids = common.encode_response(tok, "x\n", "\nab")
    assert tok.convert_ids_to_tokens(ids) == ["<unk>", "a", "b"]


def test_context_length_of_wrapped_and_plain_configs():
    from transformers import BloomConfig
    from transformers import Gemma3Config
    from transformers import GPT2Config
    from transformers import MambaConfig

    assert common.context_length("m", GPT2Config(n_positions=50)) == 50
    # BLOOM: ALiBi, no position table, no limit named: the 2048 it was trained at
    assert common.context_length("m", BloomConfig()) == 2048
    # Gemma 3 from 4B up: a multimodal wrapper, the text model's limit in text_config
    wrapped = Gemma3Config(text_config={"max_position_embeddings": 77})
    assert not hasattr(wrapped, "max_position_embeddings")
    assert common.context_length("m", wrapped) == 77
    with pytest.raises(SystemExit, match="--model m: its config .MambaConfig. names no context"):
        common.context_length("m", MambaConfig())


GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ m['role'] | replace('assistant', 'model') }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def gemma_style_tokenizer():
    """Gemma's chat conventions on a character tokenizer: EOS is <eos>, and the template ends an
    assistant turn with <end_of_turn>."""
    from tokenizers import Regex
    from tokenizers import Tokenizer
    from tokenizers import decoders
    from tokenizers import models
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    vocab = {t: i for i, t in enumerate(specials + task.CHARS + ["\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=specials[4:],
    )
    hf_tok.chat_template = GEMMA_TEMPLATE
    return hf_tok


def test_a_response_ends_as_the_chat_template_ends_a_turn():
    from transformers import AutoTokenizer
    from transformers import GenerationConfig

    tok = gemma_style_tokenizer()
    eos = tok.eos_token_id
    end_of_turn = tok.convert_tokens_to_ids("<end_of_turn>")
    assert common.response_end_id(tok) == end_of_turn != eos
    ids, n_prompt = train_sft.encode(tok, {"prompt": "1+2=", "response": "3"}, 64, "x")
    # what the template writes for the same two turns, up to the end of the answer's turn
    turns = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    rendered = tok.apply_chat_template(turns, tokenize=False)
    assert tok.decode(ids) == rendered.removesuffix("\n")
    assert tok.convert_ids_to_tokens(ids[n_prompt:]) == ["3", "<end_of_turn>"]
    # generation stops there, and the export's generation config says so too
    folder_config = GenerationConfig(eos_token_id=eos)
    stop_ids = common.stop_token_ids(tok, folder_config)
    assert stop_ids == [eos, end_of_turn]
    assert common.stopping_at(folder_config, stop_ids).eos_token_id == [eos, end_of_turn]
    assert folder_config.eos_token_id == eos  # the model's own is not changed
    # a template that ends a turn with text, and no template: the tokenizer's EOS
    plain = AutoTokenizer.from_pretrained(task.TINY_MODEL)
    assert common.response_end_id(plain) == plain.eos_token_id
    plain.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert common.response_end_id(plain) == plain.eos_token_id


# Three real templates' ways with an assistant turn, each on the character tokenizer: Mistral
# v0.3's (a space before the content, which it trims), Qwen3's (an empty think block opens the
# last turn in its default thinking mode; its non-thinking generation prompt holds it instead)
# and DeepSeek-R1's (its generation prompt opens a think block that its rendering of a past turn
# drops, with everything before "</think>").
MISTRAL_LIKE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
    "{% set turns = messages[1:] %}{% else %}{% set sys = '' %}{% set turns = messages %}"
    "{% endif %}{% for m in turns %}{% if m['role'] == 'user' %}[INST] "
    "{% if loop.last and sys %}{{ sys }} {% endif %}{{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] | trim }}{{ eos_token }}{% endif %}{% endfor %}"
)
QWEN3_LIKE = (
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{% set c = m['content'] %}"
    "{% set r = '' %}{% if '</think>' in c %}"
    "{% set r = c.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{% set c = c.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "{% if m['role'] == 'assistant' and loop.last %}<think>\n{{ r }}\n</think>\n\n{% endif %}"
    "{{ c }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
R1_LIKE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<start_of_turn>user\n{{ m['content'] }}"
    "{% else %}{% set c = m['content'] %}{% if '</think>' in c %}"
    "{% set c = c.split('</think>')[-1] %}{% endif %}"
    "<start_of_turn>assistant\n{{ c }}<end_of_turn>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>assistant\n<think>\n{% endif %}"
)


CHANNEL_LIKE = (  # GPT-OSS's way: the answer's turn opens with a special token and a header
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}<start_of_turn>final\n{% endif %}"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>assistant\n{% endif %}"
)


def templated_tokenizer(template, **special):
    """gemma_style_tokenizer's characters and special tokens under another template, with
    Qwen3's "<think>" and "</think>" as added (not special) tokens."""
    tok = gemma_style_tokenizer()
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = template
    for name, value in special.items():
        setattr(tok, name, value)
    return tok


def trained_tokens(tok, prompt, response):
    ids, n_prompt = train_sft.encode(tok, {"prompt": prompt, "response": response}, 128, "x")
    return tok.convert_ids_to_tokens(ids[n_prompt:])


def test_a_response_is_trained_as_the_chat_template_renders_its_turn(monkeypatch):
    """A template that does not print a turn's content as given (a space before it, trimmed,
    an empty think block before it) had the content trained as given, silently: a turn the
    template never shows the model. Now SFT, the pairs, PPO's reward-model inputs and the
    held-out comparison take the response as the template renders it (`common.response_text`)."""
    mistral = templated_tokenizer(MISTRAL_LIKE)
    assert trained_tokens(mistral, "1+2=", "82") == [" ", "8", "2", "<eos>"]
    assert trained_tokens(mistral, "1+2=", "  82 ") == [" ", "8", "2", "<eos>"]  # trimmed
    # a system prompt goes into the last user turn, so the whole conversation does not start
    # with the prompt: the turn as it renders after a one-question prompt
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2="}]
    assert trained_tokens(mistral, system, "82 ") == [" ", "8", "2", "<eos>"]
    qwen3 = templated_tokenizer(QWEN3_LIKE)
    think = ["<think>", "\n", "\n", "</think>", "\n", "\n"]
    assert trained_tokens(qwen3, "1+2=", "82") == think + ["8", "2", "<end_of_turn>"]
    # the whole sequence is the template's rendering of the two turns, to the turn's end
    ids, _ = train_sft.encode(qwen3, {"prompt": "1+2=", "response": "82"}, 128, "x")
    turns = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "82"}]
    assert qwen3.decode(ids) == qwen3.apply_chat_template(turns, tokenize=False)[:-1]
    assert common.response_text(qwen3, "1+2=", "82") == "<think>\n\n</think>\n\n82"
    # a reward model reads a sampled response as its pairs trained it
    row = {"prompt": "1+2=", "chosen": "82", "rejected": "81"}
    (chosen, _), _ = common.encode_pair(qwen3, row, 128, "x")
    assert train_ppo.reward_model_inputs(qwen3, ["1+2="], ["82"], [True]) == [chosen]
    # the held-out decoding has room for the block too
    assert common.decode_budget(qwen3, [{"prompt": "1+2=", "response": "82"}]) == 9
    # a reasoning cut off at --max_new_tokens keeps its own open block, not after an empty one
    cut = train_ppo.reward_model_inputs(qwen3, ["1+2="], ["<think>\nx"], [False])[0]
    assert qwen3.decode(cut).endswith("assistant\n<think>\nx")
    # non-thinking: the generation prompt holds the empty block, the response follows it
    monkeypatch.setitem(common.CHAT_TEMPLATE_KWARGS, "enable_thinking", False)
    assert trained_tokens(qwen3, "1+2=", "82") == ["8", "2", "<end_of_turn>"]
    # and a reasoning of its own after that block's "</think>" is refused
    with pytest.raises(SystemExit, match="x: the response holds '</think>', which the chat"):
        trained_tokens(qwen3, "1+2=", "<think>\nx\n</think>\n\n82")


def test_the_reward_model_renders_with_its_own_template_variables(monkeypatch):
    """PPO's --chat_template_kwargs are the policy's: the reward model renders its inputs with
    its own template's defaults (those train_rm.py recorded in its export), as it was trained,
    where the flag reached its template too and changed its scores (helper 73's probe)."""
    tok = templated_tokenizer("{% if short %}1\n{% endif %}" + GEMMA_TEMPLATE)
    row = {"prompt": "1+2=", "chosen": "82", "rejected": "81"}
    (trained, _), _ = common.encode_pair(tok, row, 128, "x")  # as train_rm.py, no flag
    monkeypatch.setitem(common.CHAT_TEMPLATE_KWARGS, "short", True)
    (otherwise, _), _ = common.encode_pair(tok, row, 128, "x")
    assert otherwise != trained  # the variable changes the rendering
    assert train_ppo.reward_model_inputs(tok, ["1+2="], ["82"], [True]) == [trained]
    assert common.CHAT_TEMPLATE_KWARGS == {"short": True}  # the policy's, back


def test_a_turn_opening_with_a_special_token_reaches_the_reward_model_once():
    """A template whose answer opens with a special token and a header (GPT-OSS's channel): PPO
    decoded samples without special tokens, and the reward model's input got the header's words
    twice ("final\\nfinal\\n82"); the held-out comparison kept the special token its decoded
    answer drops, so it never matched."""
    tok = templated_tokenizer(CHANNEL_LIKE)
    row = {"prompt": "1+2=", "chosen": "82", "rejected": "81"}
    (chosen, n_prompt), _ = common.encode_pair(tok, row, 128, "x")
    sampled = chosen[n_prompt:]  # what a policy trained on it writes, its end of turn included
    texts = train_ppo.written_texts(tok, ["1+2="], [chosen[:n_prompt]], [sampled], [True])
    assert train_ppo.reward_model_inputs(tok, ["1+2="], texts, [True]) == [chosen]
    ids = common.encode_response(tok, "1+2=", "82")
    assert tok.decode(ids, skip_special_tokens=True) == "final\n82"  # as greedy_accuracy compares


def test_a_response_repeating_the_generation_prompts_end_is_refused():
    """DeepSeek-R1's generation prompt ends with "<think>\\n" and its rendering of a past turn
    keeps only what follows "</think>": the response is trained as given after the generation
    prompt, and one that opens the think block again would train two."""
    r1 = templated_tokenizer(R1_LIKE)
    assert trained_tokens(r1, "1+2=", "x</think>82") == ["x", "</think>", "8", "2", "<end_of_turn>"]
    line = "x: the response holds '<think>', which the chat template's generation prompt"
    with pytest.raises(SystemExit, match=line):
        train_sft.encode(r1, {"prompt": "1+2=", "response": "<think>\nx</think>82"}, 128, "x")
    row = {"prompt": "1+2=", "chosen": "x</think>82", "rejected": "<think>x</think>81"}
    with pytest.raises(SystemExit, match="x: 'rejected': the response holds '<think>'"):
        common.encode_pair(r1, row, 128, "x")


def test_an_end_of_turn_that_is_also_the_pad_token_ends_a_response():
    """Llama 3 tuned with <|eot_id|> as its PAD: the template's end of turn is the PAD token,
    and response_end_id passed over it for the tokenizer's EOS, which the template never
    writes after an answer."""
    tok = templated_tokenizer(GEMMA_TEMPLATE, pad_token="<end_of_turn>")
    end_of_turn = tok.convert_tokens_to_ids("<end_of_turn>")
    assert tok.pad_token_id == end_of_turn
    assert common.response_end_id(tok) == end_of_turn


def test_building_the_tiny_model_leaves_the_callers_rng_alone(tmp_path):
    """ensure_tiny_model seeds its own weights (the same on every machine); a stage calls it after
    seeding every RNG with seed + rank, whose stream must not be reset to the model's seed."""
    for name in os.listdir(task.TINY_MODEL):
        if name != "model.safetensors":
            shutil.copy(os.path.join(task.TINY_MODEL, name), tmp_path)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    task.ensure_tiny_model(str(tmp_path))
    assert (tmp_path / "model.safetensors").exists()
    assert torch.equal(torch.get_rng_state(), before)


def test_a_frozen_model_reshards_its_root_after_a_forward():
    """FSDP2 reshards a root in its backward; a frozen model (PPO's reference and reward model,
    DPO's reference) has none, so its embeddings and head stayed gathered all run (on a GPU,
    ~2 GB per frozen 8B-class model). Its root now reshards after each forward; a trained
    model's root keeps FSDP2's default (gathered until its backward)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import task

    task.ensure_tiny_model()
    ours_group = not dist.is_initialized()
    if ours_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for frozen in (True, False):
            model = AutoModelForCausalLM.from_pretrained(task.TINY_MODEL)
            model.requires_grad_(not frozen)
            common.shard_model(model, torch.device("cpu"))
            with torch.no_grad():
                model(input_ids=torch.tensor([[5, 6, 7]]))
            sharded = isinstance(model.get_input_embeddings().weight, DTensor)
            assert sharded == frozen
    finally:
        if ours_group:
            dist.destroy_process_group()


def test_the_hf_engine_takes_persistent_buffers_at_a_weight_sync(tmp_path):
    """`rollout.sync_weights` streams the actor's state_dict, persistent buffers included: Apertus
    keeps its xIELU activation's beta as one (DeepSeek-V3 its router's correction bias). The HF
    engine looked every name up among its parameters only, and PPO's first sync failed with a
    KeyError. A changed parameter and buffer both reach the engine."""
    import torch.distributed as dist
    from test_families import SMALL
    from test_families import plain_tokenizer
    from transformers import ApertusConfig
    from transformers import ApertusForCausalLM
    from transformers import AutoModelForCausalLM

    path = str(tmp_path / "apertus")
    plain_tokenizer(path)
    torch.manual_seed(0)
    ApertusForCausalLM(ApertusConfig(**SMALL)).save_pretrained(path)
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        actor = common.shard_model(AutoModelForCausalLM.from_pretrained(path), torch.device("cpu"))
        buffers = [n for n, _ in actor.named_buffers() if n in actor.state_dict()]
        assert buffers, "no persistent buffer: the case is not tested"
        # fp32 wherever it runs (on a machine with CUDA the engine is there, in bf16 by default)
        engine = rollout.HFEngine(path, 64, 0, [2], dtype=torch.float32)
        with torch.no_grad():
            actor.get_buffer(buffers[0]).add_(0.5)
            actor.get_parameter("model.norm.weight").add_(0.25)
        rollout.sync_weights(engine, actor)
        assert torch.equal(engine.model.get_buffer(buffers[0]).cpu(), actor.get_buffer(buffers[0]))
        assert torch.equal(
            engine.model.get_parameter("model.norm.weight").cpu(),
            actor.get_parameter("model.norm.weight").full_tensor(),
        )
    finally:
        if owned:
            dist.destroy_process_group()


@pytest.mark.parametrize(
    "flag,device,threshold",
    [(0.0, "cpu", 1e-3), (0.0, "cuda", 0.05), (0.2, "cpu", 0.2), (1e-4, "cuda", 1e-4)],
)
def test_the_logprob_gap_warns_above_what_a_right_engine_reaches(flag, device, threshold):
    """fp32 on CPU: a right engine agrees with the actor to ~1e-7, and LFM2's broken vLLM-CPU
    rotary (a mean gap of 0.048) passed under the 0.05 that bf16 on a GPU needs."""
    import train_ppo

    assert train_ppo.logprob_diff_threshold(flag, torch.device(device)) == threshold


def test_the_weights_fingerprint_sees_a_change_and_stays_json():
    """`common.weights_fingerprint`, kept in meta.json for a resume to compare: one float per
    parameter, moved by a change to one tensor, and a NaN weight's sum kept as -1 (JSON would
    write NaN, which `read_meta` refuses: every later checkpoint would be unreadable)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    task.ensure_tiny_model()
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = AutoModelForCausalLM.from_pretrained(task.TINY_MODEL).requires_grad_(False)
        common.shard_model(model, torch.device("cpu"))
        before = common.weights_fingerprint(model, torch.device("cpu"))
        assert before.keys() == dict(model.named_parameters()).keys()
        assert all(type(v) is float and v >= 0 for v in before.values())
        with torch.no_grad():
            model.get_parameter("model.norm.weight").to_local()[0] = float("nan")
        after = common.weights_fingerprint(model, torch.device("cpu"))
        assert [k for k in before if before[k] != after[k]] == ["model.norm.weight"]
        assert after["model.norm.weight"] == -1.0 and checkpoint._is_fingerprints({"m": after})
    finally:
        if owned:
            dist.destroy_process_group()


def test_a_folders_identity_survives_a_re_save_and_names_an_edit(tmp_path):
    """`common.folder_identity`, kept in meta.json for a resume to compare: the same for a folder
    saved again by transformers (other file layout, keys written out at their defaults, the
    version stamp), so a re-export does not stop a resume; an edit to what the model computes
    (rope_theta, rms_norm_eps), to the generation config's stop ids or to the vocabulary is
    named by `checkpoint._same_folder`, in one line."""
    from transformers import AutoConfig
    from transformers import AutoTokenizer
    from transformers import GenerationConfig

    task.ensure_tiny_model()
    before = common.folder_identity(task.TINY_MODEL)
    assert checkpoint._is_folder_records({"model": before})
    for obj in (AutoConfig, AutoTokenizer, GenerationConfig):
        obj.from_pretrained(task.TINY_MODEL).save_pretrained(tmp_path)
    assert common.folder_identity(str(tmp_path)) == before
    config = json.load(open(tmp_path / "config.json"))
    config["rope_parameters"]["rope_theta"] = 500.0
    config["rms_norm_eps"] = 1e-5
    json.dump(config, open(tmp_path / "config.json", "w"))
    generation = json.load(open(tmp_path / "generation_config.json"))
    json.dump(
        {**generation, "eos_token_id": [2, 5]}, open(tmp_path / "generation_config.json", "w")
    )
    tokenizer = json.load(open(tmp_path / "tokenizer.json"))
    tokenizer["added_tokens"][0]["content"] = "<PAD>"
    json.dump(tokenizer, open(tmp_path / "tokenizer.json", "w"))
    after = common.folder_identity(str(tmp_path))
    args = {"model": str(tmp_path)}
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint._same_folder("ckpt", before, after, "--model", args)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"--model {tmp_path}: not the folder")
    assert "config.json's rms_norm_eps 1e-06 -> 1e-05" in line and "rope_theta" in line
    assert "generation_config.json's eos_token_id 2 -> [2, 5]" in line and "1 more" in line
    os.unlink(tmp_path / "generation_config.json")
    removed = ("generation_config.json", before["generation"], "null", True)
    assert checkpoint._changed_settings(*removed) == ["generation_config.json removed"]
    checkpoint._same_folder("ckpt", None, after, "--model", args)  # an older checkpoint: unchecked
    # read by another transformers or tokenizers (an upgrade before the resume): a key one
    # reading has and the other lacks, and the tokenizer's serialisation, may be theirs alone
    # and are not compared; a value both readings have still is
    config = json.loads(after["config"])
    config["a_default_of_another_version"] = 1
    upgraded = {**after, "config": json.dumps(config), "versions": "transformers 9.0.0"}
    checkpoint._same_folder("ckpt", after, upgraded, "--model", args)
    with pytest.raises(checkpoint.CheckpointError, match="rms_norm_eps 1e-06 -> 1e-05") as e:
        checkpoint._same_folder("ckpt", before, upgraded, "--model", args)
    assert "a_default_of_another_version" not in str(e.value)
    assert "the tokenizer" not in str(e.value)


def test_named_chat_templates_end_a_response_as_the_default_one():
    """A folder with several named templates (chat_template.jinja beside
    additional_chat_templates/, Command-R's "default" and "tool_use") gives a dict as
    `tok.chat_template`; transformers renders the "default" one. It was an unhashable cache key
    (a TypeError in every stage)."""
    tok = gemma_style_tokenizer()
    end_of_turn = common.response_end_id(tok)
    tok.chat_template = {"default": tok.chat_template, "tool_use": "{{ raise_exception('no') }}"}
    assert common.response_end_id(tok) == end_of_turn != tok.eos_token_id
    ids, n_prompt = train_sft.encode(tok, {"prompt": "1+2=", "response": "3"}, 64, "x")
    assert tok.convert_ids_to_tokens(ids[n_prompt:]) == ["3", "<end_of_turn>"]


def test_a_chat_template_that_fails_on_one_prompt_is_one_line_naming_it():
    """`check_chat_template` tries one prompt; a template that raises on some content only was a
    jinja traceback at the first such row (SFT, RM, DPO, held-out) or, through the reward
    model's own template, at the rollout that sampled it (PPO): one line naming the row now,
    PPO's found while the prompts load."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(task.TINY_MODEL)
    tok.chat_template = (
        "{% for m in messages %}{% if m['content'] | length > 8 %}"
        "{{ raise_exception('too long for me') }}{% endif %}U:{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}A:{% endif %}"
    )
    assert (
        tok.decode(common.encode_prompt(tok, "1+2=", "x"), skip_special_tokens=True) == "U:1+2=A:"
    )
    line = "x.jsonl:4: the chat template fails on this prompt .*too long for me"
    with pytest.raises(SystemExit, match=line):
        train_sft.encode(tok, {"prompt": "11+22+33=", "response": "66"}, 64, "x.jsonl:4")
    with pytest.raises(SystemExit, match=line):
        row = {"prompt": "11+22+33=", "chosen": "66", "rejected": "65"}
        train_rm.encode_pairs(tok, [("x.jsonl:4", row)], 64)
    with pytest.raises(SystemExit, match=line):
        common.check_held_out(tok, [("x.jsonl:4", {"prompt": "11+22+33=", "response": "66"})], 64)
    plain = AutoTokenizer.from_pretrained(task.TINY_MODEL)
    rows = [("d.jsonl:1", {"prompt": "1+1="}), ("d.jsonl:2", {"prompt": "11+22+33="})]
    with pytest.raises(SystemExit, match=r"d.jsonl:2 \(--reward_model\): the chat template fails"):
        train_ppo.load_prompts(rows, plain, 8, 64, reward_tok=tok)
    assert len(train_ppo.load_prompts(rows, plain, 8, 64)) == 2


def test_an_empty_held_out_prompt_without_a_bos_is_refused():
    """A held-out row with an empty prompt and a tokenizer that adds no BOS (GPT-2's): greedy
    decoding had nothing to start from (a reshape error at the first evaluation, hours in, or a
    row of padding scored silently beside others)."""
    tok = bpe_merging_tokenizer()
    examples = [("e.jsonl:1", {"prompt": "1+1=", "response": "2"})]
    common.check_held_out(tok, examples, 64)
    examples.append(("e.jsonl:2", {"prompt": "", "response": "82"}))
    with pytest.raises(SystemExit, match="e.jsonl:2: the prompt has no tokens"):
        common.check_held_out(tok, examples, 64)


def test_a_reward_models_own_head_is_kept_whatever_its_architectures_say(tmp_path):
    """train_rm.py starts a fresh head (seeded, the same on every rank) exactly when the folder
    has none, found from what loaded: a trained reward model's head was overwritten when its
    config.json's "architectures" was a string or missing, and a causal LM whose config claimed
    a classifier kept the head transformers drew from each rank's own RNG."""

    from transformers import AutoConfig
    from transformers import AutoModelForSequenceClassification
    from transformers import AutoTokenizer

    task.ensure_tiny_model()
    args = types.SimpleNamespace(model=str(tmp_path), attn_implementation="auto", seed=42)
    torch.manual_seed(1)
    cfg = AutoConfig.from_pretrained(task.TINY_MODEL, num_labels=1)
    trained = AutoModelForSequenceClassification.from_config(cfg)
    trained.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(task.TINY_MODEL).save_pretrained(tmp_path)
    config = json.load(open(tmp_path / "config.json"))
    for architectures in (["LlamaForSequenceClassification"], "LlamaForSequenceClassification"):
        json.dump({**config, "architectures": architectures}, open(tmp_path / "config.json", "w"))
        model, _ = train_rm.build_reward_model(args)
        assert torch.equal(model.score.weight, trained.score.weight)
    # a causal LM's folder, its config claiming a classifier: the head is new, and seeded
    shutil.rmtree(tmp_path)
    shutil.copytree(task.TINY_MODEL, tmp_path)
    config = json.load(open(tmp_path / "config.json"))
    json.dump(
        {**config, "architectures": ["LlamaForSequenceClassification"], "num_labels": 1},
        open(tmp_path / "config.json", "w"),
    )
    heads = []
    for seed in (1, 2):
        torch.manual_seed(seed)  # another rank's RNG
        heads.append(train_rm.build_reward_model(args)[0].score.weight)
    assert torch.equal(heads[0], heads[1])


def test_the_plan_line_and_the_warmup_note(capsys):
    """`common.print_plan`: the data's size, epochs and held-out set in one line; a note only when
    --warmup_steps reaches --max_steps, with the share of --lr the last step trains at
    (transformers' warmup: step k from 0 at k / warmup_steps)."""
    args = types.SimpleNamespace(data="d.jsonl", max_steps=10, warmup_steps=40)
    common.print_plan(args, "pairs", 200, 0, 32)
    lines = capsys.readouterr().out.splitlines()
    plan = "data: 200 pairs from d.jsonl (10 steps of 32: 1.6 epochs); no held-out evaluation"
    note = "note: --warmup_steps 40 >= --max_steps 10: the learning rate rises for the whole run"
    assert lines == [plan, note + " and ends at 22% of its peak"]
    args = types.SimpleNamespace(data="", max_steps=150, warmup_steps=149)
    common.print_plan(args, "prompts", 9000, 256, 64, "iterations")
    lines = capsys.readouterr().out.splitlines()
    plan = "data: 9,000 prompts from the embedded task (150 iterations of 64: 1.07 epochs)"
    assert lines == [plan + "; 256 held out for evaluation"]
    args = types.SimpleNamespace(data="", max_steps=1, warmup_steps=0)
    common.print_plan(args, "prompts", 9000, 0, 8, "iterations")
    plan = "data: 9,000 prompts from the embedded task (1 iteration of 8: 0.000889 epochs)"
    assert capsys.readouterr().out.splitlines() == [plan + "; no held-out evaluation"]


def test_a_failed_start_removes_only_the_empty_folders_it_made(tmp_path):
    """`common.make_local_dir` then `common.remove_empty_folders`, as a run that fails before
    writing anything: the folders it made go, deepest first; a folder that was there before, or
    one with a file in it, stays (and so do the folders above it)."""
    (tmp_path / "there").mkdir()
    out = tmp_path / "there" / "a" / "b" / "run"
    common.make_local_dir(types.SimpleNamespace(out_dir=str(out)))
    assert out.is_dir()
    common.remove_empty_folders()
    assert sorted(os.listdir(tmp_path)) == ["there"]
    assert os.listdir(tmp_path / "there") == []
    common.make_local_dir(types.SimpleNamespace(out_dir=str(out)))
    (out.parent / "file").write_text("kept")
    common.remove_empty_folders()
    assert not out.exists()
    assert (out.parent / "file").read_text() == "kept"
    # a folder that existed before the run is not the run's to remove, empty or not
    common.make_local_dir(types.SimpleNamespace(out_dir=str(out.parent)))
    common.remove_empty_folders()
    assert out.parent.is_dir()


def test_a_dropped_lock_file_is_never_a_lock_two_runs_hold(tmp_path, monkeypatch):
    """`checkpoint.drop_lock_file` unlinks a lock file still held: a run that opened it just
    before takes, once its flock is granted, the file now at the path (`checkpoint._same_file`),
    so a third run is refused, not let in beside it. A folder removed under the failed run is no
    traceback in its error path (`common.remove_empty_folders`)."""
    out = tmp_path / "run"
    out.mkdir()
    monkeypatch.setattr(checkpoint, "_run", {})
    checkpoint._lock(str(out))
    failed = checkpoint._run.pop("lock")
    real_open = checkpoint.open_regular

    def open_then_drop(path, mode="r"):  # the failed start drops its file after this open
        f = real_open(path, mode)
        if not failed[1].closed:
            checkpoint._run["lock"] = failed
            checkpoint.drop_lock_file()
        return f

    monkeypatch.setattr(checkpoint, "open_regular", open_then_drop)
    checkpoint._lock(str(out))
    monkeypatch.setattr(checkpoint, "open_regular", real_open)
    held = checkpoint._run.pop("lock")  # the second run's: kept open, so its flock stays
    assert os.fstat(held[1].fileno()).st_nlink == 1  # on the file at the path, not the orphan
    with pytest.raises(checkpoint.CheckpointError, match="another run is using"):
        checkpoint._lock(str(out))
    os.unlink(out / ".lock")
    os.rmdir(out)
    checkpoint._run["lock"] = (str(out / ".lock"), open(os.devnull))
    common.remove_empty_folders()  # the folder gone: nothing to drop, no FileNotFoundError


def test_the_template_variables_travel_with_the_tokenizer(tmp_path, monkeypatch, capsys):
    """A stage's --chat_template_kwargs become its template's defaults
    (`common.record_template_kwargs`): the tokenizer it saves renders as the run did without
    being told (the next stage, vLLM, plain transformers), a variable given explicitly wins, a
    later stage keeps them (with a note) and adds its own over them, once."""
    from transformers import AutoTokenizer

    task.ensure_tiny_model()
    tok = AutoTokenizer.from_pretrained(task.TINY_MODEL)
    tok.chat_template = THINKING_TEMPLATE
    user = [{"role": "user", "content": "1+1="}]

    def render(tok, **variables):
        return tok.apply_chat_template(
            user, add_generation_prompt=True, tokenize=False, **variables
        )

    awkward = "a'b\"#}\u00e9\n{{ x }}"  # quotes, a comment's end, non-ASCII, a line, Jinja
    flag = {"enable_thinking": False, "note": awkward, "n": [1, None, {"k": True}]}
    monkeypatch.setattr(common, "RECORDED_TEMPLATE_KWARGS", {})  # (this process's other tests)
    monkeypatch.setattr(common, "CHAT_TEMPLATE_KWARGS", dict(flag))
    common.record_template_kwargs(tok, "sft")
    assert render(tok) == "user: 1+1= assistant: <think></think>"
    assert render(tok, enable_thinking=True) == "user: 1+1= assistant: "
    tok.save_pretrained(tmp_path / "export")
    export = AutoTokenizer.from_pretrained(tmp_path / "export")  # plain transformers
    assert render(export) == "user: 1+1= assistant: <think></think>"
    assert common.template_defaults(export.chat_template) == (flag, THINKING_TEMPLATE)
    # the next stage, without the flag: the template as it was, and a note saying why
    monkeypatch.setattr(common, "CHAT_TEMPLATE_KWARGS", {})
    saved = export.chat_template
    common.record_template_kwargs(export, "sft/hf")
    assert export.chat_template == saved
    assert capsys.readouterr().out.startswith("note: sft/hf's chat template renders with {")
    # a data row carrying the recorded variables agrees with how its prompt renders
    common.check_row_template_kwargs("d.jsonl:1", {"chat_template_kwargs": flag})
    # the flag overriding a recorded value changes what renders: no note says otherwise
    monkeypatch.setattr(common, "CHAT_TEMPLATE_KWARGS", {"enable_thinking": True})
    common.check_chat_template(export, "sft/hf", "--model")
    assert capsys.readouterr().out == ""
    # with the flag repeated no note says it changes nothing; a new variable joins the old ones
    monkeypatch.setattr(common, "CHAT_TEMPLATE_KWARGS", {"enable_thinking": False, "extra": 2})
    common.check_chat_template(export, "sft/hf", "--model")
    common.record_template_kwargs(export, "sft/hf")
    assert capsys.readouterr().out == ""
    assert export.chat_template.count(common.DEFAULTS_OPEN) == 1
    assert common.template_defaults(export.chat_template)[0] == {**flag, "extra": 2}
    # named templates each (one that fails on a bare user turn, unchecked); a template that
    # starts with a line break and indentation renders as it did; a name Jinja cannot set is
    # refused in one line
    tools = "{%- if not tools %}{{ raise_exception('tools needed') }}{% endif %}"
    indented = "\n  " + THINKING_TEMPLATE.replace("{%- for", "{% for", 1)
    tok.chat_template = {"default": indented, "tool_use": tools}
    common.record_template_kwargs(tok, "m")
    assert render(tok) == "\nuser: 1+1= assistant: <think></think>"
    recorded = common.template_defaults(tok.chat_template["tool_use"])[0]
    assert recorded == {"enable_thinking": False, "extra": 2}
    monkeypatch.setattr(common, "CHAT_TEMPLATE_KWARGS", {"none": 1})
    with pytest.raises(
        SystemExit, match=r'^error: --chat_template_kwargs \{"none": 1\}: cannot be'
    ):
        common.record_template_kwargs(AutoTokenizer.from_pretrained(tmp_path / "export"), "m")


def test_chat_template_kwargs_reach_every_rendering(monkeypatch, capsys):
    """--chat_template_kwargs (`common.CHAT_TEMPLATE_KWARGS`): Qwen3's switch, a template variable,
    reaches the prompt's text and ids, and so what SFT trains on; a template that needs the
    variable passes the load's check only with it; a data row's own kwargs must agree with the
    flag's (TRL reads them per row)."""
    from transformers import AutoTokenizer

    task.ensure_tiny_model()
    tok = AutoTokenizer.from_pretrained(task.TINY_MODEL)
    tok.chat_template = THINKING_TEMPLATE
    assert common.prompt_text(tok, "1+1=") == "user: 1+1= assistant: "
    row = {"prompt": "1+1=", "chat_template_kwargs": {"enable_thinking": False}}
    with pytest.raises(SystemExit, match=r"d.jsonl:1: 'chat_template_kwargs' \{\"enable_thinking"):
        common.check_row_template_kwargs("d.jsonl:1", row)
    monkeypatch.setitem(common.CHAT_TEMPLATE_KWARGS, "enable_thinking", False)
    common.check_row_template_kwargs("d.jsonl:1", row)  # the same as the flag's: fine
    thinking = "user: 1+1= assistant: <think></think>"
    assert common.prompt_text(tok, "1+1=") == thinking
    ids = common.encode_prompt(tok, "1+1=", "d.jsonl:1")
    assert tok.decode(ids) == thinking
    example = train_sft.encode(tok, {"prompt": "1+1=", "response": "2"}, 128, "d.jsonl:1")
    assert example[0][: len(ids)] == ids and example[1] == len(ids)
    # a template that needs the variable: refused at load without it, fine with it
    tok.chat_template = (
        "{%- if enable_thinking is not defined %}{{ raise_exception('no switch') }}{%- endif %}"
        + THINKING_TEMPLATE
    )
    common.check_chat_template(tok, "m", "--model")
    monkeypatch.delitem(common.CHAT_TEMPLATE_KWARGS, "enable_thinking")
    with pytest.raises(SystemExit, match="--model m: its chat template fails on a user turn"):
        common.check_chat_template(tok, "m", "--model")
    # a variable the template does not read (misspelt) changes nothing: said once, at load
    tok.chat_template = THINKING_TEMPLATE
    monkeypatch.setitem(common.CHAT_TEMPLATE_KWARGS, "enable_thinkin", False)
    common.check_chat_template(tok, "m", "--model")
    note = 'note: --chat_template_kwargs {"enable_thinkin": false} change nothing in how m\'s'
    assert capsys.readouterr().out.startswith(note)


def test_renders_are_remembered_by_all_that_changes_them(monkeypatch):
    """common.render_chat remembers the latest renders (encoding one row asks for the same three
    conversations nine times) by the tokenizer, its template and special tokens,
    --chat_template_kwargs, the messages and the generation prompt: a change of any renders anew,
    as the template renders it then; a render that fails is not remembered; at most
    RENDERED_KEPT are kept."""
    tok = templated_tokenizer(QWEN3_LIKE)
    renders = []
    render = tok.apply_chat_template

    def counted(*args, **kwargs):
        renders.append(args)
        return render(*args, **kwargs)

    monkeypatch.setattr(tok, "apply_chat_template", counted)
    monkeypatch.setattr(common, "RENDERED", {})
    turn = [user("1+1=")]
    asked = common.render_chat(tok, turn, True, "r:1")
    assert asked == render(turn, add_generation_prompt=True, tokenize=False)
    assert common.render_chat(tok, [user("1+1=")], True, "r:1") == asked  # equal messages
    assert len(renders) == 1
    assert common.render_chat(tok, turn, False, "r:1") == render(turn, tokenize=False)
    assert common.render_chat(tok, [user("1+2=")], True, "r:1") == asked.replace("1=", "2=")
    assert len(renders) == 3
    monkeypatch.setitem(common.CHAT_TEMPLATE_KWARGS, "enable_thinking", False)
    assert common.render_chat(tok, turn, True, "r:1") == asked + "<think>\n\n</think>\n\n"
    monkeypatch.setattr(tok, "chat_template", MISTRAL_LIKE)
    assert common.render_chat(tok, turn, True, "r:1") == "<bos>[INST] 1+1= [/INST]"
    monkeypatch.setattr(tok, "bos_token", "<pad>")  # a special token the template prints
    assert common.render_chat(tok, turn, True, "r:1") == "<pad>[INST] 1+1= [/INST]"
    other = templated_tokenizer(QWEN3_LIKE)
    other.bos_token = "<pad>"  # the same template, another tokenizer
    monkeypatch.setattr(other, "chat_template", MISTRAL_LIKE)
    assert common.render_chat(other, turn, True, "r:1") == "<pad>[INST] 1+1= [/INST]"
    monkeypatch.setattr(tok, "chat_template", "{{ raise_exception('no') }}")
    for _ in range(2):
        with pytest.raises(Exception, match="no"):
            common.render_chat(tok, turn, True, "r:1")
    assert len(renders) == 8  # the failure rendered each time
    for n in range(2 * common.RENDERED_KEPT):
        common.render_chat(other, [user(f"{n}+1=")], True, "r:1")
    assert len(common.RENDERED) == common.RENDERED_KEPT


def test_dpo_says_it_leaves_a_pairs_margin_unread(capsys):
    """train_rm.py reads a pair's "margin" (TRL's reward data may carry one); DPO's loss has no
    margin of a pair's own, and took such a file without a word."""
    rows = [("p.jsonl:1", {"margin": 1.5}), ("p.jsonl:2", {}), ("p.jsonl:3", {"margin": 0})]
    train_dpo.note_margins("p.jsonl", rows)
    note = "note: p.jsonl: 2 of its 3 pairs have a 'margin' field, which train_rm.py reads"
    assert capsys.readouterr().out.startswith(note)
    train_dpo.note_margins("p.jsonl", rows[1:2])
    assert capsys.readouterr().out == ""


def test_a_special_tokens_text_in_data_is_refused(one_rank):
    """The chat template renders a conversation to a string that the tokenizer reads whole, so
    a special token's text in data was that token, silently: "2<end_of_turn>" trained an end of
    turn in mid-answer, "<start_of_turn>" in a prompt faked a turn (transformers and TRL read it
    so too). Refused in one line naming the row and field, in SFT, the pairs, the held-out
    examples and PPO's prompts; an added token that is not special (Qwen3's "<think>") is text
    data may hold."""
    tok = templated_tokenizer(QWEN3_LIKE)
    example = {"prompt": "1+2=", "response": "3<end_of_turn>\n<start_of_turn>user\nmore"}
    with pytest.raises(SystemExit, match=r"^error: r:1: 'response' holds '<end_of_turn>', the"):
        train_sft.encode(tok, example, 128, "r:1")
    turns = [{"role": "user", "content": "hi<start_of_turn>assistant\nok"}]
    with pytest.raises(SystemExit, match="message 0's 'content' holds '<start_of_turn>'"):
        train_sft.encode(tok, {"prompt": turns, "response": "3"}, 128, "r:1")
    row = {"prompt": "1+2=", "chosen": "3", "rejected": "4<eos>"}
    with pytest.raises(SystemExit, match="'rejected' holds '<eos>'"):
        common.encode_pair(tok, row, 128, "r:1")
    with pytest.raises(SystemExit, match="'response' holds '<pad>'"):
        common.check_held_out(tok, [("r:1", {"prompt": "1+2=", "response": "3<pad>"})], 128)
    rows = [("p:1", {"prompt": "1+2=<end_of_turn>"})]
    with pytest.raises(SystemExit, match="p:1: 'prompt' holds '<end_of_turn>'"):
        train_ppo.load_prompts(rows, tok, 8, 128)
    from transformers import AutoTokenizer

    # a string prompt for a tokenizer without a template is the user's own formatting of the
    # turns, special tokens included (a base model's "<s>[INST] ..."): not refused; a reward
    # model's tokenizer with a template reads the prompt as a turn, and is checked
    plain = AutoTokenizer.from_pretrained(task.TINY_MODEL)
    rows = [("p:1", {"prompt": "<s>1+2=</s>"})]
    assert len(train_ppo.load_prompts(rows, plain, 8, 128)) == 1
    with pytest.raises(SystemExit, match=r"p:1 \(--reward_model\): 'prompt' holds '<eos>'"):
        train_ppo.load_prompts([("p:1", {"prompt": "1+2=<eos>"})], plain, 8, 128, reward_tok=tok)
    # what is not a special token's text passes: "<think>" is added, not special; a lone "<"
    (ids, n_prompt) = train_sft.encode(tok, {"prompt": "a<b", "response": "<think>\nx"}, 128, "r")
    assert tok.convert_ids_to_tokens(ids[n_prompt:])[:1] == ["<think>"]


def test_the_reward_model_reads_a_sentencepiece_response_with_its_first_space():
    """A SentencePiece tokenizer (Llama 2, Mistral; no template) opens a response after "a:"
    with "▁8": decoded alone it is "82", and the reward model read "8" "2", not the "▁8" "2"
    its pairs trained. `written_text` keeps the text training would encode back into the
    policy's ids."""
    tok = sentencepiece_like_tokenizer()
    row = {"prompt": "a:", "chosen": " 82", "rejected": " 81"}
    (chosen, n_prompt), _ = common.encode_pair(tok, row, 128, "x")
    assert tok.convert_ids_to_tokens(chosen[n_prompt:]) == ["▁8", "2", "</s>"]
    texts = train_ppo.written_texts(tok, ["a:"], [chosen[:n_prompt]], [chosen[n_prompt:]], [True])
    assert texts == [" 82"]
    assert train_ppo.reward_model_inputs(tok, ["a:"], texts, [True]) == [chosen]
    # a template that puts a space before the answer as given (Mistral v0.1's ' ' + content):
    # there the text decoded alone is the one training encoded, "82", not " 82" (which it would
    # render with two spaces: "▁" "▁8" "2")
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
        "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
    )
    (chosen, n_prompt), _ = common.encode_pair(tok, {**row, "chosen": "82"}, 128, "x")
    assert tok.convert_ids_to_tokens(chosen[n_prompt:]) == ["▁8", "2", "</s>"]
    texts = train_ppo.written_texts(tok, ["a:"], [chosen[:n_prompt]], [chosen[n_prompt:]], [True])
    assert texts == ["82"]
    assert train_ppo.reward_model_inputs(tok, ["a:"], texts, [True]) == [chosen]


def test_empty_responses_are_noted(one_rank, tmp_path, capsys):
    """A response that renders to nothing trains the end of the turn alone: legal, but more often
    a lost answer than a lesson, and it went unsaid. A note counts them."""
    from transformers import AutoTokenizer

    rows = [{"prompt": "1+2=", "response": "3"}, {"prompt": "1+3=", "response": ""}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tok = AutoTokenizer.from_pretrained(task.TINY_MODEL)
    args = train_sft.Args(data=str(data), train_batch_size=2, eval_samples=0)
    train, _ = train_sft.load_data(args, tok, 64)
    assert [len(ids) - n_prompt for ids, n_prompt in train] == [2, 1]  # "3" and EOS; EOS alone
    assert f"note: {data}: 1 of 2 responses are empty" in capsys.readouterr().out


def test_vllms_sets_in_an_error_line_are_ordered():
    """vLLM lists a module's parameters as a Python set, ordered by each process's own string
    hashes: `rollout._sorted_sets` sorts every such set, so that every rank's line is the same
    (`common.first_to_say` prints it once), a name holding ", " whole."""
    line = "are: {'o.weight', 'qkv.bias', 'a, b'} and {'z'}; {1, 2} stays"
    assert (
        rollout._sorted_sets(line)
        == "are: {'a, b', 'o.weight', 'qkv.bias'} and {'z'}; {1, 2} stays"
    )


def test_vllms_rope_table_stops_at_the_engines_length(tmp_path):
    """vLLM computes its RoPE cos/sin table for every position config.json names: a crafted
    max_position_embeddings of 2**24 took 11 GB on the tiny model, 10**12 a failed 4 TB
    allocation. With plain RoPE the engine's table stops at its own max_model_len (the rows below
    it are the same at any length); a scaled RoPE, computed from the lengths, is left alone."""
    task.ensure_tiny_model()
    folder = tmp_path / "model"
    shutil.copytree(task.TINY_MODEL, folder)
    config = json.loads((folder / "config.json").read_text())

    def with_config(**change):
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        return str(folder)

    long = with_config(max_position_embeddings=2**24)
    want = {"hf_overrides": {"max_position_embeddings": 96}}
    assert rollout._rope_cache_settings(long, 96) == want
    assert rollout._rope_cache_settings(task.TINY_MODEL, 64) == {}  # no longer than needed
    scaled = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    assert rollout._rope_cache_settings(with_config(rope_parameters=scaled), 16) == {}
