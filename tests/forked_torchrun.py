"""`torchrun TORCHRUN_ARGS SCRIPT ARGS` with its workers forked from this process: what
`conftest.run` asks of tests/zygote.py, which has imported torch and transformers already.

Why: a 2-rank run on this machine paid ~2.4 s for torchrun's own start and ~3.5 s of imports in
each rank before the script's first line; the suite makes a few hundred such runs. Here only the
script's own modules (and vLLM's, where a rank builds an engine) are imported by each rank.

It is torchrun: `torch.distributed.run.main` with the caller's flags plus torchrun's own
`--run-path` (the script runs as a function in a worker process) and `--start-method fork` (the
workers are forked from this process, not spawned). The same rendezvous, environment per rank
(RANK, WORLD_SIZE, MASTER_ADDR, OMP_NUM_THREADS, ...), failure handling and exit status. One
thing is replaced: torchrun's `run_script_path` (`runpy.run_path` and nothing else) by
`run_script` below, which ends a rank as `python -u SCRIPT ARGS` ends: unbuffered output, the
script's folder first on sys.path, a SystemExit's status and message, an uncaught exception
through sys.excepthook (torch.distributed's, once the process group exists: the "[rank0]:"
prefix), non-daemon threads joined and atexit handlers run (an object-store lock is released
at exit), the thread count of OMP_NUM_THREADS.

Usage (from conftest.run, through tests/zygote.py; or from conftest.popen_torchrun, in a fresh
Python that imports tests/zygote.py's modules below): forked_torchrun.py TORCHRUN_ARGS SCRIPT
ARGS, with SCRIPT's path absolute.
"""

import io
import os
import runpy
import sys

import torch
import torch.distributed.run
from torch.distributed.elastic.multiprocessing.errors import record

# this file runs from tests/zygote.py or as a script in tests/: tests/ is on sys.path
from zygote import exit_status
from zygote import finish


def unbuffered():
    """sys.stdout/stderr written through at once, as `python -u` (torchrun's own worker command)
    has them: a rank's last line is not lost when its process ends abruptly."""
    sys.stdout = io.TextIOWrapper(
        open(1, "wb", buffering=0, closefd=False), encoding="utf-8", write_through=True
    )
    sys.stderr = io.TextIOWrapper(
        open(2, "wb", buffering=0, closefd=False),
        encoding="utf-8",
        errors="backslashreplace",
        write_through=True,
    )


def run_script(training_script, *training_script_args):
    """A rank: the script as `__main__`. A clean end returns (torchrun's worker wrapper then
    reports it and the process exits 0); any other end exits here with the interpreter's status."""
    sys.argv = [training_script, *training_script_args]
    sys.path[0] = os.path.dirname(training_script)
    # /proc shows a forked rank the launcher's command line and environment (RANK is set after
    # the fork), so a test finds the ranks by this name (`conftest.workers`; `ps` shows it too)
    with open("/proc/self/comm", "w") as comm:
        comm.write(f"rank{os.environ['RANK']}")
    # libgomp read OMP_NUM_THREADS when torch was imported, before torchrun set it for the rank
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    status = 0
    try:
        runpy.run_path(training_script, run_name="__main__")
    except SystemExit as e:
        status = exit_status(e)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        status = 1
    finish()
    if status != 0:
        os._exit(status)


def main():
    """torchrun's own `main`: its parser, then `run` under `record`."""
    unbuffered()
    torch.distributed.run.run_script_path = run_script  # what --run-path calls in each rank
    args = torch.distributed.run.parse_args(sys.argv[1:])
    args.run_path = True
    args.start_method = "fork"
    os.environ["PLAINRLHF_LAUNCHER_PID"] = str(os.getpid())  # as launch.sh's torchrun does
    record(torch.distributed.run.run)(args)


if __name__ == "__main__":
    main()
