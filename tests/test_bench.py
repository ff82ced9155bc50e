"""The benchmarks that call checkpoint.py's functions directly, and bench/profile_step.py, which
wraps a stage's train_step by name, still run (bench/ is not a test, but
a benchmark that has stopped running measures nothing: bench/checkpoint_io.py and
bench/store_io.py failed from 2026-11-25 to 27, unnoticed, after checkpoint.load began to read
--max_steps from the run's args). Tiny sizes, one repeat: what is checked is that each ends with
its BENCH line and that its numbers are numbers, never how fast anything is (RESULTS.md holds
that). The benchmarks that only run the stage scripts break as loudly as the stages' own tests."""

import json
import math

import pytest

from conftest import run
from conftest import run_py


def bench_json(stdout):
    """The `BENCH {json}` line a benchmark ends with, parsed."""
    lines = [line for line in stdout.splitlines() if line.startswith("BENCH ")]
    assert lines, f"no BENCH line in:\n{stdout[-3000:]}"
    return json.loads(lines[-1][len("BENCH ") :])


def assert_positive_numbers(result, keys):
    for key in keys:
        value = result[key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)


@pytest.mark.slow
def test_checkpoint_io_bench_runs(tmp_path):
    p = run(
        "bench/checkpoint_io.py",
        *("--hidden", 64, "--layers", 1, "--repeats", 1, "--dir", tmp_path / "ckpt"),
    )
    result = bench_json(p.stdout)["checkpoint"]
    rates = ["save_gb_s", "raw_write_gb_s", "load_gb_s", "raw_read_gb_s", "resume_gb_s"]
    assert_positive_numbers(result, ["state_gb", "step_s", *rates])


@pytest.mark.slow
def test_store_io_bench_runs():
    pytest.importorskip("s3fs", reason="s3fs is not installed (requirements-cpu.txt pins it)")
    pytest.importorskip("moto.server", reason="moto[server] is not installed")
    p = run_py("bench/store_io.py", "--hidden", 64, "--layers", 1, "--repeats", 1, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    result = bench_json(p.stdout)["store"]
    keys = ["state_gb", "save_gb_s", "upload_gb_s", "load_gb_s", "download_gb_s"]
    assert_positive_numbers(result, keys)


def test_adamw_bench_refuses_too_few_steps():
    p = run_py("bench/adamw_step.py", "--steps", 3)
    assert p.returncode == 2
    assert "--steps 3: expected at least 4" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.slow
def test_profile_step_writes_the_table(tmp_path):
    """bench/profile_step.py runs the stage's own main and profiles the step asked for; a --step
    the run never reaches is one line, not a silent run without a table."""
    table = tmp_path / "profile.txt"
    stage = ("train_sft.py", "--max_steps", 2, "--eval_every", 0, "--save_every", 100)
    stage += ("--train_batch_size", 8, "--micro_batch_size", 4)
    wrapper = ("bench/profile_step.py", "--table", table)
    run(*wrapper, "--step", 2, *stage, "--out_dir", tmp_path / "a", nproc=1)
    text = table.read_text()
    assert text.startswith("step 2: ") and "aten::mm" in text, text[:2000]
    p = run(*wrapper, "--step", 3, *stage, "--out_dir", tmp_path / "b", nproc=1, check=False)
    assert p.returncode != 0
    assert "error: --step 3: the run took 2 steps; nothing profiled" in p.stderr + p.stdout


def test_math_vs_trl_runs_plainrlhfs_side(tmp_path):
    """bench/math_vs_trl.py's plainrlhf side computes every row's value. It needs no TRL, but
    nothing ran it: from 00a2acc (2026-11-28) it failed on a SimpleNamespace of flags without
    --scale_rewards, which compute_advantages had begun to read (a helper found it)."""
    import importlib.util
    import os

    import torch

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench", "math_vs_trl.py")
    spec = importlib.util.spec_from_file_location("math_vs_trl", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    torch.manual_seed(1234)
    inp = {}
    bench.ppo_inputs(inp)
    bench.group_and_pair_inputs(inp)
    torch.save(inp, tmp_path / "inputs.pt")
    p = run_py("bench/math_vs_trl.py", "--side", "plainrlhf", "--work", tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    out = torch.load(tmp_path / "plainrlhf.pt", weights_only=True)
    for key, _, _ in bench.ROWS:
        assert torch.isfinite(out[key]).all(), key


@pytest.mark.slow
def test_reward_model_benches_run(tmp_path):
    """bench/rm_kinds.py and bench/rm_verifier.py (the README's numbers for what a reward model
    of the task tells apart) on a random-weight reward model and policy of the embedded size."""
    from transformers import AutoModelForSequenceClassification
    from transformers import AutoTokenizer

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_pretrained("assets/tiny-llama", num_labels=1)
    rm.config.reward_mean = 0.0  # as train_rm.py's export records them
    rm.config.reward_std = 1.0
    rm.save_pretrained(tmp_path / "rm")
    AutoTokenizer.from_pretrained("assets/tiny-llama").save_pretrained(tmp_path / "rm")
    # one thread each: two threads beside the other test worker's processes spin-wait (this
    # test took 270 s of the suite, 29 s alone)
    one = {"OMP_NUM_THREADS": "1"}
    kinds = run_py("bench/rm_kinds.py", tmp_path / "rm", "assets/tiny-llama", env=one)
    assert kinds.returncode == 0, kinds.stderr[-3000:]
    assert "on-policy" in kinds.stdout, kinds.stdout[-3000:]
    verifier = run_py("bench/rm_verifier.py", tmp_path / "rm", "assets/tiny-llama", "16", env=one)
    assert verifier.returncode == 0, verifier.stderr[-3000:]
    for line in ("training pairs:", "on-policy:", "within a prompt:", "accepting 10% of"):
        assert line in verifier.stdout, verifier.stdout[-3000:]
