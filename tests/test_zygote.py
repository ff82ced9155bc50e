"""conftest.run_py forks most scripts from tests/zygote.py instead of starting Python, and
conftest.run forks torchrun's ranks from it (tests/forked_torchrun.py): what a test sees of a run
must be what a fresh `python SCRIPT ARGS`, or `torchrun ... SCRIPT ARGS`, gives."""

import os
import subprocess
import textwrap

import pytest

from conftest import NO_ZYGOTE
from conftest import run
from conftest import run_py

SCRIPT = textwrap.dedent(
    """
    import atexit
    import os
    import sys
    import threading
    import time

    def late():
        time.sleep(0.2)
        print("thread done", flush=True)

    atexit.register(lambda: print("atexit ran"))
    threading.Thread(target=late).start()  # not a daemon: the interpreter waits for it
    print("out", sys.argv[1:], os.path.basename(sys.path[0]), __name__)
    print("err", file=sys.stderr)
    if sys.argv[1] == "raise":
        raise ValueError("boom")
    if sys.argv[1] == "message":
        sys.exit("error: a message")
    if sys.argv[1] == "sleep":
        time.sleep(60)
    sys.exit(int(sys.argv[1]))
    """
)


def both(monkeypatch, *args, **kwargs):
    forked = run_py(*args, **kwargs)
    monkeypatch.setenv(NO_ZYGOTE, "1")
    fresh = run_py(*args, **kwargs)
    monkeypatch.delenv(NO_ZYGOTE)
    return forked, fresh


@pytest.mark.parametrize("how", ["0", "3", "raise", "message"])
def test_a_forked_script_ends_as_a_fresh_one(tmp_path, monkeypatch, how):
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    forked, fresh = both(monkeypatch, path, how)
    assert forked.returncode == fresh.returncode
    assert forked.stdout == fresh.stdout
    assert "thread done" in forked.stdout and "atexit ran" in forked.stdout
    assert f"['{how}'] {os.path.basename(tmp_path)} __main__" in forked.stdout
    # a traceback's frames differ (runpy's are in the forked one); its last line does not
    assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1]


def test_a_forked_script_is_killed_at_its_timeout(tmp_path):
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    with pytest.raises(subprocess.TimeoutExpired):
        run_py(path, "sleep", timeout=2)
    assert run_py(path, "0").returncode == 0  # the zygote serves the next one


def test_a_stage_refuses_a_bad_flag_alike_either_way(monkeypatch):
    forked, fresh = both(monkeypatch, "train_sft.py", "--max_steps", "-1")
    assert forked.returncode == fresh.returncode == 1
    assert forked.stderr == fresh.stderr == "error: --max_steps -1: expected a number >= 1\n"


RANKS = textwrap.dedent(
    """
    import atexit
    import os
    import sys

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # one write a line: the ranks share the pipe, unbuffered (`python -u`), and print writes its
    # pieces one by one
    atexit.register(lambda: sys.stdout.write(f"atexit ran {rank}\\n"))
    where = os.path.basename(sys.path[0])
    threads = torch.get_num_threads()
    world = dist.get_world_size()
    sys.stdout.write(f"out {rank} {world} {sys.argv[1:]} {where} {__name__} {threads}\\n")
    dist.barrier()
    dist.destroy_process_group()
    if sys.argv[1] == "raise" and rank == 1:
        raise ValueError("boom")
    if sys.argv[1] == "message" and rank == 0:
        sys.exit("error: a message")
    sys.exit(int(sys.argv[1]))
    """
)


def ranks_lines(text):
    """The ranks' lines before their barrier, sorted (two ranks print in either order)."""
    return sorted(line for line in text.splitlines() if line.startswith("out "))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["0", "3", "raise", "message"])
def test_a_forked_torchrun_ends_as_a_fresh_one(tmp_path, monkeypatch, how):
    """conftest.run forks torchrun's ranks from the zygote (tests/forked_torchrun.py): each rank
    must end as torchrun's own `python -u SCRIPT` rank does."""
    path = tmp_path / "ranks.py"
    path.write_text(RANKS)
    forked = run(path, how, check=False)
    monkeypatch.setenv(NO_ZYGOTE, "1")
    fresh = run(path, how, check=False)
    assert forked.returncode == fresh.returncode == (0 if how == "0" else 1)
    assert ranks_lines(forked.stdout) == ranks_lines(fresh.stdout)
    assert f"out 0 2 ['{how}'] {tmp_path.name} __main__ 1" in forked.stdout
    for line in ("[rank1]: ValueError: boom", "error: a message"):
        assert (line in forked.stderr) == (line in fresh.stderr), line
    if how == "0":  # where a rank fails, torchrun may stop the other before its atexit
        assert "atexit ran 0" in forked.stdout and "atexit ran 1" in forked.stdout
