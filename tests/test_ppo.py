"""train_ppo.py under torchrun with 2 ranks and the vLLM engine: it trains, and it resumes exactly."""
import json, os, signal, subprocess

import pytest
import torch
from safetensors.torch import load_file

from conftest import (PY, REPO, TORCHRUN, assert_same_tensors, latest, logged_steps, metrics, read_tensors, run,
                      run_py, wait_for, workers)
import task

pytestmark = pytest.mark.slow
N = 4


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sft"))
    run("train_sft.py", "--out_dir", out, "--max_steps", 60, "--eval_every", 0, "--eval_samples", 16, "--save_every", 100)
    return os.path.join(out, "hf")


def ppo(out, model, *extra):
    return ("--model", model, "--out_dir", out, "--rollout_batch_size", 16, "--n_samples_per_prompt", 2,
            "--train_batch_size", 16, "--micro_batch_size", 8, "--max_new_tokens", 6, "--max_steps", N,
            "--eval_every", 2, "--eval_samples", 16, "--save_every", 100, "--rollout_engine", "vllm", *extra)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, sft_model):
    out = str(tmp_path_factory.mktemp("ppo-straight"))
    run("train_ppo.py", *ppo(out, sft_model))
    return out


def test_ppo_trains(straight, sft_model):
    rows = metrics(straight)
    assert [r["step"] for r in rows] == list(range(N + 1)) and "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
    for r in rows[1:]:
        assert r["policy/first_ratio_dev"] == 0.0  # dropout off, same inputs: the first ratio is exactly 1
        assert all(torch.isfinite(torch.tensor(r[k])) for k in ("objective/kl", "objective/score", "val/loss"))
    assert any(r["objective/kl"] != 0 for r in rows[2:]) and any(r["policy/clipfrac"] > 0 for r in rows[1:])
    a, b = load_file(os.path.join(sft_model, "model.safetensors")), load_file(os.path.join(straight, "hf", "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
    assert sum(not torch.equal(a[k], b[k]) for k in a) == len(a)  # every actor tensor moved
    meta = json.load(open(os.path.join(latest(straight), "meta.json")))
    assert meta["roles"] == ["actor", "critic"] and "kl_coef" in meta and meta["consumed_prompts"] == N * 16
    assert any(k.startswith("critic.optim.state.") for k in read_tensors(latest(straight)))
    assert os.path.getsize(os.path.join(straight, "samples.jsonl")) > 0


def test_ppo_resume_is_exact(tmp_path, straight, sft_model):
    out = str(tmp_path)
    run("train_ppo.py", *ppo(out, sft_model, "--stop_at_step", 2))
    p = run("train_ppo.py", *ppo(out, sft_model, "--resume", "latest"))
    assert "at step 2" in p.stdout + p.stderr
    assert metrics(straight) == metrics(out)  # every step's scores, KL, losses and sampled-responses hash
    assert_same_tensors(latest(straight), latest(out))  # actor, critic and both optimizers


def test_grpo_with_reward_model_and_hf_engine(tmp_path, sft_model):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    cfg = AutoConfig.from_pretrained(task.TINY_MODEL, num_labels=1)
    torch.manual_seed(0)
    rm_dir = str(tmp_path / "rm")
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(task.TINY_MODEL).save_pretrained(rm_dir)
    out = str(tmp_path / "run")
    run("train_ppo.py", *ppo(out, sft_model, "--advantage_estimator", "grpo", "--reward_model", rm_dir,
                             "--rollout_engine", "hf", "--max_steps", 2, "--target_kl", 0.1))
    rows = metrics(out)
    assert len(rows) == 3 and rows[1]["val/loss"] == 0.0 and rows[1]["policy/first_ratio_dev"] == 0.0
    assert rows[2]["objective/kl_coef"] != rows[1]["objective/kl_coef"]  # the adaptive controller moved
    assert json.load(open(os.path.join(latest(out), "meta.json")))["roles"] == ["actor"]  # no critic


def test_sigterm_mid_ppo_saves_and_resume_is_exact(tmp_path, straight, sft_model):
    """Preemption with the vLLM engine in the process (it must not take over our signal handlers), with
    --async_save on: SIGTERM to rank 0 only -> both ranks checkpoint at the step's end and exit 0."""
    out = str(tmp_path)
    args = ppo(out, sft_model, "--async_save", "true", "--save_every", 1)
    proc = subprocess.Popen([TORCHRUN, "--standalone", "--nproc_per_node=2", os.path.join(REPO, "train_ppo.py"),
                             *map(str, args)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for(lambda: logged_steps(out) >= 2 and len(workers(proc.pid)) == 2, proc)  # step 0's eval, step 1
    workers(proc.pid)[0].send_signal(signal.SIGTERM)
    log, _ = proc.communicate(timeout=300)
    k = logged_steps(out) - 1
    assert proc.returncode == 0 and "stopping after step" in log and k < N, log[-3000:]
    assert latest(out).endswith(f"step-{k:08d}")
    run("train_ppo.py", *args, "--resume", "latest")
    assert_same_tensors(latest(straight), latest(out))
    assert metrics(straight) == metrics(out)


def test_export_round_trip(tmp_path, straight):
    """`python checkpoint.py export` on a PPO checkpoint: the actor loads with plain transformers and plain
    vLLM (tokenizer and generation config included) and both decode alike; the critic exports too."""
    actor, critic = tmp_path / "actor", tmp_path / "critic"
    for role, out in (("actor", actor), ("critic", critic)):
        p = run_py("checkpoint.py", "export", latest(straight), out, "--role", role)
        assert p.returncode == 0, p.stderr[-2000:]
    p = subprocess.run([PY, os.path.join(REPO, "tests", "roundtrip_check.py"), str(actor)], capture_output=True,
                       text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0 and "ROUNDTRIP_OK" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]
    from transformers import AutoModelForTokenClassification
    value_model = AutoModelForTokenClassification.from_pretrained(critic, num_labels=1)
    saved = read_tensors(latest(straight))
    assert torch.equal(value_model.score.weight, saved["critic.model.score.weight"])
    assert torch.equal(load_file(os.path.join(straight, "hf", "model.safetensors"))["lm_head.weight"],
                       load_file(actor / "model.safetensors")["lm_head.weight"])  # the run's own export: the same
    p = run_py("checkpoint.py", "export", latest(straight), tmp_path / "x", "--role", "reward")
    assert p.returncode != 0 and "--role reward: checkpoint has roles ['actor', 'critic']" in p.stderr
