"""train_ppo.py under torchrun with 2 ranks and the vLLM engine:
it trains, and it resumes exactly."""

import json
import os
import signal
import subprocess

import pytest
import torch
from safetensors.torch import load_file
from safetensors.torch import save_file
from test_bad_input import assert_one_line_error

import task
from conftest import PY
from conftest import REPO
from conftest import assert_same_tensors
from conftest import kill_twice_then_resume
from conftest import latest
from conftest import logged_steps
from conftest import metrics
from conftest import popen_torchrun
from conftest import read_tensors
from conftest import run
from conftest import run_py
from conftest import wait_for
from conftest import workers

pytestmark = pytest.mark.slow
N = 4


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sft"))
    args = ("--out_dir", out, "--max_steps", 60, "--eval_every", 0, "--eval_samples", 16)
    run("train_sft.py", *args, "--save_every", 100)
    for row in metrics(out, drop=("train/", "eval/")):  # SFT's phases, timed every step
        assert row["time/forward_backward_s"] + row["time/optimizer_s"] <= row["time/step_s"]
    return os.path.join(out, "hf")


def test_sft_lowers_its_loss(sft_model):
    """SFT itself learns (the GPU test checks it on CUDA): the fixture's 60 steps take the
    response tokens' loss from ~4.8 nats (the tiny model's random start) to ~1.4."""
    losses = [row["train/loss"] for row in metrics(os.path.dirname(sft_model))]
    assert len(losses) == 60
    first = sum(losses[:10]) / 10
    last = sum(losses[-10:]) / 10
    assert last < first / 2, losses


def ppo(out, model, *extra):
    args = ("--model", model, "--out_dir", out, "--rollout_batch_size", 16)
    args += ("--n_samples_per_prompt", 2, "--train_batch_size", 16, "--micro_batch_size", 8)
    args += ("--max_new_tokens", 6, "--max_steps", N, "--eval_every", 2, "--eval_samples", 16)
    args += ("--save_every", 100, "--rollout_engine", "vllm", *extra)
    return args


@pytest.fixture(scope="module")
def straight(tmp_path_factory, sft_model):
    out = str(tmp_path_factory.mktemp("ppo-straight"))
    run("train_ppo.py", *ppo(out, sft_model))
    return out


def test_ppo_trains(straight, sft_model):
    rows = metrics(straight)
    assert [r["step"] for r in rows] == list(range(N + 1))
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
    trained = rows[1:]  # row 0 is the evaluation before the first step
    keys = ("objective/kl", "objective/score", "val/loss")
    for r in trained:
        # dropout off, same inputs: the first ratio is exactly 1
        assert r["policy/first_ratio_dev"] == 0.0
        assert all(torch.isfinite(torch.tensor(r[k])) for k in keys)
    after_first = rows[2:]
    assert any(r["objective/kl"] != 0 for r in after_first)
    assert any(r["policy/clipfrac"] > 0 for r in trained)
    a = load_file(os.path.join(sft_model, "model.safetensors"))
    b = load_file(os.path.join(straight, "hf", "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
    assert sum(not torch.equal(a[k], b[k]) for k in a) == len(a)  # every actor tensor moved
    meta = json.load(open(os.path.join(latest(straight), "meta.json")))
    assert meta["roles"] == ["actor", "critic"] and "kl_coef" in meta
    assert meta["consumed_prompts"] == N * 16
    assert any(k.startswith("critic.optim.state.") for k in read_tensors(latest(straight)))
    assert os.path.getsize(os.path.join(straight, "samples.jsonl")) > 0
    # every phase of an iteration timed, in the order the README's metric table lists them
    phases = ["rollout", "score", "logprobs", "advantages", "train", "sync"]
    iterations = metrics(straight, drop=("eval/",))[1:]  # row 0: the evaluation before step 1
    for r in iterations:
        assert [k[5:-2] for k in r if k.startswith("time/")] == phases, r
        assert all(r[f"time/{k}_s"] >= 0 for k in phases)


@pytest.mark.parametrize("estimator", ["gae", "grpo", "rloo", "grpo-batch"])
def test_each_estimator_raises_the_score_it_is_given(tmp_path, sft_model, estimator):
    """The optimisation itself, which the tests of one step's numbers cannot see: under each
    advantage estimator a reward the tiny model can learn (the share of '1's in its answer,
    tests/learnable.py; ~0.25 at the SFT model) climbs within 12 iterations (to ~0.6). It fails
    if the scores reach other responses than those they were given for (a shuffle across ranks,
    rows or epochs), or if the update climbs the wrong way. grpo-batch: GRPO with the batch's
    std (--scale_rewards batch, a collective in the advantages), and the reward as two rules,
    the learnable one and the task's at weight 0, each logged on its own."""
    estimator, _, scale = estimator.partition("-")
    args = ("--model", sft_model, "--out_dir", tmp_path, "--advantage_estimator", estimator)
    rules = ("--reward_fn", "tests.learnable:ones")
    if scale:
        args += ("--scale_rewards", scale)
        rules = ("--reward_fn", "tests.learnable:ones,task:reward_fn", "--reward_weights", "1,0")
    args += (*rules, "--rollout_batch_size", 16)
    args += ("--n_samples_per_prompt", 4, "--train_batch_size", 32, "--micro_batch_size", 16)
    args += ("--max_new_tokens", 6, "--max_steps", 12, "--eval_every", 0, "--save_every", 100)
    run("train_ppo.py", *args)
    iterations = metrics(str(tmp_path))[1:]  # row 0: the evaluation before the first step
    scores = [row["objective/score"] for row in iterations]
    assert len(scores) == 12
    if scale:  # the sum is the learnable rule's (the other weighs 0), and both are logged
        assert [row["objective/rule/tests.learnable.ones"] for row in iterations] == scores
        assert all(0 <= row["objective/rule/task.reward_fn"] <= 1 for row in iterations)
        start = metrics(str(tmp_path))[0]  # and at the evaluation, each rule's own mean
        assert start["eval/rule/tests.learnable.ones"] == start["eval/accuracy"], start
        assert 0 <= start["eval/rule/task.reward_fn"] <= 1, start
        with open(tmp_path / "samples.jsonl") as f:  # and each sample's, beside its score
            samples = [json.loads(line) for line in f]
        assert samples and all(r["rule/tests.learnable.ones"] == r["score"] for r in samples)
        assert all(r["rule/task.reward_fn"] in (0.0, 1.0) for r in samples), samples
    last = sum(scores[-4:]) / 4
    # The SFT model's answers hold ~0.25 '1's (about half the sums are above 99), its first
    # batch's 0.17-0.32 by the seed; after 12 iterations 0.56-0.64 at seeds 1, 2, 3 and 42 (one
    # AMD EPYC), and 0.13-0.24 with the scores rolled by one row (a mutation, checked by hand)
    assert last > 0.45, scores


def test_the_batch_std_is_the_whole_batchs_over_ranks(tmp_path):
    """--scale_rewards batch divides by the std of every rank's scores together
    (`train_ppo.py: batch_std`), as TRL's over its gathered batch: a rank holds only its own
    prompts' groups, and its own std would make the advantages depend on how the batch is split
    over ranks."""
    script = tmp_path / "check.py"
    script.write_text(
        "import statistics\n"
        "import sys\n"
        f"sys.path.insert(0, {REPO!r})\n"
        "import torch\n"
        "import torch.distributed as dist\n"
        "import train_ppo\n"
        "dist.init_process_group('gloo')\n"
        "every = [[1.0, 0.0, 0.0, 1.0], [3.0, 3.0, 2.5, 7.0, 1.0, 0.5]]\n"
        "mine = torch.tensor(every[dist.get_rank()])\n"
        "got = train_ppo.batch_std(mine)\n"
        "want = statistics.stdev(every[0] + every[1])\n"
        "assert abs(got - want) < 1e-12, (got, want)\n"
        "print('same', got)\n"
        "dist.destroy_process_group()\n"
    )
    p = run(str(script))
    assert p.stdout.count("same") == 2, p.stdout


def test_samples_are_logged_without_a_held_out_set(tmp_path, sft_model):
    """samples.jsonl holds rank 0's own sampled rows, which need no held-out prompts: a user's
    --data without --eval_data (here --eval_samples 0) logged none (they were written only
    beside an evaluation)."""
    out = tmp_path / "ppo"
    flags = ("--eval_samples", 0, "--eval_every", 1, "--max_steps", 2, "--rollout_engine", "hf")
    p = run_py("train_ppo.py", *ppo(out, sft_model, *flags))
    assert p.returncode == 0, p.stderr[-2000:]
    assert not any(k.startswith("eval/") for row in metrics(str(out)) for k in row)
    with open(out / "samples.jsonl") as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps == [1] * 4 + [2] * 4, steps


def test_ppo_resume_is_exact(tmp_path, straight, sft_model):
    out = str(tmp_path)
    run("train_ppo.py", *ppo(out, sft_model, "--stop_at_step", 2))
    p = run("train_ppo.py", *ppo(out, sft_model, "--resume", "latest"))
    assert "at step 2" in p.stdout + p.stderr
    # every step's scores, KL, losses and sampled-responses hash
    assert metrics(straight) == metrics(out)
    assert_same_tensors(latest(straight), latest(out))  # actor, critic and both optimizers


def test_grpo_with_reward_model_and_hf_engine(tmp_path, sft_model):
    from transformers import AutoConfig
    from transformers import AutoModelForSequenceClassification
    from transformers import AutoTokenizer

    cfg = AutoConfig.from_pretrained(task.TINY_MODEL, num_labels=1)
    torch.manual_seed(0)
    rm_dir = str(tmp_path / "rm")
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(task.TINY_MODEL).save_pretrained(rm_dir)
    out = str(tmp_path / "run")
    flags = ("--advantage_estimator", "grpo", "--reward_model", rm_dir, "--rollout_engine", "hf")
    flags += ("--max_steps", 2, "--target_kl", 0.1, "--warmup_steps", 2)
    run("train_ppo.py", *ppo(out, sft_model, *flags))
    rows = metrics(out)
    assert len(rows) == 3 and "val/loss" not in rows[1] and "policy/kl_loss" in rows[1]
    # warmup over both iterations: the first updates at lr 0, the second at half of --lr (1e-4);
    # train/lr is the rate each iteration trained at
    assert [row.get("train/lr") for row in rows] == [None, 0.0, 5e-5]  # row 0: the start's eval
    assert rows[1]["policy/first_ratio_dev"] == 0.0
    # the adaptive controller moved
    assert rows[2]["objective/kl_coef"] != rows[1]["objective/kl_coef"]
    meta = json.load(open(os.path.join(latest(out), "meta.json")))
    assert meta["roles"] == ["actor"]  # no critic


def stopped_against_a_random_reward_model(tmp_path, sft_model, **stats):
    """A random tiny reward model in tmp_path/rm (its config.json with `stats`, if any), and a
    GRPO run against it stopped after step 1; returns (rm_dir, out_dir, the run's flags)."""
    from transformers import AutoConfig
    from transformers import AutoModelForSequenceClassification
    from transformers import AutoTokenizer

    cfg = AutoConfig.from_pretrained(task.TINY_MODEL, num_labels=1)
    for key, value in stats.items():  # from_pretrained drops keys its config class lacks
        setattr(cfg, key, value)
    torch.manual_seed(0)
    rm_dir = tmp_path / "rm"
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(task.TINY_MODEL).save_pretrained(rm_dir)
    out = str(tmp_path / "run")
    flags = ("--advantage_estimator", "grpo", "--reward_model", rm_dir, "--rollout_engine", "hf")
    flags += ("--max_steps", 2, "--eval_every", 0, "--eval_samples", 0)
    p = run_py("train_ppo.py", *ppo(out, sft_model, *flags, "--stop_at_step", 1))
    assert p.returncode == 0, p.stderr[-2000:]
    return rm_dir, out, flags


def test_resume_checks_the_reward_model_is_the_one_the_run_began_with(tmp_path, sft_model):
    """The frozen models come from their folders again at a resume: a --reward_model folder whose
    weights changed since the run began is one line naming it, not a run that goes on against
    another reward (the reference, from --model, unchanged, passes the same check)."""
    rm_dir, out, flags = stopped_against_a_random_reward_model(tmp_path, sft_model)
    weights = load_file(rm_dir / "model.safetensors")
    name = sorted(weights)[-1]
    weights[name] = weights[name] + 1e-3
    save_file(weights, rm_dir / "model.safetensors", metadata={"format": "pt"})
    p = run_py("train_ppo.py", *ppo(out, sft_model, *flags, "--resume", "latest"))
    assert_one_line_error(p, f"--reward_model {rm_dir}: its weights are not those", name)


def test_resume_checks_the_folders_config_and_tokenizer(tmp_path, sft_model):
    """A resume builds the models from their folders' config.json and tokenises with their
    tokenizers again: a folder edited since the run began, its weights unchanged (so the
    fingerprint above cannot see it), is one line naming what changed: another reward_std would
    rescale the reward mid-run, another tokenizer score other token ids. Put back as they were,
    the resume goes on (with a warning: it samples with another engine than the run began with)."""
    stats = {"reward_mean": 0.5, "reward_std": 2.0}
    rm_dir, out, flags = stopped_against_a_random_reward_model(tmp_path, sft_model, **stats)
    resume = ppo(out, sft_model, *flags, "--resume", "latest")
    config = json.load(open(rm_dir / "config.json"))
    json.dump({**config, "reward_std": 3.0}, open(rm_dir / "config.json", "w"))
    p = run_py("train_ppo.py", *resume)
    assert_one_line_error(p, f"--reward_model {rm_dir}: not the folder", "reward_std 2.0 -> 3.0")
    json.dump(config, open(rm_dir / "config.json", "w"))
    tokenizer = json.load(open(rm_dir / "tokenizer.json"))
    vocab = dict(tokenizer["model"]["vocab"])
    one = vocab["1"]  # the digits' ids swapped
    vocab["1"] = vocab["2"]
    vocab["2"] = one
    changed = {**tokenizer, "model": {**tokenizer["model"], "vocab": vocab}}
    json.dump(changed, open(rm_dir / "tokenizer.json", "w"))
    p = run_py("train_ppo.py", *resume)
    assert_one_line_error(p, f"--reward_model {rm_dir}: not the folder", "the tokenizer")
    json.dump(tokenizer, open(rm_dir / "tokenizer.json", "w"))
    # the resume samples with vLLM, the run began with the HF engine: allowed, and said
    p = run_py("train_ppo.py", *resume, "--rollout_engine", "vllm")
    assert p.returncode == 0 and "at step 1" in p.stdout, p.stderr[-2000:]
    assert "trained with the hf rollout engine, this resume samples with vllm" in p.stdout


# (A plain "gae" case, 2 epochs without a reference, took ~36 s and checked nothing these two do
# not: grpo takes step (3)'s path without a reference, gae-one-update the critic's.)
@pytest.mark.parametrize("estimator", ["grpo", "gae-one-update"])
def test_kl_coef_0_runs_no_reference_and_trains_the_same(tmp_path, sft_model, estimator):
    """--kl_coef 0: no reference model is loaded or run, and objective/kl is not logged. The KL
    weighed 0 before as well, so the run is bitwise the one that keeps the reference (a
    --target_kl keeps it, and a kl_coef of 0 stays 0 under the controller).
    gae-one-update: one optimizer step per iteration, so without a reference the update's forward
    gives the old logprobs (`old_logprobs_from_update`), while with one (a KL reward, even if
    weighed 0) step (3) computes them first: the two paths, bitwise the same on 2 ranks."""
    flags = ("--kl_coef", 0, "--max_steps", 2)
    flags += ("--advantage_estimator", estimator.removesuffix("-one-update"))
    if estimator == "gae-one-update":
        flags += ("--ppo_epochs", 1, "--train_batch_size", 32)  # 16 prompts x 2 samples
    flags += ("--eval_every", 0, "--eval_samples", 0)
    # The HF engine: what is compared here does not involve the engine, and each of the four
    # runs then skips vLLM's start (~8 s); the later flag wins over ppo()'s --rollout_engine vllm
    flags += ("--rollout_engine", "hf")
    without = str(tmp_path / "without")
    run("train_ppo.py", *ppo(without, sft_model, *flags))
    kept = str(tmp_path / "kept")
    run("train_ppo.py", *ppo(kept, sft_model, *flags, "--target_kl", 1))
    assert_same_tensors(latest(without), latest(kept))
    measured = ("objective/kl", "policy/kl_loss")
    rows = metrics(without)
    assert [row["step"] for row in rows] == [1, 2]
    for a, b in zip(rows, metrics(kept), strict=True):
        assert not set(measured) & a.keys() and "objective/kl" in b
        assert a == {k: v for k, v in b.items() if k not in measured}


def test_sigterm_mid_ppo_saves_and_resume_is_exact(tmp_path, straight, sft_model):
    """Preemption with the vLLM engine in the process (it must not take over our signal
    handlers), with --async_save on: SIGTERM to rank 0 only -> both ranks checkpoint at the
    step's end and exit 0."""
    out = str(tmp_path)
    args = ppo(out, sft_model, "--async_save", "true", "--save_every", 1)
    proc = popen_torchrun(
        "train_ppo.py", *args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    # until two rows are logged: step 0's eval and step 1
    wait_for(lambda: logged_steps(out) >= 2 and len(workers(proc.pid)) == 2, proc)
    workers(proc.pid)[0].send_signal(signal.SIGTERM)
    log, _ = proc.communicate(timeout=300)
    k = logged_steps(out) - 1
    assert proc.returncode == 0 and "stopping after step" in log and k < N, log[-3000:]
    assert latest(out).endswith(f"step-{k:08d}")
    run("train_ppo.py", *args, "--resume", "latest")
    assert_same_tensors(latest(straight), latest(out))
    assert metrics(straight) == metrics(out)


def test_sigkills_mid_ppo_then_resume_is_exact(tmp_path, straight, sft_model):
    """SIGKILL the whole tree (the vLLM engines die with their ranks) twice: at a random moment
    after step 1, and while an asynchronous save is being written; each `--resume latest` starts
    from the newest checkpoint that verifies, and the run ends where the straight one did."""
    out = str(tmp_path)
    root = os.path.join(out, "checkpoints")
    args = ppo(out, sft_model, "--async_save", "true", "--save_every", 1, "--resume", "latest")
    kill_twice_then_resume("train_ppo.py", args, out, straight, latest_sleep=1.0, seed=3)
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]


def test_export_round_trip(tmp_path, straight):
    """`python checkpoint.py export` on a PPO checkpoint: the actor loads with plain
    transformers and plain vLLM (tokenizer and generation config included) and both decode
    alike; the critic exports too."""
    actor = tmp_path / "actor"
    critic = tmp_path / "critic"
    for role, out in (("actor", actor), ("critic", critic)):
        p = run_py("checkpoint.py", "export", latest(straight), out, "--role", role)
        assert p.returncode == 0, p.stderr[-2000:]
    cmd = [PY, os.path.join(REPO, "tests", "roundtrip_check.py"), str(actor)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0 and "ROUNDTRIP_OK" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]
    from transformers import AutoModelForTokenClassification

    value_model = AutoModelForTokenClassification.from_pretrained(critic, num_labels=1)
    saved = read_tensors(latest(straight))
    assert torch.equal(value_model.score.weight, saved["critic.model.score.weight"])
    ours = load_file(os.path.join(straight, "hf", "model.safetensors"))["lm_head.weight"]
    exported = load_file(actor / "model.safetensors")["lm_head.weight"]
    assert torch.equal(ours, exported)  # the run's own export: the same
    p = run_py("checkpoint.py", "export", latest(straight), tmp_path / "x", "--role", "reward")
    assert p.returncode != 0
    assert "--role reward: checkpoint has roles ['actor', 'critic']" in p.stderr


@pytest.mark.parametrize(
    "flag", [("--gradient_checkpointing", "true"), ("--reshard_after_forward", "false")]
)
def test_memory_settings_change_nothing_but_memory(tmp_path, straight, sft_model, flag):
    """Actor and critic with activation checkpointing, or every model's blocks keeping FSDP2's
    gathered parameters after their forward: the same tensors and metrics."""
    out = str(tmp_path)
    run("train_ppo.py", *ppo(out, sft_model, *flag))
    assert_same_tensors(latest(straight), latest(out))
    assert metrics(straight) == metrics(out)
