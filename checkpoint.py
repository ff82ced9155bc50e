"""Atomic, rank-coordinated, full-state checkpoints: the only code that touches training state on
disk.

The commit protocol (README, "Checkpoints"): all ranks write `.tmp-step-N/` (with --async_save, in
the background); once every rank has succeeded, rank 0 writes a sha256 manifest, fsyncs, renames the
folder `step-N/` and os.replace()s `latest`. A kill or a failed write at any moment leaves the
previous checkpoint latest. Resume verifies the manifest first and falls back to an older
checkpoint.

Safety: DCP's own loader unpickles `.metadata` with a plain `pickle.load` and byte entries with
`torch.load(weights_only=False)`; `dcp_load` closes both holes (allow-listing unpickler,
weights-only bytes), so loading a checkpoint never runs code from it.

    python checkpoint.py verify CKPT [CKPT...]
    python checkpoint.py export CKPT OUT [--role actor|critic|reward_model]   # an HF folder
"""

import base64
import hashlib
import json
import os
import pickle
import random
import shutil
import sys
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict import set_state_dict

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, damaged, unsafe or from another run; the message says which."""


# ---- loading safely ------------------------------------------------------------------------------
# Every global the .metadata pickle of DCP (torch 2.13) refers to, and nothing more.
ALLOWED_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "StorageMeta",
        "MetadataIndex",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "pathlib": {"PosixPath"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        allowed = name in ALLOWED_GLOBALS.get(module, ())
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if allowed or is_dtype:
            return super().find_class(module, name)
        raise CheckpointError(f"refusing to unpickle {module}.{name}: not a DCP metadata class")


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):  # FileSystemReader's own is a plain pickle.load
        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            return _SafeUnpickler(f).load()


class _SafePlanner(DefaultLoadPlanner):
    """Assumes flatten_state_dict=True, the default."""

    def load_bytes(self, read_item, value):
        # DefaultLoadPlanner's own is torch.load(weights_only=False): code could run from here
        fqn = self.mappings[read_item.dest_index.fqn]
        set_element(self.original_state_dict, fqn, torch.load(value, weights_only=True))


def dcp_load(state, path, no_dist=False):
    """dcp.load, minus its two unpickling holes; fills `state` in place."""
    dcp.load(state, storage_reader=_SafeReader(path), planner=_SafePlanner(), no_dist=no_dist)


# ---- what a checkpoint holds ---------------------------------------------------------------------
def _state(roles):
    """{role: {"model": ..., "optim": ...}}: the sharded state dicts, the layout DCP stores."""
    state = {}
    for role, (model, optim) in roles.items():
        model_state, optim_state = get_state_dict(model, optim)
        state[role] = {"model": model_state, "optim": optim_state}
    return state


def _b64(tensor):
    return base64.b64encode(tensor.numpy().tobytes()).decode()


def _unb64(text):
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state():
    """This rank's Python, NumPy, torch (and CUDA) RNG states, as JSON (nothing to unpickle)."""
    # NumPy's state: (name, uint32 keys, pos, has_gauss, gauss)
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    cuda = None
    if torch.cuda.is_available():
        cuda = _b64(torch.cuda.get_rng_state())
    return {
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), pos, has_gauss, gauss],
        "torch": _b64(torch.get_rng_state()),
        "cuda": cuda,
    }


def set_rng_state(state):
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(_unb64(state["torch"]))
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(state["cuda"]))


# ---- files on disk -------------------------------------------------------------------------------
def _durable(path, text=None):
    """Write text (if any) to path, then fsync it: a file's data, or a directory's entries."""
    if text is not None:
        with open(path, "w") as f:
            f.write(text)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def _manifest_files(root):
    """{relative path: {size, sha256}} of every file below root but the manifest itself."""
    paths = []
    for folder, _, names in os.walk(root):
        for name in names:
            if name != "manifest.json":
                paths.append(os.path.relpath(os.path.join(folder, name), root))
    files = {}
    for rel in sorted(paths):
        with open(os.path.join(root, rel), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            files[rel] = {"size": size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}
    return files


def _step_dirs(root):
    """(committed checkpoints' names, newest first; the name `latest` points at, or None)."""
    names = []
    if os.path.isdir(root):
        names = [n for n in os.listdir(root) if n.startswith("step-") and n[5:].isdigit()]
    names.sort(key=_step_of, reverse=True)
    latest = None
    pointer = os.path.join(root, "latest")
    if os.path.isfile(pointer):
        with open(pointer) as f:
            latest = f.read().strip()
    return names, latest


def _step_of(name):
    return int(name[len("step-") :])


def verify(path):
    """Return the manifest, or raise CheckpointError naming the file that is missing, cut or
    altered."""
    manifest_path = os.path.join(path, "manifest.json")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        expected = manifest["files"].items()
        actual = _manifest_files(path)
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise CheckpointError(
            f"{manifest_path}: missing or unreadable "
            f"(not a checkpoint, or an unfinished one: {e!r})"
        )
    for rel, want in expected:
        got = actual.get(rel)
        if got == want:
            continue
        where = os.path.join(path, rel)
        if got is None:
            raise CheckpointError(f"{where}: missing")
        if got["size"] != want["size"]:
            raise CheckpointError(f"{where}: size {got['size']}, manifest says {want['size']}")
        raise CheckpointError(f"{where}: checksum mismatch")
    return manifest


# ---- saving: write on every rank, agree, then commit on rank 0 -----------------------------------
_pending = []  # the save in flight: (future or None, root, name, step, keep_last, on_error)
_last_save = [time.monotonic()]  # when the last save started, for --save_every_minutes
_async_group = []  # the gloo group DCP's background writes use (made on the first async save)


def _describe_failure(e, tmp):
    """One line for a failed write: the error, and the free space where it was writing."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]  # DCP wraps each rank's own exception
    disk = "."
    for candidate in (os.path.dirname(tmp), os.path.dirname(os.path.dirname(tmp))):
        if os.path.isdir(candidate):
            disk = candidate
            break
    free_mib = shutil.disk_usage(disk).free >> 20
    first_line = (str(e).splitlines() or [""])[0]
    return f"rank {dist.get_rank()}: {type(e).__name__}: {first_line} [{free_mib} MiB free]"


def _agree(fn, tmp, on_error):
    """Collective: run fn on this rank; if it failed on any rank, remove the temp dir and raise on
    all ranks (or, with on_error 'warn', print a warning and return False)."""
    err = None
    try:
        fn()
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is no Exception
        err = _describe_failure(e, tmp)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, err)  # so that every rank takes the same branch below
    bad = "; ".join(e for e in errors if e)
    if not bad:
        return True
    shutil.rmtree(tmp, ignore_errors=True)
    step_name = os.path.basename(tmp)[len(".tmp-") :]
    msg = f"{step_name} not saved ({bad}); the previous checkpoint is intact and latest"
    if on_error != "warn":
        raise CheckpointError(msg)
    if dist.get_rank() == 0:
        print(f"WARNING: {msg}; training goes on (--on_save_error warn)", flush=True)
    return False


def save(out_dir, step, roles, meta, hf_objs, keep_last, async_save=False, on_error="stop"):
    """Collective. roles = {name: (model, optimizer)}; meta: JSON; hf_objs (config, tokenizer,
    generation config) go to hf/. async_save: a thread writes a copy of the state while training
    goes on, and boundary() commits it later. Returns the committed path (None while in flight)."""
    commit()  # one save in flight at a time
    root = os.path.join(out_dir, "checkpoints")
    name = f"step-{step:08d}"
    tmp = os.path.join(root, f".tmp-{name}")
    _last_save[0] = time.monotonic()
    if async_save and not _async_group:
        # DCP's thread runs collectives of its own: on a group of its own, not the trainer's
        _async_group.append(dist.new_group(backend="gloo"))
    future = []

    def write():
        # DCP raises on every rank when it fails on one; the small files can fail on one rank only
        os.makedirs(tmp, exist_ok=True)  # was empty: resolve() and _agree() remove failed saves
        state = _state(roles)
        writer = dcp.FileSystemWriter(os.path.join(tmp, "dcp"))
        if async_save:
            future.append(
                dcp.async_save(state, storage_writer=writer, process_group=_async_group[0])
            )
        else:
            dcp.save(state, storage_writer=writer)
        _write_small_files(tmp, step, roles, meta, hf_objs)

    if not _agree(write, tmp, on_error):
        return None
    pending_future = None
    if async_save:
        pending_future = future[0]
    _pending.append((pending_future, root, name, step, keep_last, on_error))
    if async_save:
        return None
    return commit()


def _write_small_files(tmp, step, roles, meta, hf_objs):
    """Every rank its RNG state; rank 0 the run's meta.json and the HF config/tokenizer in hf/."""
    rank = dist.get_rank()
    _durable(os.path.join(tmp, f"rng-rank{rank}.json"), json.dumps(rng_state()))
    if rank != 0:
        return
    header = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": dist.get_world_size(),
        "roles": list(roles),
    }
    _durable(os.path.join(tmp, "meta.json"), json.dumps({**header, **meta}, indent=1))
    for obj in hf_objs:
        obj.save_pretrained(os.path.join(tmp, "hf"))


def commit():
    """Collective: once the save in flight is on disk on every rank, rank 0 publishes it."""
    if not _pending:  # nothing in flight
        return None
    future, root, name, step, keep_last, on_error = _pending.pop()
    tmp = os.path.join(root, f".tmp-{name}")
    final = os.path.join(root, name)

    def wait_for_writes():
        if future is not None:
            future.result()

    def publish():
        if dist.get_rank() == 0:
            _publish(tmp, final, root, name, step)

    # All ranks' shards written, then rank 0 commits; a failure on any rank stops both.
    if not _agree(wait_for_writes, tmp, on_error):
        return None
    if not _agree(publish, tmp, on_error):
        return None
    if dist.get_rank() == 0:
        _prune(root, step, keep_last)
    return final


def _publish(tmp, final, root, name, step):
    """Rank 0: manifest, fsync everything, rename to step-N, then point `latest` at it
    atomically."""
    manifest = {"step": step, "files": _manifest_files(tmp)}
    _durable(os.path.join(tmp, "manifest.json"), json.dumps(manifest))
    for folder, _, _ in os.walk(tmp):
        _durable(folder)
    shutil.rmtree(final, ignore_errors=True)  # a save of this step by a run resumed from before it
    os.rename(tmp, final)
    _durable(root)  # the rename is on disk before `latest` may point at it
    _durable(os.path.join(root, "latest.tmp"), name + "\n")
    os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))  # atomic
    _durable(root)


def _prune(root, step, keep_last):
    """Now that step-N is committed, keep the keep_last newest up to it (0: keep all). Checkpoints
    newer than step-N are an abandoned branch (a run resumed from before them): they stay until
    this run overwrites them."""
    if not keep_last:
        return
    names, _ = _step_dirs(root)
    older = [n for n in names if _step_of(n) < step]  # newest first
    # step-N is the newest kept: keep_last - 1 older ones stay with it
    pruned = older[keep_last - 1 :]
    for name in pruned:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def boundary(step, every, minutes, signalled, device):
    """Collective, at every step's end: (save?, stop?), one answer for all ranks; commits a
    finished async save."""
    busy = bool(_pending and _pending[0][0] and not _pending[0][0].done())
    clock = minutes > 0 and time.monotonic() - _last_save[0] >= 60 * minutes
    clock = clock and dist.get_rank() == 0  # rank 0's clock decides, so all ranks save together
    flags = torch.tensor([signalled, clock, busy], dtype=torch.float32, device=device)
    dist.all_reduce(
        flags, op=dist.ReduceOp.MAX
    )  # one decision for all ranks: any rank's flag counts
    stop, clock, busy = flags.bool().tolist()
    if not busy:
        commit()
    return stop or clock or (every > 0 and step % every == 0), stop


# ---- resuming ------------------------------------------------------------------------------------
def resolve(out_dir, resume):
    """Collective: the checkpoint to resume from ('' = start fresh); rank 0 picks, all ranks get
    it."""
    choice = ["", None]  # [path, error]
    if dist.get_rank() == 0:
        choice = _choose(os.path.join(out_dir, "checkpoints"), resume)
    dist.broadcast_object_list(
        choice, src=0
    )  # all ranks load the very same checkpoint, or all fail
    if choice[1]:
        raise CheckpointError(choice[1])
    return choice[0]


def _choose(root, resume):
    """Rank 0: [path or '', error or None] for --resume `resume` in the checkpoints folder
    `root`."""
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith(".tmp-"):  # left by a killed save: never resumed from
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    names, top = _step_dirs(root)
    if resume and resume != "latest":  # --resume PATH: that one, or a clear error
        try:
            verify(resume)
        except CheckpointError as e:
            return ["", str(e)]
        return [resume, None]
    if not resume:
        if names:  # a fresh start must not mix its metrics and saves with an earlier run's
            hint = "--resume latest continues it; or use another --out_dir"
            return ["", f"{root} holds an earlier run's checkpoints: {hint}"]
        return ["", None]
    # `latest` first, then older ones; newer ones than `latest` are an abandoned branch
    candidates = names
    if top in names:
        candidates = [top] + [n for n in names if _step_of(n) < _step_of(top)]
    for name in candidates:
        path = os.path.join(root, name)
        try:
            verify(path)
        except CheckpointError as e:
            print(
                f"WARNING: skipping checkpoint {name}: {e}; falling back to an older one",
                flush=True,
            )
            continue
        return [path, None]
    return ["", None]


def load(path, roles, args, must_match):
    """Collective: every role's model and optimizer in place, then this rank's RNG (so call it
    after anything that draws from the RNG: engines, iterators); returns meta.json."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    diff = []
    for k in must_match:
        if meta["args"].get(k) != args[k]:
            diff.append(f"--{k} {meta['args'].get(k)!r} -> {args[k]!r}")
    if meta["format_version"] != FORMAT_VERSION:
        diff.append(f"format_version {meta['format_version']} -> {FORMAT_VERSION}")
    if diff:
        raise CheckpointError(
            f"{path} was saved by a different run; differing settings: {', '.join(diff)}"
        )
    state = _state(roles)
    dcp_load(state, os.path.join(path, "dcp"))
    for role, (model, optim) in roles.items():
        set_state_dict(
            model,
            optim,
            model_state_dict=state[role]["model"],
            optim_state_dict=state[role]["optim"],
        )
    rank_file = f"rng-rank{dist.get_rank() % meta['world_size']}.json"
    with open(os.path.join(path, rank_file)) as f:
        set_rng_state(json.load(f))
    if meta["world_size"] != dist.get_world_size() and dist.get_rank() == 0:
        # exact only at the same world size
        print(
            f"WARNING: resuming a {meta['world_size']}-rank checkpoint on "
            f"{dist.get_world_size()} ranks: weights, optimizer and data position carry over, "
            "RNG streams cannot (reused round-robin)",
            flush=True,
        )
    return meta


# ---- export: a checkpoint's model as an HF folder ------------------------------------------------
def export(path, out, role=None):
    """A checkpoint's `role` model -> an HF folder (safetensors, config, tokenizer, generation
    config) that transformers and vLLM load: for deployment, or the next stage. One process, DCP's
    no_dist mode. The critic exports as a token-classification (value) model with one label, the
    reward model (train_rm.py) as a sequence-classification model with one label."""
    from transformers import AutoConfig
    from transformers import AutoModelForCausalLM
    from transformers import AutoModelForSequenceClassification
    from transformers import AutoModelForTokenClassification
    from transformers import AutoTokenizer
    from transformers import GenerationConfig

    verify(path)
    with open(os.path.join(path, "meta.json")) as f:
        roles = json.load(f)["roles"]
    role = role or roles[0]
    if role not in roles:
        raise CheckpointError(f"--role {role}: checkpoint has roles {roles}")
    hf = os.path.join(path, "hf")
    if role == "critic":  # PPO's value model
        config = AutoConfig.from_pretrained(hf, num_labels=1)
        model = AutoModelForTokenClassification.from_config(config)
    elif role == "reward_model":  # train_rm.py's: its config carries reward_mean and reward_std
        config = AutoConfig.from_pretrained(hf, num_labels=1)
        model = AutoModelForSequenceClassification.from_config(config)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf))
    warnings.filterwarnings("ignore", "torch.distributed is disabled")  # no_dist says so: we know
    state = {role: {"model": model.state_dict()}}
    dcp_load(state, os.path.join(path, "dcp"), no_dist=True)  # fills the model's tensors in place
    if os.path.exists(os.path.join(hf, "generation_config.json")):  # a reward model has none
        model.generation_config = GenerationConfig.from_pretrained(hf)
    # save_pretrained only logs an error and returns when `out` is a file: raise here instead
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(hf).save_pretrained(out)


USAGE = "usage: python checkpoint.py verify CKPT [CKPT...] | export CKPT OUT [--role NAME]"


def cli(argv):
    match argv:
        case ["verify", *ckpts] if ckpts:
            for ckpt in ckpts:
                print(f"{ckpt}: ok, step {verify(ckpt)['step']}")
        case ["export", ckpt, out]:
            export(ckpt, out)
            print(f"exported {ckpt} -> {out}")
        case ["export", ckpt, out, "--role", role]:
            export(ckpt, out, role)
            print(f"exported {ckpt} -> {out}")
        case _:
            sys.exit(USAGE)


if __name__ == "__main__":
    try:
        cli(sys.argv[1:])
    except (CheckpointError, OSError) as err:
        sys.exit(f"error: {err}")
