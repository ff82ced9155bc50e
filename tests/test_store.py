"""Checkpoints straight to an object store (issue 15): a real S3 server on 127.0.0.1 (moto's
standalone server) and s3fs as the client. Save, exact resume, verify and export against it; kills
during saves; a corrupted object; the server gone mid-save."""

import json
import os
import random
import socket
import subprocess
import threading
import time

import pytest
from safetensors.torch import load_file

from conftest import assert_same_tensors
from conftest import kill_tree
from conftest import latest
from conftest import logged_steps
from conftest import metrics
from conftest import popen_torchrun
from conftest import run
from conftest import run_py

s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (requirements-cpu.txt pins it)")
moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed")

pytestmark = pytest.mark.slow
N = 6
BUCKET = "plainrlhf-test"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class Proxy:
    """A TCP forwarder in front of the server: stop() is the server vanishing mid-save for the
    client (the server itself, and what it stores, stay for the test to inspect)."""

    def __init__(self, port):
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.conns = []
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            self.conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self.pipe, args=(a, b), daemon=True).start()

    def pipe(self, a, b):
        try:
            data = a.recv(1 << 16)
            while data:
                b.sendall(data)
                data = a.recv(1 << 16)
        except OSError:
            pass
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stop(self):
        self.listener.close()
        for s in self.conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@pytest.fixture(scope="module")
def store():
    """The server; its endpoint in this process's environment (torchrun's children inherit it)."""
    saved = {k: os.environ.get(k) for k in [*CREDENTIALS, "AWS_ENDPOINT_URL_S3"]}
    os.environ.update(CREDENTIALS)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ["AWS_ENDPOINT_URL_S3"] = f"http://{host}:{port}"
    fs = s3fs.S3FileSystem()
    fs.mkdir(BUCKET)
    yield fs, port
    server.stop()
    for k, v in saved.items():
        os.environ.pop(k, None)
        if v is not None:
            os.environ[k] = v


def sft(out, data, *extra):
    args = ("--data", data, "--eval_data", data, "--eval_samples", 16, "--train_batch_size", 16)
    args += ("--micro_batch_size", 4, "--max_steps", N, "--eval_every", 3, "--save_every", 100)
    args += ("--warmup_steps", 2, "--out_dir", out, *extra)
    return args


def fetch(fs, url, local):
    """A copy of everything under url/ in the local folder (to compare tensors, metrics)."""
    fs.invalidate_cache()
    fs.get(url.rstrip("/") + "/", str(local), recursive=True)
    return str(local)


def store_latest(fs, url):
    fs.invalidate_cache()
    return fs.cat_file(f"{url}/checkpoints/latest").decode().strip()


@pytest.fixture(scope="module")
def straight(tmp_path_factory, addition_jsonl):
    """The uninterrupted run, on local disk."""
    out = str(tmp_path_factory.mktemp("straight"))
    run("train_sft.py", *sft(out, addition_jsonl, "--save_every", 2))
    return out


@pytest.fixture(scope="module")
def sft_on_store(store, addition_jsonl, tmp_path_factory):
    """SFT on the store, stopped at step 3 (saves at 2 and 3); an unfinished save planted; resumed
    to the end on a fresh local folder (a new machine). Returns (url, its logs, scratch folder)."""
    fs, _ = store
    tmp = tmp_path_factory.mktemp("sft-store")
    url = f"s3://{BUCKET}/sft"
    first = ("--save_every", 2, "--stop_at_step", 3, "--local_dir", tmp / "first")
    run("train_sft.py", *sft(url, addition_jsonl, *first))
    assert store_latest(fs, url) == "step-00000003"
    # a save killed before its manifest: objects under a prefix with no manifest
    fs.pipe_file(f"{BUCKET}/sft/checkpoints/step-00000005/dcp/__0_0.distcp", b"half")
    local = str(tmp / "logs")  # a new machine: no local logs, they come from the store
    run("train_sft.py", *sft(url, addition_jsonl, "--resume", "latest", "--local_dir", local))
    return url, local, tmp


def test_sft_save_resume_verify_export(store, straight, sft_on_store):
    """The resumed run on the store: the same tensors, metrics and export as the straight local
    run; the unfinished save deleted, the lock released; verify and export on store URLs."""
    fs, _ = store
    url, local, tmp = sft_on_store
    fs.invalidate_cache()
    assert not fs.exists(f"{BUCKET}/sft/checkpoints/step-00000005/dcp/__0_0.distcp")
    assert not fs.exists(f"{BUCKET}/sft/.lock")  # released at the clean exit
    copy = fetch(fs, url, tmp / "copy")
    assert_same_tensors(latest(straight), latest(copy))
    assert metrics(copy) == metrics(straight)
    assert metrics(local) == metrics(straight)
    want = load_file(os.path.join(straight, "hf", "model.safetensors"))
    got = load_file(os.path.join(copy, "hf", "model.safetensors"))
    assert want.keys() == got.keys() and all((want[k] == got[k]).all() for k in want)
    ckpt = f"{url}/checkpoints/step-{N:08d}"
    p = run_py("checkpoint.py", "verify", ckpt)
    assert p.returncode == 0 and f"ok, step {N}" in p.stdout, p.stderr
    p = run_py("checkpoint.py", "export", ckpt, tmp / "export")
    assert p.returncode == 0, p.stderr
    exported = load_file(str(tmp / "export" / "model.safetensors"))
    assert all((want[k] == exported[k]).all() for k in want)


def test_a_kill_right_after_a_commit_loses_no_row(store, straight, addition_jsonl, tmp_path):
    """Rank 0 killed right after step 2's save committed (tests/die_after_commit.py), then resumed
    on a new machine (a fresh --local_dir, so the logs come from the store): every row of the
    straight run. The logs went up after the commit, so a kill there (pruning, the upload itself)
    left the store's copy short of `latest`, and the resumed run lost those rows (helper 82)."""
    fs, _ = store
    url = f"s3://{BUCKET}/commit-kill"
    first = ("--save_every", 2, "--local_dir", tmp_path / "first")
    p = run("tests/die_after_commit.py", 2, *sft(url, addition_jsonl, *first), check=False)
    assert p.returncode != 0 and store_latest(fs, url) == "step-00000002", p.stderr[-3000:]
    local = tmp_path / "second"
    run("train_sft.py", *sft(url, addition_jsonl, "--resume", "latest", "--local_dir", local))
    assert metrics(local) == metrics(straight)


def test_corrupted_object_is_detected_with_fallback(store, sft_on_store, capsys):
    """A flipped byte in the latest checkpoint's shard: verify names the object, and the resume's
    pick (checkpoint.py: _candidates, _choose; in-process) falls back to the checkpoint before."""
    fs, _ = store
    url, _, _ = sft_on_store
    shard = f"{BUCKET}/sft/checkpoints/step-{N:08d}/dcp/__1_0.distcp"
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 1
    fs.pipe_file(shard, bytes(data))
    p = run_py("checkpoint.py", "verify", f"{url}/checkpoints/step-{N:08d}")
    assert p.returncode == 1 and "__1_0.distcp: checksum mismatch" in p.stderr, p.stderr
    import torch.distributed as dist

    import checkpoint

    def pick(resume):  # resolve()'s pick without its run lock: candidates, then the collective
        paths, error = checkpoint._candidates(f"{url}/checkpoints", resume)
        assert error is None
        return checkpoint._choose(paths, resume)

    # _choose is collective: a process group of one rank, in-process (an earlier in-process test
    # may have made one already: that one is used, and left as it was)
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        path, error = pick("latest")
        assert error is None and path == f"{url}/checkpoints/step-00000003"
        assert f"skipping checkpoint step-{N:08d}" in capsys.readouterr().out
        # --resume s3://.../step-N: that one, or one line naming the damaged object
        good = f"{url}/checkpoints/step-00000003"
        assert pick(good) == (good, None)
        path, error = pick(f"{url}/checkpoints/step-{N:08d}")
        assert path == "" and "__1_0.distcp: checksum mismatch" in error
    finally:
        if owned:
            dist.destroy_process_group()


def popen(url, data, *extra, env=None):
    args = sft(url, data, *extra)
    return popen_torchrun(
        "train_sft.py", *args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def unfinished(fs, name):
    """The step prefixes of s3://BUCKET/name holding objects but no manifest: saves under way."""
    fs.invalidate_cache()
    steps = {}
    for key in fs.find(f"{BUCKET}/{name}/checkpoints/"):
        parts = key.split("/")  # bucket, name, "checkpoints", step-N, ...
        if len(parts) > 4:
            steps.setdefault(parts[3], set()).add("/".join(parts[4:]))
    return sorted(step for step, files in steps.items() if "manifest.json" not in files)


def test_sigkills_during_saves_then_resume(store, straight, addition_jsonl, tmp_path):
    """SIGKILL the whole tree at random moments while every step saves (twice in the middle of a
    save: objects written, no manifest yet; every other run saves asynchronously), then --resume
    latest, until the run completes: the straight run's weights; each start deletes the killed
    save's objects."""
    fs, _ = store
    url = f"s3://{BUCKET}/kills"
    local = str(tmp_path / "logs")
    rng = random.Random(15)
    flags = ("--save_every", 1, "--keep_last", 2, "--resume", "latest", "--local_dir", local)
    mid_save = []
    for attempt in range(4):
        async_save = ["false", "true"][attempt % 2]  # DCP's background writer to the store too
        stale = set(unfinished(fs, "kills"))  # a killed save's, until this start deletes it
        proc = popen(url, addition_jsonl, *flags, "--async_save", async_save)
        if attempt < 3:
            done = logged_steps(local)
            t0 = time.time()
            while proc.poll() is None and time.time() - t0 < 300:
                if attempt != 1 and set(unfinished(fs, "kills")) - stale:
                    break  # a save of this run's is being written
                if attempt == 1 and logged_steps(local) > done:
                    time.sleep(rng.uniform(0.0, 1.5))  # anywhere: in a step or a save
                    break
                time.sleep(0.01)
            assert kill_tree(proc.pid) == -9, attempt  # it landed: the run had not ended
            mid_save += sorted(set(unfinished(fs, "kills")) - stale)
            continue
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]
        assert "resumed from" in out, out[-3000:]
    assert mid_save, "no kill landed in the middle of a save"
    assert not unfinished(fs, "kills")  # the starts deleted them
    # --keep_last 2: the last two steps, and nothing older
    fs.invalidate_cache()
    kept = sorted(os.path.basename(p) for p in fs.ls(f"{BUCKET}/kills/checkpoints/"))
    assert kept == ["latest", f"step-{N - 1:08d}", f"step-{N:08d}"], kept
    assert_same_tensors(latest(straight), latest(fetch(fs, url, tmp_path / "copy")))


def test_server_gone_mid_save_is_one_clear_error(store, addition_jsonl, tmp_path):
    """The store unreachable while a save is written: one error line, exit 1; in the store, the
    previous checkpoint is still latest and verifies."""
    fs, port = store
    proxy = Proxy(port)
    url = f"s3://{BUCKET}/gone"
    local = str(tmp_path / "logs")
    env = {"AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{proxy.port}", "AWS_MAX_ATTEMPTS": "2"}
    proc = popen(url, addition_jsonl, "--save_every", 1, "--local_dir", local, env=env)
    t0 = time.time()
    while logged_steps(local) < 3 and proc.poll() is None and time.time() - t0 < 300:
        time.sleep(0.01)
    proxy.stop()
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 1, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert errors and "not saved" in errors[0] and "is intact and latest" in errors[0], out[-3000:]
    kept = store_latest(fs, url)
    assert kept in errors[0]
    p = run_py("checkpoint.py", "verify", f"{url}/checkpoints/{kept}")
    assert p.returncode == 0, p.stderr


def ppo(out, *extra):
    import task

    args = ("--model", task.TINY_MODEL, "--out_dir", out, "--rollout_batch_size", 16)
    args += ("--n_samples_per_prompt", 2, "--train_batch_size", 16, "--micro_batch_size", 8)
    args += ("--max_new_tokens", 6, "--max_steps", 2, "--eval_every", 0, "--eval_samples", 16)
    args += ("--save_every", 100, "--rollout_engine", "hf", *extra)
    return args


def test_ppo_save_resume_export(store, tmp_path):
    """PPO (actor, critic, both optimizers, the KL controller, sampled responses) stopped at step 1
    of 2 on the store and resumed: the same metrics and tensors as an uninterrupted local run; the
    critic exports from the store."""
    fs, _ = store
    straight = str(tmp_path / "straight")
    run("train_ppo.py", *ppo(straight))
    url = f"s3://{BUCKET}/ppo"
    local = ("--local_dir", tmp_path / "logs")
    run("train_ppo.py", *ppo(url, "--stop_at_step", 1, *local))
    p = run("train_ppo.py", *ppo(url, "--resume", "latest", *local))
    assert "at step 1" in p.stdout + p.stderr
    copy = fetch(fs, url, tmp_path / "copy")
    assert metrics(copy) == metrics(straight)
    assert_same_tensors(latest(straight), latest(copy))  # actor, critic and both optimizers
    ckpt = f"{url}/checkpoints/step-00000002"
    p = run_py("checkpoint.py", "export", ckpt, tmp_path / "critic", "--role", "critic")
    assert p.returncode == 0 and os.path.exists(tmp_path / "critic" / "model.safetensors"), p.stderr


# ---- crafted checkpoints on the store, in-process (no torchrun) ----------------------------------
def small_on_store(fs, tmp_path, name, step=1):
    """conftest's small checkpoint (meta, RNG, a.bin, sub/b.bin, manifest) copied to the store."""
    from conftest import write_small_checkpoint

    local = tmp_path / name
    local.mkdir()
    write_small_checkpoint(local, step)
    fs.put(str(local) + "/", f"{BUCKET}/crafted/{name}/", recursive=True)
    return f"s3://{BUCKET}/crafted/{name}"


def test_a_failed_save_never_removes_a_committed_prefix(store, tmp_path, one_rank):
    """A save that fails on a store removes its step's objects, unless a manifest is among them:
    then it failed after its commit (the `latest` PUT), or the prefix is another run's (which
    `_publish_store` refuses to write over); the commit is kept, and only an uncommitted prefix
    goes."""
    import checkpoint

    fs, _ = store
    url = small_on_store(fs, tmp_path, "committed")
    checkpoint._remove_unfinished(url)
    assert checkpoint.verify(url)["step"] == 1
    fs.rm(f"{BUCKET}/crafted/committed/manifest.json")
    checkpoint._remove_unfinished(url)
    fs.invalidate_cache()
    assert not fs.exists(f"{BUCKET}/crafted/committed/a.bin")


def test_folder_markers_are_no_part_of_a_checkpoint(store, tmp_path, one_rank):
    """An S3 console's "Create folder" (and some sync tools) writes an empty object named
    `folder/`; s3fs lists it as a file. Inside a committed step it failed verification as "not a
    plain name" (`--resume latest` then fell back a checkpoint); it holds nothing, so it is no
    part of one, and deleting the step deletes it too (or the prefix stayed listed)."""
    import boto3

    import checkpoint
    import objstore

    fs, _ = store
    url = small_on_store(fs, tmp_path, "marked")
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"])
    # the step's own marker too (a sync tool writes one for every folder: s3fs lists it as "")
    for key in ("crafted/marked/", "crafted/marked/sub/", "crafted/marked/empty/"):
        client.put_object(Bucket=BUCKET, Key=key, Body=b"")
    assert checkpoint.verify(url)["step"] == 1
    client.put_object(Bucket=BUCKET, Key="crafted/marked/odd/", Body=b"xy")  # not a marker
    with pytest.raises(checkpoint.CheckpointError, match="odd/: not a plain name"):
        checkpoint.verify(url)
    objstore.remove_prefix(url)
    fs.invalidate_cache()
    assert not fs.find(f"{BUCKET}/crafted/marked/")


def test_keep_last_prunes_committed_checkpoints_on_the_store(store, tmp_path, one_rank):
    """--keep_last on a store deletes the committed steps older than the newest kept (manifest
    first); steps newer than the one just saved (an abandoned branch) stay. A failed save's
    clean-up keeps any prefix with a manifest: pruning must not go through it (it once did, and
    a store run kept every checkpoint)."""
    import checkpoint

    fs, _ = store
    for k in (1, 2, 3, 5):
        small_on_store(fs, tmp_path, f"step-{k:08d}", step=k)
    root = f"s3://{BUCKET}/crafted"
    checkpoint._prune(root, 3, 2)  # step-3 just committed; step-5 is an abandoned branch
    fs.invalidate_cache()
    left = sorted(os.path.basename(p) for p in fs.ls(f"{BUCKET}/crafted/"))
    assert [n for n in left if n.startswith("step-")] == [f"step-{k:08d}" for k in (2, 3, 5)]
    assert checkpoint.verify(f"{root}/step-00000002")["step"] == 2  # the kept ones are whole


def test_keep_last_counts_only_committed_checkpoints_on_the_store(store, tmp_path, one_rank):
    """A save that failed with the store unreachable for its clean-up too leaves its prefix (no
    manifest; the next start deletes it). --keep_last counted it as a kept checkpoint and deleted
    a committed one in its place: with the default 2, one checkpoint to resume from was left."""
    import checkpoint
    from conftest import write_small_checkpoint

    fs, _ = store
    root = two_steps_on_store(fs, tmp_path, "keep")
    for k in (3, 4):
        local = tmp_path / f"step-{k}"
        local.mkdir()
        write_small_checkpoint(local, k)
        fs.put(str(local) + "/", f"{BUCKET}/keep/checkpoints/step-{k:08d}/", recursive=True)
    fs.rm(f"{BUCKET}/keep/checkpoints/step-00000003/manifest.json")  # step 3's save failed
    checkpoint._prune(root, 4, 2)  # step-4 just committed
    fs.invalidate_cache()
    assert checkpoint.verify(f"{root}/step-00000002")["step"] == 2  # kept with step-4
    assert not fs.exists(f"{BUCKET}/keep/checkpoints/step-00000001/manifest.json")
    assert fs.exists(f"{BUCKET}/keep/checkpoints/step-00000003/meta.json")  # the next start's


def test_a_run_whose_lock_was_taken_over_saves_nothing(store, tmp_path, monkeypatch, one_rank):
    """Another run took the lock over (this one stalled past its lease; rank 0's heartbeat found
    it, `objstore.renew_once`): a save stops on every rank, whatever --on_save_error says, before
    anything is written or deleted (a failed save's clean-up would delete a step prefix the other
    run may be writing)."""
    import checkpoint
    import objstore

    fs, _ = store
    out = f"s3://{BUCKET}/taken-over"
    monkeypatch.setitem(objstore._lost, f"{out}/.lock", {"run": "theirs"})
    monkeypatch.setitem(checkpoint._run, "id", "stalled1")  # as `resolve` set it at the start
    with pytest.raises(checkpoint.CheckpointError, match="another run took this run's lock over"):
        checkpoint.save(out, 2, {}, {}, (), keep_last=2, on_error="warn")
    fs.invalidate_cache()
    assert not fs.exists(f"{BUCKET}/taken-over")


def test_an_async_save_in_flight_is_not_committed_once_the_lock_is_lost(
    store, tmp_path, monkeypatch, one_rank
):
    """An --async_save in flight when another run takes the lock over: its shards are written,
    but its commit (the manifest, `latest`, pruning the other run's checkpoints) stops the run.
    `checkpoint.commit` went ahead: only a new save checked the lock."""
    import torch

    import checkpoint
    import objstore

    fs, _ = store
    out = f"s3://{BUCKET}/async-taken-over"
    monkeypatch.setitem(checkpoint._run, "id", "stalled2")
    model = torch.nn.Linear(2, 2)
    roles = {"model": (model, torch.optim.AdamW(model.parameters()))}
    meta = {"args": {}}
    assert checkpoint.save(out, 1, roles, meta, (), keep_last=2, async_save=True) is None
    monkeypatch.setitem(objstore._lost, f"{out}/.lock", {"run": "theirs"})
    with pytest.raises(checkpoint.CheckpointError, match="another run took this run's lock over"):
        checkpoint.commit()
    fs.invalidate_cache()
    assert not fs.exists(f"{BUCKET}/async-taken-over/checkpoints/latest")
    assert not fs.glob(f"{BUCKET}/async-taken-over/checkpoints/**/manifest.json")


def test_a_full_local_disk_while_downloading_is_not_the_store_failing(store, tmp_path, monkeypatch):
    """An export from a store downloads hf/ into a local scratch folder; a full local disk there
    was reported as the store not answering (`checkpoint.StoreUnreachable`, "the store did not
    answer"). It is the local file's OSError now, named as such."""
    import errno

    import checkpoint
    import objstore

    fs, _ = store
    fs.pipe_file(f"{BUCKET}/scratch/hf/config.json", b"{}")

    def full_disk(path, mode="r", *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(objstore, "open", full_disk, raising=False)
    url = f"s3://{BUCKET}/scratch/hf"
    with pytest.raises(OSError) as info:
        checkpoint._store_call(objstore.download, url, {"config.json": 2}, str(tmp_path / "hf"))
    assert info.value.errno == errno.ENOSPC and info.value.filename.endswith("hf/config.json")
    assert not isinstance(info.value, checkpoint.CheckpointError)


def two_steps_on_store(fs, tmp_path, run):
    """s3://BUCKET/<run>/checkpoints with conftest's small checkpoints as step-1 and step-2, and
    `latest` naming step-2; returns that checkpoints URL."""
    from conftest import write_small_checkpoint

    for k in (1, 2):
        local = tmp_path / f"step-{k}"
        local.mkdir()
        write_small_checkpoint(local, k)
        fs.put(str(local) + "/", f"{BUCKET}/{run}/checkpoints/step-{k:08d}/", recursive=True)
    fs.pipe_file(f"{BUCKET}/{run}/checkpoints/latest", b"step-00000002\n")
    return f"s3://{BUCKET}/{run}/checkpoints"


def test_an_abandoned_latest_is_repointed_before_it_is_deleted(store, tmp_path, one_rank):
    """A run resumed from step-1 while `latest` names step-2 (a --resume PATH, or a fallback)
    deletes step-2 before saving its own step 2 there: `latest` first names the run's own
    checkpoint, so a save failing after the deletion leaves it naming one that verifies."""
    import checkpoint

    fs, _ = store
    root = two_steps_on_store(fs, tmp_path, "branch")
    checkpoint._run["branch"] = "step-00000001"  # as `resolve` sets it after the resume
    checkpoint._run["latest"] = "step-00000002"  # what `latest` named at the start
    try:
        cleared = checkpoint._clear_step(f"{root}/step-00000002", "step-00000002", "warn")
        # a later failed save, the store unreachable, calls this one latest, not the deleted step
        assert checkpoint._run["latest"] == "step-00000001"
    finally:
        checkpoint._run.pop("branch")
        checkpoint._run.pop("latest")
    assert cleared
    fs.invalidate_cache()
    assert not fs.exists(f"{BUCKET}/branch/checkpoints/step-00000002/manifest.json")
    assert store_latest(fs, f"s3://{BUCKET}/branch") == "step-00000001"
    assert checkpoint.verify(f"{root}/step-00000001")["step"] == 1


@pytest.mark.parametrize("read", ["sha256", "read_bytes"])
def test_a_store_that_fails_to_answer_is_no_damaged_checkpoint(
    store, tmp_path, monkeypatch, one_rank, read
):
    """The store erring while `latest` is verified (a timeout reading an object back for its
    checksum, or reading its RNG file) says nothing of the checkpoint: --resume latest stops with
    one line instead of going on from an older one (which would later delete the newer, good
    one to save that step again)."""
    import checkpoint
    import objstore

    fs, _ = store
    newer = small_on_store(fs, tmp_path, f"answer-2-{read}")
    older = small_on_store(fs, tmp_path, f"answer-1-{read}")
    original = getattr(objstore, read)

    def failing(url, size):
        if "answer-2" in url and (read == "sha256" or "rng-rank" in url):
            raise objstore.StoreError(f"{url}: ReadTimeoutError: read timed out")
        return original(url, size)

    monkeypatch.setattr(objstore, read, failing)
    path, error = checkpoint._choose([newer, older], "latest")
    assert path == "" and "the store did not answer" in error and "ReadTimeoutError" in error


def test_crafted_manifests_and_objects_on_the_store(store, tmp_path):
    """verify on a store: unlisted objects, paths leaving the prefix, sizes other than the
    manifest's, each refused in one line."""
    import checkpoint

    fs, _ = store
    url = small_on_store(fs, tmp_path, "ok")
    assert checkpoint.verify(url)["step"] == 1
    url = small_on_store(fs, tmp_path, "extra")
    fs.pipe_file(f"{BUCKET}/crafted/extra/c.bin", b"!")
    with pytest.raises(checkpoint.CheckpointError, match="c.bin: not listed in the manifest"):
        checkpoint.verify(url)
    url = small_on_store(fs, tmp_path, "bigger")
    fs.pipe_file(f"{BUCKET}/crafted/bigger/a.bin", b"hello" * 1000)  # read no further than 5
    with pytest.raises(checkpoint.CheckpointError, match="a.bin: size 5000, manifest says 5"):
        checkpoint.verify(url)
    url = small_on_store(fs, tmp_path, "dotdot")
    manifest = json.loads(fs.cat_file(f"{BUCKET}/crafted/dotdot/manifest.json"))
    manifest["files"]["../ok/a.bin"] = manifest["files"]["a.bin"]
    fs.pipe_file(f"{BUCKET}/crafted/dotdot/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(checkpoint.CheckpointError, match="not a plain name inside"):
        checkpoint.verify(url)


def test_crafted_metadata_on_the_store_reads_only_listed_objects(store, tmp_path):
    """A .metadata whose storage entries name an object the manifest does not list (another
    checkpoint's, via ..) or a byte range beyond the listed size: refused before DCP reads."""
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    import checkpoint

    fs, _ = store
    folder = tmp_path / "dcp"
    dcp.save({"t": torch.arange(1000.0)}, checkpoint_id=str(folder), no_dist=True)
    fs.put(str(folder) + "/", f"{BUCKET}/meta/dcp/", recursive=True)
    url = f"s3://{BUCKET}/meta/dcp"
    sizes = {p.name: p.stat().st_size for p in folder.iterdir()}
    state = {"t": torch.zeros(1000)}
    checkpoint.dcp_load(state, url, no_dist=True, sizes=sizes)
    assert torch.equal(state["t"], torch.arange(1000.0))
    crafted = [({"relative_path": "../x.distcp"}, "not an object listed here")]
    crafted += [({"length": 3 << 30}, "reads bytes")]
    for changes, needle in crafted:
        md = pickle.loads((folder / ".metadata").read_bytes())  # our own file, just written
        for index, info in md.storage_data.items():
            md.storage_data[index] = type(info)(**{**info.__dict__, **changes})
        fs.pipe_file(f"{BUCKET}/meta/dcp/.metadata", pickle.dumps(md))
        sizes[".metadata"] = len(pickle.dumps(md))
        with pytest.raises(checkpoint.CheckpointError, match=needle):
            checkpoint.dcp_load({"t": torch.zeros(1000)}, url, no_dist=True, sizes=sizes)
    sizes[".metadata"] -= 1  # the object is larger than the manifest says: read no further
    with pytest.raises(checkpoint.CheckpointError, match="larger than the"):
        checkpoint.dcp_load({"t": torch.zeros(1000)}, url, no_dist=True, sizes=sizes)


def test_a_compressed_record_on_the_store_is_refused_before_it_is_inflated(store, tmp_path):
    """The store's reader checks each range's records as the local one does
    (`checkpoint._check_uncompressed`): a deflated copy of the tensor's record appended to its
    object, the index pointing at it, is refused before torch.load inflates it."""
    import pickle

    import torch

    import checkpoint
    from conftest import dcp_folder
    from conftest import deflated_copy

    fs, _ = store
    folder, md = dcp_folder(tmp_path)
    index, info = next(iter(md.storage_data.items()))
    shard = folder / info.relative_path
    deflated = deflated_copy(shard.read_bytes()[info.offset : info.offset + info.length])
    changes = {"offset": shard.stat().st_size, "length": len(deflated)}
    md.storage_data[index] = type(info)(**{**info.__dict__, **changes})
    with open(shard, "ab") as f:
        f.write(deflated)
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    fs.put(str(folder) + "/", f"{BUCKET}/deflated/dcp/", recursive=True)
    sizes = {p.name: p.stat().st_size for p in folder.iterdir()}
    url = f"s3://{BUCKET}/deflated/dcp"
    with pytest.raises(checkpoint.CheckpointError, match="is compressed"):
        checkpoint.dcp_load({"t": torch.zeros(1000)}, url, no_dist=True, sizes=sizes)


def test_an_export_into_a_checkpoint_on_the_store_is_refused(store, tmp_path):
    """An export to a store checked nothing: `export s3://.../step-4 s3://.../step-4/hf` uploaded
    into the checkpoint (which then failed verification, the fallback it was lost); so did one
    into another checkpoint, or as a step folder beside them. Refused in one line, as locally."""
    import checkpoint

    fs, _ = store
    root = two_steps_on_store(fs, tmp_path, "exports")
    src = f"{root}/step-00000002"
    refused = {
        f"{src}/hf": "inside the checkpoint",
        f"{root}/step-00000001/hf": "inside s3://",
        f"{root}/step-00000099": "inside s3://",
    }
    for out, needle in refused.items():
        with pytest.raises(checkpoint.CheckpointError, match=needle):
            checkpoint._check_export_prefix(out, src)
    checkpoint._check_export_prefix(f"s3://{BUCKET}/exports/hf", src)  # where a stage exports


def test_a_shard_on_the_store_is_fetched_in_one_get(store, tmp_path, monkeypatch):
    """Each range's check (`_SafeStoreReader._slice_file`) reads its zip's end first: the object
    is still fetched whole, once (`_WholeObjectStreams`), not again from each place read."""
    import torch
    import torch.distributed.checkpoint as dcp

    import checkpoint

    fs, _ = store
    state = {f"t{i}": torch.randn(2500) for i in range(20)}  # 20 ranges in one object
    folder = tmp_path / "dcp"
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    fs.put(str(folder) + "/", f"{BUCKET}/whole/dcp/", recursive=True)
    sizes = {p.name: p.stat().st_size for p in folder.iterdir()}
    gets = []
    fetch_range = s3fs.core.S3File._fetch_range

    def counted(self, start, end):
        gets.append((os.path.basename(self.path), start, end))
        return fetch_range(self, start, end)

    monkeypatch.setattr(s3fs.core.S3File, "_fetch_range", counted)
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    checkpoint.dcp_load(loaded, f"s3://{BUCKET}/whole/dcp", no_dist=True, sizes=sizes)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    shard = [g for g in gets if g[0] != ".metadata"]
    assert len(shard) == 1 and shard[0][1:] == (0, sizes[shard[0][0]]), shard
