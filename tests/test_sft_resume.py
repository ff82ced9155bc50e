"""Exact resume of train_sft.py under torchrun with 2 ranks,
and the checkpoint's safety guarantees."""

import io
import json
import os
import pickle
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO
from conftest import TORCHRUN
from conftest import assert_same_tensors
from conftest import assert_steps_match
from conftest import kill_tree
from conftest import latest
from conftest import metrics
from conftest import plain_steps
from conftest import rewrite_manifest
from conftest import run
from conftest import run_py
from conftest import stage_args

pytestmark = pytest.mark.slow

N = 10  # steps; the 64-example file makes 4 steps per epoch


def sft(out, data, *extra, model=None, micro=4):
    args = ("--data", data, "--eval_data", data, "--eval_samples", 16, "--train_batch_size", 16)
    args += ("--micro_batch_size", micro, "--max_steps", N, "--eval_every", 5, "--save_every", 100)
    args += ("--warmup_steps", 2, "--out_dir", out)
    if model:
        args += ("--model", model)
    return args + extra


@pytest.fixture(scope="module")
def straight_dropout(tmp_path_factory, addition_jsonl, dropout_model):
    out = str(tmp_path_factory.mktemp("straight-dropout"))
    run("train_sft.py", *sft(out, addition_jsonl, model=dropout_model))
    return out


@pytest.fixture(scope="module")
def straight(tmp_path_factory, addition_jsonl):
    out = str(tmp_path_factory.mktemp("straight"))
    run("train_sft.py", *sft(out, addition_jsonl))
    return out


@pytest.mark.parametrize("micro", [4, 32], ids=["two-micro-batches", "micro-batch-above-share"])
def test_the_steps_are_the_papers_loss_over_the_whole_batch(
    micro, tmp_path, straight, addition_jsonl, one_rank
):
    """Two ranks, two micro-batches each, FSDP2 and fused AdamW log, step by step, what one process
    computes from the whole global batch at once (`conftest.plain_steps`): the loss of Ouyang et
    al. 2022's SFT, the mean negative log-likelihood over every response token of the batch, the
    norm of its gradient before clipping, the rate. A --micro_batch_size above a rank's share (32
    against 8) makes the share one micro-batch, and the same steps (it was refused at start-up:
    the defaults stopped on 8 GPUs)."""
    from transformers import AutoModelForCausalLM

    import common
    import train_sft

    out = straight
    if micro != 4:
        out = str(tmp_path)
        run("train_sft.py", *sft(out, addition_jsonl, micro=micro))
    args = stage_args(train_sft, *sft(out, addition_jsonl, micro=micro))
    model, tok = common.load_model_and_tokenizer(
        args.model, AutoModelForCausalLM, args.attn_implementation
    )
    model.train()
    train, _ = train_sft.load_data(args, tok, common.context_length(args.model, model.config))

    def loss_fn(model, batch):
        nll = []
        for ids, n_prompt in batch:  # one unpadded sequence at a time
            x = torch.tensor([ids])
            logprobs = model(input_ids=x).logits[0].float().log_softmax(-1)  # [T, V]
            # token t is predicted at t - 1: the response's from the prompt's last token on
            nll.append(-logprobs[n_prompt - 1 : -1].gather(1, x[0, n_prompt:, None]))
        return torch.cat(nll).mean(), {}

    assert_steps_match(out, plain_steps(args, model, train, loss_fn, args.weight_decay))


@pytest.mark.parametrize("k", [4, 6], ids=["epoch-boundary", "mid-epoch"])
def test_resume_is_bitwise_exact(k, tmp_path, straight_dropout, addition_jsonl, dropout_model):
    out = str(tmp_path)
    run("train_sft.py", *sft(out, addition_jsonl, "--stop_at_step", k, model=dropout_model))
    assert latest(out).endswith(f"step-{k:08d}") and not os.path.exists(os.path.join(out, "hf"))
    p = run("train_sft.py", *sft(out, addition_jsonl, "--resume", "latest", model=dropout_model))
    assert f"at step {k}" in p.stdout + p.stderr
    assert_same_tensors(latest(straight_dropout), latest(out))
    assert metrics(straight_dropout) == metrics(out)  # every step's loss, lr, grad norm, accuracy
    a = json.load(open(os.path.join(latest(straight_dropout), "meta.json")))
    b = json.load(open(os.path.join(latest(out), "meta.json")))
    assert a["scheduler"] == b["scheduler"]
    assert a["consumed_samples"] == b["consumed_samples"] == N * 16
    ea = load_file(os.path.join(straight_dropout, "hf", "model.safetensors"))
    eb = load_file(os.path.join(out, "hf", "model.safetensors"))
    assert ea.keys() == eb.keys() and all(torch.equal(ea[n], eb[n]) for n in ea)


def test_dropout_makes_rng_matter(straight_dropout, straight):
    """The dropout run differs from the dropout-free one,
    so the exact match above needed the RNG."""
    assert metrics(straight_dropout)[1]["train/loss"] != metrics(straight)[1]["train/loss"]


def test_resume_on_one_rank_continues_from_the_right_sample(tmp_path, straight, addition_jsonl):
    out = str(tmp_path)
    k = 6
    run("train_sft.py", *sft(out, addition_jsonl, "--stop_at_step", k))
    p = run("train_sft.py", *sft(out, addition_jsonl, "--resume", "latest"), nproc=1)
    said = "checkpoint on 1 rank: weights, optimizer and data position carry over, RNG streams"
    assert f"{said} cannot" in p.stdout + p.stderr
    assert "starts a new one" not in p.stdout + p.stderr  # 2 -> 1: no rank lacks a stream
    want = metrics(straight)
    got = metrics(out)
    assert [r["step"] for r in got] == list(range(1, N + 1))
    # Same weights (resharded by DCP) and the same batch: step k+1's loss matches up to summation
    # order. A wrong data position would give another batch, whose loss differs by far more.
    assert abs(got[k]["train/loss"] - want[k]["train/loss"]) < 1e-5
    others = [abs(want[k]["train/loss"] - r["train/loss"]) for r in want if r["step"] != k + 1]
    assert min(others) > 1e-3
    for r, w in zip(got[k:], want[k:]):
        assert abs(r["train/loss"] - w["train/loss"]) < 1e-3


def test_a_rank_the_checkpoint_has_no_stream_for_starts_its_own(
    tmp_path, addition_jsonl, dropout_model
):
    """A 1-rank checkpoint resumed on 2 ranks: rank 1 took a copy of rank 0's stream, and both
    drew the same from then on (the same dropout masks for the same shapes; Python's and NumPy's
    states, which training does not draw from, saved equal). Now rank 1 starts a stream of its
    own (`checkpoint.py: seed_new_stream`)."""
    out = str(tmp_path)
    run(
        "train_sft.py", *sft(out, addition_jsonl, "--stop_at_step", 6, model=dropout_model), nproc=1
    )
    p = run("train_sft.py", *sft(out, addition_jsonl, "--resume", "latest", model=dropout_model))
    assert "starts a new one" in p.stdout + p.stderr
    rng = [json.load(open(os.path.join(latest(out), f"rng-rank{r}.json"))) for r in (0, 1)]
    for kind in ("python", "numpy", "torch"):
        assert rng[0][kind] != rng[1][kind], kind


def test_sigkill_during_save_leaves_a_verified_latest(tmp_path, straight, addition_jsonl):
    out = str(tmp_path)
    root = os.path.join(out, "checkpoints")
    args = sft(out, addition_jsonl, "--save_every", 1, "--keep_last", 2)
    script = os.path.join(REPO, "train_sft.py")
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", script, *map(str, args)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    killed_in_save = False
    while proc.poll() is None:  # kill the whole group the moment a save is under way
        names = os.listdir(root) if os.path.isdir(root) else []
        if "latest" in names and any(n.startswith(".tmp-") for n in names):
            killed_in_save = kill_tree(proc.pid) == -9  # not if the run had ended just then
            break
        time.sleep(0.002)
    proc.wait()
    assert killed_in_save, "the run finished before a save could be interrupted"
    p = run_py("checkpoint.py", "verify", latest(out))
    assert p.returncode == 0, p.stderr
    before = latest(out)
    k = int(os.path.basename(before).removeprefix("step-"))
    args = sft(out, addition_jsonl, "--resume", "latest", "--save_every", 1)
    p = run("train_sft.py", *args)
    # it went on from the checkpoint (a start from scratch would end with the same weights)
    assert f"resumed from {before} at step {k}" in p.stdout, p.stdout[-2000:]
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-")]
    assert_same_tensors(latest(straight), latest(out))


def test_corrupt_checkpoint_is_detected(tmp_path, addition_jsonl):
    out = str(tmp_path)
    args = sft(out, addition_jsonl, "--save_every", 3, "--max_steps", 6, "--keep_last", 3)
    run("train_sft.py", *args)
    newest = latest(out)
    assert newest.endswith("step-00000006")
    victim = os.path.join(newest, "dcp", "__0_0.distcp")
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    open(victim, "wb").write(data)

    p = run_py("checkpoint.py", "verify", newest)
    assert p.returncode != 0 and "__0_0.distcp" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    p = run("train_sft.py", *args, "--resume", newest, check=False)
    assert p.returncode != 0 and "__0_0.distcp: checksum mismatch" in p.stderr
    p = run("train_sft.py", *args, "--resume", "latest")
    assert "WARNING: skipping checkpoint step-00000006" in p.stdout + p.stderr
    assert "resumed from" in p.stdout + p.stderr
    assert "step-00000003 at step 3" in p.stdout + p.stderr

    # Truncation of a small file of the (re-saved) newest checkpoint is caught as well.
    rng = os.path.join(latest(out), "rng-rank1.json")
    open(rng, "r+").truncate(100)
    p = run("train_sft.py", *args, "--resume", latest(out), check=False)
    assert p.returncode != 0 and "rng-rank1.json: size 100" in p.stderr
    root = os.path.join(out, "checkpoints")
    older = os.path.join(root, "step-00000003")
    newer = os.path.join(root, "step-00000006")
    p = run_py("checkpoint.py", "verify", older, newer)
    assert p.returncode != 0 and "step-00000003: ok, step 3" in p.stdout
    assert "rng-rank1.json: size 100" in p.stderr

    # Two damaged files, hashed by different ranks (resume shares the sums out): the one named is
    # the manifest's first, as `checkpoint.py verify` (one process, in order) names it.
    shard = os.path.join(newer, "dcp", "__1_0.distcp")
    data = bytearray(open(shard, "rb").read())
    data[-1] ^= 0x80
    open(shard, "wb").write(data)
    p = run_py("checkpoint.py", "verify", newer)
    assert p.returncode != 0 and "__1_0.distcp: checksum mismatch" in p.stderr
    p = run("train_sft.py", *args, "--resume", newer, check=False)
    assert p.returncode != 0 and "__1_0.distcp: checksum mismatch" in p.stderr
    assert "rng-rank1.json" not in p.stderr


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_payloads_are_refused(tmp_path, addition_jsonl):
    out = str(tmp_path / "run")
    flags = ("--max_steps", 1, "--train_batch_size", 4, "--micro_batch_size", 4)
    args = sft(out, addition_jsonl, *flags)
    run("train_sft.py", *args, nproc=1)
    ckpt = latest(out)
    meta_path = os.path.join(ckpt, "dcp", ".metadata")
    original = open(meta_path, "rb").read()
    marker = tmp_path / "pwned"

    # 1. The .metadata file itself is a pickle.
    open(meta_path, "wb").write(pickle.dumps(Payload(marker)))
    rewrite_manifest(ckpt)  # an attacker can rewrite checksums too
    p = run_py("checkpoint.py", "export", ckpt, tmp_path / "export")
    assert p.returncode != 0 and "refusing to unpickle" in p.stderr
    p = run("train_sft.py", *args, "--resume", ckpt, nproc=1, check=False)
    assert p.returncode != 0 and "refusing to unpickle" in p.stderr
    assert not marker.exists()

    # 2. A non-tensor entry (an optimizer param_group value) is a torch.save pickle
    # inside a .distcp.
    md = pickle.loads(original)  # our own, trusted file
    key = next(k for k in md.storage_data if k.fqn.endswith("param_groups.0.lr"))
    info = md.storage_data[key]
    shard = os.path.join(ckpt, "dcp", info.relative_path)
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    offset = os.path.getsize(shard)
    open(shard, "ab").write(buf.getvalue())
    md.storage_data[key] = type(info)(info.relative_path, offset, len(buf.getvalue()))
    open(meta_path, "wb").write(pickle.dumps(md))
    rewrite_manifest(ckpt)
    p = run("train_sft.py", *args, "--resume", ckpt, nproc=1, check=False)
    line = f"error: {ckpt}: model.optim.param_groups.0.lr: refusing to unpickle it (the global "
    assert p.returncode != 0 and line in p.stderr, p.stderr[:2000]
    assert not marker.exists()


@pytest.mark.parametrize("store", ["shared", "per-round"])
def test_torchrun_restarts_a_killed_rank_and_resumes(tmp_path, straight, addition_jsonl, store):
    """launch.sh passes --max-restarts: when a rank dies the group restarts, and the restarted run
    (TORCHELASTIC_RESTART_COUNT > 0) resumes from latest by itself and ends with the same weights.
    shared: torchrun's default, one store for every round; without init_distributed's per-attempt
    store prefix this failed 3 times in 5 here (gloo could not connect: the new group read the
    dead group's addresses). per-round: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, what launch.sh sets
    on several nodes (`common.check_restarts_can_meet`): rank 0 serves a new store each round,
    used without a prefix."""
    import psutil

    out = str(tmp_path)
    args = sft(out, addition_jsonl, "--save_every", 3)
    script = os.path.join(REPO, "train_sft.py")
    launcher = [TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=1"]
    cmd = [*launcher, script, *map(str, args)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    if store == "per-round":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    killed = False
    while proc.poll() is None and not killed:  # SIGKILL rank 1 once a checkpoint exists
        if os.path.exists(os.path.join(out, "checkpoints", "latest")):
            for child in psutil.Process(proc.pid).children(recursive=True):
                try:
                    rank = child.environ().get("RANK")
                    if rank == "1" and "train_sft.py" in " ".join(child.cmdline()):
                        child.kill()
                        killed = True
                except psutil.NoSuchProcess:
                    pass
        time.sleep(0.01)
    log, _ = proc.communicate(timeout=600)
    assert killed and proc.returncode == 0, log[-3000:]
    assert "resumed from" in log  # the restarted group found the checkpoint without being told
    assert_same_tensors(latest(straight), latest(out))
    assert metrics(straight) == metrics(out)


@pytest.mark.parametrize(
    "flag", [("--gradient_checkpointing", "true"), ("--reshard_after_forward", "false")]
)
def test_memory_settings_change_nothing_but_memory(
    tmp_path, straight_dropout, addition_jsonl, dropout_model, flag
):
    """Recomputing each block's activations in the backward (with attention dropout on: the
    recompute must draw the same masks), or keeping FSDP2's gathered parameters from forward to
    backward (and after the evaluation's generate, until the save reshards them), gives the same
    weights, optimizer state and metrics."""
    out = str(tmp_path)
    args = sft(out, addition_jsonl, *flag, model=dropout_model)
    run("train_sft.py", *args)
    assert_same_tensors(latest(straight_dropout), latest(out))
    assert metrics(straight_dropout) == metrics(out)
