"""A process that imports torch and transformers (and vLLM's dependencies) once and forks a
child for each `python SCRIPT ARGS` the tests ask of `conftest.run_py`.

Why: about a hundred of the suite's cases run a script that fails or finishes within a second
(a bad flag, a crafted file, `checkpoint.py verify`), and each paid ~5 s of imports on this
machine before reaching its first line. A forked child starts with those modules loaded.

What a child runs is what `python SCRIPT ARGS` runs, but for the third-party imports: the
script as `__main__` (runpy), its argv, folder on sys.path, working directory and environment
(this process's own was the tests' at start: no GPU), its stdout and stderr in the files the
request names, stdin from /dev/null; the project's own modules are imported by the child, fresh
(common.py sets an environment variable at import). At the end, as the interpreter does: a
SystemExit's status (its message to stderr), a traceback and status 1 for anything else, threads
joined, atexit handlers run, streams flushed.

Protocol (one JSON object a line): a request {"argv", "cwd", "env", "stdout", "stderr",
"timeout"} on stdin; {"status": waitpid's, "timed_out": bool} on stdout once the child has ended
(SIGKILLed at the timeout).
"""

import atexit
import gc
import importlib
import importlib.util
import io
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback

# The imports every script of the project makes; not the project's own modules (see above), not
# vLLM (it may start threads, which a fork does not copy).
import numpy  # noqa: F401
import safetensors.torch  # noqa: F401
import tokenizers  # noqa: F401
import torch  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import transformers  # noqa: F401
from transformers import AutoModelForCausalLM  # noqa: F401
from transformers import AutoModelForSequenceClassification  # noqa: F401
from transformers import AutoTokenizer  # noqa: F401

# The packages vLLM 0.32 imports when a rank builds its engine, but not vLLM itself: ~2.5 s of
# its ~4.5 s import on this machine (`python -X importtime`), in every PPO run on the vLLM engine.
# None of them leaves a thread running (OpenTelemetry's import runs its resource detectors on a
# thread pool it shuts down), none changes torch's global settings, logging or signal handlers,
# and none reads at import a setting the project or its tests give a child (TorchInductor's
# config, which reads its own, is imported with transformers above, as in a fresh process); the
# atexit handlers some register do nothing in a run that compiles nothing. A speed-up only: one
# that is missing or fails (no vLLM, as on the lent GPU machines, or another version's
# dependencies) is left to the child.
VLLM_DEPENDENCIES = (
    "aiohttp",
    "fastapi",
    "openai.types.responses",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "torch._inductor.compile_fx",
    "torch._inductor.lowering",
    "torch.utils.cpp_extension",
    "transformers.models.auto.image_processing_auto",
    "xgrammar",
)


def import_vllm_dependencies():
    if importlib.util.find_spec("vllm") is None:
        return
    for name in VLLM_DEPENDENCIES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - not this vLLM's, or broken: the child imports it
            pass


import_vllm_dependencies()

# What the imports above made lives as long as the process: out of the collector's reach
# (`gc.freeze`, as forking servers do), a child's full collections walk its own objects only and
# leave the pages it shares with this process uncopied. One walked ~618,000 objects in 0.3-0.5 s
# here, ~95,000 in 0.06-0.08 s after the freeze; vLLM makes several as an engine starts
# (`load_model`, `freeze_gc_heap`) and a stage one as it ends (`common.release_collectives`): 1-2 s
# of CPU less per 2-rank run (4+4 runs, alternated).
gc.freeze()


def exit_status(e):
    """The process status of an uncaught SystemExit, as the interpreter makes it."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1


def redirect(request):
    """fds 0, 1, 2 and sys.std* as a subprocess.run(capture_output=True) child has them."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, key in ((1, "stdout"), (2, "stderr")):
        f = os.open(request[key], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(0, closefd=False)
    sys.stdout = io.TextIOWrapper(open(1, "wb", closefd=False), encoding="utf-8")
    sys.stderr = io.TextIOWrapper(
        open(2, "wb", closefd=False), encoding="utf-8", errors="backslashreplace"
    )


def child(request):
    """Runs in the forked child; never returns."""
    status = 1
    try:
        os.setsid()  # a group of its own, with whatever it forks: killed whole at the timeout
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        redirect(request)
        script = request["argv"][0]
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        try:
            runpy.run_path(script, run_name="__main__")
            status = 0
        except SystemExit as e:
            status = exit_status(e)
        except BaseException:
            traceback.print_exc()
            status = 1
        finish()
    finally:
        os._exit(status)


def finish():
    """What the interpreter does at exit before its last flush."""
    threading._shutdown()  # non-daemon threads are joined before atexit handlers run
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()


def wait(pid, timeout):
    """(waitpid's status, whether the child was killed at the timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status, False
        time.sleep(0.005)
    os.killpg(pid, signal.SIGKILL)  # the child and its forks (tests/forked_torchrun.py's ranks)
    return os.waitpid(pid, 0)[1], True


def main():
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(request)
        status, timed_out = wait(pid, request["timeout"])
        print(json.dumps({"status": status, "timed_out": timed_out}), flush=True)


if __name__ == "__main__":
    main()
