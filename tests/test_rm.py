"""train_rm.py under torchrun with 2 ranks: it resumes exactly, its export loads in plain
transformers with the normalisation statistics, and train_ppo.py scores with it (the gold rule
logged beside)."""

import json
import os

import pytest
import torch

import task
from conftest import assert_same_export
from conftest import assert_same_tensors
from conftest import assert_steps_match
from conftest import kill_twice_then_resume
from conftest import latest
from conftest import metrics
from conftest import plain_steps
from conftest import right_padded
from conftest import run
from conftest import stage_args
from conftest import write_dead_rows

pytestmark = pytest.mark.slow

N = 6  # steps of 16 pairs


def rm(out, *extra):
    args = ("--model", task.TINY_MODEL, "--out_dir", out, "--max_steps", N)
    args += ("--train_batch_size", 16, "--micro_batch_size", 4, "--warmup_steps", 2)
    args += ("--eval_every", 3, "--eval_samples", 16, "--norm_samples", 32, "--save_every", 100)
    args += ("--pairs_per_prompt", 1)  # a quarter of the pairs to encode at start-up
    return args + extra


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("rm-straight"))
    run("train_rm.py", *rm(out))
    return out


def test_the_steps_are_the_papers_loss_over_the_whole_batch(straight, one_rank):
    """Two ranks, two micro-batches each, FSDP2 and fused AdamW log, step by step, what one process
    computes from the whole global batch at once (`conftest.plain_steps`): the Bradley-Terry loss
    (Stiennon et al. 2020, eq. 1) averaged over the batch's pairs, each score as plain
    transformers' sequence classifier reads it (at the last token of the unpadded sequence), the
    share of pairs ranked right, the gradient's norm before clipping, the rate."""
    import torch.nn.functional as F

    import common
    import train_rm

    args = stage_args(train_rm, *rm(straight))
    model, tok = train_rm.build_reward_model(args)  # the run's fresh head, drawn from --seed
    train, _ = train_rm.load_data(args, tok, common.context_length(args.model, model.config))

    def loss_fn(model, batch):
        losses = []
        right = 0
        for pair in batch:  # one unpadded sequence at a time
            r_chosen = model(input_ids=torch.tensor([pair.chosen])).logits[0, 0]
            r_rejected = model(input_ids=torch.tensor([pair.rejected])).logits[0, 0]
            losses.append(-F.logsigmoid(r_chosen - r_rejected - pair.margin))
            right += int(r_chosen > r_rejected)
        return torch.stack(losses).mean(), {"train/accuracy": right / len(batch)}

    assert_steps_match(straight, plain_steps(args, model, train, loss_fn, args.weight_decay))


def test_rm_resume_is_bitwise_exact(tmp_path, straight):
    out = str(tmp_path)
    write_dead_rows(out, (1, 2))  # the fresh start below drops them (it kept them, and appended)
    run("train_rm.py", *rm(out, "--stop_at_step", 4, "--resume", "latest"))
    assert latest(out).endswith("step-00000004") and not os.path.exists(os.path.join(out, "hf"))
    # --pairs_per_prompt makes the embedded training set, hence the batches: it must match
    p = run("train_rm.py", *rm(out, "--resume", "latest", "--pairs_per_prompt", 2), check=False)
    assert p.returncode != 0 and "--pairs_per_prompt 1 -> 2" in p.stderr
    p = run("train_rm.py", *rm(out, "--resume", "latest"))
    assert "at step 4" in p.stdout + p.stderr
    assert_same_tensors(latest(straight), latest(out))  # weights and optimizer state
    assert metrics(straight) == metrics(out)  # every step's loss, accuracy, eval, statistics
    assert_same_export(straight, out)


def test_rm_sigkills_then_resume_is_exact(tmp_path, straight):
    """The issue's "kill, --resume latest, every tensor equal": SIGKILL the whole tree at a random
    moment of a step and while an asynchronous save is written; the resumed run ends in the
    straight run's weights, optimizer state, metrics (the normalisation statistics of each save
    among them) and export."""
    out = str(tmp_path)
    args = rm(out, "--async_save", "true", "--save_every", 1, "--resume", "latest")
    kill_twice_then_resume("train_rm.py", args, out, straight, latest_sleep=0.3, seed=4)
    assert_same_export(straight, out)
    config = json.load(open(os.path.join(out, "hf", "config.json")))
    straight_config = json.load(open(os.path.join(straight, "hf", "config.json")))
    assert config["reward_mean"] == straight_config["reward_mean"]
    assert config["reward_std"] == straight_config["reward_std"]


def test_rm_logs_its_metrics(straight):
    rows = metrics(straight)
    assert [r["step"] for r in rows] == list(range(1, N + 1))
    for key in ("train/loss", "train/accuracy", "train/lr", "train/grad_norm"):
        assert all(key in r for r in rows)
    for key in ("eval/accuracy", "eval/margin", "eval/reward_chosen", "eval/reward_rejected"):
        assert key in rows[2] and key in rows[-1]
    last = rows[-1]
    assert last["eval/margin"] == pytest.approx(
        last["eval/reward_chosen"] - last["eval/reward_rejected"], abs=1e-5
    )
    assert last["train/reward_std"] > 0


def test_rm_trains_without_dropout(tmp_path, dropout_model):
    """A model with attention dropout in its config (GPT-2 ships 0.1) trains with it off, as TRL's
    RewardTrainer: one pair, `--lr 0` (the weights never move), so the loss of step 1 must be
    -log σ of the margin the evaluation after it reads in eval mode."""
    data = tmp_path / "pair.jsonl"
    data.write_text(json.dumps({"prompt": "37+45=", "chosen": "82", "rejected": "83"}) + "\n")
    args = ("--model", dropout_model, "--data", data, "--eval_data", data, "--lr", 0)
    args += ("--out_dir", tmp_path / "rm", "--max_steps", 1, "--train_batch_size", 1)
    args += ("--micro_batch_size", 1, "--warmup_steps", 0, "--save_every", 0)
    run("train_rm.py", *args, nproc=1)
    (row,) = metrics(str(tmp_path / "rm"))
    expected = -torch.nn.functional.logsigmoid(
        torch.tensor(row["eval/margin"], dtype=torch.float64)
    )
    assert row["train/loss"] == pytest.approx(expected.item(), rel=1e-5)


def test_rm_export_loads_in_plain_transformers(straight):
    from transformers import AutoModelForSequenceClassification
    from transformers import AutoTokenizer

    import train_ppo

    hf = os.path.join(straight, "hf")
    model = AutoModelForSequenceClassification.from_pretrained(hf)
    tok = AutoTokenizer.from_pretrained(hf)
    assert model.config.num_labels == 1 and model.config.pad_token_id == tok.pad_token_id
    # the normalisation statistics are in the export's config, as logged
    config = json.load(open(os.path.join(hf, "config.json")))
    last = metrics(straight)[-1]
    assert config["reward_mean"] == last["train/reward_mean"]
    assert config["reward_std"] == last["train/reward_std"]
    # transformers' own pooling (PAD != EOS here) and PPO's last-token read agree
    seqs = train_ppo.reward_model_inputs(tok, ["37+45=", "1+1="], ["82", "3"], [True, True])
    input_ids, attention_mask = right_padded(seqs, tok.pad_token_id)
    with torch.no_grad():
        theirs = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0]
    import torch.distributed as dist

    # A 1-rank group for the collective scoring; an earlier test module may have left one
    # (tests/test_ppo_math.py's fixture does), then it is reused and left in place.
    ours_group = not dist.is_initialized()
    if ours_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ours = train_ppo.reward_model_scores(model, seqs, tok.pad_token_id, 8, "cpu")
    finally:
        if ours_group:
            dist.destroy_process_group()
    assert torch.allclose(theirs, ours, atol=1e-5)


def test_ppo_optimises_the_rm_and_logs_the_gold_rule(tmp_path, straight):
    out = str(tmp_path)
    args = ("--model", task.TINY_MODEL, "--reward_model", os.path.join(straight, "hf"))
    args += ("--gold_reward_fn", "task:reward_fn", "--rollout_engine", "hf", "--out_dir", out)
    args += ("--max_steps", 1, "--rollout_batch_size", 8, "--n_samples_per_prompt", 2)
    args += ("--train_batch_size", 16, "--micro_batch_size", 8, "--max_new_tokens", 4)
    args += ("--eval_samples", 8, "--save_every", 100)
    run("train_ppo.py", *args)
    rows = metrics(out)
    assert "eval/gold_accuracy" in rows[0] and "eval/gold_accuracy" in rows[-1]
    assert 0 <= rows[1]["objective/gold_score"] <= 1
    # the score is the RM's, normalised: not the 0/1 rule's
    assert rows[1]["objective/score"] not in (0.0, 1.0)


def test_every_checkpoint_carries_its_own_weights_statistics(tmp_path, straight):
    """Started from a reward model's export (its config has reward_mean and reward_std): an
    export (by hand) of a checkpoint before the last step kept the old model's, and PPO
    normalised the new scores with them; later such checkpoints carried none, and a resume that
    ended at one (--max_steps lowered to its step) exported a reward model without them. Every
    checkpoint's config now holds its own weights' (`train_rm.py: main`)."""
    out = str(tmp_path)
    args = ("--model", os.path.join(straight, "hf"), "--out_dir", out, "--max_steps", 2)
    args += ("--train_batch_size", 4, "--micro_batch_size", 4, "--save_every", 1)
    args += ("--eval_every", 0, "--pairs_per_prompt", 1)
    run("train_rm.py", *args, "--stop_at_step", 1, nproc=1)
    config = json.load(open(os.path.join(latest(out), "hf", "config.json")))
    old = json.load(open(os.path.join(straight, "hf", "config.json")))
    assert config["reward_std"] > 0 and config["reward_mean"] != old["reward_mean"]
    run("train_rm.py", *args, "--max_steps", 1, "--resume", "latest", nproc=1)
    exported = json.load(open(os.path.join(out, "hf", "config.json")))
    assert exported["reward_mean"] == config["reward_mean"]
    assert exported["reward_std"] == config["reward_std"]
