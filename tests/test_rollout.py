"""rollout.py under torchrun with 2 ranks:
the vLLM engine against the HF one, weight sync, seeds."""

import pytest

from conftest import run

pytestmark = pytest.mark.slow


def test_rollout_engines_sync_and_seeds():
    p = run("tests/rollout_check.py", nproc=2)
    assert "ROLLOUT CHECK OK rank 0" in p.stdout, p.stdout[-2000:]
    assert "ROLLOUT CHECK OK rank 1" in p.stdout, p.stdout[-2000:]
