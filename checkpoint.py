"""Atomic, rank-coordinated, full-state checkpoints: the only code that touches training state on disk.

Layout of one checkpoint, `<out_dir>/checkpoints/step-00000012/`:
    dcp/            model and optimizer of every role, sharded, torch.distributed.checkpoint (DCP)
    rng-rank<R>.json  python, numpy, torch CPU and CUDA RNG of rank R (per rank: DCP would merge them)
    meta.json       format version, step counters, sampler position, LR schedule, the run's args
    hf/             the model's config and tokenizer, so `export` needs nothing else
    manifest.json   size and sha256 of every file above; written last, it marks the checkpoint whole
`<out_dir>/checkpoints/latest` names the newest committed checkpoint.

Commit protocol (DCP has no multi-file atomic commit, see shared/reference/fsdp_dcp_cpu.md): every rank
writes into `.tmp-step-N/`; after a barrier rank 0 writes the manifest, fsyncs, renames the directory
to `step-N/`, then replaces `latest` with os.replace. A kill at any instant leaves the old or the new
checkpoint as latest, never a half one. Old checkpoints are pruned only after that.

Security: DCP's `.metadata` and its non-tensor entries are pickles, and plain `dcp.load` unpickles
them, so a crafted checkpoint runs code. Here the metadata goes through an allow-listing unpickler and
byte entries through `torch.load(weights_only=True)`. Everything else is JSON or safetensors.

    python checkpoint.py ls OUT_DIR | verify CKPT | export CKPT OUT [--role NAME]
"""
import base64, hashlib, json, os, pickle, random, shutil, sys

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    pass


# ---- safe reading of DCP ------------------------------------------------------------------------
_ALLOWED = {  # every global the .metadata pickle of DCP (torch 2.13) refers to, and nothing more
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "StorageMeta",
        "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
        "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"}, "torch": {"Size"}, "pathlib": {"PosixPath"},
}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if name in _ALLOWED.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"refusing to unpickle {module}.{name}: not a DCP metadata class")


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            metadata = _SafeUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value):  # DCP's own uses torch.load(weights_only=False)
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def dcp_load(state, path, no_dist=False):
    dcp.load(state, storage_reader=_SafeReader(path), planner=_SafePlanner(), no_dist=no_dist)


# ---- RNG of every generator, per rank -------------------------------------------------------------
def rng_state():
    b64 = lambda t: base64.b64encode(t.numpy().tobytes()).decode()
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": [name, keys.tolist(), pos, has_gauss, gauss],
            "torch": b64(torch.get_rng_state()),
            "cuda": b64(torch.cuda.get_rng_state()) if torch.cuda.is_available() else None}


def set_rng_state(s):
    unb64 = lambda x: torch.frombuffer(bytearray(base64.b64decode(x)), dtype=torch.uint8)
    v, state, gauss = s["python"]
    random.setstate((v, tuple(state), gauss))
    name, keys, pos, has_gauss, g = s["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, g))
    torch.set_rng_state(unb64(s["torch"]))
    if s["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(unb64(s["cuda"]))


# ---- files ----------------------------------------------------------------------------------------
def _write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def _step_dirs(root):
    """Committed checkpoints (renamed into place, so manifest written), newest first."""
    names = [n for n in os.listdir(root) if n.startswith("step-") and n[5:].isdigit()] if os.path.isdir(root) else []
    return sorted(names, key=lambda n: int(n[5:]), reverse=True)


def verify(path):
    """Raise CheckpointError naming the first file that is missing, truncated or altered."""
    mpath = os.path.join(path, "manifest.json")
    if not os.path.isfile(mpath):
        raise CheckpointError(f"{mpath}: missing (not a checkpoint, or an unfinished one)")
    try:
        manifest = json.load(open(mpath))
        files = manifest["files"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{mpath}: unreadable ({e})")
    for rel, want in files.items():
        p = os.path.join(path, rel)
        if not os.path.isfile(p):
            raise CheckpointError(f"{p}: missing")
        if os.path.getsize(p) != want["size"]:
            raise CheckpointError(f"{p}: size {os.path.getsize(p)}, manifest says {want['size']}")
        if _sha256(p) != want["sha256"]:
            raise CheckpointError(f"{p}: checksum mismatch (file altered or corrupted)")
    return manifest


# ---- save -----------------------------------------------------------------------------------------
def save(out_dir, step, roles, meta, config, tokenizer, generation_config, keep_last):
    """Collective: every rank calls it. roles = {name: (model, optimizer)}; meta must be JSON."""
    root = os.path.join(out_dir, "checkpoints")
    name = f"step-{step:08d}"
    tmp, final = os.path.join(root, f".tmp-{name}"), os.path.join(root, name)
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a save that was killed
        os.makedirs(tmp)
    dist.barrier()  # the empty temp dir exists before anyone writes into it
    state = {}
    for role, (model, optim) in roles.items():
        msd, osd = get_state_dict(model, optim)
        state[role] = {"model": msd, "optim": osd}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(tmp, "dcp")))
    _write_json(os.path.join(tmp, f"rng-rank{rank}.json"), rng_state())
    if rank == 0:
        _write_json(os.path.join(tmp, "meta.json"), {"format_version": FORMAT_VERSION, "step": step,
                    "world_size": dist.get_world_size(), "roles": list(roles), **meta})
        for obj in (config, tokenizer, generation_config):
            obj.save_pretrained(os.path.join(tmp, "hf"))
    dist.barrier()  # every rank's files are on disk before rank 0 checksums and commits them
    if rank == 0:
        _commit(root, tmp, final, step, keep_last)
    dist.barrier()  # nobody runs ahead (and maybe saves again) before the commit is done
    return final


def _commit(root, tmp, final, step, keep_last):
    files = {rel: {"size": os.path.getsize(os.path.join(tmp, rel)), "sha256": _sha256(os.path.join(tmp, rel))}
             for rel in _files(tmp)}
    _write_json(os.path.join(tmp, "manifest.json"), {"format_version": FORMAT_VERSION, "step": step,
                                                     "files": files})
    for d, _, _ in os.walk(tmp):
        _fsync_dir(d)
    if os.path.exists(final):  # an older save of this step, from a run resumed before it: replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    with open(os.path.join(root, "latest.tmp"), "w") as f:
        f.write(os.path.basename(final) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
    _fsync_dir(root)
    # Prune only now that the new one is committed. Newer steps (from a run that was resumed from an
    # earlier checkpoint) are left alone: they are not ours to delete.
    older = [n for n in _step_dirs(root) if int(n[5:]) < step]
    for n in older[max(keep_last - 1, 0):] if keep_last > 0 else []:
        shutil.rmtree(os.path.join(root, n))


# ---- resume ---------------------------------------------------------------------------------------
def resolve(out_dir, resume):
    """Collective. Path of the checkpoint to resume from ('' = start fresh): rank 0 picks, all agree."""
    choice = [None]
    if dist.get_rank() == 0:
        try:
            choice[0] = _pick(out_dir, resume)
        except CheckpointError as e:
            choice[0] = e
    dist.broadcast_object_list(choice, src=0)  # all ranks must load the very same checkpoint
    if isinstance(choice[0], CheckpointError):
        raise choice[0]
    return choice[0]


def _pick(out_dir, resume):
    if not resume:
        return ""
    if resume != "latest":
        verify(resume)  # --resume PATH: that one or a clear error
        return resume
    root = os.path.join(out_dir, "checkpoints")
    names = _step_dirs(root)
    pointer = os.path.join(root, "latest")
    if os.path.isfile(pointer) and open(pointer).read().strip() in names:
        top = open(pointer).read().strip()
        names = [top] + [n for n in names if int(n[5:]) < int(top[5:])]
    for n in names:
        try:
            verify(os.path.join(root, n))
            return os.path.join(root, n)
        except CheckpointError as e:
            print(f"WARNING: skipping checkpoint {n}: {e}; falling back to an older one", flush=True)
    print(f"--resume latest: no checkpoint in {root}; starting from scratch", flush=True)
    return ""


def load(path, roles, args, must_match):
    """Collective. Loads every role's model and optimizer in place; returns meta.json's contents.

    RNG is not restored here: call `load_rng` last, after anything that might draw from it."""
    meta = json.load(open(os.path.join(path, "meta.json")))
    if meta["format_version"] != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {meta['format_version']}, expected {FORMAT_VERSION}")
    diff = [f"--{k} {meta['args'].get(k)!r} -> {args[k]!r}" for k in must_match if meta["args"].get(k) != args[k]]
    if diff:
        raise CheckpointError(f"{path} was saved by a different run; differing settings: {', '.join(diff)}")
    state = {}
    for role, (model, optim) in roles.items():
        msd, osd = get_state_dict(model, optim)
        state[role] = {"model": msd, "optim": osd}
    dcp_load(state, os.path.join(path, "dcp"))
    for role, (model, optim) in roles.items():
        set_state_dict(model, optim, model_state_dict=state[role]["model"],
                       optim_state_dict=state[role]["optim"])
    return meta


def load_rng(path, meta):
    """Restore this rank's RNG. Exact only at the same world size; otherwise say so and reseed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if meta["world_size"] != world:
        if rank == 0:
            print(f"WARNING: resuming a {meta['world_size']}-rank checkpoint on {world} ranks: weights, "
                  "optimizer and data position carry over, RNG streams cannot (reseeded)", flush=True)
        seed = meta["args"]["seed"] + 1000003 * (rank + 1) + meta["step"]
        random.seed(seed); np.random.seed(seed % 2**32); torch.manual_seed(seed)
        return
    set_rng_state(json.load(open(os.path.join(path, f"rng-rank{rank}.json"))))


# ---- export -------------------------------------------------------------------------------------
def export_hf(model_sd, config, tokenizer, out, generation_config=None):
    """Write an HF folder (safetensors) from a full state dict, on one process."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):  # no second copy of the weights: load_state_dict(assign=True) below
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(model_sd, assign=True)
    model.tie_weights()
    if generation_config is not None:
        model.generation_config = generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def export_checkpoint(path, out, role=None):
    """Checkpoint -> HF folder, without a process group (DCP's no_dist mode)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    verify(path)
    meta = json.load(open(os.path.join(path, "meta.json")))
    role = role or meta["roles"][0]
    if role not in meta["roles"]:
        raise CheckpointError(f"--role {role}: checkpoint has roles {meta['roles']}")
    hf = os.path.join(path, "hf")
    config = AutoConfig.from_pretrained(hf)
    model = AutoModelForCausalLM.from_config(config)
    state = {role: {"model": model.state_dict()}}
    dcp_load(state, os.path.join(path, "dcp"), no_dist=True)
    export_hf(state[role]["model"], config, AutoTokenizer.from_pretrained(hf), out,
              GenerationConfig.from_pretrained(hf))


def main(argv):
    cmd, rest = (argv[0], argv[1:]) if argv else ("", [])
    try:
        if cmd == "ls" and len(rest) == 1:
            root = os.path.join(rest[0], "checkpoints")
            latest = open(os.path.join(root, "latest")).read().strip() if os.path.isfile(os.path.join(root, "latest")) else None
            for n in sorted(_step_dirs(root)):
                try:
                    verify(os.path.join(root, n)); status = "ok"
                except CheckpointError as e:
                    status = f"BAD: {e}"
                print(f"{n}  step {int(n[5:])}  {status}{'  <- latest' if n == latest else ''}")
        elif cmd == "verify" and len(rest) == 1:
            print(f"{rest[0]}: ok, step {verify(rest[0])['step']}")
        elif cmd == "export" and len(rest) in (2, 4) and (len(rest) == 2 or rest[2] == "--role"):
            export_checkpoint(rest[0], rest[1], rest[3] if len(rest) == 4 else None)
            print(f"exported {rest[0]} -> {rest[1]}")
        else:
            sys.exit("usage: python checkpoint.py ls OUT_DIR | verify CKPT | export CKPT OUT [--role NAME]")
    except (CheckpointError, OSError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
