"""Atomic, rank-coordinated, full-state checkpoints: the only code that touches training state on disk.

All ranks write `.tmp-step-N/` (async_save: in the background); once all have succeeded, rank 0 writes a
sha256 manifest, fsyncs, renames it `step-N/`, os.replace()s `latest`: a kill or a failed write leaves the
previous checkpoint latest. README, "Checkpoints". CLI: verify CKPT [CKPT...] | export CKPT OUT [--role R]
"""
import base64, hashlib, json, os, pickle, random, shutil, sys, time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, damaged, unsafe or from another run; the message says which."""


_ALLOWED = {"torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "StorageMeta", "MetadataIndex",
    "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING"}, "pathlib": {"PosixPath"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"}, "torch.serialization": {"_get_layout"}, "torch": {"Size"}}
# ^ every global the .metadata pickle of DCP (torch 2.13) refers to, and nothing more


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if name in _ALLOWED.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"refusing to unpickle {module}.{name}: not a DCP metadata class")


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):  # FileSystemReader's own is a plain pickle.load
        return _SafeUnpickler(open(os.path.join(self.path, ".metadata"), "rb")).load()


class _SafePlanner(DefaultLoadPlanner):  # assumes flatten_state_dict=True, the default
    def load_bytes(self, read_item, value):  # DefaultLoadPlanner's own: torch.load(weights_only=False)
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], torch.load(value, weights_only=True))


def dcp_load(state, path, no_dist=False):  # dcp.load, minus its two unpickling holes
    dcp.load(state, storage_reader=_SafeReader(path), planner=_SafePlanner(), no_dist=no_dist)


def _state(roles):  # {role: {"model": ..., "optim": ...}}: sharded state dicts, the layout DCP stores
    return {role: dict(zip(("model", "optim"), get_state_dict(m, o))) for role, (m, o) in roles.items()}


def rng_state():
    b64 = lambda t: base64.b64encode(t.numpy().tobytes()).decode()
    np_state = list(np.random.get_state())  # (name, uint32 keys, pos, has_gauss, gauss)
    return {"python": random.getstate(), "numpy": np_state[:1] + [np_state[1].tolist()] + np_state[2:],
            "torch": b64(torch.get_rng_state()), "cuda": b64(torch.cuda.get_rng_state()) if torch.cuda.is_available() else None}


def set_rng_state(s):
    unb64 = lambda x: torch.frombuffer(bytearray(base64.b64decode(x)), dtype=torch.uint8)
    random.setstate((s["python"][0], tuple(s["python"][1]), s["python"][2]))
    np.random.set_state((s["numpy"][0], np.array(s["numpy"][1], dtype=np.uint32), *s["numpy"][2:]))
    torch.set_rng_state(unb64(s["torch"]))
    if s["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(unb64(s["cuda"]))


def _durable(path, text=None):  # write text (if any) to path, then fsync it: a file's data, a dir's entries
    if text is not None:
        with open(path, "w") as f:
            f.write(text)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def _manifest_files(root):  # {relative path: {size, sha256}} of every file below root but the manifest
    files = {}
    for rel in sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs if f != "manifest.json"):
        with open(os.path.join(root, rel), "rb") as f:
            files[rel] = {"size": os.fstat(f.fileno()).st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}
    return files


def _step_dirs(root):  # (committed checkpoints, newest first; the `latest` pointer's target or None)
    names = [n for n in os.listdir(root) if n.startswith("step-") and n[5:].isdigit()] if os.path.isdir(root) else []
    latest = open(os.path.join(root, "latest")).read().strip() if os.path.isfile(os.path.join(root, "latest")) else None
    return sorted(names, key=lambda n: int(n[5:]), reverse=True), latest


def verify(path):
    """Return the manifest, or raise CheckpointError naming the file that is missing, cut or altered."""
    try:
        files, actual = (manifest := json.load(open(mpath := os.path.join(path, "manifest.json"))))["files"].items(), _manifest_files(path)
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{mpath}: missing or unreadable (not a checkpoint, or an unfinished one: {e!r})")
    for rel, want, got in [(rel, want, actual.get(rel)) for rel, want in files if actual.get(rel) != want][:1]:
        raise CheckpointError(f"{os.path.join(path, rel)}: " + ("missing" if got is None else f"size {got['size']}, "
                              f"manifest says {want['size']}" if got["size"] != want["size"] else "checksum mismatch"))
    return manifest


_pending, _last_save, _async_group = [], [time.monotonic()], []  # [the save in flight (async_save)]


def _agree(fn, tmp, on_error):
    """Collective: run fn; on a failure on any rank, remove the temp dir and raise on all (or warn: False)."""
    err = None
    try:
        fn()
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is no Exception
        e = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) and e.failures else e
        disk = next((d for d in (os.path.dirname(tmp), os.path.dirname(os.path.dirname(tmp))) if os.path.isdir(d)), ".")
        err = f"rank {dist.get_rank()}: {type(e).__name__}: {(str(e).splitlines() or [''])[0]} [{shutil.disk_usage(disk).free >> 20} MiB free]"
    dist.all_gather_object(errs := [None] * dist.get_world_size(), err)  # so all ranks take the same branch
    if bad := "; ".join(e for e in errs if e):
        shutil.rmtree(tmp, ignore_errors=True)
        msg = f"{os.path.basename(tmp)[5:]} not saved ({bad}); the previous checkpoint is intact and latest"
        if on_error != "warn":
            raise CheckpointError(msg)
        if dist.get_rank() == 0:
            print(f"WARNING: {msg}; training goes on (--on_save_error warn)", flush=True)
    return not bad


def save(out_dir, step, roles, meta, hf_objs, keep_last, async_save=False, on_error="stop"):
    """Collective. roles = {name: (model, optimizer)}; meta: JSON; hf_objs go to hf/. async_save: a thread
    writes a copy of the state as training goes on; boundary() commits it. Returns the committed path."""
    commit()  # one save in flight at a time
    root, name, rank, future = os.path.join(out_dir, "checkpoints"), f"step-{step:08d}", dist.get_rank(), []
    tmp, _last_save[0] = os.path.join(root, f".tmp-{name}"), time.monotonic()
    if async_save and not _async_group:  # DCP's thread runs collectives of its own: on a group of its own
        _async_group.append(dist.new_group(backend="gloo"))

    def write():  # DCP raises on every rank when it fails on one; the small files can fail on one only
        os.makedirs(tmp, exist_ok=True)  # empty: resolve() and _agree() remove what failed saves left
        state, writer = _state(roles), dcp.FileSystemWriter(os.path.join(tmp, "dcp"))
        future.append(dcp.async_save(state, storage_writer=writer, process_group=_async_group[0]) if async_save
                      else dcp.save(state, storage_writer=writer))
        _durable(os.path.join(tmp, f"rng-rank{rank}.json"), json.dumps(rng_state()))
        if rank == 0:
            _durable(os.path.join(tmp, "meta.json"), json.dumps({"format_version": FORMAT_VERSION, "step": step,
                   "world_size": dist.get_world_size(), "roles": list(roles), **meta}, indent=1))
            for obj in hf_objs:
                obj.save_pretrained(os.path.join(tmp, "hf"))
    if _agree(write, tmp, on_error):
        _pending.append((future[0] if async_save else None, root, name, step, keep_last, on_error))
        return None if async_save else commit()


def commit():
    """Collective: once the save in flight is on disk on every rank, rank 0 publishes it."""
    if not _pending:  # nothing in flight
        return None
    future, root, name, step, keep_last, on_error = _pending.pop()
    tmp, final, rank = os.path.join(root, f".tmp-{name}"), os.path.join(root, name), dist.get_rank()

    def publish():
        _durable(os.path.join(tmp, "manifest.json"), json.dumps({"step": step, "files": _manifest_files(tmp)}))
        for d, _, _ in os.walk(tmp):
            _durable(d)
        shutil.rmtree(final, ignore_errors=True)  # a save of this step by a run later resumed from before it
        os.rename(tmp, final)
        _durable(root)  # the rename is on disk before `latest` may point at it
        _durable(os.path.join(root, "latest.tmp"), name + "\n")
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))  # atomic; then durable:
        _durable(root)
    if not (_agree(future.result if future else lambda: None, tmp, on_error)  # all ranks' shards written,
            and _agree(publish if rank == 0 else lambda: None, tmp, on_error)):  # then rank 0 commits
        return None
    # Prune now that the new one is committed (keep_last 0: keep all); newer ones are an abandoned branch
    for n in [n for n in _step_dirs(root)[0] if int(n[5:]) < step][keep_last - 1:] if keep_last and rank == 0 else []:
        shutil.rmtree(os.path.join(root, n), ignore_errors=True)
    return final


def boundary(step, every, minutes, signalled, device):
    """Collective, at every step's end: (save?, stop?), one answer for all ranks; commits a finished async save."""
    busy = bool(_pending and _pending[0][0] and not _pending[0][0].done())
    clock = dist.get_rank() == 0 and minutes > 0 and time.monotonic() - _last_save[0] >= 60 * minutes
    flags = torch.tensor([signalled, clock, busy], dtype=torch.float32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # one decision for all ranks: any rank's flag counts
    stop, clock, busy = flags.bool().tolist()
    if not busy:
        commit()
    return stop or clock or (every > 0 and step % every == 0), stop


def resolve(out_dir, resume):
    """Collective: the checkpoint to resume from ('' = start fresh); rank 0 picks, every rank gets it."""
    choice, root = ["", None], os.path.join(out_dir, "checkpoints")
    for n in [n for n in os.listdir(root) if n.startswith(".tmp-")] if dist.get_rank() == 0 and os.path.isdir(root) else []:
        shutil.rmtree(os.path.join(root, n), ignore_errors=True)  # left by a killed save: never resumed from
    if dist.get_rank() == 0 and resume and resume != "latest":
        try:
            choice[0] = verify(resume) and resume  # --resume PATH: that one or a clear error
        except CheckpointError as e:
            choice[1] = str(e)
    elif dist.get_rank() == 0 and _step_dirs(root)[0] and not resume:  # a fresh start must not mix with them
        choice[1] = f"{root} holds an earlier run's checkpoints: --resume latest continues it; or use another --out_dir"
    elif dist.get_rank() == 0 and resume:
        names, top = _step_dirs(root)
        for n in [top] + [n for n in names if int(n[5:]) < int(top[5:])] if top in names else names:
            try:  # the `latest` pointer first, then older ones (newer ones are an abandoned branch)
                choice[0] = verify(os.path.join(root, n)) and os.path.join(root, n)
                break
            except CheckpointError as e:
                print(f"WARNING: skipping checkpoint {n}: {e}; falling back to an older one", flush=True)
    dist.broadcast_object_list(choice, src=0)  # all ranks load the very same checkpoint, or all fail
    if choice[1]:
        raise CheckpointError(choice[1])
    return choice[0]


def load(path, roles, args, must_match):
    """Collective: every role's model and optimizer in place, then this rank's RNG (so call it after
    anything that draws from the RNG: engines, iterators); returns meta.json."""
    meta = json.load(open(os.path.join(path, "meta.json")))
    diff = [f"--{k} {meta['args'].get(k)!r} -> {args[k]!r}" for k in must_match if meta["args"].get(k) != args[k]]
    diff += [f"format_version {meta['format_version']} -> {FORMAT_VERSION}"] if meta["format_version"] != FORMAT_VERSION else []
    if diff:
        raise CheckpointError(f"{path} was saved by a different run; differing settings: {', '.join(diff)}")
    dcp_load(state := _state(roles), os.path.join(path, "dcp"))
    for role, (model, optim) in roles.items():
        set_state_dict(model, optim, model_state_dict=state[role]["model"], optim_state_dict=state[role]["optim"])
    set_rng_state(json.load(open(os.path.join(path, f"rng-rank{dist.get_rank() % meta['world_size']}.json"))))
    if meta["world_size"] != dist.get_world_size() and dist.get_rank() == 0:  # exact only at the same size
        print(f"WARNING: resuming a {meta['world_size']}-rank checkpoint on {dist.get_world_size()} ranks: weights, "
              "optimizer and data position carry over, RNG streams cannot (reused round-robin)", flush=True)
    return meta


if __name__ == "__main__":
    try:
        match sys.argv[1:]:
            case ["verify", *ckpts] if ckpts:
                for ckpt in ckpts:
                    print(f"{ckpt}: ok, step {verify(ckpt)['step']}")
            case ["export", ckpt, out] | ["export", ckpt, out, "--role", _]:
                import rollout  # the export lives with the other ways the actor leaves the trainer
                rollout.export(ckpt, out, sys.argv[5] if len(sys.argv) == 6 else None)
                print(f"exported {ckpt} -> {out}")
            case _:
                sys.exit("usage: python checkpoint.py verify CKPT [CKPT...] | export CKPT OUT [--role NAME]")
    except (CheckpointError, OSError) as err:
        sys.exit(f"error: {err}")
