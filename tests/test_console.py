"""A quiet console: a run through `launch.sh` prints its progress bar, its evaluation lines, a
summary, and nothing of vLLM's, transformers' or torch's (`common.quiet_console`). One demo used to
print 667 lines, 243 of them third-party WARNINGs, a vLLM traceback and a load report per model."""

import os
import socket
import subprocess
from datetime import timedelta

import pytest

from conftest import REPO
from conftest import run
from conftest import run_py

pytestmark = pytest.mark.slow
CHATTER = ("WARNING", "Warning", "INFO", "Traceback", "LOAD REPORT", "Loading weights")


def launch(*args):
    """./launch.sh args, stdout and stderr together: (status, the lines a terminal keeps). Bytes,
    not text: text mode would read each "\r" of a progress bar's redraws as a new line."""
    cmd = [os.path.join(REPO, "launch.sh"), *map(str, args)]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600, cwd=REPO)
    lines = [line for line in p.stdout.decode().split("\n") if line.strip()]
    return p.returncode, lines


def assert_quiet(lines, most):
    text = "\n".join(lines)
    assert len(lines) <= most, text
    assert not [word for word in CHATTER if word in text], text


def test_a_short_sft_and_ppo_print_their_own_lines_only(tmp_path):
    sft = tmp_path / "sft"
    args = ("--out_dir", sft, "--max_steps", 10, "--eval_every", 5, "--eval_samples", 8)
    status, lines = launch("sft", *args, "--train_batch_size", 16, "--micro_batch_size", 8)
    assert status == 0, "\n".join(lines)
    # the data line, the warmup note (SFT's 30 warmup steps in a 10-step run), the bar (drawn
    # around the evaluation lines), step 5 and step 10, the summary
    assert_quiet(lines, 8)
    plan = "data: 9,000 examples from the embedded task (10 steps of 16: 0.0178 epochs); 8 held out"
    assert lines[0] == plan + " for evaluation", lines
    note = "note: --warmup_steps 30 >= --max_steps 10: the learning rate rises for the whole run"
    assert lines[1] == note + " and ends at 30% of its peak", lines
    assert lines[-1].startswith("done: 10 steps"), lines
    args = ("--model", sft / "hf", "--out_dir", tmp_path / "ppo", "--rollout_engine", "vllm")
    args += ("--rollout_batch_size", 8, "--n_samples_per_prompt", 2, "--train_batch_size", 16)
    args += ("--micro_batch_size", 8, "--max_steps", 2, "--eval_every", 1, "--eval_samples", 8)
    status, lines = launch("ppo", *args)
    assert status == 0, "\n".join(lines)
    assert_quiet(lines, 8)  # the data line, the bar, steps 0, 1 and 2, the summary
    assert lines[0].startswith("data: 9,000 prompts from the embedded task (2 iterations of 8:")
    assert lines[-1].startswith("done: 2 steps"), lines


def test_an_error_both_ranks_meet_is_one_line(tmp_path):
    """Both ranks refuse the file: one line for the two (each printed its own copy: eight on a
    node of eight GPUs), and none of torchrun's traceback and failure table."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "response": "2"}\n{"prompt": 3}\n')
    status, lines = launch("sft", "--out_dir", tmp_path / "out", "--data", bad)
    assert status == 1
    hint = ' (or a conversation: a list of {"role", "content"} messages)'
    assert lines == [f"error: {bad}:2: expected a string field 'prompt'{hint}"], lines
    # the --out_dir the run made and never wrote to is gone again (`common.remove_empty_folders`)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("mode,lines", [("alike", 1), ("own", 2), ("bar", 1), ("closed", 1)])
def test_a_node_prints_each_error_line_once(mode, lines):
    """`common.print_error` under 2 ranks: a line the two ranks meet alike once, the ranks' own
    lines each; rank 1's line starts a line of its own after rank 0's bar, and adds no blank
    line where there is no bar, or the bar has closed (`common.bar_break`)."""
    p = run("tests/console_check.py", mode, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    errors = [line for line in p.stderr.split("\n") if line.startswith("error:")]
    assert len(errors) == lines and len(set(errors)) == lines, p.stderr
    if mode == "bar":
        assert "0/10 [00:00<?, ?it/s]\nerror: every rank's alike\n" in p.stderr, p.stderr
    elif mode == "closed":  # the bar ended its own line: no blank one (text mode: \r is \n)
        assert "0/10 [00:00<?, ?it/s]\nerror: every rank's alike\n" in p.stderr, p.stderr
        assert "\n\nerror:" not in p.stderr, p.stderr
    else:
        assert not p.stderr.startswith("\n") and "\n\n" not in p.stderr, p.stderr


def test_a_bad_flag_and_help_are_printed_once(tmp_path):
    """Every rank parses the same command line, and each printed its own copy of a bad flag's
    line and of --help; one rank per node prints them now (`common.parse_once_per_node`). An
    error a rank meets in its own work is still its own line (the test above)."""
    status, lines = launch("sft", "--out_dir", tmp_path / "out", "--lr", "inf")
    assert status == 1 and lines == ["error: --lr inf: expected a finite number"], lines
    status, lines = launch("sft", "--help")
    usage = [line for line in lines if line.startswith("usage: train_sft.py")]
    assert status == 0 and len(usage) == 1, lines


def test_a_name_that_is_not_utf8_prints_under_a_strict_locale(tmp_path):
    """os.listdir gives such a name as surrogate escapes; printing it under a strict UTF-8
    stdout (a real en_US.UTF-8 locale) raised, and took a damaged checkpoint's fallback with it."""
    code = (
        "import common, train_sft; "
        "common.run(lambda args: print('skipping step-\\udcff'), train_sft.Args, train_sft.LIMITS)"
    )
    env = {"PYTHONIOENCODING": "utf-8:strict", "PYTHONUTF8": "0"}
    p = run_py("-c", code, "--out_dir", tmp_path, env=env)
    assert p.returncode == 0 and "skipping step-\\udcff" in p.stdout, p.stderr[-2000:]


def test_a_bar_closes_after_the_launchers_store_is_gone():
    """torchrun killed alone takes its TCPStore with it while the ranks train on to the end; rank
    0 then died with a traceback in `common.close_progress_bar` (which tells the store its bar has
    closed), not at a collective's one line. The store's host here is a process of its own,
    killed before the bar closes: closing it is best effort, as `common.bar_break` is."""
    import sys

    import torch.distributed as dist

    import common

    host = subprocess.Popen(
        [sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        port = int(host.stdout.readline())
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
        ours = not dist.is_initialized()
        if ours:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        common.CONSOLE["store"] = dist.PrefixStore("console/", store)
        bar = common.progress_bar(3, 0, "step")  # the store is told: a bar is on this console
        host.kill()
        host.wait()
        with pytest.raises(dist.DistError):
            store.get(f"console/bar/{socket.gethostname()}")  # the store is gone indeed
        common.close_progress_bar(bar)
    finally:
        host.kill()
        common.CONSOLE.pop("store", None)
        if ours and dist.is_initialized():
            dist.destroy_process_group()


# A TCPStore on a free port, its port printed; it lives until killed.
STORE_HOST = """
import time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(600)
"""
