"""Atomic, rank-coordinated, full-state checkpoints: the only code that touches training state on disk.

`<out_dir>/checkpoints/step-00000012/`: dcp/ (every role's model and optimizer, sharded, by DCP),
rng-rank<R>.json (rank R's python/numpy/torch/CUDA RNG: DCP would merge per-rank values), meta.json
(counters, LR schedule, algorithm state, args), hf/ (config, tokenizer), manifest.json (size + sha256
of every file). All ranks write `.tmp-step-N/`; after a barrier rank 0 writes the manifest, fsyncs,
renames it to `step-N/`, then os.replace()s `latest`: a kill at any instant leaves the old or the new
checkpoint as latest, never a half one. Plain `dcp.load` unpickles `.metadata` and non-tensor entries
(a crafted checkpoint runs code): here an allow-listing unpickler and weights_only=True read them.

    python checkpoint.py ls OUT_DIR | verify CKPT | export CKPT OUT [--role NAME]
"""
import base64, hashlib, json, os, pickle, random, shutil, sys, warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, damaged, unsafe or from another run; the message says which."""


_ALLOWED = {  # every global the .metadata pickle of DCP (torch 2.13) refers to, and nothing more
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "StorageMeta", "MetadataIndex",
        "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"}, "torch.serialization": {"_get_layout"},
    "torch": {"Size"}, "pathlib": {"PosixPath"}}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if name in _ALLOWED.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"refusing to unpickle {module}.{name}: not a DCP metadata class")


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):  # FileSystemReader's own is a plain pickle.load
        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            return _SafeUnpickler(f).load()


class _SafePlanner(DefaultLoadPlanner):  # assumes flatten_state_dict=True, the default
    def load_bytes(self, read_item, value):  # DefaultLoadPlanner's own: torch.load(weights_only=False)
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                    torch.load(value, weights_only=True))


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


def _write(path, text):  # durable: the data is on disk when this returns
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path):  # makes renames and new files in `path` durable
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def _manifest_files(root):  # {relative path: {size, sha256}} of every file below root
    files = {}
    for rel in sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs):
        with open(os.path.join(root, rel), "rb") as f:
            files[rel] = {"size": os.fstat(f.fileno()).st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}
    files.pop("manifest.json", None)
    return files


def _step_dirs(root):  # (committed checkpoints, newest first; the `latest` pointer's target or None)
    names = [n for n in os.listdir(root) if n.startswith("step-") and n[5:].isdigit()] if os.path.isdir(root) else []
    latest = open(os.path.join(root, "latest")).read().strip() if os.path.isfile(os.path.join(root, "latest")) else None
    return sorted(names, key=lambda n: int(n[5:]), reverse=True), latest


def verify(path):
    """Return the manifest, or raise CheckpointError naming the file that is missing, cut or altered."""
    mpath = os.path.join(path, "manifest.json")
    if not os.path.isfile(mpath):
        raise CheckpointError(f"{mpath}: missing (not a checkpoint, or an unfinished one)")
    try:
        manifest, files = (m := json.load(open(mpath))), m["files"].items()
    except (ValueError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{mpath}: unreadable ({e!r})")
    actual = _manifest_files(path)
    for rel, want in files:
        if (got := actual.get(rel)) != want:
            raise CheckpointError(f"{os.path.join(path, rel)}: " + ("missing" if got is None else
                f"size {got['size']}, manifest says {want['size']}" if got["size"] != want["size"]
                else "checksum mismatch (file altered or corrupted)"))
    return manifest


def save(out_dir, step, roles, meta, config, tokenizer, generation_config, keep_last):
    """Collective: every rank calls it. roles = {name: (model, optimizer)}; meta must be JSON."""
    root, name = os.path.join(out_dir, "checkpoints"), f"step-{step:08d}"
    tmp, final = os.path.join(root, f".tmp-{name}"), os.path.join(root, name)
    if (rank := dist.get_rank()) == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a save that was killed
        os.makedirs(tmp)
    dist.barrier()  # the empty temp dir exists before anyone writes into it
    dcp.save(_state(roles), storage_writer=dcp.FileSystemWriter(os.path.join(tmp, "dcp")))
    _write(os.path.join(tmp, f"rng-rank{rank}.json"), json.dumps(rng_state()))
    if rank == 0:
        _write(os.path.join(tmp, "meta.json"), json.dumps({"format_version": FORMAT_VERSION, "step": step,
               "world_size": dist.get_world_size(), "roles": list(roles), **meta}, indent=1))
        for obj in (config, tokenizer, generation_config):
            obj.save_pretrained(os.path.join(tmp, "hf"))
    dist.barrier()  # every rank's files are on disk before rank 0 checksums and commits them
    if rank == 0:
        _write(os.path.join(tmp, "manifest.json"), json.dumps({"step": step, "files": _manifest_files(tmp)}))
        for d, _, _ in os.walk(tmp):
            _fsync_dir(d)
        if os.path.exists(final):  # an older save of this step, by a run resumed before it: replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        _write(os.path.join(root, "latest.tmp"), name + "\n")
        os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))
        _fsync_dir(root)
        # Prune only now that the new one is committed (keep_last 0 keeps all); newer steps, left by a
        # run that was then resumed from an earlier checkpoint, are not ours to delete.
        for n in [n for n in _step_dirs(root)[0] if int(n[5:]) < step][keep_last - 1:] if keep_last > 0 else []:
            shutil.rmtree(os.path.join(root, n))
    dist.barrier()  # nobody runs ahead (and maybe saves again) before the commit is done
    return final


def resolve(out_dir, resume):
    """Collective: the checkpoint to resume from ('' = start fresh); rank 0 picks, every rank gets it."""
    choice, root = ["", None], os.path.join(out_dir, "checkpoints")
    if dist.get_rank() == 0 and resume and resume != "latest":
        try:
            choice[0] = verify(resume) and resume  # --resume PATH: that one or a clear error
        except CheckpointError as e:
            choice[1] = str(e)
    elif dist.get_rank() == 0 and resume:
        names, top = _step_dirs(root)
        if top in names:  # the pointer first, then older ones (newer ones are an abandoned branch)
            names = [top] + [n for n in names if int(n[5:]) < int(top[5:])]
        for n in names:
            try:
                choice[0] = verify(os.path.join(root, n)) and os.path.join(root, n)
                break
            except CheckpointError as e:
                print(f"WARNING: skipping checkpoint {n}: {e}; falling back to an older one", flush=True)
        else:
            print(f"--resume latest: no checkpoint in {root}; starting from scratch", flush=True)
    dist.broadcast_object_list(choice, src=0)  # all ranks load the very same checkpoint, or all fail
    if choice[1]:
        raise CheckpointError(choice[1])
    return choice[0]


def load(path, roles, args, must_match):
    """Collective. Loads every role's model and optimizer in place, then this rank's RNG; returns
    meta.json. Call it after anything that draws from the RNG (building engines, iterators)."""
    meta = json.load(open(os.path.join(path, "meta.json")))
    if meta["format_version"] != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {meta['format_version']}, expected {FORMAT_VERSION}")
    diff = [f"--{k} {meta['args'].get(k)!r} -> {args[k]!r}" for k in must_match if meta["args"].get(k) != args[k]]
    if diff:
        raise CheckpointError(f"{path} was saved by a different run; differing settings: {', '.join(diff)}")
    dcp_load(state := _state(roles), os.path.join(path, "dcp"))
    for role, (model, optim) in roles.items():
        set_state_dict(model, optim, model_state_dict=state[role]["model"], optim_state_dict=state[role]["optim"])
    rank, world = dist.get_rank(), dist.get_world_size()
    if meta["world_size"] == world:  # RNG is exact only at the same world size; else say so, reseed
        set_rng_state(json.load(open(os.path.join(path, f"rng-rank{rank}.json"))))
    else:
        seed = meta["args"]["seed"] + 1000003 * (rank + 1) + meta["step"]
        random.seed(seed), np.random.seed(seed % 2**32), torch.manual_seed(seed)
        if rank == 0:
            print(f"WARNING: resuming a {meta['world_size']}-rank checkpoint on {world} ranks: weights, optimizer "
                  "and data position carry over, RNG streams cannot (reseeded)", flush=True)
    return meta


def export(path, out, role=None):
    """Checkpoint -> HF folder (safetensors, config, tokenizer), on one process: DCP's no_dist mode."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    verify(path)
    roles, hf = json.load(open(os.path.join(path, "meta.json")))["roles"], os.path.join(path, "hf")
    if (role := role or roles[0]) not in roles:
        raise CheckpointError(f"--role {role}: checkpoint has roles {roles}")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf))
    warnings.filterwarnings("ignore", "torch.distributed is disabled")  # no_dist says so: we know
    dcp_load({role: {"model": model.state_dict()}}, os.path.join(path, "dcp"), no_dist=True)  # in place
    model.generation_config = GenerationConfig.from_pretrained(hf)
    for obj in (model, AutoTokenizer.from_pretrained(hf)):
        obj.save_pretrained(out)


def main(argv):
    try:
        match argv:
            case ["ls", out_dir]:
                root = os.path.join(out_dir, "checkpoints")
                names, top = _step_dirs(root)
                for n in reversed(names):
                    try:
                        status = verify(os.path.join(root, n)) and "ok"
                    except CheckpointError as err:
                        status = f"BAD: {err}"
                    print(f"{n}  step {int(n[5:])}  {status}{'  <- latest' if n == top else ''}")
            case ["verify", ckpt]:
                print(f"{ckpt}: ok, step {verify(ckpt)['step']}")
            case ["export", ckpt, out] | ["export", ckpt, out, "--role", _]:
                export(ckpt, out, argv[4] if len(argv) == 5 else None)
                print(f"exported {ckpt} -> {out}")
            case _:
                sys.exit("usage: python checkpoint.py ls OUT_DIR | verify CKPT | export CKPT OUT [--role NAME]")
    except (CheckpointError, OSError) as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main(sys.argv[1:])
