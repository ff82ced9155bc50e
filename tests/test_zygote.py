"""conftest.run_py forks most scripts from tests/zygote.py instead of starting Python: what a test
sees of a run must be what a fresh `python SCRIPT ARGS` gives."""

import os
import subprocess
import textwrap

import pytest

from conftest import NO_ZYGOTE
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
