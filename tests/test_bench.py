"""The benchmarks that call checkpoint.py's functions directly still run (bench/ is not a test, but
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
