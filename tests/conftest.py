"""Helpers for the tests: run the real scripts under the real torchrun, read checkpoints back."""

import io
import json
import math
import os
import pickle
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import checkpoint  # noqa: E402
import task  # noqa: E402

PY = sys.executable
TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")


CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


def run(script, *args, nproc=2, check=True, timeout=600, env=None, gpu=False):
    """`torchrun --standalone --nproc_per_node=nproc script args`; returns the CompletedProcess.
    Without gpu, the run sees no GPU even where there is one: the CPU suite's checks are fp32
    and bitwise (on a GPU the same code runs NCCL and bf16), and 2 ranks on a 1-GPU machine would
    ask for a device that is not there. tests/test_gpu.py passes gpu=True.
    A CPU run with the tests' own environment is forked from tests/zygote.py through
    tests/forked_torchrun.py (torchrun itself, its ranks forked: ~8 s a run less);
    PLAINRLHF_TESTS_NO_ZYGOTE=1 starts `torchrun` as a user would."""
    path = os.path.join(REPO, script)
    cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", path, *map(str, args)]
    full_env = {**os.environ, **CPU_ONLY, **(env or {})}
    if gpu:
        full_env = {**os.environ, **(env or {})}
    forked = not gpu and env is None and os.environ.get(NO_ZYGOTE) != "1"
    if forked:
        p = run_forked([PY, FORKED_TORCHRUN, *cmd[1:]], timeout, full_env)
    else:
        p = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=full_env
        )
    if check and p.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
        )
    return p


def popen_torchrun(script, *args, env=None, nproc=2, **popen_kwargs):
    """`torchrun --standalone --nproc_per_node=nproc script args` as a subprocess.Popen, for a
    test that starts the run itself (to signal or kill it mid-way: a child of its own), on the
    CPU as `run` has it, `env` added to the tests' environment. It starts
    tests/forked_torchrun.py in a fresh Python, which imports torch, transformers and vLLM's
    dependencies once and forks its ranks from itself, instead of torchrun and a fresh
    interpreter per rank importing them each (the PPO SIGKILL test, three launches: 123 s, then
    62-109 s, on this machine); PLAINRLHF_TESTS_NO_ZYGOTE=1 gives `torchrun` itself. The CPU is
    not only for the checks: xgrammar's import asks CUDA, which a rank forked after it could not
    use."""
    path = os.path.join(REPO, script)
    flags = ["--standalone", f"--nproc_per_node={nproc}", path, *map(str, args)]
    cmd = [PY, FORKED_TORCHRUN, *flags]
    if os.environ.get(NO_ZYGOTE) == "1":
        cmd = [TORCHRUN, *flags]
    full_env = {**os.environ, **CPU_ONLY, **(env or {})}
    return subprocess.Popen(cmd, cwd=REPO, env=full_env, **popen_kwargs)


def run_py(*args, check=False, timeout=300, env=None):
    """Plain `python args...` in the repo (one process; the scripts make their own 1-rank group),
    on the CPU as `run` without gpu. A script run with the tests' own environment is forked from
    tests/zygote.py, which has imported torch and transformers already (~5 s a case less);
    `python -c`, an `env` of the test's own (read at import, perhaps) and
    PLAINRLHF_TESTS_NO_ZYGOTE=1 start a fresh interpreter."""
    cmd = [PY, *map(str, args)]
    full_env = {**os.environ, **CPU_ONLY, **(env or {})}
    fresh = env is not None or cmd[1].startswith("-") or os.environ.get(NO_ZYGOTE) == "1"
    if not fresh:
        return run_forked(cmd, timeout, full_env)
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=full_env
    )


NO_ZYGOTE = "PLAINRLHF_TESTS_NO_ZYGOTE"
FORKED_TORCHRUN = os.path.join(REPO, "tests", "forked_torchrun.py")
_zygote = []  # this pytest process's tests/zygote.py, started at its first use
_zygote_lock = threading.Lock()  # one request at a time on its pipes


def zygote():
    if not _zygote or _zygote[0].poll() is not None:
        path = os.path.join(REPO, "tests", "zygote.py")
        env = {**os.environ, **CPU_ONLY}
        pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        _zygote[:] = [subprocess.Popen([PY, path], cwd=REPO, env=env, **pipes)]
    return _zygote[0]


def run_forked(cmd, timeout, env):
    """run_py's `cmd` as a child of the zygote; the same CompletedProcess, or TimeoutExpired."""
    with _zygote_lock:
        return _run_forked(cmd, timeout, env)


def _run_forked(cmd, timeout, env):
    z = zygote()
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "stdout")
        err = os.path.join(folder, "stderr")
        request = {"argv": cmd[1:], "cwd": REPO, "env": env, "stdout": out, "stderr": err}
        z.stdin.write(json.dumps({**request, "timeout": timeout}) + "\n")
        z.stdin.flush()
        reply = json.loads(z.stdout.readline())
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(cmd, timeout)
        # text=True's decoding: the locale's encoding, universal newlines
        stdout = open(out).read()
        stderr = open(err).read()
    return subprocess.CompletedProcess(
        cmd, os.waitstatus_to_exitcode(reply["status"]), stdout, stderr
    )


def kill_tree(pid, sig=9):
    """SIGKILL torchrun and its workers
    (they sit in sessions of their own, so killpg misses them). Returns pid's exit status: -sig
    if the signal ended it, 0 if it had finished first, None if it had finished and was reaped
    already (a Popen's poll() reaps: the kill landed nowhere, and the caller's `== -9` says so
    instead of psutil's traceback). psutil reaps it here, so a Popen's own wait() afterwards
    reads 0 whatever happened: use this."""
    import psutil

    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    gone, _ = psutil.wait_procs(procs, timeout=30)
    return {p.pid: p.returncode for p in gone}.get(pid)


def logged_steps(out):
    path = os.path.join(out, "metrics.jsonl")
    return sum(1 for line in open(path) if line.endswith("\n")) if os.path.exists(path) else 0


def workers(pid):
    """The training processes under a torchrun (or launch.sh, or `popen_torchrun`) pid, by rank."""
    if FORKED_TORCHRUN in psutil.Process(pid).cmdline():
        return forked_ranks(pid)
    found = {}
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if (
                "train_" in " ".join(p.cmdline())
                and "RANK" in p.environ()
                and "torchrun" not in p.cmdline()[1]
            ):
                found[int(p.environ()["RANK"])] = p
        except (psutil.NoSuchProcess, IndexError):
            pass
    return found


def forked_ranks(pid):
    """The ranks of tests/forked_torchrun.py (`popen_torchrun`), by rank: the processes it forked,
    each named `rank<RANK>` there (/proc shows them the launcher's environment: torchrun sets
    RANK after the fork)."""
    found = {}
    for p in psutil.Process(pid).children():
        try:
            name = p.name()
        except psutil.NoSuchProcess:
            continue
        if name.startswith("rank") and name[4:].isdigit():
            found[int(name[4:])] = p
    return found


def wait_for(cond, proc, timeout=300):
    t0 = time.time()
    while not cond():
        # cond() once more once it has ended: it may have come true just before the end
        assert proc.poll() is None or cond(), (
            f"the run ended (exit {proc.returncode}) before the moment to interrupt it"
        )
        if proc.returncode is not None:
            return
        assert time.time() - t0 < timeout
        time.sleep(0.005)


def read_tensors(ckpt):
    """Every tensor of a checkpoint's DCP state (model and optimizer), by flat key."""
    path = os.path.join(ckpt, "dcp")
    md = checkpoint._SafeReader(path).read_metadata()
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in md.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    dcp.load(
        state,
        storage_reader=checkpoint._SafeReader(path),
        planner=checkpoint._SafePlanner(),
        no_dist=True,
    )
    return state


def assert_same_tensors(a, b):
    ta = read_tensors(a)
    tb = read_tensors(b)
    assert ta.keys() == tb.keys()
    assert any(".optim.state." in k for k in ta), "optimizer state missing from the checkpoint"
    bad = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert not bad, f"{len(bad)} tensors differ, e.g. {bad[:3]}"


def kill_twice_then_resume(script, args, out, straight, latest_sleep, seed):
    """SIGKILL a run of `script args` (which resumes: --resume latest, --save_every 1,
    --async_save true) and its whole tree twice, each time a fresh start: once at a random moment
    up to `latest_sleep` s after two rows are logged, once while an asynchronous save of its own is
    being written. Then it resumes to the end, which must hold the uninterrupted run's (`straight`)
    every tensor (weights, optimizer state) and every logged metric. The moments (attempt, rows
    logged, checkpoint folder's names) say where a failure began."""
    root = os.path.join(out, "checkpoints")
    rng = random.Random(seed)
    moments = []
    for attempt in range(2):
        stale = set(os.listdir(root)) if os.path.isdir(root) else set()

        def saving():  # a committed checkpoint, and a save of this start's under way
            names = set(os.listdir(root)) if os.path.isdir(root) else set()
            return "latest" in names and any(n.startswith(".tmp-") for n in names - stale)

        proc = popen_torchrun(script, *args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        if attempt == 0:  # two rows (PPO: step 0's evaluation and step 1); then anywhere
            wait_for(lambda: logged_steps(out) >= 2, proc)
            time.sleep(rng.uniform(0, latest_sleep))
        else:
            wait_for(saving, proc)
        moments.append((attempt, logged_steps(out), sorted(os.listdir(root))))
        assert kill_tree(proc.pid) == -9, moments  # it landed: the run had not ended
        proc.wait()
    p = run(script, *args)
    assert "resumed from" in p.stdout + p.stderr, moments
    assert_same_tensors(latest(straight), latest(out))
    assert metrics(straight) == metrics(out), moments


def assert_same_export(a, b):
    """The two runs' exports (`<out_dir>/hf/model.safetensors`) hold equal tensors, bit for bit."""
    from safetensors.torch import load_file

    a = load_file(os.path.join(a, "hf", "model.safetensors"))
    b = load_file(os.path.join(b, "hf", "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def stage_args(stage, *argv):
    """`stage.Args` as `stage`'s command line `argv` makes them (`common.parse_args`)."""
    import common

    saved = sys.argv
    sys.argv = [stage.__name__ + ".py", *map(str, argv)]
    try:
        return common.parse_args(stage.Args, stage.LIMITS)
    finally:
        sys.argv = saved


def cosine_rate(step, peak, warmup, total):
    """The learning rate of step `step` (from 0): linear warmup from 0, then a half cosine down to
    0 at `total` (transformers' get_cosine_schedule_with_warmup, written out)."""
    if step < warmup:
        return peak * step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return peak * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def plain_steps(args, model, train, loss_fn, weight_decay):
    """A stage's --max_steps optimizer steps written the plain way, as a reader of the papers would:
    one process, no FSDP, no micro-batches, no normaliser split over ranks. Each step's global batch
    (drawn as the stages draw it: `common.batch_indices`) goes through `loss_fn(model, batch)` ->
    (the loss over the whole batch, {logged name: value}) in one piece, one backward, torch's
    clip_grad_norm_, and AdamW as torch's loop over tensors (the stages run its fused kernel) at
    the schedule's rate written out. Returns each step's metrics, named as the stages log them."""
    import common

    optim = torch.optim.AdamW(
        model.parameters(), betas=(0.9, 0.95), weight_decay=weight_decay, foreach=False
    )
    logged = []
    for step in range(args.max_steps):
        idx, _ = common.batch_indices(step, len(train), args.train_batch_size, args.seed)
        rate = cosine_rate(step, args.lr, args.warmup_steps, args.max_steps)
        for group in optim.param_groups:
            group["lr"] = rate
        loss, row = loss_fn(model, [train[i] for i in idx])
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optim.step()
        optim.zero_grad()
        row.update({"train/loss": loss.item(), "train/grad_norm": grad_norm.item()})
        row["train/lr"] = rate
        logged.append(row)
    return logged


def assert_steps_match(out_dir, reference):
    """The run's logged training steps agree with `plain_steps`' to fp32 rounding: the kernels
    and the order of the sums differ (fused AdamW, FSDP2's reduce-scatter), nothing else may. A
    structural slip moves them at the third digit (a loss averaged per rank or per micro-batch
    moved the SFT run's grad norm at step 2 by 0.3%: measured, helper 74)."""
    rows = [row for row in metrics(out_dir) if "train/loss" in row]
    assert [row["step"] for row in rows] == list(range(1, len(reference) + 1))
    for row, want in zip(rows, reference):
        for key, value in want.items():
            assert row[key] == pytest.approx(value, rel=2e-5, abs=1e-7), (row["step"], key)


def dcp_folder(tmp_path):
    """A real one-process DCP checkpoint of one tensor in tmp_path/dcp; returns (folder, its
    metadata). Its records carry their zip CRC32s (`deflated_copy` reads them with zipfile, which
    checks them) even where this process has saved a checkpoint, which turns them off."""
    folder = tmp_path / "dcp"
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(True)
    try:
        dcp.save({"t": torch.arange(1000.0)}, checkpoint_id=str(folder), no_dist=True)
    finally:
        torch.serialization.set_crc32_options(crc)
    md = pickle.loads((folder / ".metadata").read_bytes())  # our own file, just written
    return folder, md


def deflated_copy(record):
    """A torch.save zip `record` (bytes) with every record deflated, as no torch.save writes it."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(record)) as src:
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
            for name in src.namelist():
                dst.writestr(name, src.read(name))
    return out.getvalue()


def write_dead_rows(out_dir, steps):
    """metrics.jsonl as a run killed before its first save leaves it: a row for each of `steps`,
    then one cut short by the kill. Returns the whole rows' text."""
    rows = "".join(json.dumps({"step": s, "train/loss": 99.0}) + "\n" for s in steps)
    with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
        f.write(rows + f'{{"step": {steps[-1] + 1}, "train/lo')
    return rows


def metrics(out_dir, drop=("time/",)):
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    return [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rows]


def latest(out_dir):
    root = os.path.join(out_dir, "checkpoints")
    return os.path.join(root, open(os.path.join(root, "latest")).read().strip())


def rewrite_manifest(ckpt):
    """What an attacker (or a test) does after editing files: make the checksums match again."""
    m = json.load(open(os.path.join(ckpt, "manifest.json")))
    m["files"] = checkpoint._manifest_files(ckpt)
    json.dump(m, open(os.path.join(ckpt, "manifest.json"), "w"))


def write_small_checkpoint(path, step=1):
    """A checkpoint's files: meta.json, one rank's RNG file, a.bin, sub/b.bin, a DCP save of one
    tensor in dcp/ (verify() reads its .metadata), and the manifest of them."""
    dcp.save({"t": torch.arange(4.0)}, checkpoint_id=str(path / "dcp"), no_dist=True)
    meta = {"format_version": 1, "step": step, "world_size": 1, "roles": ["model"], "args": {}}
    (path / "meta.json").write_text(json.dumps(meta))
    (path / "rng-rank0.json").write_text(json.dumps(checkpoint.rng_state()))
    (path / "a.bin").write_bytes(b"hello")
    (path / "sub").mkdir()
    (path / "sub" / "b.bin").write_bytes(b"world")
    files = checkpoint._manifest_files(str(path))
    (path / "manifest.json").write_text(json.dumps({"step": step, "files": files}))


@pytest.fixture
def one_rank():
    """A process group of one rank, in-process, as a run has one (what these tests call asks for
    the rank, or runs a collective); an earlier in-process test's group is used as it is."""
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if owned:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def addition_jsonl(tmp_path_factory):
    """A small training file: 64 addition examples, so an epoch is 4 steps of 16."""
    p = tmp_path_factory.mktemp("data") / "train.jsonl"
    with open(p, "w") as f:
        examples = task.make_split("train")[:64]
        for ex in examples:
            f.write(json.dumps(ex) + "\n")
    return str(p)


@pytest.fixture(scope="session")
def dropout_model(tmp_path_factory):
    """The tiny model with attention dropout on: resume must restore every rank's RNG to match."""
    d = tmp_path_factory.mktemp("dropout-model")
    for f in os.listdir(task.TINY_MODEL):
        if f != "model.safetensors":
            shutil.copy(os.path.join(task.TINY_MODEL, f), d)
    cfg = json.load(open(d / "config.json"))
    cfg["attention_dropout"] = 0.1
    json.dump(cfg, open(d / "config.json", "w"))
    task.ensure_tiny_model(str(d))
    return str(d)


@pytest.fixture(scope="session")
def memorised_sft(tmp_path_factory):
    """A start with something to lose, fast: the tiny model SFT-trained on 16 held-out sums until it
    answers them all (80 steps, 100% greedy on them, checked). Returns (its hf/ export, those 16
    examples as a JSONL for --eval_data, their preference pairs as a JSONL for --data)."""
    d = tmp_path_factory.mktemp("memorised")
    examples = task.make_split("test")[:16]
    pairs = task.make_pairs("test")[:16]  # the same prompts, in the same order
    eval_path = str(d / "eval.jsonl")
    pairs_path = str(d / "pairs.jsonl")
    with open(eval_path, "w") as f:
        f.writelines(json.dumps(ex) + "\n" for ex in examples)
    with open(pairs_path, "w") as f:
        f.writelines(json.dumps(pair) + "\n" for pair in pairs)
    out = str(d / "sft")
    args = ("--data", eval_path, "--eval_data", eval_path, "--out_dir", out, "--max_steps", 80)
    args += ("--train_batch_size", 16, "--micro_batch_size", 8, "--warmup_steps", 5)
    args += ("--weight_decay", 0)  # memorising is the point here: no pull towards small weights
    run("train_sft.py", *args, "--eval_every", 0, "--eval_samples", 16, "--save_every", 0)
    assert metrics(out)[-1]["eval/accuracy"] == 1.0
    return os.path.join(out, "hf"), eval_path, pairs_path


@pytest.fixture
def fsynced(monkeypatch):
    """The paths `os.fsync` is called on from here on, in order (the real fsync still runs)."""
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def tiny_llama(vocab_size):
    """A 2-block random Llama (seed 0) in eval mode, as build_models leaves it: no dropout."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


class NoKeep(torch.nn.Module):
    """A causal LM whose forward takes no `logits_to_keep` (as Whisper's decoder): its head runs
    at every column."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask, use_cache, position_ids=None):
        return self.inner(input_ids, attention_mask, position_ids=position_ids)


# A chat template that reads Qwen3's switch: `enable_thinking` false adds an empty think block after
# the generation prompt (--chat_template_kwargs). Spaces, not newlines: the tiny model has none.
THINKING_TEMPLATE = (
    "{%- for m in messages %}{{- m.role + ': ' + m.content + ' ' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'assistant: ' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think></think>' }}"
    "{%- endif %}{%- endif %}"
)


def right_padded(seqs, pad_id):
    """(input_ids, attention_mask) of token-id lists padded on the right to the longest."""
    width = max(len(s) for s in seqs)
    input_ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs])
    attention_mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    return input_ids, attention_mask
