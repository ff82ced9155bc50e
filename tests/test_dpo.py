"""train_dpo.py under torchrun with 2 ranks, from an SFT start that answers 16 sums right and on
those sums' pairs: the first loss is log 2, it resumes exactly, its greedy accuracy does not fall,
and its export loads in plain transformers and vLLM."""

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from safetensors.torch import save_file
from test_bad_input import assert_one_line_error

from conftest import assert_same_export
from conftest import assert_same_tensors
from conftest import assert_steps_match
from conftest import kill_twice_then_resume
from conftest import latest
from conftest import metrics
from conftest import plain_steps
from conftest import run
from conftest import run_py
from conftest import stage_args
from conftest import write_dead_rows

pytestmark = pytest.mark.slow

N = 6  # steps of 16 pairs


def dpo(out, start, *extra):
    model, eval_data, pairs = start
    args = ("--model", model, "--data", pairs, "--eval_data", eval_data)
    # the default --lr (1e-4): at 1e-3 the first update takes the chosen answers' logprob from
    # -0.02 to -1.9 nats and half of the 16 sums are lost (measured; so not the default)
    args += ("--out_dir", out, "--max_steps", N)
    args += ("--train_batch_size", 16, "--micro_batch_size", 4, "--warmup_steps", 1)
    args += ("--eval_every", 3, "--eval_samples", 16, "--save_every", 100)
    return args + extra


@pytest.fixture(scope="module")
def dropout_start(tmp_path_factory, memorised_sft):
    """memorised_sft's export with attention dropout 0.1 in its config (GPT-2 ships 0.1): DPO
    must switch it off in the policy too, or step 1's loss is not log 2."""
    model, eval_data, pairs = memorised_sft
    folder = tmp_path_factory.mktemp("dpo-start-with-dropout")
    for name in os.listdir(model):
        shutil.copy(os.path.join(model, name), folder)
    config = json.load(open(folder / "config.json"))
    config["attention_dropout"] = 0.1
    json.dump(config, open(folder / "config.json", "w"))
    return str(folder), eval_data, pairs


@pytest.fixture(scope="module")
def straight(tmp_path_factory, dropout_start):
    out = str(tmp_path_factory.mktemp("dpo-straight"))
    run("train_dpo.py", *dpo(out, dropout_start))
    return out


def test_the_steps_are_the_papers_loss_over_the_whole_batch(straight, dropout_start, one_rank):
    """Two ranks, two micro-batches each, FSDP2 and fused AdamW log, step by step, what one process
    computes from the whole global batch at once (`conftest.plain_steps`): the DPO loss (Rafailov
    et al. 2023, eq. 7) averaged over the batch's pairs, the implicit rewards β·log(π/π_ref) of
    eq. 5 and the responses' summed logprobs averaged as TRL logs them, the gradient's norm
    before clipping, the rate. Policy and reference both without dropout, as in the paper's code."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    import common
    import train_dpo

    args = stage_args(train_dpo, *dpo(straight, dropout_start))
    assert (args.loss_type, args.label_smoothing) == ("sigmoid", 0)  # eq. 7 as the paper writes it
    model, tok = common.load_model_and_tokenizer(
        args.model, AutoModelForCausalLM, args.attn_implementation
    )
    reference, _ = common.load_model_and_tokenizer(
        args.model, AutoModelForCausalLM, args.attn_implementation
    )
    reference.requires_grad_(False)
    train, _ = train_dpo.load_data(args, tok, common.context_length(args.model, model.config))

    def logprob(model, ids, n_prompt):
        """log pi(response | prompt): the response tokens' logprobs, summed."""
        x = torch.tensor([ids])
        logprobs = model(input_ids=x).logits[0].float().log_softmax(-1)  # [T, V]
        return logprobs[n_prompt - 1 : -1].gather(1, x[0, n_prompt:, None]).sum()

    def loss_fn(model, batch):
        logps = {"chosen": [], "rejected": []}
        rewards = {"chosen": [], "rejected": []}
        for pair in batch:  # one unpadded sequence at a time
            for name, (ids, n_prompt) in zip(("chosen", "rejected"), pair):
                logp = logprob(model, ids, n_prompt)
                logps[name].append(logp)
                rewards[name].append(args.beta * (logp - logprob(reference, ids, n_prompt)))
        chosen = torch.stack(rewards["chosen"])  # [B]
        rejected = torch.stack(rewards["rejected"])  # [B]
        row = {f"rewards/{name}": torch.stack(r).mean().item() for name, r in rewards.items()}
        row.update({f"logps/{name}": torch.stack(p).mean().item() for name, p in logps.items()})
        return -F.logsigmoid(chosen - rejected).mean(), row

    assert_steps_match(straight, plain_steps(args, model, train, loss_fn, weight_decay=0.0))


def test_dpo_first_loss_is_log_2(straight):
    # step 1 is computed before any update: the policy is the reference, so h = 0 for every pair
    # (a start with dropout in its config: the policy has none either, as the reference has none)
    first = metrics(straight)[1]
    assert first["step"] == 1
    assert first["train/loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margins"] == 0


def test_dpo_logs_its_metrics_and_learns(straight):
    rows = metrics(straight)
    assert [r["step"] for r in rows] == list(range(0, N + 1))
    keys = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
    keys += ("logps/chosen", "logps/rejected", "train/loss", "train/lr", "train/grad_norm")
    training = rows[1:]  # step 0 is the starting evaluation only
    for key in keys:
        assert all(key in r for r in training)
    # the rate each step trained at: 0 in the one warmup step, then the peak (--lr 1e-4)
    assert training[0]["train/lr"] == 0.0 and training[1]["train/lr"] == pytest.approx(1e-4)
    last = rows[-1]
    assert last["rewards/margins"] == pytest.approx(
        last["rewards/chosen"] - last["rewards/rejected"], abs=1e-5
    )
    assert last["train/loss"] < math.log(2) and last["rewards/margins"] > 0  # it learns the pairs
    # The greedy accuracy on the 16 sums whose pairs it trains on: at step 0 (the SFT start, which
    # answers all 16) and at the end, not lower. A sign error in the loss pushes the right answers
    # (the chosen) down and fails this.
    assert rows[0]["eval/accuracy"] == 1.0 and "eval/accuracy" in rows[3]
    assert rows[-1]["eval/accuracy"] >= rows[0]["eval/accuracy"]


def test_dpo_resume_is_bitwise_exact(tmp_path, straight, dropout_start):
    out = str(tmp_path)
    # a run killed before its first save left rows (the last cut short): the fresh start drops
    # them before its step-0 evaluation (it kept them, and appended)
    write_dead_rows(out, (0, 1))
    run("train_dpo.py", *dpo(out, dropout_start, "--stop_at_step", 4, "--resume", "latest"))
    assert latest(out).endswith("step-00000004") and not os.path.exists(os.path.join(out, "hf"))
    p = run("train_dpo.py", *dpo(out, dropout_start, "--resume", "latest"))
    assert "at step 4" in p.stdout + p.stderr
    assert_same_tensors(latest(straight), latest(out))  # weights and optimizer state
    assert metrics(straight) == metrics(out)  # every step's loss, rewards, logps, eval
    assert_same_export(straight, out)


def test_dpo_sigkills_then_resume_is_exact(tmp_path, straight, dropout_start):
    """SIGKILL the whole tree at a random moment of a step and while an asynchronous save is
    written; the resumed run (the frozen reference loaded again) ends in the straight run's
    weights, optimizer state, metrics and export."""
    out = str(tmp_path)
    args = dpo(out, dropout_start, "--async_save", "true", "--save_every", 1, "--resume", "latest")
    kill_twice_then_resume("train_dpo.py", args, out, straight, latest_sleep=0.3, seed=5)
    assert_same_export(straight, out)


def test_dpo_export_loads_in_plain_transformers_and_vllm(straight, memorised_sft):
    from transformers import AutoModelForCausalLM

    hf = os.path.join(straight, "hf")
    model = AutoModelForCausalLM.from_pretrained(hf)
    reference = AutoModelForCausalLM.from_pretrained(memorised_sft[0])
    moved = [
        n for n, p in model.named_parameters() if not torch.equal(p, reference.get_parameter(n))
    ]
    assert moved, "the export is the starting model"
    # and vLLM (the engine PPO would start from it with) decodes the same greedy tokens
    p = run_py("tests/roundtrip_check.py", hf)
    assert p.returncode == 0 and "ROUNDTRIP_OK" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]


def test_resume_checks_the_reference_is_the_one_the_run_began_with(tmp_path, memorised_sft):
    """The reference is loaded from --model's folder again at every resume (checkpoints hold
    what trains). Resumed on another world size (1 rank after 2: a different sharding sums the
    fingerprint in another order) it goes on; with the folder's weights changed since (an export
    into the same path), one line, not a run that goes on against another reference."""
    model, eval_data, pairs = memorised_sft
    folder = tmp_path / "start"
    shutil.copytree(model, folder)
    start = (str(folder), eval_data, pairs)
    out = str(tmp_path / "run")
    run("train_dpo.py", *dpo(out, start, "--stop_at_step", 1))
    p = run_py("train_dpo.py", *dpo(out, start, "--stop_at_step", 2, "--resume", "latest"))
    assert p.returncode == 0 and "at step 1" in p.stdout + p.stderr, p.stderr[-2000:]
    weights = load_file(folder / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name] * 1.001  # one tensor, moved a little
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    p = run_py("train_dpo.py", *dpo(out, start, "--resume", "latest"))
    assert_one_line_error(p, f"--model {folder}: its weights are not those", name)
