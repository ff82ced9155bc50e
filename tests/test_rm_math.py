"""The reward model's math by hand (score position: `common.last_token_scores`; Bradley-Terry
loss, encoding), PPO's score normalisation, and the embedded preference pairs (task.make_pairs)."""

import math
import sys

import pytest
import torch

import common
import task
import train_ppo
import train_rm


def test_score_is_read_at_the_last_real_token_right_padding():
    # two sequences of different lengths (a pair whose responses differ in length), right-padded
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    per_token = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0, 9.0]])
    assert common.last_token_scores(per_token, mask).tolist() == [4.0, 7.0]


def test_score_is_read_at_the_last_real_token_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    per_token = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0, 9.0]])
    assert common.last_token_scores(per_token, mask).tolist() == [4.0, 9.0]


def test_collate_right_pads_and_the_score_follows_the_mask_not_the_ids():
    # PAD equal to EOS (2): the mask, not the ids, says where each sequence ends
    input_ids, mask = common.right_padded([[1, 5, 2], [1, 5, 6, 7, 2]], pad_id=2)
    assert input_ids.tolist() == [[1, 5, 2, 2, 2], [1, 5, 6, 7, 2]]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    per_token = input_ids.float() * 10 + torch.arange(5)  # distinct values per position
    assert common.last_token_scores(per_token, mask).tolist() == [22.0, 24.0]


def test_bradley_terry_loss_by_hand():
    r_chosen = torch.tensor([2.0, 0.0])
    r_rejected = torch.tensor([1.0, 1.0])
    # -log sigmoid(x) = log(1 + e^-x); differences 1 and -1; 4 pairs in the global batch
    want = (math.log(1 + math.exp(-1)) + math.log(1 + math.exp(1))) / 4
    got = train_rm.bradley_terry_loss(r_chosen, r_rejected, 0.0, 4)
    assert got.item() == pytest.approx(want, rel=1e-6)
    # a margin of 1 moves both differences down by 1: 0 and -2
    want = (math.log(2) + math.log(1 + math.exp(2))) / 4
    got = train_rm.bradley_terry_loss(r_chosen, r_rejected, 1.0, 4)
    assert got.item() == pytest.approx(want, rel=1e-6)


def test_a_margin_per_pair_from_the_data(monkeypatch):
    """TRL's reward data may carry a "margin" per pair (Llama 2's, by preference strength): the
    pair's margin in the loss; --margin for pairs without one; never both (--margin 0 spelt out
    too: `common.given_flags`); a number."""
    from transformers import AutoTokenizer

    # per pair: the differences 1 and -1 less margins 1 and 0: 0 and -1
    r_chosen = torch.tensor([2.0, 0.0])
    r_rejected = torch.tensor([1.0, 1.0])
    want = (math.log(2) + math.log(1 + math.exp(1))) / 4
    got = train_rm.bradley_terry_loss(r_chosen, r_rejected, torch.tensor([1.0, 0.0]), 4)
    assert got.item() == pytest.approx(want, rel=1e-6)
    tok = AutoTokenizer.from_pretrained(task.TINY_MODEL)
    row = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}
    rows = [("d:1", {**row, "margin": 2}), ("d:2", row)]
    assert [pair.margin for pair in train_rm.encode_pairs(tok, rows, 64)] == [2.0, 0.0]
    assert [pair.margin for pair in train_rm.encode_pairs(tok, rows[1:], 64, 0.5)] == [0.5]
    with pytest.raises(SystemExit, match=r"^error: d:1: a 'margin' field beside --margin 0.5"):
        train_rm.encode_pairs(tok, rows, 64, 0.5)
    for bad in (True, "1", float("nan"), None, 10**400, 1e39):  # 1e39: inf in float32
        with pytest.raises(SystemExit, match=r"^error: d:1: field 'margin': expected a number fin"):
            train_rm.encode_pairs(tok, [("d:1", {**row, "margin": bad})], 64)
    assert train_rm.encode_pairs(tok, [("d:1", {**row, "margin": -1})], 64)[0].margin == -1.0
    monkeypatch.setattr(sys, "argv", ["train_rm.py", "--margin", "0"])
    with pytest.raises(SystemExit, match=r"^error: d:1: a 'margin' field beside --margin 0.0"):
        train_rm.encode_pairs(tok, rows, 64, 0.0)


def test_pairs_per_prompt_is_the_embedded_tasks_only(monkeypatch):
    """--pairs_per_prompt makes the embedded pairs: with --data it did nothing, silently, and a
    resume without it was refused as another run's. Refused beside --data, at its default too."""
    monkeypatch.setattr(sys, "argv", ["train_rm.py"])
    train_rm.check_pairs_flag(train_rm.Args(pairs_per_prompt=2))
    train_rm.check_pairs_flag(train_rm.Args(data="d.jsonl"))
    with pytest.raises(SystemExit, match=r"^error: --pairs_per_prompt 2: makes the embedded"):
        train_rm.check_pairs_flag(train_rm.Args(data="d.jsonl", pairs_per_prompt=2))
    monkeypatch.setattr(sys, "argv", ["train_rm.py", "--pairs_per_prompt=4"])
    with pytest.raises(SystemExit, match=r"--data d.jsonl gives its own$"):
        train_rm.check_pairs_flag(train_rm.Args(data="d.jsonl"))


def test_micro_batches_add_up_to_the_global_mean():
    r_chosen = torch.tensor([0.3, -1.2, 2.0, 0.1])
    r_rejected = torch.tensor([0.0, 0.5, -1.0, 0.4])
    whole = train_rm.bradley_terry_loss(r_chosen, r_rejected, 0.0, 4)
    halves = train_rm.bradley_terry_loss(r_chosen[:2], r_rejected[:2], 0.0, 4)
    halves = halves + train_rm.bradley_terry_loss(r_chosen[2:], r_rejected[2:], 0.0, 4)
    assert halves.item() == pytest.approx(whole.item(), rel=1e-6)


def test_the_rm_is_trained_on_the_format_ppo_scores():
    """encode_pairs builds exactly what train_ppo.reward_model_inputs gives a finished response."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(task.TINY_MODEL)
    row = {"prompt": "37+45=", "chosen": "82", "rejected": "712"}
    [(chosen, rejected, margin)] = train_rm.encode_pairs(tok, [("data:1", row)], 64)
    assert margin == 0.0
    want = train_ppo.reward_model_inputs(tok, ["37+45="] * 2, ["82", "712"], [True, True])
    assert [chosen, rejected] == want
    assert chosen[-1] == tok.eos_token_id and len(rejected) == len(chosen) + 1


def test_init_reward_head_is_the_same_for_every_seed_call():
    a = torch.nn.Linear(128, 1, bias=False)
    b = torch.nn.Linear(128, 1, bias=False)
    train_rm.init_reward_head(a, 42)
    torch.manual_seed(123)  # the global RNG plays no part
    train_rm.init_reward_head(b, 42)
    assert torch.equal(a.weight, b.weight)
    assert 0.5 / math.sqrt(129) < a.weight.std().item() < 2 / math.sqrt(129)


def test_normalised_scores():
    scores = torch.tensor([1.0, 3.0, -1.0])
    got = train_ppo.normalised_scores(scores, 1.0, 2.0)
    assert got.tolist() == [0.0, 1.0, -1.0]
    train_ppo.check_finite_scores(got, "not raised")
    # a reward_std that reward_normalisation takes (positive, finite) can still overflow the
    # score: one line from `score`, not a diverged gradient norm blaming --lr two phases later
    tiny = train_ppo.normalised_scores(scores, 0.0, 1e-40)
    with pytest.raises(SystemExit, match="^error: rm/config.json: out of range$"):
        train_ppo.check_finite_scores(tiny, "rm/config.json: out of range")


def test_the_reward_statistics_count_each_chosen_response_once():
    """A prompt's pairs share its chosen response: the statistics PPO normalises with take the
    first --norm_samples distinct ones, in order."""
    pairs = [([1, 2], [1, 3]), ([1, 2], [1, 4]), ([5, 6], [5, 7]), ([1, 2], [1, 9]), ([8], [9])]
    pairs = [train_rm.Pair(chosen, rejected, 0.0) for chosen, rejected in pairs]
    assert train_rm.distinct_chosen(pairs, 2) == [[1, 2], [5, 6]]
    assert train_rm.distinct_chosen(pairs, 10) == [[1, 2], [5, 6], [8]]
    from transformers import AutoTokenizer

    task.ensure_tiny_model()
    tok = AutoTokenizer.from_pretrained(task.TINY_MODEL)
    rows = task.make_pairs("train", per_prompt=4)[:64]
    pairs = train_rm.encode_pairs(tok, common.numbered("embedded", rows), 64)
    prompts = {row["prompt"] for row in rows}
    assert len(prompts) < 20 and len(train_rm.distinct_chosen(pairs, 1024)) == len(prompts)


def test_pairs_are_deterministic_wrong_and_held_out():
    train = task.make_pairs("train")
    test = task.make_pairs("test")
    assert train == task.make_pairs("train") and test == task.make_pairs("test")
    assert len(train) == len(task.make_split("train")) and len(test) == task.N_HELD_OUT
    for row in train + test:
        a, b = row["prompt"].rstrip("=").split("+")
        assert row["chosen"] == str(int(a) + int(b))
        assert row["rejected"] != row["chosen"] and row["rejected"].isdigit()
        assert task.reward_fn(row["prompt"], row["rejected"]) == 0.0
    # held-out pairs: the held-out split's prompts, none of the training prompts
    assert [r["prompt"] for r in test] == [e["prompt"] for e in task.make_split("test")]
    assert not {r["prompt"] for r in test} & {r["prompt"] for r in train}
    # mostly near misses: the rejected answer is within one digit of the right one's length
    near = [r for r in train if abs(len(r["rejected"]) - len(r["chosen"])) <= 1]
    assert len(near) > 0.9 * len(train)


def test_several_near_misses_per_prompt():
    one = task.make_pairs("train")
    four = task.make_pairs("train", per_prompt=4)
    by_prompt = {}
    for row in four:
        assert row["rejected"] != row["chosen"] and row["rejected"].isdigit()
        by_prompt.setdefault(row["prompt"], []).append(row["rejected"])
    assert list(by_prompt) == [r["prompt"] for r in one]  # every prompt, in order
    assert all(len(set(wrong)) == len(wrong) <= 4 for wrong in by_prompt.values())
    assert len(four) > 3.9 * len(one)  # only a few small sums have fewer than four
    # one per prompt is what it always was: the held-out pairs do not move with the option
    assert task.make_pairs("test", per_prompt=1) == task.make_pairs("test")
    # pinned: the pairs every measured number in the README was taken on
    assert task.make_pairs("test")[:3] == [
        {"prompt": "13+54=", "chosen": "67", "rejected": "68"},
        {"prompt": "26+16=", "chosen": "42", "rejected": "4"},
        {"prompt": "86+57=", "chosen": "143", "rejected": "1433"},
    ]


def test_carry_forgotten():
    assert task.carry_forgotten(37, 45) == 72
    assert task.carry_forgotten(99, 1) == 90
    assert task.carry_forgotten(12, 34) == 46  # no carry: the right sum


def test_reward_normalisation_is_read_checked_from_the_config(capsys):
    from types import SimpleNamespace

    def norm(**fields):
        return train_ppo.reward_normalisation(SimpleNamespace(**fields), "rm")

    assert norm(reward_mean=0.5, reward_std=2) == (0.5, 2.0)
    # none recorded (a reward model from elsewhere): the raw score, and a line saying so
    assert norm() is None
    assert "no reward_mean/reward_std; using the raw score" in capsys.readouterr().out
    # std 0: every reference response scored alike, nothing to divide by: raw, said
    assert norm(reward_mean=1.0, reward_std=0.0) is None
    assert "reward_std 0; using the raw score" in capsys.readouterr().out
    bad = [
        ({"reward_mean": 1.0}, "reward_std must be a number finite in float32, got None"),
        ({"reward_mean": "1", "reward_std": 1.0}, "reward_mean must be a number .*, got '1'"),
        ({"reward_mean": 0.0, "reward_std": True}, "reward_std must be a number .*, got True"),
        ({"reward_mean": math.nan, "reward_std": 1.0}, "reward_mean must be a number .*, got nan"),
        ({"reward_mean": 0.0, "reward_std": math.inf}, "reward_std must be a number .*, got inf"),
        ({"reward_mean": 10**400, "reward_std": 1.0}, "reward_mean must be a number .*, got 1000"),
        (
            {"reward_mean": 1e300, "reward_std": 1.0},
            "reward_mean must be a number .*, got 1e\\+300",
        ),
        ({"reward_mean": 0.0, "reward_std": -1.0}, "reward_std must be >= 0, got -1.0"),
    ]
    for fields, message in bad:
        with pytest.raises(SystemExit, match=f"^error: --reward_model rm: config.json: {message}"):
            norm(**fields)


def test_the_saved_config_has_no_pad_id_where_pad_ends_every_sequence(tmp_path):
    """Plain transformers scores a sequence at its last token that is not PAD. Where PAD is the
    EOS every scored sequence ends with (a base without a PAD gets EOS as one), the export's
    pad id made transformers score the token before it, even one sequence at a time: the
    export saves none there (`train_rm.SavedConfig`), and then transformers scores a sequence
    at its last token, where plainrlhf does."""
    import json

    from transformers import AutoConfig
    from transformers import AutoModelForSequenceClassification
    from transformers import AutoTokenizer

    task.ensure_tiny_model()
    tok = AutoTokenizer.from_pretrained(task.TINY_MODEL)
    config = AutoConfig.from_pretrained(task.TINY_MODEL, num_labels=1)
    config.pad_token_id = tok.pad_token_id  # <pad>, not EOS: kept
    train_rm.SavedConfig(config, tok).save_pretrained(tmp_path / "kept")
    assert json.load(open(tmp_path / "kept" / "config.json"))["pad_token_id"] == tok.pad_token_id
    tok.pad_token = tok.eos_token  # as common.load_model_and_tokenizer sets it without a PAD
    config.pad_token_id = tok.pad_token_id
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    train_rm.SavedConfig(model.config, tok).save_pretrained(tmp_path / "rm")
    assert model.config.pad_token_id == tok.eos_token_id  # training keeps it
    saved = AutoConfig.from_pretrained(tmp_path / "rm")
    assert saved.pad_token_id is None
    ids = torch.tensor([tok("37+45=").input_ids + tok("82", add_special_tokens=False).input_ids])
    ids = torch.cat([ids, torch.tensor([[tok.eos_token_id]])], dim=1)  # ends as PPO scores it
    with torch.no_grad():
        at_end = model.score(model.model(ids).last_hidden_state[:, -1])  # [1, 1]
        model.config.pad_token_id = saved.pad_token_id
        theirs = model(ids).logits
        model.config.pad_token_id = tok.eos_token_id
        before = model(ids).logits  # the old export's: the token before the EOS
    assert torch.allclose(theirs, at_end, rtol=0, atol=1e-6)
    assert not torch.allclose(before, at_end, rtol=0, atol=1e-3)
