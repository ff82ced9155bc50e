"""Crafted and damaged checkpoints, in-process (no torchrun): what verification and the safe DCP
loader refuse, and that they refuse it before reading (issue 12: items 2, 9 and 11)."""

import io
import json
import os
import pickle
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

import checkpoint
from conftest import dcp_folder
from conftest import deflated_copy
from conftest import latest
from conftest import rewrite_manifest
from conftest import run_py
from conftest import write_small_checkpoint


def manifest_lists(path, rel, size=10):
    """Add rel to the manifest by hand (rewrite_manifest refuses what is no regular file)."""
    m = json.load(open(path / "manifest.json"))
    m["files"][rel] = {"size": size, "sha256": "0" * 64}
    (path / "manifest.json").write_text(json.dumps(m))


def assert_cli_refuses(path, *needles):
    """`checkpoint.py verify` ends in one line naming the problem, within the timeout (a read of
    /dev/zero or a FIFO would hang it)."""
    p = run_py("checkpoint.py", "verify", path, timeout=60)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and all(n in lines[0] for n in needles), p.stderr[-2000:]


def test_a_listed_symlink_to_dev_zero_fails_verification(tmp_path):
    write_small_checkpoint(tmp_path)
    os.symlink("/dev/zero", tmp_path / "sub" / "zero.bin")
    manifest_lists(tmp_path, "sub/zero.bin", size=3 << 30)
    assert_cli_refuses(tmp_path, "sub/zero.bin: not a regular file")


@pytest.mark.parametrize("listed", [True, False], ids=["listed", "unlisted"])
def test_a_fifo_fails_verification_without_hanging(tmp_path, listed):
    write_small_checkpoint(tmp_path)
    os.mkfifo(tmp_path / "sub" / "fifo")
    if listed:
        manifest_lists(tmp_path, "sub/fifo")
    assert_cli_refuses(tmp_path, "sub/fifo: not a regular file")


@pytest.mark.parametrize("rel", ["../outside.bin", "sub/../a.bin", "sub//b.bin"])
def test_a_listed_name_outside_the_checkpoint_fails_verification(tmp_path, rel):
    """A manifest naming a file by a path that leaves the checkpoint (or names one of its files a
    second way): never read, and said as such, where "../x" was "missing" though x was there."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    write_small_checkpoint(folder)
    (tmp_path / "outside.bin").write_bytes(b"0123456789")
    manifest_lists(folder, rel)
    assert_cli_refuses(folder, f"{rel}: not a plain name inside the checkpoint")


def test_unlisted_files_and_symlinked_folders_fail_verification(tmp_path):
    write_small_checkpoint(tmp_path)
    (tmp_path / "sub" / "extra.py").write_text("print('hi')\n")
    with pytest.raises(checkpoint.CheckpointError, match="extra.py: not listed in the manifest"):
        checkpoint.verify(str(tmp_path))
    os.unlink(tmp_path / "sub" / "extra.py")
    os.symlink("/etc", tmp_path / "etc")
    with pytest.raises(checkpoint.CheckpointError, match="etc: not a regular file"):
        checkpoint.verify(str(tmp_path))


@pytest.mark.parametrize(
    "manifest",
    ['["files"]', '{"step": 1, "files": "x"}', '{"step": -1, "files": {}}', "{", "\xff"],
    ids=["list", "files-str", "step-negative", "cut", "not-utf8"],
)
def test_a_malformed_manifest_is_one_line(tmp_path, manifest):
    write_small_checkpoint(tmp_path)
    (tmp_path / "manifest.json").write_bytes(manifest.encode("latin-1"))
    assert_cli_refuses(tmp_path, "manifest.json: ")


# A well-formed record of a model folder (`common.folder_identity`), for the crafted ones below.
FOLDER = {"config": "{}", "generation": "null", "tokenizer": "0" * 64, "versions": "v"}


@pytest.mark.parametrize(
    "field,value",
    [
        ("step", 10**30),
        ("step", -7),
        ("step", 2),  # the manifest says 1
        ("world_size", -1),
        ("world_size", True),
        ("roles", []),
        ("format_version", 99),
        ("scheduler", {"last_epoch": -(10**9), "_step_count": 2}),  # trained at a negative rate
        ("scheduler", {"last_epoch": 10**30, "_step_count": 2}),
        ("scheduler", {"actor": {"last_epoch": 1, "_step_count": 2}, "critic": {}}),
        ("scheduler", "cosine"),  # stopped the resume, where an older checkpoint would do
        ("frozen", {"model": {"lm_head.weight": "1.0"}}),  # the frozen models' fingerprints
        ("frozen", {"model": [1.0]}),
        ("frozen", ["model"]),
        ("frozen", {"model": {"lm_head.weight": 10**400}}),  # an int isfinite cannot take
        ("folders", {"model": {**FOLDER, "tokenizer": None}}),  # the folders' records
        ("folders", {"model": {k: v for k, v in FOLDER.items() if k != "versions"}}),
        ("folders", {"model": {**FOLDER, "config": "[1]"}}),
        ("folders", {"model": {**FOLDER, "config": "{"}}),
        ("folders", {"model": {**FOLDER, "generation": "1"}}),
        ("folders", {"model": {**FOLDER, "tokenizer": "../x"}}),
        ("folders", {"model": {**FOLDER, "config": "[" * 10**5}}),
        ("folders", ["model"]),
        ("engine", "vllm\nerror: made up"),  # PPO's rollout engine: a name only
    ],
)
def test_a_crafted_meta_json_is_a_damaged_checkpoint(tmp_path, field, value):
    write_small_checkpoint(tmp_path)
    meta = json.load(open(tmp_path / "meta.json"))
    meta[field] = value
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    os.unlink(tmp_path / "manifest.json")
    files = checkpoint._manifest_files(str(tmp_path))
    (tmp_path / "manifest.json").write_text(json.dumps({"step": 1, "files": files}))
    assert_cli_refuses(tmp_path, "meta.json: malformed", field)


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: s.update(torch="!!"),
        lambda s: s.update(numpy=["MT19937", [-1] * 624, 0, 0, 0.0]),
        lambda s: s.pop("python"),
        lambda s: s.update(cuda="AAAA"),  # 3 bytes: a GPU resume's traceback after the weights
    ],
    ids=["torch-not-base64", "numpy-negative-keys", "python-missing", "cuda-3-bytes"],
)
def test_a_malformed_rng_file_is_one_line(tmp_path, edit):
    write_small_checkpoint(tmp_path)
    state = json.load(open(tmp_path / "rng-rank0.json"))
    edit(state)
    (tmp_path / "rng-rank0.json").write_text(json.dumps(state))
    os.unlink(tmp_path / "manifest.json")
    files = checkpoint._manifest_files(str(tmp_path))
    (tmp_path / "manifest.json").write_text(json.dumps({"step": 1, "files": files}))
    assert_cli_refuses(tmp_path, "rng-rank0.json: malformed RNG state")


def test_build_may_set_only_a_dcp_class_own_fields():
    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([4]))
    assert checkpoint._SafeUnpickler(io.BytesIO(pickle.dumps(chunk))).load() == chunk
    chunk.__dict__["__class__"] = "x"  # BUILD would set attributes DCP never sets
    with pytest.raises(checkpoint.CheckpointError, match="BUILD sets dict state"):
        checkpoint._SafeUnpickler(io.BytesIO(pickle.dumps(chunk))).load()


def craft(folder, md, **changes):
    """Point every storage entry elsewhere (changes: relative_path, offset, length)."""
    for index, info in md.storage_data.items():
        fields = {**info.__dict__, **changes}
        md.storage_data[index] = type(info)(**fields)
    (folder / ".metadata").write_bytes(pickle.dumps(md))


def load_t(folder):
    state = {"t": torch.zeros(1000)}
    checkpoint.dcp_load(state, str(folder), no_dist=True)
    return state["t"]


def test_the_real_dcp_folder_loads(tmp_path):
    folder, _ = dcp_folder(tmp_path)
    assert torch.equal(load_t(folder), torch.arange(1000.0))


@pytest.mark.parametrize("where", ["dotdot", "absolute", "symlink"])
def test_storage_entries_outside_the_checkpoint_are_refused(tmp_path, where):
    """The marker: a copy of the real shard outside the folder. Loading from it would succeed
    (that is the attack): the loader must refuse before reading."""
    folder, md = dcp_folder(tmp_path)
    shard = next(iter(md.storage_data.values())).relative_path
    outside = tmp_path / "outside.distcp"
    shutil.copy(folder / shard, outside)
    names = {"dotdot": "../outside.distcp", "absolute": str(outside), "symlink": "link.distcp"}
    os.symlink(outside, folder / "link.distcp")
    craft(folder, md, relative_path=names[where])
    with pytest.raises(checkpoint.CheckpointError, match="not a regular file in"):
        load_t(folder)


@pytest.mark.parametrize(
    "changes",
    [{"length": 3 << 30}, {"offset": -8}, {"offset": 10**30}, {"length": "big"}],
    ids=["3GiB", "negative", "huge", "not-a-number"],
)
def test_storage_ranges_beyond_the_file_are_refused(tmp_path, changes):
    folder, md = dcp_folder(tmp_path)
    craft(folder, md, **changes)
    with pytest.raises(checkpoint.CheckpointError, match="reads bytes"):
        load_t(folder)


def scheduler(lr=1e-3):
    import torch
    from transformers import get_cosine_schedule_with_warmup

    optim = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    return get_cosine_schedule_with_warmup(optim, 3, 10)


@pytest.mark.parametrize(
    "change",
    [
        {"base_lrs": ["x"]},
        {"base_lrs": [0.001, 0.001]},
        {"last_epoch": 1e30},
        {"_last_lr": [float("nan")]},
        {"__class__": "x"},
        {"lr_lambdas": {"a": 1}},
    ],
)
def test_a_crafted_scheduler_state_is_refused(change):
    """meta.json's scheduler state went into load_state_dict (a __dict__.update) unchecked: a
    crafted one crashed mid-run with a traceback, or set any attribute it liked."""
    sched = scheduler()
    state = json.loads(json.dumps(sched.state_dict()))
    field = r"^ckpt/meta.json: (scheduler field '\w+' is |the scheduler state is not a LambdaLR's)"
    with pytest.raises(checkpoint.CheckpointError, match=field):
        checkpoint.restore_scheduler(sched, {**state, **change}, "ckpt/meta.json")
    not_a_state = r"^ckpt/meta.json: the scheduler state is not a LambdaLR's$"
    with pytest.raises(checkpoint.CheckpointError, match=not_a_state):
        checkpoint.restore_scheduler(sched, [state], "ckpt/meta.json")


def test_a_saved_scheduler_state_is_restored():
    sched = scheduler()
    for _ in range(4):
        sched.optimizer.step()
        sched.step()
    state = json.loads(json.dumps(sched.state_dict()))  # as meta.json holds it
    fresh = scheduler()
    checkpoint.restore_scheduler(fresh, state, "ckpt/meta.json")
    assert fresh.state_dict() == sched.state_dict()
    assert fresh.get_last_lr() == sched.get_last_lr()
    assert fresh.optimizer.param_groups[0]["lr"] == sched.optimizer.param_groups[0]["lr"]


def test_a_resumed_schedule_follows_this_runs_lr():
    """The schedule's position comes from the checkpoint, its peak rate from this run's --lr.
    load_state_dict alone restored the saved run's base_lrs (and a resume restores the optimizer's
    param groups with the saved rate): a resumed run given another --lr went on at the old one."""
    saved = scheduler(lr=1e-3)
    for _ in range(4):
        saved.optimizer.step()
        saved.step()
    state = json.loads(json.dumps(saved.state_dict()))
    fresh = scheduler(lr=5e-4)
    fresh.optimizer.load_state_dict(saved.optimizer.state_dict())  # as checkpoint.load does
    checkpoint.restore_scheduler(fresh, state, "ckpt/meta.json")
    assert fresh.last_epoch == 4 and fresh.base_lrs == [5e-4]
    # half the rate at the same point of the schedule (halving a float is exact)
    assert fresh.optimizer.param_groups[0]["lr"] == saved.get_last_lr()[0] / 2
    assert fresh.get_last_lr() == [saved.get_last_lr()[0] / 2]
    for sched in (saved, fresh):
        sched.optimizer.step()
        sched.step()
    assert fresh.get_last_lr() == [saved.get_last_lr()[0] / 2]


@pytest.mark.parametrize("kl_coef", ["0.1", -1.0, float("inf"), True, None, 10**400])
def test_a_crafted_kl_coef_is_refused(kl_coef):
    import train_ppo

    scheds = {"actor": scheduler()}
    state = {"actor": json.loads(json.dumps(scheds["actor"].state_dict()))}
    meta = {"scheduler": state, "kl_coef": kl_coef}
    adaptive = train_ppo.Args(kl_coef=0.2, target_kl=6.0)
    with pytest.raises(checkpoint.CheckpointError, match="kl_coef"):
        train_ppo.restore_schedules(meta, scheds, "ckpt/meta.json", adaptive)
    with pytest.raises(checkpoint.CheckpointError, match="scheduler states"):
        train_ppo.restore_schedules({**meta, "scheduler": {}}, scheds, "ckpt/meta.json", adaptive)
    good = {**meta, "kl_coef": 0.05}
    # the controller's beta from the checkpoint; a fixed one from this run's --kl_coef, which a
    # resume may change (it was the saved 0.05 whatever the flag said)
    assert train_ppo.restore_schedules(good, scheds, "ckpt/meta.json", adaptive) == 0.05
    fixed = train_ppo.Args(kl_coef=0.2, target_kl=0.0)
    assert train_ppo.restore_schedules(good, scheds, "ckpt/meta.json", fixed) == 0.2


def remanifest(path):
    """After an edit: the manifest rewritten to match, as an attacker would."""
    os.unlink(path / "manifest.json")
    files = checkpoint._manifest_files(str(path))
    (path / "manifest.json").write_text(json.dumps({"step": 1, "files": files}))


@pytest.mark.parametrize(
    "data",
    [b"", "half", b"\x80\x04b.", b"garbage bytes"],
    ids=["empty", "cut", "build-on-empty-stack", "garbage"],
)
def test_a_malformed_dcp_metadata_is_one_line_and_fails_verification(tmp_path, data):
    """The safe unpickler raised pickle's own errors (EOFError, IndexError, ...) as tracebacks,
    and verify() never read .metadata, so `--resume latest` did not pass over the checkpoint."""
    write_small_checkpoint(tmp_path)
    metadata = tmp_path / "dcp" / ".metadata"
    if data == "half":
        data = metadata.read_bytes()[: metadata.stat().st_size // 2]
    metadata.write_bytes(data)
    remanifest(tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match="dcp/.metadata: "):
        checkpoint.verify(str(tmp_path))
    assert_cli_refuses(tmp_path, "dcp/.metadata: ")


def edit_small_index(tmp_path, edit):
    """A small checkpoint (conftest.write_small_checkpoint) whose dcp/.metadata `edit` changed in
    place, its manifest rewritten to match."""
    write_small_checkpoint(tmp_path)
    path = tmp_path / "dcp" / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    edit(metadata)
    path.write_bytes(pickle.dumps(metadata))
    remanifest(tmp_path)


def craft_small_entry(tmp_path, craft):
    """edit_small_index, its tensor 't''s index entry replaced by craft(entry)."""

    def edit(metadata):
        metadata.state_dict_metadata["t"] = craft(metadata.state_dict_metadata["t"])

    edit_small_index(tmp_path, edit)


def no_build(entry):
    """The entry as a pickle can make it: the class's object with no BUILD, no attributes."""
    return type(entry).__new__(type(entry))


def chunk_of_other_dims(entry):
    entry.chunks[0].offsets = torch.Size([0, 0])
    return entry


def size_of_text(entry):
    entry.size = "4"
    return entry


@pytest.mark.parametrize("craft", [no_build, chunk_of_other_dims, size_of_text])
def test_a_dcp_index_entry_not_as_dcp_writes_it_fails_verification(tmp_path, craft):
    """The allow-listed classes of .metadata's index, made without their BUILD (a NEWOBJ alone)
    or built with values of other types, passed verify() and failed in DCP's planner with an
    AttributeError traceback, which --resume latest did not pass over. One line now
    (`checkpoint._check_entries`), at verify."""
    craft_small_entry(tmp_path, craft)
    needle = "dcp/.metadata: entry 't' is not what DCP writes for a tensor or bytes"
    with pytest.raises(checkpoint.CheckpointError, match=needle):
        checkpoint.verify(str(tmp_path))


def half_a_chunk(entry):
    entry.chunks[0].sizes = torch.Size([2])
    return entry


def no_chunks(entry):
    entry.chunks = []
    return entry


def a_chunk_beyond_the_size(entry):
    entry.chunks[0].offsets = torch.Size([2])
    return entry


def two_chunks_overlapping(entry):
    first = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([2]))
    second = ChunkStorageMetadata(offsets=torch.Size([1]), sizes=torch.Size([2]))
    entry.chunks = [first, second]
    return entry


@pytest.mark.parametrize(
    "craft", [half_a_chunk, no_chunks, a_chunk_beyond_the_size, two_chunks_overlapping]
)
def test_chunks_that_do_not_cover_a_tensor_once_fail_verification(tmp_path, craft):
    """DCP fills only what a tensor's chunks cover: where they left a gap, an export wrote the
    uninitialised memory of its empty tensor (and a resume kept the --model weights there), exit
    status 0. (`checkpoint._chunks_tile`.) Overlapping chunks that add up to the tensor's size
    leave a gap too."""
    craft_small_entry(tmp_path, craft)
    needle = "dcp/.metadata: entry 't': its chunks do not cover its shape \\(4,\\) exactly once"
    with pytest.raises(checkpoint.CheckpointError, match=needle):
        checkpoint.verify(str(tmp_path))


def test_a_chunk_without_a_storage_entry_fails_verification(tmp_path):
    """DCP's own failure was a KeyError naming a MetadataIndex, not the checkpoint."""
    edit_small_index(tmp_path, lambda metadata: metadata.storage_data.clear())
    with pytest.raises(checkpoint.CheckpointError, match="entry 't' has no storage entry"):
        checkpoint.verify(str(tmp_path))


def test_tuples_nested_a_million_deep_are_refused_not_a_crash(tmp_path):
    """A dict keyed by a tuple nested 1,000,000 deep (1 MB of TUPLE1 opcodes, no global at all):
    CPython hashes it recursively in C with no recursion check, and verify, export and resume
    died of SIGSEGV, no line and no fallback to an older checkpoint."""
    write_small_checkpoint(tmp_path)
    deep = b"\x80\x02}" + b")" + b"\x85" * 1_000_000 + b"Ns."
    (tmp_path / "dcp" / ".metadata").write_bytes(deep)
    remanifest(tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match="tuples nested over 32 deep"):
        checkpoint.verify(str(tmp_path))


def test_a_zip_listing_one_records_bytes_under_two_names_is_refused():
    """torch.save's records lie side by side in a range; a crafted central directory may list one
    stored record's bytes under many names, each loaded as a tensor of its own (1.1 MB of range:
    400 MB). Each record passes alone; together they hold more bytes than the range."""
    import copy
    import zipfile

    blob = io.BytesIO()
    with zipfile.ZipFile(blob, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data/0", bytes(1000))
        again = copy.copy(z.getinfo("archive/data/0"))
        again.filename = "archive/data/1"
        z.filelist.append(again)  # written into the central directory at close
    info = SimpleNamespace(offset=0, length=len(blob.getvalue()))
    with pytest.raises(checkpoint.CheckpointError, match="hold more bytes than the range"):
        checkpoint._check_uncompressed(blob, info, "r")


def test_a_stored_record_larger_than_its_range_is_named_as_such():
    """A stored (not deflated) record whose directory claims more bytes than its range holds:
    refused with its own words, not as a compressed one."""
    import zipfile

    blob = io.BytesIO()
    with zipfile.ZipFile(blob, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data/0", bytes(1000))
        z.getinfo("archive/data/0").file_size = 10**9  # written into the central directory
    info = SimpleNamespace(offset=0, length=len(blob.getvalue()))
    with pytest.raises(checkpoint.CheckpointError, match="claims 1000000000 bytes, more than"):
        checkpoint._check_uncompressed(blob, info, "r")


def box(offsets, sizes):
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def test_chunks_tile_as_dcp_lays_them_out_and_nothing_else():
    """`checkpoint._chunks_tile` on layouts DCP writes (FSDP2's uneven rows, an empty shard, a
    2-D grid of a second placement, a scalar) and on ones it does not (an overlap whose sizes
    still add up). 20,000 chunks split along dim 1, a
    layout the first version compared pairwise (quadratic: 15 MB of .metadata, an hour), are
    checked in well under a second."""
    from torch.distributed.checkpoint.metadata import TensorProperties
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    def tiles(size, chunks):
        entry = TensorStorageMetadata(TensorProperties(), torch.Size(size), chunks)
        return checkpoint._chunks_tile(entry)

    assert tiles([12, 3], [box([0, 0], [5, 3]), box([5, 0], [7, 3])])
    assert tiles([2, 3], [box([0, 0], [1, 3]), box([1, 0], [1, 3]), box([2, 0], [0, 3])])
    grid = [box([i, j], [2, 2]) for i in (0, 2) for j in (0, 2)]
    assert tiles([4, 4], grid) and tiles([], [box([], [])])
    overlap = [box([0, 0], [2, 2]), box([1, 1], [2, 2]), box([0, 2], [1, 2]), box([3, 0], [1, 2])]
    assert not tiles([4, 4], overlap)
    columns = [box([0, j], [2, 1]) for j in range(20_000)]
    assert tiles([2, 20_000], columns)
    assert not tiles([2, 20_000], columns[:-1] + [box([0, 19_998], [2, 1])])


def test_a_compressed_record_is_refused_before_it_is_inflated(tmp_path):
    """torch.save stores its records as they are; torch.load inflates deflated ones, so a
    crafted storage range of 1 MB allocated 1 GB. The range here is the tensor's own record,
    deflated and appended to the shard: refused before DCP reads it
    (`checkpoint._check_uncompressed`, for this rank's reads)."""

    folder, md = dcp_folder(tmp_path)
    info = next(iter(md.storage_data.values()))
    shard = folder / info.relative_path
    deflated = deflated_copy(shard.read_bytes()[info.offset : info.offset + info.length])
    end = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(deflated)
    craft(folder, md, offset=end, length=len(deflated))
    with pytest.raises(checkpoint.CheckpointError, match="is compressed"):
        load_t(folder)


@pytest.mark.parametrize("name", ["meta.json", "manifest.json"])
def test_deeply_nested_json_is_one_line(tmp_path, name):
    write_small_checkpoint(tmp_path)
    (tmp_path / name).write_text("[" * 100_000)
    if name == "meta.json":
        remanifest(tmp_path)
    assert_cli_refuses(tmp_path, f"{name}: ")


def test_step_names_in_other_digits_are_not_checkpoints(tmp_path):
    """'step-²'.isdigit() is True and int('²') fails: such a folder is not a checkpoint."""
    root = tmp_path / "checkpoints"
    write_small_checkpoint(root / "step-00000001")
    (root / "step-²").mkdir()
    (root / "latest").write_text("step-²\n")
    assert checkpoint._step_dirs(str(root)) == (["step-00000001"], None)


@pytest.mark.parametrize(
    "text,note",
    [
        ("step-00000009\n", "names step-00000009, which is not there"),
        ("\x00\xff junk", "names no checkpoint"),
        (None, None),  # no `latest` at all (a run killed before its first save's end): no note
        ("step-00000002\n", None),
    ],
    ids=["a-missing-step", "junk", "none", "a-step-there"],
)
def test_a_latest_naming_no_checkpoint_is_noted(tmp_path, capsys, text, note):
    """`--resume latest` with a `latest` that names no checkpoint here tries the newest by name,
    as it did silently: now with a note, as the newest may be an abandoned branch's. With no
    checkpoint left at all it started over, dropping the run's metrics.jsonl: now it stops."""
    root = tmp_path / "checkpoints"
    write_small_checkpoint(root / "step-00000001", step=1)
    write_small_checkpoint(root / "step-00000002", step=2)
    if text is not None:
        (root / "latest").write_text(text, encoding="latin-1")
    paths, error = checkpoint._candidates(str(root), "latest")
    assert error is None and paths[0] == str(root / "step-00000002")
    out = capsys.readouterr().out
    if note is None:
        assert out == ""
    else:
        assert out.startswith(f"note: {root / 'latest'} {note}; trying the newest, step-00000002")
    # with no checkpoint left, a fresh start would drop the run's metrics: it stops instead
    for step in ("step-00000001", "step-00000002"):
        shutil.rmtree(root / step)
    paths, error = checkpoint._candidates(str(root), "latest")
    assert paths == []
    if text is None:  # no `latest` either: a first launch (or one killed before its first save)
        assert error is None
    else:
        assert error.startswith(f"{root / 'latest'} names ") and error.endswith(
            f", and {root} holds none: to start over, remove it or use another --out_dir"
        )


# ---- the run lock on a store (objstore.py), on fsspec's in-memory store ------------------------
@pytest.mark.parametrize(
    "body",
    [
        "[" * 100_000,  # RecursionError in json.loads
        '{"time": Infinity}',
        '{"time": 1' + "0" * 400 + "}",  # float() overflows
        '{"time": 1e12}',  # ages ahead of any clock: no lease
        "\xff\xfe",  # not UTF-8
        "[1, 2]",
    ],
    ids=["deep", "infinite-time", "huge-time", "future", "not-utf8", "not-an-object"],
)
def test_a_crafted_lock_is_taken_over_without_a_traceback(body):
    """A lock that holds no valid lease (crafted, or written by no run) is stale: taken over."""
    import objstore

    url = f"memory://plainrlhf-locks/crafted-{len(body)}-{body[:12]}"
    fs, path = objstore.fs_of(url)
    fs.pipe_file(f"{path}/.lock", body.encode("latin-1"))
    objstore.take_lock(url, "mine")
    assert json.loads(fs.cat_file(f"{path}/.lock"))["run"] == "mine"


def test_a_live_lock_naming_an_impossible_pid_is_kept():
    """Same host, fresh time, a pid beyond pid_max (os.kill raised OverflowError): its lease
    decides, and it has not run out."""
    import socket
    import time

    import objstore

    url = "memory://plainrlhf-locks/bigpid"
    fs, path = objstore.fs_of(url)
    holder = {"run": "theirs", "host": socket.gethostname(), "pid": 2**70, "time": time.time()}
    fs.pipe_file(f"{path}/.lock", json.dumps(holder).encode())
    with pytest.raises(objstore.StoreError, match="another run is using this --out_dir"):
        objstore.take_lock(url, "mine")


def a_dead_pid():
    """A pid no process in this pid space has now (a child that has ended and been reaped)."""
    import subprocess

    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("whose", ["a-dead-pid", "our-own-pid"])
def test_a_dead_runs_lock_in_this_pid_space_is_taken_over(whose):
    """A lock of this host, boot and pid namespace whose process is gone (a SIGKILLed run,
    resumed at once) is stale; so is one naming this very process (which takes the lock once): a
    dead run's pid given again to its restarted rank 0."""
    import time

    import objstore

    pid = os.getpid()
    if whose == "a-dead-pid":
        pid = a_dead_pid()
    url = f"memory://plainrlhf-locks/dead-{whose}"
    fs, path = objstore.fs_of(url)
    holder = {"run": "theirs", **objstore.pid_space(), "pid": pid, "time": time.time()}
    fs.pipe_file(f"{path}/.lock", json.dumps(holder).encode())
    objstore.take_lock(url, "mine")
    assert json.loads(fs.cat_file(f"{path}/.lock"))["run"] == "mine"


@pytest.mark.parametrize("space", ["another-pid-namespace", "another-boot", "no-record"])
def test_a_live_lock_of_another_pid_space_is_kept(space):
    """Same host name, fresh time, a pid no process here has: a container on this host with pids
    of its own (`--network host` ones report the host's name), this host before a reboot, or a
    lock of an older plainrlhf that did not say: the pid says nothing, so the lease decides (it
    was taken over, and two runs shared the --out_dir)."""
    import time

    import objstore

    holder = {"run": "theirs", **objstore.pid_space(), "pid": a_dead_pid(), "time": time.time()}
    if space == "another-pid-namespace":
        holder["pidns"] = "pid:[1]"
    if space == "another-boot":
        holder["boot"] = "00000000-0000-0000-0000-000000000000"
    if space == "no-record":
        del holder["pidns"], holder["boot"]
    url = f"memory://plainrlhf-locks/live-{space}"
    fs, path = objstore.fs_of(url)
    fs.pipe_file(f"{path}/.lock", json.dumps(holder).encode())
    with pytest.raises(objstore.StoreError, match="another run is using this --out_dir"):
        objstore.take_lock(url, "mine")


def test_a_heartbeat_that_finds_another_run_in_its_lock_stops():
    """A run that went a lease without renewing (stalled, suspended) finds its lock taken over
    as stale: its heartbeat rewrote it, taking it back from the live run, and both went on
    writing the folder. Now the heartbeat stops and records the new holder (`lock_lost`), and the
    run's next save stops (`checkpoint._check_lock_kept`, tests/test_store.py)."""
    import objstore

    url = "memory://plainrlhf-locks/taken-over"
    fs, path = objstore.fs_of(url)
    objstore.take_lock(url, "mine")
    body = {"run": "mine", **objstore.pid_space(), "pid": os.getpid()}
    assert objstore.renew_once(f"{url}/.lock", body) and objstore.lock_lost(url) is None
    theirs = {"run": "theirs", "host": "elsewhere", "pid": 1, "time": 1.0}
    fs.pipe_file(f"{path}/.lock", json.dumps(theirs).encode())
    assert not objstore.renew_once(f"{url}/.lock", body)
    assert json.loads(fs.cat_file(f"{path}/.lock"))["run"] == "theirs"
    assert objstore.lock_lost(url) == theirs


def test_a_heartbeat_after_the_release_does_not_take_the_lock_again():
    """A clean exit deletes the lock (`objstore._release`, atexit); a heartbeat running just
    after found it gone and wrote it anew, and the next run waited out a whole lease. Now the
    heartbeat stops once the lock is released."""
    import objstore

    url = "memory://plainrlhf-locks/released"
    fs, path = objstore.fs_of(url)
    objstore.take_lock(url, "mine")
    body = {"run": "mine", **objstore.pid_space(), "pid": os.getpid()}
    objstore._release(f"{url}/.lock", "mine")
    assert not fs.exists(f"{path}/.lock")
    assert not objstore.renew_once(f"{url}/.lock", body)
    assert not fs.exists(f"{path}/.lock")


def test_a_lock_that_cannot_be_read_is_not_taken_over(monkeypatch):
    """The store failing on the lock's GET (a timeout, a 503) is no sign the holder is gone: the
    run stops with one line, and the live run's lock stays (it was deleted and taken over)."""
    import time

    import objstore

    url = "memory://plainrlhf-locks/unreadable"
    fs, path = objstore.fs_of(url)
    holder = {"run": "theirs", "host": "elsewhere", "pid": 1, "time": time.time()}
    fs.pipe_file(f"{path}/.lock", json.dumps(holder).encode())

    def failing(url, limit):
        raise objstore.StoreError(f"{url}: ReadTimeoutError: read timed out")

    monkeypatch.setattr(objstore, "read_bytes", failing)
    with pytest.raises(objstore.StoreError, match="the run lock cannot be read"):
        objstore.take_lock(url, "mine")
    assert json.loads(fs.cat_file(f"{path}/.lock"))["run"] == "theirs"


def test_a_latest_the_store_fails_to_read_stops_the_start(monkeypatch):
    """`latest` unreadable (the store erring, not the object missing) read as "no latest" made
    every step a candidate, newest first: a run resumed from before `latest` would have gone on
    from its abandoned branch. Now the start stops with one line."""
    import objstore

    url = "memory://plainrlhf-latest/run"
    fs, path = objstore.fs_of(url)
    fs.pipe_file(f"{path}/checkpoints/latest", b"step-00000001\n")
    read = objstore.read_bytes

    def failing(url, limit):
        if url.endswith("/latest"):
            raise objstore.StoreError(f"{url}: ReadTimeoutError: read timed out")
        return read(url, limit)

    monkeypatch.setattr(objstore, "read_bytes", failing)
    monkeypatch.setitem(checkpoint._run, "lock", (url, None))  # this process holds the lock
    plan = checkpoint._start_store(url, "latest")
    assert plan["candidates"] == [] and "run_id" not in plan
    assert "ReadTimeoutError" in plan["error"] and "latest" in plan["error"]


def test_oversized_latest_and_lock_on_a_store_are_no_outage():
    """A `latest` over its 64 bytes, or a lock over 16 MiB, is the store answering with something
    no run writes: no latest, and a lock nobody holds; not "the store did not answer"."""
    import objstore

    url = "memory://plainrlhf-oversized/run"
    fs, path = objstore.fs_of(url)
    fs.pipe_file(f"{path}/checkpoints/latest", b"step-00000001" + b" " * 100)
    assert checkpoint._read_latest(f"{url}/checkpoints") is None
    fs.pipe_file(f"{path}/.lock", b"{" + b" " * objstore.SMALL_CAP + b"}")
    objstore.take_lock(url, "mine")
    assert json.loads(fs.cat_file(f"{path}/.lock"))["run"] == "mine"


def test_another_runs_checkpoint_into_a_folder_of_checkpoints_is_refused(tmp_path, monkeypatch):
    """`--resume PATH` from another run into an --out_dir that holds checkpoints would overwrite
    that run's steps of the same number and prune the rest: refused, before anything changes.
    Into an empty folder, or from the folder's own checkpoints (an earlier step: a branch), it
    goes ahead. A torchrun restart of a run started so carries on from its own checkpoints
    (their meta.json has this --resume), never from a foreign run's."""
    other = tmp_path / "a" / "checkpoints" / "step-00000004"
    other.mkdir(parents=True)
    root = tmp_path / "b" / "checkpoints"
    (root / "step-00000002").mkdir(parents=True)
    (root / "step-00000002" / "meta.json").write_text(json.dumps({"args": {"resume": ""}}))
    paths, error = checkpoint._candidates(str(root), str(other))
    assert paths == [] and "not one of" in error and "--resume latest continues" in error
    own = str(root / "step-00000002") + "/"  # a trailing slash: still its own
    assert checkpoint._candidates(str(root), own) == ([own], None)
    empty = tmp_path / "c" / "checkpoints"
    assert checkpoint._candidates(str(empty), str(other)) == ([str(other)], None)
    monkeypatch.setitem(checkpoint._run, "restarted", True)  # as `resolve` agreed on it
    paths, error = checkpoint._candidates(str(root), str(other))  # a foreign run's, still
    assert paths == [] and "not one of" in error
    (root / "step-00000002" / "meta.json").write_text(json.dumps({"args": {"resume": str(other)}}))
    assert checkpoint._candidates(str(root), str(other)) == ([str(root / "step-00000002")], None)


def test_deeply_nested_or_garbled_json_lines_in_data_and_logs():
    """A data file's line nested 100,000 deep is one line naming file and line (it was a
    RecursionError); in metrics.jsonl such a line, or one that is not UTF-8, is dropped when a
    resume truncates the log (it stopped the resume with a traceback), the whole rows kept."""
    import tempfile

    import common

    with tempfile.TemporaryDirectory() as folder:
        data = os.path.join(folder, "data.jsonl")
        with open(data, "w") as f:
            f.write(json.dumps({"prompt": "1+1=", "response": "2"}) + "\n" + "[" * 100_000 + "\n")
        with pytest.raises(SystemExit, match="data.jsonl:2: not valid JSON .nested too deeply"):
            common.load_jsonl(data, ["prompt", "response"])
        log = os.path.join(folder, "metrics.jsonl")
        rows = [json.dumps({"step": n}) + "\n" for n in (1, 2, 3)]
        with open(log, "wb") as f:
            f.write(rows[0].encode() + b"[" * 100_000 + b"\n" + rows[1].encode())
            f.write(b'{"step": 2, "x": "\xff"}\n' + rows[2].encode())
        common.truncate_jsonl(log, 2)
        assert open(log).read() == rows[0] + rows[1]


def test_a_checkpoint_folders_deep_is_damage_not_a_traceback(tmp_path):
    """1,200 nested folders inside a checkpoint (deeper than Python's recursion limit) were a
    RecursionError from the walk, in verify and in --resume latest's fallback."""
    write_small_checkpoint(tmp_path)
    deep = str(tmp_path)
    for _ in range(1200):  # (os.makedirs recurses too)
        deep = os.path.join(deep, "d")
        os.mkdir(deep)
    open(os.path.join(deep, "x"), "wb").close()
    try:
        with pytest.raises(checkpoint.CheckpointError, match="not listed in the manifest"):
            checkpoint.verify(str(tmp_path))
    finally:  # bottom up: pytest's own clean-up of tmp_path recurses, and would fail on it
        os.unlink(os.path.join(deep, "x"))
        for _ in range(1200):
            os.rmdir(deep)
            deep = os.path.dirname(deep)


def test_small_misuses_are_named(tmp_path):
    """A checkpoint (or its hf/ folder) given as --model, a folder or device as --data, an empty
    OUT for export (which exported the whole model before failing to write it): each one line that
    says so."""
    import common

    write_small_checkpoint(tmp_path)
    line = common.load_error(str(tmp_path), OSError("Can't load tokenizer"))
    assert "a checkpoint, not a model folder; export it first" in line
    # its hf/ folder: config and tokenizer load, the weights are missing
    hf = os.path.join(str(tmp_path), "hf")
    os.makedirs(hf, exist_ok=True)
    line = common.load_error(hf, OSError("no file named model.safetensors"))
    assert "a checkpoint's hf/ folder" in line and f"export {tmp_path} OUT" in line
    for path in (str(tmp_path), "/dev/null"):
        with pytest.raises(SystemExit, match="not a file .a folder or a device.; expected JSONL"):
            common.load_jsonl(path, ["prompt"])
    with pytest.raises(SystemExit, match="an empty argument"):
        checkpoint.cli(["export", str(tmp_path), ""])
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "latest").write_text("step-00000004")
    with pytest.raises(
        SystemExit, match="the file naming a run's newest checkpoint .step-00000004"
    ):
        checkpoint.cli(["export", str(root / "latest"), str(tmp_path / "out")])


def test_an_earlier_export_of_any_tokenizer_kind_may_be_replaced(tmp_path):
    """An export replaces only a folder of what exports write: besides EXPORT_FILES, the files the
    checkpoint's own tokenizer saved (a Mistral tokenizer's tekken.json) and the folder of named
    chat templates (Command-R's); a user's file or folder there is not ours."""
    (tmp_path / "tekken.json").write_text("{}")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("{{ x }}")
    (tmp_path / "notes").mkdir()
    assert checkpoint._is_export_file(str(tmp_path), "tekken.json", {"tekken.json"})
    assert not checkpoint._is_export_file(str(tmp_path), "tekken.json", set())
    assert checkpoint._is_export_file(str(tmp_path), "additional_chat_templates", set())
    assert not checkpoint._is_export_file(str(tmp_path), "notes", set())
    (tmp_path / "additional_chat_templates" / "mine.txt").write_text("not a template")
    assert not checkpoint._is_export_file(str(tmp_path), "additional_chat_templates", set())


def test_a_store_save_missing_a_ranks_objects_is_not_committed(tmp_path):
    """On a store, rank 0 writes the manifest from what it lists. A listing without another rank's
    objects (a store that is not shared, as memory:// between processes; one whose listing lags
    behind writes) gave a committed checkpoint, and a `latest`, that no resume could load. Now
    the save fails before the manifest: every rank's RNG file and every shard DCP's metadata
    names must be listed."""
    import objstore

    folder = tmp_path / "dcp"
    dcp.save({"t": torch.arange(1000.0)}, checkpoint_id=str(folder), no_dist=True)
    url = "memory://plainrlhf-uncommitted/run/checkpoints"
    fs, path = objstore.fs_of(url)
    step = f"{path}/step-00000002"
    for name in os.listdir(folder):
        fs.pipe_file(f"{step}/dcp/{name}", (folder / name).read_bytes())
    fs.pipe_file(f"{step}/meta.json", b"{}")
    fs.pipe_file(f"{step}/rng-rank0.json", b"{}")
    final = f"{url}/step-00000002"
    with pytest.raises(checkpoint.CheckpointError, match="rng-rank1.json: rank 1 wrote it, but"):
        checkpoint._publish_store(final, url, "step-00000002", 2, world=2)
    fs.pipe_file(f"{step}/rng-rank1.json", b"{}")
    shard = next(name for name in os.listdir(folder) if name.endswith(".distcp"))
    fs.rm(f"{step}/dcp/{shard}")
    with pytest.raises(checkpoint.CheckpointError, match=f"names '{shard}', not an object listed"):
        checkpoint._publish_store(final, url, "step-00000002", 2, world=2)
    assert not fs.exists(f"{step}/manifest.json") and not fs.exists(f"{path}/latest")
    fs.pipe_file(f"{step}/dcp/{shard}", (folder / shard).read_bytes())
    checkpoint._publish_store(final, url, "step-00000002", 2, world=2)  # now complete: committed
    assert fs.cat_file(f"{path}/latest") == b"step-00000002\n"


@pytest.mark.parametrize(
    "kept",
    [("relative_path", "length", "transform_descriptors"), ()],
    ids=["no-offset", "no-build"],
)
def test_a_storage_entry_missing_its_fields_is_one_line(tmp_path, kept):
    """A storage entry the pickle builds without its offset (a BUILD that leaves a field out, or
    that sets none) passed the BUILD check and failed as an AttributeError traceback in
    `_check_storage`: `verify` and `--resume latest`'s fallback never saw a damaged checkpoint.
    (An entry made with no BUILD at all is `_check_storage`'s own: its getattr.)"""
    write_small_checkpoint(tmp_path)
    path = tmp_path / "dcp" / ".metadata"
    md = pickle.loads(path.read_bytes())  # our own file, just written
    for info in md.storage_data.values():
        for key in [k for k in vars(info) if k not in kept]:
            del vars(info)[key]
    path.write_bytes(pickle.dumps(md))
    remanifest(tmp_path)
    refused = "refusing to unpickle: BUILD sets dict state on _StorageInfo"
    with pytest.raises(checkpoint.CheckpointError, match=refused):
        checkpoint.verify(str(tmp_path))
    assert_cli_refuses(tmp_path, refused)


def test_an_oversized_json_file_is_refused_unread(tmp_path):
    """A checkpoint's JSON files are read at most 16 MiB far, as on a store: a crafted sparse
    manifest.json of 64 GiB was read whole (a MemoryError traceback, or the machine's memory)."""
    write_small_checkpoint(tmp_path)
    with open(tmp_path / "manifest.json", "r+b") as f:
        f.truncate(64 << 30)  # sparse: no disk used
    assert_cli_refuses(tmp_path, "manifest.json: over 16 MiB, not a checkpoint's")


def test_an_export_into_another_checkpoint_or_beside_its_steps_is_refused(tmp_path):
    """Only the checkpoint exported was refused as OUT: another checkpoint's hf/ passed (the
    export replaced it, that checkpoint failed verification, and the fallback it was was lost),
    and checkpoints/step-00000099 made a step folder a save or prune would delete."""
    root = tmp_path / "run" / "checkpoints"
    for name in ("step-00000001", "other"):
        (root / name).mkdir(parents=True)
        write_small_checkpoint(root / name)
    (root / "latest").write_text("step-00000001\n")
    src = str(root / "other")
    manifest = checkpoint.verify(src)
    for out in (root / "step-00000001" / "sub", root / "step-00000001" / "hf", root / "step-99"):
        with pytest.raises(checkpoint.CheckpointError, match="inside .*; export it somewhere"):
            checkpoint._check_export_folder(str(out), src, manifest)
    checkpoint._check_export_folder(str(tmp_path / "run" / "hf"), src, manifest)  # the stages'


def test_keep_last_counts_only_this_runs_history(tmp_path, monkeypatch):
    """--resume latest passed over a damaged step-6 and resumed from step-3; at step 8 the
    pruning counted step-6 as a kept checkpoint and deleted step-3: one checkpoint that
    verifies where --keep_last 2 promised two. A checkpoint newer than the resume point and not
    written by this run is not counted now, and pruned once the run is past it
    (`checkpoint._of_this_history`)."""
    root = tmp_path / "checkpoints"
    for k in (1, 2, 3, 6, 8):
        (root / f"step-{k:08d}").mkdir(parents=True)
    monkeypatch.setitem(checkpoint._run, "since", 3)
    monkeypatch.setitem(checkpoint._run, "written", {"step-00000008"})
    (root / "step-00000010").mkdir()  # an abandoned branch's, newer: it stays
    checkpoint._prune(str(root), 8, 2)
    assert sorted(os.listdir(root)) == ["step-00000003", "step-00000008", "step-00000010"]
    # this run's own saves count: at step 9, step-8 is kept with it, and step-3 goes
    (root / "step-00000009").mkdir()
    monkeypatch.setitem(checkpoint._run, "written", {"step-00000008", "step-00000009"})
    checkpoint._prune(str(root), 9, 2)
    assert sorted(os.listdir(root)) == ["step-00000008", "step-00000009", "step-00000010"]


def test_a_crafted_manifest_cannot_make_a_users_folder_an_export(tmp_path):
    """The checkpoint's own tokenizer files may be in a folder an export replaces; a crafted
    manifest listing hf/README.md and hf/LICENSE made a base model's folder one (replaced, then
    deleted). Only names of the kinds tokenizers save count now."""
    (tmp_path / "ckpt").mkdir()
    write_small_checkpoint(tmp_path / "ckpt")
    manifest = checkpoint.verify(str(tmp_path / "ckpt"))
    listed = {"size": 1, "sha256": "0" * 64}
    crafted = {**manifest, "files": {**manifest["files"], "hf/README.md": listed}}
    crafted["files"]["hf/LICENSE"] = listed
    crafted["files"]["hf/tekken.json"] = listed
    base = tmp_path / "base"
    base.mkdir()
    for name in ("config.json", "tekken.json", "README.md", "LICENSE"):
        (base / name).write_text("x")
    with pytest.raises(checkpoint.CheckpointError, match="holds 'LICENSE', which no export"):
        checkpoint._check_export_folder(str(base), str(tmp_path / "ckpt"), crafted)
    for name in ("README.md", "LICENSE"):
        (base / name).unlink()
    checkpoint._check_export_folder(str(base), str(tmp_path / "ckpt"), crafted)


def test_a_checkpoint_under_another_steps_name_fails_verification(tmp_path):
    """A copy or rename of step 1's folder as step-00000009 verified, and `--resume latest`, which
    orders checkpoints by their names, took it for the newest."""
    (tmp_path / "step-00000009").mkdir()
    write_small_checkpoint(tmp_path / "step-00000009")
    assert_cli_refuses(tmp_path / "step-00000009", "manifest.json: step 1, in a folder named")
    os.rename(tmp_path / "step-00000009", tmp_path / "step-00000001")
    assert checkpoint.verify(str(tmp_path / "step-00000001"))["step"] == 1


def test_verify_says_of_every_checkpoint_given_whether_it_is_ok(tmp_path):
    """`verify step-*` stopped at the first damaged one (the oldest, in the glob's order), and
    said nothing of the newer ones. A line each now; the status says whether any failed. A file
    whose name holds a line break is named on one line."""
    good = tmp_path / "good"
    bad = tmp_path / "bad"
    for path in (bad, good):
        path.mkdir()
        write_small_checkpoint(path)
    (bad / "a.bin").write_bytes(b"HELLO")
    (good / "x\nerror: made up").write_text("")
    p = run_py("checkpoint.py", "verify", bad, good, tmp_path / "good" / "sub", timeout=60)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert lines[:2] == [
        f"error: {bad}/a.bin: checksum mismatch",
        f"error: {good}/x\\nerror: made up: not listed in the manifest",
    ], p.stderr
    assert len(lines) == 3 and lines[2].startswith(f"error: {good}/sub/manifest.json: missing")
    (good / "x\nerror: made up").unlink()
    p = run_py("checkpoint.py", "verify", good, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == f"{good}: ok, step 1", p.stdout


# ---- an export to a store (objstore.upload_export), on fsspec's in-memory store ---------------
def test_a_store_export_writes_config_json_last_and_drops_stale_weights(tmp_path, monkeypatch):
    """An export to a store was uploaded file by file, config.json anywhere in the order, over an
    earlier export whose other objects stayed: a kill mid-way left a prefix that loads (one
    export's config.json, the two exports' files mixed), and new weight shards sat beside the
    earlier model.safetensors, which transformers loads first. Now the earlier config.json goes
    first, then the new files, then the earlier export's files not overwritten, then the new
    config.json; a user's own object stays."""
    import objstore

    url = "memory://plainrlhf-exports/hf"
    fs, path = objstore.fs_of(url)
    earlier = {"config.json": b"old", "model.safetensors": b"old", "tokenizer.json": b"old"}
    for name, data in {**earlier, "notes.txt": b"mine"}.items():
        fs.pipe_file(f"{path}/{name}", data)
    new = {"config.json": b"new", "tokenizer.json": b"new", "model.safetensors.index.json": b"{}"}
    new.update({f"model-0000{i}-of-00002.safetensors": b"shard" for i in (1, 2)})
    for name, data in new.items():
        (tmp_path / name).write_bytes(data)
    put_file = type(fs).put_file
    puts = []  # the names uploaded, in order
    fail_at = [3]  # the upload that fails (the store going away mid-way); 0: none

    def recorded_put(self, lpath, rpath, **kwargs):
        puts.append(os.path.basename(rpath))
        if len(puts) == fail_at[0]:
            raise ConnectionError("the store went away")
        return put_file(self, lpath, rpath, **kwargs)

    monkeypatch.setattr(type(fs), "put_file", recorded_put)
    with pytest.raises(objstore.StoreError, match="ConnectionError: the store went away"):
        objstore.upload_export(url, str(tmp_path), checkpoint._is_export_name)
    assert not fs.exists(f"{path}/config.json")  # a prefix that loads nothing, not a mix
    puts.clear()
    fail_at[0] = 0
    objstore.upload_export(url, str(tmp_path), checkpoint._is_export_name)
    assert puts[-1] == "config.json" and sorted(puts) == sorted(new)
    left = {rel: fs.cat_file(f"{path}/{rel}") for rel in objstore.listing(url)}
    assert left == {**new, "notes.txt": b"mine"}
    fs.rm(path, recursive=True)


def test_a_resume_on_a_store_takes_the_store_logs_unless_they_lack_rows(
    tmp_path, monkeypatch, capsys, one_rank
):
    """With an object-store --out_dir, rank 0 logs locally and copies the logs up at each save. A
    rank 0 back on a machine it ran on before (a requeue) kept that machine's copy, older or an
    abandoned branch's: truncated at the checkpoint and uploaded over the store's, it lost the
    steps logged elsewhere. `MetricsLog.fetch` takes the store's copy (the checkpoint's save put
    its run's rows there) unless it lacks rows up to the checkpoint that the local one has (an
    upload that failed); a store that fails to answer leaves the local copy, with a warning."""
    import common
    import objstore

    store = "memory://plainrlhf-logs/run"
    fs, path = objstore.fs_of(store)

    def rows(steps):
        return "".join(json.dumps({"step": s, "train/loss": 1.0}) + "\n" for s in steps)

    fs.pipe_file(f"{path}/metrics.jsonl", rows(range(1, 7)).encode())  # up to the save of step 6
    cases = [
        (None, 6, range(1, 7)),  # a new machine
        (range(1, 4), 6, range(1, 7)),  # this machine's older copy
        (range(1, 10), 6, range(1, 7)),  # an abandoned branch's, further but not this run's
        (range(1, 9), 8, range(1, 9)),  # the store's lacks 7 and 8 (their upload failed)
    ]
    for i, (mine, step, kept) in enumerate(cases):
        local = tmp_path / f"local-{i}"
        local.mkdir()
        if mine is not None:
            (local / "metrics.jsonl").write_text(rows(mine) + '{"step": 11, "cut')
        common.MetricsLog(str(local), store=store).truncate(step)  # fetch, then the resume's cut
        assert [r["step"] for r in map(json.loads, open(local / "metrics.jsonl"))] == list(kept)
        assert sorted(os.listdir(local)) == ["metrics.jsonl"]

    def unreachable(url, local):
        raise objstore.StoreError(f"{url}: EndpointConnectionError: could not connect")

    monkeypatch.setattr(objstore, "get_file", unreachable)
    local = tmp_path / "local-unreachable"
    local.mkdir()
    (local / "metrics.jsonl").write_text(rows(range(1, 4)))
    capsys.readouterr()
    common.MetricsLog(str(local), store=store).truncate(3)
    assert [r["step"] for r in map(json.loads, open(local / "metrics.jsonl"))] == [1, 2, 3]
    assert capsys.readouterr().err.startswith(f"warning: {store}/metrics.jsonl: not fetched (")
    fs.rm(path, recursive=True)


@pytest.fixture(scope="module")
def sft_checkpoint(tmp_path_factory):
    """A real checkpoint: one SFT step of the tiny model, one process."""
    import task

    out = tmp_path_factory.mktemp("sft")
    args = ("--model", task.TINY_MODEL, "--out_dir", out, "--max_steps", 1, "--eval_every", 0)
    p = run_py("train_sft.py", *args, "--train_batch_size", 8, "--micro_batch_size", 8)
    assert p.returncode == 0, p.stderr[-2000:]
    return latest(out)


def edit_dcp(ckpt, edit):
    """The checkpoint's DCP state through one torch file, `edit`ed in place, written back as DCP,
    and the manifest rewritten to match, as an attacker would: it verifies."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    whole = str(ckpt / "whole.pt")
    dcp_to_torch_save(str(ckpt / "dcp"), whole)
    state = torch.load(whole, weights_only=False)  # the test's own file
    edit(state["model"])
    torch.save(state, whole)
    shutil.rmtree(ckpt / "dcp")
    torch_save_to_dcp(whole, str(ckpt / "dcp"))
    os.unlink(whole)
    rewrite_manifest(ckpt)


def set_weight(name, value):
    def edit(state):
        state["model"][name] = value(state["model"][name])

    return edit


def set_moment(name, value):
    def edit(state):
        moments = state["optim"]["state"]["model.norm.weight"]
        moments[name] = value(moments[name])

    return edit


def drop_weight(state):
    del state["model"]["lm_head.weight"]


def an_object_setting(state):
    state["optim"]["param_groups"][0]["foreach"] = object()


NORM = "model.model.model.norm.weight"
MOMENTS = "model.optim.state.model.norm.weight"


@pytest.mark.parametrize(
    "command,edit,needle",
    [
        (
            "export",
            set_weight("lm_head.weight", lambda w: "x"),
            "model.model.lm_head.weight: expec",
        ),
        ("export", set_weight("model.norm.weight", lambda w: w.long()), f"{NORM}: torch.int64 in"),
        ("export", set_weight("model.norm.weight", lambda w: w / 0), f"{NORM}: infinite"),
        ("export", drop_weight, "model.model.lm_head.weight: missing"),
        ("resume", set_moment("exp_avg_sq", lambda m: -m - 1), f"{MOMENTS}.exp_avg_sq: below 0"),
        ("resume", set_moment("step", lambda m: "1"), f"{MOMENTS}.step: expected a tensor"),
        ("resume", set_moment("exp_avg", lambda m: m.view(-1, 2)), f"{MOMENTS}.exp_avg: shape ("),
        ("resume", an_object_setting, "model.optim.param_groups.0.foreach: refusing to unpickle"),
    ],
    ids=["a-string", "int64", "nan", "missing", "negative", "step-string", "shape", "object"],
)
def test_a_crafted_dcp_entry_is_one_line(tmp_path, sft_checkpoint, command, edit, needle):
    """A checkpoint whose DCP state was edited (and its manifest rewritten: it verifies). The
    export wrote the model's fresh random weight for an entry stored as other data, or missing,
    and cast an int64 one into the float weights, exit status 0; a resume ran AdamW from a
    negative second moment to NaN weights, saved and exported them, exit status 0, or raised a
    traceback of 25 to 2,000 lines (`checkpoint.py: _check_stored`, `_unsaveable_value`)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(sft_checkpoint, ckpt)
    edit_dcp(ckpt, edit)
    if command == "export":
        p = run_py("checkpoint.py", "export", ckpt, tmp_path / "hf")
    else:
        args = ("--resume", ckpt, "--out_dir", tmp_path / "run", "--max_steps", 2)
        p = run_py("train_sft.py", *args, "--train_batch_size", 8, "--micro_batch_size", 8)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p.stderr[-2000:]
    assert lines[0].startswith(f"error: {ckpt}: {needle}"), lines
    assert not (tmp_path / "hf").exists()  # the export's
    assert not (tmp_path / "run" / "hf").exists()  # a resume's: it trained and exported nothing
    assert not (tmp_path / "run" / "checkpoints" / "step-00000002").exists()


def test_an_export_prints_its_one_line(tmp_path, sft_checkpoint):
    """`checkpoint.py export` printed transformers' "Writing model shards" bar (and its warnings
    about the files) around its own line."""
    p = run_py("checkpoint.py", "export", sft_checkpoint, tmp_path / "hf")
    assert p.returncode == 0 and p.stderr == "", p.stderr[-2000:]
    assert p.stdout == f"exported {sft_checkpoint} -> {tmp_path / 'hf'}\n", p.stdout
    # the weights as readable as the configs: safetensors wrote them 0600, through a private
    # temporary file (`checkpoint._readable_as_umask_allows`)
    config_mode = os.stat(tmp_path / "hf" / "config.json").st_mode
    assert os.stat(tmp_path / "hf" / "model.safetensors").st_mode == config_mode


@pytest.mark.parametrize("role", ["policy", "critic", "reward_model"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_an_export_builds_the_model_without_initialising_it(tmp_path, role, tied):
    """export() builds its model on the meta device and gives it empty memory (a random
    initialisation of every weight, overwritten by the load, cost ~6 s per billion parameters):
    the same tensors as from_config's, by name and shape, a tied head tied again (to_empty gives
    it memory of its own; saved, it would be a second tensor)."""
    from transformers import Qwen2Config

    Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    ).save_pretrained(tmp_path)
    model = checkpoint._empty_model(str(tmp_path), role)
    reference = checkpoint._model_of_role(str(tmp_path), role)  # on the CPU, initialised
    assert type(model) is type(reference)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    assert shapes == {k: v.shape for k, v in reference.state_dict().items()}
    assert all(v.device.type == "cpu" for v in model.state_dict().values())
    if role == "policy":
        head = model.get_output_embeddings().weight
        assert (head is model.get_input_embeddings().weight) == tied


def test_checkpoint_bytes_are_its_files_sizes(sft_checkpoint):
    """What the other ranks' wait for rank 0's export grows with (`common.export_wait_group`)."""
    listed = checkpoint._read_manifest(sft_checkpoint)["files"]
    on_disk = sum(os.path.getsize(os.path.join(sft_checkpoint, rel)) for rel in listed)
    assert checkpoint.checkpoint_bytes(sft_checkpoint) == on_disk > 0


def test_an_export_of_a_generation_config_transformers_will_not_save_is_one_line(
    tmp_path, sft_checkpoint
):
    """A checkpoint's hf/generation_config.json that transformers loads and refuses to save
    (`temperature` without `do_sample`): the export ended in a traceback of its ValueError."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(sft_checkpoint, ckpt)
    path = ckpt / "hf" / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "temperature": 0.7}))
    rewrite_manifest(ckpt)
    p = run_py("checkpoint.py", "export", ckpt, tmp_path / "hf")
    line = f"error: {ckpt}/hf: generation_config.json: transformers would refuse to save it ("
    assert p.returncode == 1 and p.stderr.startswith(line), p.stderr[-2000:]
    assert p.stderr.count("\n") == 1 and not (tmp_path / "hf").exists()


def test_a_checkpoint_with_the_older_spelling_of_a_list_flag_resumes():
    """train_ppo.py writes --reward_fn and --reward_weights without spaces around entries since
    the thirty-fourth session; a checkpoint from before kept "a:f, b:g", which no command line
    could match: it is read in today's spelling (`checkpoint.OLDER_SPELLINGS`). Another list
    is still another run."""
    saved = {"reward_fn": "task:reward_fn, rules:length", "reward_weights": "1.0, 0.5"}
    args = {"reward_fn": "task:reward_fn,rules:length", "reward_weights": "1.0,0.5"}
    checkpoint._same_settings("ckpt", saved, args, ["reward_fn", "reward_weights"], {})
    args["reward_weights"] = "1.0,0.25"
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint._same_settings("ckpt", saved, args, ["reward_fn", "reward_weights"], {})
    assert str(e.value).endswith("differing settings: --reward_weights '1.0,0.5' -> '1.0,0.25'")


def test_a_flag_newer_than_the_checkpoint_counts_at_its_stages_default():
    """A checkpoint's meta.json lacks a flag added after it was written (a fork's too): it ran
    with the flag's default, the stage's Args' (`common.arg_defaults`). A list in checkpoint.py
    (NEWER_FLAGS) held the two the project had added; a fork's new flag refused every earlier
    checkpoint ("--loss_type None -> 'token_mean'") until it was added there."""
    import common
    import train_ppo

    args = train_ppo.Args()
    defaults = common.arg_defaults(args)
    assert defaults["scale_rewards"] == "group" and defaults["reward_weights"] == ""
    saved = {k: v for k, v in vars(args).items() if k != "scale_rewards"}
    checkpoint._same_settings("ckpt", saved, vars(args), ["scale_rewards"], defaults)
    changed = vars(train_ppo.Args(scale_rewards="none"))
    with pytest.raises(checkpoint.CheckpointError, match="--scale_rewards 'group' -> 'none'"):
        checkpoint._same_settings("ckpt", saved, changed, ["scale_rewards"], defaults)
    # where the default changed what the code did, the stage says what ran before the flag:
    # PPO used the reward model's raw score before --reward_norm (default true)
    before = {**defaults, **train_ppo.BEFORE_FLAGS}
    saved = {k: v for k, v in vars(args).items() if k != "reward_norm"}
    with pytest.raises(checkpoint.CheckpointError, match="--reward_norm False -> True"):
        checkpoint._same_settings("ckpt", saved, vars(args), ["reward_norm"], before)


def test_an_export_in_float16_refuses_a_weight_beyond_its_range(tmp_path, monkeypatch):
    """`checkpoint._cast_for_export` casts the weights for save_pretrained; a weight beyond
    float16's 65504 would be saved as inf: one line naming it, nothing cast. `common.export_dtype`
    resolves --export_dtype auto from the folder's config.json as it loaded: bf16 as stored,
    fp32 where it names none or one no export is made in (float64)."""
    from transformers import AutoConfig

    import common

    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight[0, 0] = 70000.0
    with pytest.raises(checkpoint.CheckpointError, match="weight weight holds values beyond"):
        checkpoint._cast_for_export(model, "float16")
    assert model.weight.dtype == torch.float32
    checkpoint._cast_for_export(model, "bfloat16")
    assert model.weight.dtype == torch.bfloat16 and model.weight[0, 0] == 70144.0  # rounded
    for stored, expected in (("bfloat16", "bfloat16"), (None, "float32"), ("float64", "float32")):
        folder = tmp_path / str(stored)
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": stored}))
        assert common.stored_dtype(AutoConfig.from_pretrained(folder)) == expected
    monkeypatch.setitem(common.STORED_DTYPES, "m", "bfloat16")  # as --model m loaded
    assert common.export_dtype(SimpleNamespace(export_dtype="auto", model="m")) == "bfloat16"
    assert common.export_dtype(SimpleNamespace(export_dtype="float16", model="m")) == "float16"


def test_export_options_are_each_given_once():
    """`checkpoint.py export CKPT OUT [--role NAME] [--dtype D]`, in either order; a flag given
    twice (the last one won, silently), an unknown one or an odd word is the usage line."""
    assert checkpoint._export_options(["--dtype", "bfloat16", "--role", "critic"]) == {
        "dtype": "bfloat16",
        "role": "critic",
    }
    for options in (["--role", "a", "--role", "b"], ["--dtype"], ["--seed", "1"]):
        with pytest.raises(SystemExit, match="^usage: python checkpoint.py"):
            checkpoint._export_options(options)
