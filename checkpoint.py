"""Atomic, rank-coordinated, full-state checkpoints: the only code that touches training state on
disk.

The commit protocol (README, "Checkpoints"): all ranks write `.tmp-step-N-<run id>/` (with
--async_save, in the background) and hash the files they wrote; once every rank has succeeded,
rank 0 writes the sha256 manifest, fsyncs, renames the folder `step-N/` and os.replace()s
`latest`. A kill or a failed write at any moment leaves the previous checkpoint latest. Resume
verifies the manifest first (locally every rank hashing a share of the files; on a store rank 0
alone) and falls back to an older checkpoint.

Safety (README, "Checkpoints": the threat model): DCP's own loader unpickles `.metadata` with a
plain `pickle.load` and byte entries with `torch.load(weights_only=False)`; `dcp_load` closes both
holes (allow-listing unpickler, weights-only bytes) and checks that every storage entry names a byte
range of a regular file inside the checkpoint, so loading a checkpoint never runs code from it nor
reads outside it. Every file opened under a checkpoint or run folder is a regular file reached
without following a symlink (`open_regular`); `verify` reads only those, no further than the
manifest says. A run holds a lock on its --out_dir (`resolve`), so two runs never share one.

On an object store (`--out_dir s3://...`, objstore.py) there is no rename: a save writes under its
final prefix and the manifest, written last by rank 0, is the commit; see objstore.py's docstring.

    python checkpoint.py verify CKPT [CKPT...]
    python checkpoint.py export CKPT OUT [--role actor|critic|reward_model]   # an HF folder
"""

import base64
import bisect
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import io
import json
import math
import os
import pickle
import random
import re
import shutil
import socket
import stat
import sys
import tempfile
import time
import uuid
import warnings
import zipfile

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint._nested_dict import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.metadata import TensorProperties
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict import set_state_dict
from torch.distributed.tensor import DTensor

import objstore

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, damaged, unsafe or from another run; the message says which."""


class StoreUnreachable(CheckpointError):
    """The store failed to answer (a timeout, a refusal): says nothing of the checkpoint, so
    `--resume latest` must not pass over it to an older one as if it were damaged."""


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


# The largest step or size a checkpoint may claim: the largest integer a JSON reader holds exactly.
MAX_COUNT = 2**53 - 1

# How deeply a .metadata pickle may nest tuples (DCP's own: 3, a chunk's offsets in an index)
MAX_PICKLE_NESTING = 32


class _SafeUnpickler(pickle._Unpickler):
    """Only the allow-listed classes, and BUILD only as DCP's own pickles use it. The pure-Python
    unpickler (pickle._Unpickler): its opcode table can be overridden, the C one's cannot."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, f):
        super().__init__(f)
        self._nesting = {}  # id of every tuple and frozenset made -> how deeply it nests
        self._made = []  # each kept alive, so no id is reused

    def _check_nesting(self):
        """Tuples and frozensets nested deeper than DCP's ever are (a tuple 1,000,000 deep, 1 MB
        of TUPLE1 opcodes, hashed as a dict key): CPython hashes and compares them recursively in
        C, without a recursion check, and the process died of SIGSEGV, no line, no fallback."""
        obj = self.stack[-1]
        if type(obj) not in (tuple, frozenset):
            return
        depth = 1 + max((self._nesting.get(id(item), 0) for item in obj), default=0)
        if depth > MAX_PICKLE_NESTING:
            raise CheckpointError(
                f"refusing to unpickle: tuples nested over {MAX_PICKLE_NESTING} deep"
            )
        self._nesting[id(obj)] = depth
        self._made.append(obj)

    # every opcode that makes a tuple or a frozenset checks how deeply it nests
    def load_tuple(self):
        super().load_tuple()
        self._check_nesting()

    def load_tuple1(self):
        super().load_tuple1()
        self._check_nesting()

    def load_tuple2(self):
        super().load_tuple2()
        self._check_nesting()

    def load_tuple3(self):
        super().load_tuple3()
        self._check_nesting()

    def load_frozenset(self):
        super().load_frozenset()
        self._check_nesting()

    dispatch[pickle.TUPLE[0]] = load_tuple
    dispatch[pickle.TUPLE1[0]] = load_tuple1
    dispatch[pickle.TUPLE2[0]] = load_tuple2
    dispatch[pickle.TUPLE3[0]] = load_tuple3
    dispatch[pickle.FROZENSET[0]] = load_frozenset

    def find_class(self, module, name):
        allowed = name in ALLOWED_GLOBALS.get(module, ())
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if allowed or is_dtype:
            return super().find_class(module, name)
        raise CheckpointError(f"refusing to unpickle {module}.{name}: not a DCP metadata class")

    def load_build(self):
        _check_build(self.stack[-2], self.stack[-1])
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


def _check_build(obj, state):
    """BUILD sets attributes on an object: here only the dataclass fields of an allow-listed DCP
    class (TensorProperties: the 5-tuple its own __setstate__ takes). Anything else is refused."""
    cls = type(obj)
    ok = False
    allowed = cls.__qualname__ in ALLOWED_GLOBALS.get(cls.__module__, ())
    if allowed and dataclasses.is_dataclass(cls):
        fields = [f.name for f in dataclasses.fields(cls)]
        # the fields without a default: an object left without one fails later, at a getattr
        # (an AttributeError traceback from `_check_storage`), not here in one line
        required = [f.name for f in dataclasses.fields(cls) if _has_no_default(f)]
        if "__setstate__" in vars(cls):
            ok = type(state) is tuple and len(state) == len(fields)
        else:
            ok = type(state) is dict and all(k in fields for k in state)
            ok = ok and all(k in state for k in required)
    if not ok:
        raise CheckpointError(
            f"refusing to unpickle: BUILD sets {type(state).__name__} state on {cls.__name__}, "
            "which DCP's metadata never does"
        )


def _has_no_default(field):
    """Whether a dataclass field has neither a default nor a default factory."""
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def _unpickle_metadata(f, where):
    """DCP's .metadata through _SafeUnpickler. A pickle cut short, empty or garbled fails inside
    the unpickler in many ways (UnpicklingError, EOFError, KeyError, TypeError, IndexError on an
    empty stack, RecursionError): each is one CheckpointError line, a damaged checkpoint."""
    try:
        return _SafeUnpickler(f).load()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{where}: malformed DCP metadata ({type(e).__name__}: {e})")


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):  # FileSystemReader's own is a plain pickle.load
        if getattr(self, "metadata", None) is None:  # read once: dcp_load reads it first
            path = os.path.join(self.path, ".metadata")
            with open_regular(path, "rb") as f:
                metadata = _unpickle_metadata(f, path)
            _check_storage(metadata, self.path)
            self.metadata = metadata
        return self.metadata

    def prepare_local_plan(self, plan):
        """Before this rank reads: each byte range it will torch.load holds only records stored
        as they are (`_check_uncompressed`). Here, not in `_check_storage`: a rank opens the
        ranges it reads, not every rank's of every file. (A store's ranges:
        `_SafeStoreReader._slice_file`.)"""
        for path, infos in _ranges_by_file(plan, self.storage_data).items():
            with open_regular(os.path.join(self.path, path), "rb") as f:
                for fqn, info in infos:
                    _check_uncompressed(f, info, f"{self.path}/{path}: {fqn!r:.80}")
        return plan


def _ranges_by_file(plan, storage_data):
    """{relative path: [(fqn, its _StorageInfo)]} of the storage ranges a load plan reads, each
    once."""
    ranges = {}
    for item in plan.items:
        info = storage_data[item.storage_index]
        # by offset and length: two entries at one offset are two ranges (a crafted one, inside
        # the other, went unchecked)
        key = (info.offset, info.length)
        ranges.setdefault(info.relative_path, {})[key] = (item.storage_index.fqn, info)
    return {path: list(infos.values()) for path, infos in ranges.items()}


def _check_storage(metadata, folder, sizes=None):
    """Before DCP reads anything: every storage entry names a regular file right in `folder` (the
    only place DCP writes them: no `..`, no absolute path, no symlink) and a byte range within that
    file's real size. Otherwise a crafted .metadata reads other files, or /dev/zero for ever."""
    where = os.path.join(folder, ".metadata")
    if type(metadata) is not Metadata or type(metadata.storage_data) is not dict:
        raise CheckpointError(f"{where}: not DCP metadata")
    _check_entries(metadata, where)
    listed = sizes
    sizes = {}
    for index, info in metadata.storage_data.items():
        # getattr: an object the pickle made without BUILD has no attributes at all
        name = getattr(info, "relative_path", None)
        transforms = getattr(info, "transform_descriptors", None)
        if type(info) is not _StorageInfo or transforms or type(name) is not str:
            raise CheckpointError(f"{where}: storage entry {index!r} is not a plain file range")
        if name not in sizes and listed is not None:  # a store: only the manifest's objects
            sizes[name] = _listed_size(listed, name, where)
        if name not in sizes:
            sizes[name] = _storage_size(folder, name, where)
        offset = getattr(info, "offset", None)
        length = getattr(info, "length", None)
        fits = _is_count(offset) and _is_count(length) and offset + length <= sizes[name]
        if not fits:
            fqn = getattr(index, "fqn", index)
            raise CheckpointError(
                f"{where}: storage entry {fqn!r:.80} reads bytes {offset!r}+{length!r} of "
                f"{name}, which holds {sizes[name]}"
            )


class _Window(io.RawIOBase):
    """Bytes offset..offset+length of an open file, as a file of its own (for zipfile). Not DCP's
    own view of a range (`_create_file_view`): its seek from the end counts backwards (zipfile's
    seek(-22, 2) lands 22 bytes past the range) and a relative seek is not kept within it."""

    def __init__(self, f, offset, length):
        self.f = f
        self.offset = offset
        self.length = length
        self.pos = 0

    def seekable(self):
        return True

    def readable(self):
        return True

    def seek(self, pos, whence=io.SEEK_SET):
        if whence == io.SEEK_CUR:
            pos += self.pos
        elif whence == io.SEEK_END:
            pos += self.length
        self.pos = max(0, min(self.length, pos))
        return self.pos

    def tell(self):
        return self.pos

    def read(self, n=-1):
        left = self.length - self.pos
        if n is not None and 0 <= n < left:
            left = n
        self.f.seek(self.offset + self.pos)
        data = self.f.read(left)
        self.pos += len(data)
        return data


def _check_uncompressed(f, info, where):
    """A storage range (`info`, of the open file `f`) is a torch.save zip, which DCP hands to
    torch.load: torch.save stores its records as they are, and torch.load inflates deflated
    ones, so a crafted range of 1 MB allocated 1 GB (20 MB: 20 GB). Every record must be stored
    as it is, within the range. Reads the zip's central directory only."""
    try:
        with zipfile.ZipFile(_Window(f, info.offset, info.length)) as z:
            records = z.infolist()
    except (zipfile.BadZipFile, ValueError, EOFError) as e:
        raise CheckpointError(f"{where}: not a torch.save record ({e})") from None
    for r in records:
        if r.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(
                f"{where}: record {r.filename!r:.80} is compressed ({r.compress_size} bytes "
                f"inflating to {r.file_size}); torch.save stores records as they are"
            )
        if r.file_size > info.length:
            raise CheckpointError(
                f"{where}: record {r.filename!r:.80} claims {r.file_size} bytes, more than its "
                f"range's {info.length}"
            )
    # torch.save's records lie side by side; a crafted directory listing one record's bytes
    # under many names made torch.load allocate each (1.1 MB: 400 MB, and more with more names)
    if sum(r.file_size for r in records) > info.length:
        raise CheckpointError(f"{where}: its records hold more bytes than the range")


def _check_entries(metadata, where):
    """Every entry of the state's index is what DCP writes: bytes, or a tensor's properties (a
    dtype), global size and chunks. A pickle can make an allow-listed object without its BUILD
    (no attributes at all) or BUILD it with values of other types: DCP's planner then failed in
    an AttributeError or TypeError traceback, past the one line of a damaged checkpoint."""
    entries = getattr(metadata, "state_dict_metadata", None)
    if type(entries) is not dict:
        raise CheckpointError(f"{where}: not DCP metadata (no index of the state)")
    for key, entry in entries.items():
        if type(entry) is not BytesStorageMetadata and not _is_tensor_entry(entry):
            raise CheckpointError(
                f"{where}: entry {key!r:.80} is not what DCP writes for a tensor or bytes"
            )
        offsets = [None]  # bytes: one storage entry, at no offset
        if type(entry) is TensorStorageMetadata:
            if not _chunks_tile(entry):
                # DCP fills only what the chunks cover: the rest of the tensor kept the export's
                # uninitialised memory (or a resume's --model weights), exit status 0
                raise CheckpointError(
                    f"{where}: entry {key!r:.80}: its chunks do not cover its shape "
                    f"{tuple(entry.size)} exactly once"
                )
            offsets = [chunk.offsets for chunk in entry.chunks]
        for offset in offsets:
            # (DCP's own failure: a KeyError naming a MetadataIndex, not the checkpoint)
            if MetadataIndex(key, offset) not in metadata.storage_data:
                raise CheckpointError(f"{where}: entry {key!r:.80} has no storage entry")


def _chunks_tile(entry):
    """Whether a tensor entry's chunks lie within its size and cover every element once: in
    bounds, as many elements in all as the tensor holds, and no element in two (`_cover_once`)."""
    size = tuple(entry.size)
    boxes = []  # (offsets, sizes) of each chunk that holds elements
    for chunk in entry.chunks:
        start = tuple(chunk.offsets)
        extent = tuple(chunk.sizes)
        if any(o + k > d for o, k, d in zip(start, extent, size)):
            return False
        if math.prod(extent):
            boxes.append((start, extent))
    if sum(math.prod(extent) for _, extent in boxes) != math.prod(size):
        return False
    return _cover_once(boxes, size)


def _cover_once(boxes, size):
    """Whether no element lies in two boxes. The boxes' edges cut each dim into a grid; each box
    covers whole cells, marked as it is. DCP's chunks split dims where the placements do, a grid
    of as many cells as chunks; one of more cells than 4 per box is not DCP's, refused. (Pairwise
    comparison was quadratic: 100,000 chunks of one tensor, 15 MB of .metadata, an hour.)"""
    cuts = []
    for dim, length in enumerate(size):
        edges = {0, length}
        for start, extent in boxes:
            edges.update((start[dim], start[dim] + extent[dim]))
        cuts.append(sorted(edges))
    shape = [len(edges) - 1 for edges in cuts]
    if math.prod(shape) > 4 * len(boxes) + 4:
        return False
    seen = np.zeros(shape, dtype=bool)
    for start, extent in boxes:
        cells = tuple(
            slice(bisect.bisect_left(edges, s), bisect.bisect_left(edges, s + k))
            for edges, s, k in zip(cuts, start, extent)
        )
        if seen[cells].any():
            return False
        seen[cells] = True
    return True


def _is_tensor_entry(entry):
    """A TensorStorageMetadata as DCP makes one: a dtype, a size, chunks of that many dims."""
    if type(entry) is not TensorStorageMetadata:
        return False
    properties = getattr(entry, "properties", None)
    size = getattr(entry, "size", None)
    chunks = getattr(entry, "chunks", None)
    if type(properties) is not TensorProperties:
        return False
    if not isinstance(getattr(properties, "dtype", None), torch.dtype):
        return False
    if not _is_shape(size) or type(chunks) is not list:
        return False
    for chunk in chunks:
        if type(chunk) is not ChunkStorageMetadata:
            return False
        offsets = getattr(chunk, "offsets", None)
        sizes = getattr(chunk, "sizes", None)
        if not (
            _is_shape(offsets) and _is_shape(sizes) and len(offsets) == len(sizes) == len(size)
        ):
            return False
    return True


def _is_shape(value):
    """A tensor's shape, or a chunk's offsets: a torch.Size (or tuple) of counts."""
    return isinstance(value, tuple) and all(_is_count(n) for n in value)


def _storage_size(folder, name, where):
    """The size of `name`, a regular file right in `folder`; CheckpointError if it is not one."""
    plain = name not in ("", ".", "..") and os.path.basename(name) == name
    mode = 0
    if plain and os.path.lexists(os.path.join(folder, name)):
        st = os.lstat(os.path.join(folder, name))
        mode = st.st_mode
    if not stat.S_ISREG(mode):
        raise CheckpointError(
            f"{where}: a storage entry names {name!r}, not a regular file in {folder}"
        )
    return st.st_size


def _listed_size(listed, name, where):
    """The manifest's size of the object `name` right in the dcp/ prefix; CheckpointError if the
    manifest lists no such object (a crafted name would read outside the checkpoint)."""
    if name not in listed or "/" in name or name in ("", ".", ".."):
        raise CheckpointError(f"{where}: a storage entry names {name!r}, not an object listed here")
    return listed[name]


class _SafeStoreReader(FsspecReader):
    """DCP's fsspec reader with the same safe .metadata as _SafeReader: read no further than the
    manifest's size, unpickled by _SafeUnpickler, every storage entry checked against the
    manifest's objects (`sizes`: {name in dcp/: size})."""

    def __init__(self, path, sizes):
        super().__init__(path)
        self.sizes = sizes
        streams = _WholeObjectStreams(sizes)
        streams.fs = self.fs.fs  # the client FsspecReader made for `path`
        self.fs = streams

    def read_metadata(self, *args, **kwargs):  # FsspecReader's own is a plain pickle.load
        if getattr(self, "metadata", None) is None:
            where = os.path.join(self.path, ".metadata")
            if ".metadata" not in self.sizes:
                raise CheckpointError(f"{where}: not listed in the manifest")
            data = _store_call(objstore.read_bytes, where, self.sizes[".metadata"])
            metadata = _unpickle_metadata(io.BytesIO(data), where)
            _check_storage(metadata, self.path, self.sizes)
            self.metadata = metadata
        return self.metadata

    def _slice_file(self, file, sinfo):
        """DCP's view of one range, which it hands to torch.load, once its records are checked
        (`_check_uncompressed`, as _SafeReader's plan): here, as DCP slices it, since `file` is
        the object `_WholeObjectStreams` fetched whole, and the check costs no GET more."""
        _check_uncompressed(file, sinfo, f"{self.path}/{sinfo.relative_path} at {sinfo.offset}")
        return super()._slice_file(file, sinfo)


class _WholeObjectStreams(FsspecFileSystem):
    """DCP's fsspec streams, each fetching its whole object (its manifest size) in one ranged GET
    on the first read: DCP reads a shard item by item, which with fsspec's default 5 MiB blocks is
    a GET per few items."""

    def __init__(self, sizes):
        super().__init__()
        self.sizes = sizes

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        size = self.sizes.get(os.path.basename(os.fspath(path)), 0)
        block = max(size, 1 << 20)
        with self.fs.open(os.fspath(path), mode, block_size=block, cache_type="readahead") as f:
            # the first read from byte 0 fills the cache with the whole object: a range's check
            # (`_SafeStoreReader._slice_file`) reads its end first, which fetched from there on
            f.read(1)
            f.seek(0)
            yield f


def _store_call(fn, *args):
    """fn(*args) against the store; a refusal or an unreachable store is one CheckpointError. (An
    OSError of a local file, `objstore.download`'s, is not the store's: it goes up as it is.)"""
    try:
        return fn(*args)
    except FileNotFoundError as e:
        raise CheckpointError(f"{args[0]}: missing ({e})")
    except objstore.TooLarge as e:  # the store answered: what it holds is wrong
        raise CheckpointError(str(e))
    except objstore.StoreError as e:  # (the client's errors, OSErrors too: `_translated`)
        raise StoreUnreachable(f"{args[0]}: {describe(e)}")


def _is_count(x):
    """A whole number a checkpoint may claim: an int (not a bool) in [0, MAX_COUNT]."""
    return type(x) is int and 0 <= x <= MAX_COUNT


class _SafePlanner(DefaultLoadPlanner):
    """Assumes flatten_state_dict=True, the default."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for key, value in self.state_dict.items():  # flattened: "model.model.lm_head.weight"
            _check_stored(key, value, self.metadata.state_dict_metadata.get(key))

    def load_bytes(self, read_item, value):
        # DefaultLoadPlanner's own is torch.load(weights_only=False): code could run from here
        key = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:  # its text: a page of advice, in terminal colours
            # "Unsupported global: GLOBAL builtins.object was not ...", "Trying to load
            # unsupported GLOBAL posix.system whose module posix is blocked."
            found = re.search(r"[Uu]nsupported (?:global: )?GLOBAL (\S+)", str(e))
            what = "torch's weights-only loader refuses it"
            if found:
                what = f"the global {found.group(1)}: torch's weights-only loader refuses it"
            raise CheckpointError(f"{key}: refusing to unpickle it ({what})")
        set_element(self.original_state_dict, self.mappings[key], loaded)


def _check_stored(key, value, stored):
    """What the checkpoint's .metadata says it holds for `key` must be what the state to fill
    holds (`value`): a tensor of its dtype and global shape. Else DCP put whatever bytes it had in
    a tensor's place (the export saved the model's fresh random weight for it, a resume raised a
    traceback at set_state_dict), cast another dtype into it (int32 read as float weights), or
    raised its own message, which names neither the checkpoint nor the entry plainly."""
    if stored is None:
        raise CheckpointError(f"{key}: missing (the checkpoint of another model or optimizer?)")
    if not isinstance(value, torch.Tensor):
        return  # a setting (a param group's lr), or a step count of a number
    if not isinstance(stored, TensorStorageMetadata):
        raise CheckpointError(f"{key}: expected a tensor, the checkpoint holds other data")
    if stored.properties.dtype != value.dtype:
        raise CheckpointError(
            f"{key}: {stored.properties.dtype} in the checkpoint, {value.dtype} expected"
        )
    if tuple(stored.size) != tuple(value.shape):  # a DTensor's shape is the global one
        raise CheckpointError(
            f"{key}: shape {tuple(stored.size)} in the checkpoint, {tuple(value.shape)} expected"
        )


def metadata_reader(path, sizes=None):
    """DCP's reader of the checkpoint's dcp/ folder `path`, its .metadata read and checked. On a
    store, `sizes`: the manifest's {name in dcp/: size}."""
    reader = _SafeReader(path)
    if objstore.is_url(path):
        reader = _SafeStoreReader(path, sizes)
    # A refused .metadata raises here, as itself: inside dcp.load, DCP would log its traceback,
    # retry it as "rank-local metadata", and wrap the error in a CheckpointException.
    reader.read_metadata()
    return reader


def dcp_load(state, path, no_dist=False, sizes=None, reader=None):
    """dcp.load, minus its two unpickling holes and its reads outside the checkpoint; fills
    `state` in place. reader: `metadata_reader`'s of `path` (made here when not given)."""
    if reader is None:
        reader = metadata_reader(path, sizes)
    try:
        dcp.load(state, storage_reader=reader, planner=_SafePlanner(), no_dist=no_dist)
    except CheckpointException as e:  # every rank's (DCP gathers the plans' failures)
        failures = [errors[0] for errors in e.failures.values()]
        ours = [f for f in failures if isinstance(f, CheckpointError)]
        if ours:
            raise CheckpointError(f"{os.path.dirname(path)}: {ours[0]}") from None
        raise
    mine = _unsaveable_value(state)
    problems = [mine]
    if not no_dist and dist.is_initialized():
        problems = [None] * dist.get_world_size()
        # each rank checked its own shards: every rank stops, or none
        dist.all_gather_object(problems, mine)
    found = [problem for problem in problems if problem]
    if found:
        raise CheckpointError(f"{os.path.dirname(path)}: {found[0]}")


def _unsaveable_value(state):
    """The first tensor of a loaded state that no run saves, said in a few words, or None: a
    weight not finite, NaN anywhere (a step that diverges is never applied nor saved:
    `common.clip_grad_norm`), an AdamW second moment or step below 0. (An infinite moment is
    left alone: a finite gradient above 1.8e19, with clipping off, squares to one, and the
    weights stay finite.) A crafted checkpoint with one (its manifest written anew, so it
    verifies) trained on to NaN weights, then saved and exported them, exit status 0. This
    rank's shards of the DTensors."""
    for name, value in _tensors(state):
        if isinstance(value, DTensor):
            value = value.to_local()
        weight = ".optim." not in f".{name}"
        if value.is_floating_point() and value.isnan().any():
            return f"{name}: NaN, which no run saves"
        if weight and value.is_floating_point() and value.isinf().any():
            return f"{name}: infinite, which no run saves"
        nonnegative = name.rsplit(".", 1)[-1] in ("exp_avg_sq", "max_exp_avg_sq", "step")
        if nonnegative and (value < 0).any():
            return f"{name}: below 0, which no run saves"
    return None


def _tensors(value, name=""):
    """(dotted name, tensor) of every tensor in nested dicts and lists."""
    if isinstance(value, torch.Tensor):
        yield name, value
        return
    items = []
    if isinstance(value, dict):
        items = value.items()
    if isinstance(value, (list, tuple)):
        items = enumerate(value)
    for key, item in items:
        yield from _tensors(item, f"{name}.{key}".lstrip("."))


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
    data = base64.b64decode(text, validate=True)  # binascii.Error (a ValueError) if it is not
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


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


# ---- files on disk: regular files inside their folder, nothing else ------------------------------
_MODES = {
    "r": os.O_RDONLY,
    "rb": os.O_RDONLY,
    "a": os.O_WRONLY | os.O_APPEND | os.O_CREAT,
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,  # a new file: never writes through what was there
}


def open_regular(path, mode="r"):
    """open(path, mode) for a regular file only: a symlink (at the last component) is never
    followed, and a FIFO or device is refused before it is read (O_NONBLOCK: opening a FIFO does
    not wait for a writer). Modes: r, rb, a (append or create), x (create; the name must be free).
    CheckpointError for anything but a regular file; OSError (e.g. FileNotFoundError) as open's,
    and ENXIO's for a FIFO without a reader opened to write (a or x)."""
    flags = _MODES[mode] | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if os.path.islink(path):  # O_NOFOLLOW's ELOOP
            raise CheckpointError(f"{path}: a symlink; files here are never opened through links")
        raise e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: not a regular file (a FIFO, device or socket)")
    return os.fdopen(fd, mode.replace("x", "w"))


def _remove_entry(path):
    """Remove what is at path, if anything: a folder with its contents, a symlink itself (never
    its target), a file."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _durable(path, text=None):
    """Write text (if any) to the new file path, then fsync it: a file's data, or a directory's
    entries."""
    if text is not None:
        with open_regular(path, "x") as f:
            f.write(text)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    os.fsync(fd)
    os.close(fd)


def _readable_as_umask_allows(root):
    """Give the files an export wrote (top level) config.json's mode, the one a new file gets
    (0666 less the umask): safetensors writes model.safetensors through a private temporary file
    and a rename, so it was 0600 beside 0644 configs, unreadable to a serving job of another
    user."""
    mode = stat.S_IMODE(os.stat(os.path.join(root, "config.json")).st_mode)
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if stat.S_ISREG(os.lstat(path).st_mode):
            os.chmod(path, mode)


def _durable_tree(root):
    """fsync every regular file below root, every real folder (its entries), and root's parent
    (root's own entry). A symlink is left alone: what it points to is not ours to sync."""
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                _durable(path)
        _durable(folder)
    _durable(os.path.dirname(os.path.abspath(root)))


def _entries(root):
    """{relative path: lstat mode} of every entry below root but its real folders, which are
    walked (no symlink is followed: a symlink to a folder is listed here, as a link). With a
    stack, not os.walk: Python 3.11's recurses, and a crafted checkpoint 1,500 folders deep
    was a RecursionError where a damaged checkpoint's one line belongs."""
    found = {}
    folders = [root]
    while folders:
        folder = folders.pop()
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISDIR(mode):
                folders.append(path)
            else:
                found[os.path.relpath(path, root)] = mode
    return found


def _sha256(path):
    """(size, sha256) of the regular file at path."""
    with open_regular(path, "rb") as f:
        return os.fstat(f.fileno()).st_size, hashlib.file_digest(f, "sha256").hexdigest()


def _manifest_files(root, hashed=None):
    """{relative path: {size, sha256}} of every file below root but the manifest itself; a
    symlink, FIFO or device below root is a CheckpointError. hashed: entries already computed
    (by the ranks that wrote those files), taken as they are; every other file is hashed here."""
    hashed = hashed or {}
    entries = _entries(root)
    for rel in hashed:
        if rel not in entries:  # a rank hashed it, this rank cannot see it: no shared folder
            raise CheckpointError(f"{os.path.join(root, rel)}: written by another rank, not here")
    files = {}
    for rel, mode in sorted(entries.items()):
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{os.path.join(root, rel)}: not a regular file")
        if rel in hashed:
            files[rel] = hashed[rel]
        elif rel != "manifest.json":
            size, digest = _sha256(os.path.join(root, rel))
            files[rel] = {"size": size, "sha256": digest}
    return files


def _own_files(tmp):
    """The files of a save that this rank wrote: its DCP shards (DCP names a rank's files
    `__<rank>_<n>.distcp`) and its RNG state. Rank 0's other files (DCP's `.metadata`, meta.json,
    hf/) are hashed by _publish, as is anything DCP might one day name otherwise."""
    rank = dist.get_rank()
    shards = sorted(n for n in os.listdir(os.path.join(tmp, "dcp")) if n.startswith(f"__{rank}_"))
    return [os.path.join("dcp", n) for n in shards] + [f"rng-rank{rank}.json"]


def _hash_own_files(tmp):
    """{relative path: {size, sha256}} of this rank's own files, read once they are written (a
    blocking save: right after, from the page cache; an async one: at its commit, some steps
    later), so that every rank hashes its share at once, not rank 0 all of it."""
    files = {}
    for rel in _own_files(tmp):
        size, digest = _sha256(os.path.join(tmp, rel))
        files[rel] = {"size": size, "sha256": digest}
    return files


def _step_dirs(root):
    """(step-N names, newest first: locally the committed ones, on a store committed or not (a
    manifest says which); the name `latest` points at, or None)."""
    names = []
    if objstore.is_url(root):
        names = _store_call(objstore.step_names, root)
    elif os.path.isdir(root):
        names = [n for n in os.listdir(root) if objstore.is_step_name(n)]
    names.sort(key=_step_of, reverse=True)
    return names, _read_latest(root)


def _read_latest(root):
    """The checkpoint name in root/latest; None if there is none, or no sensible one."""
    if objstore.is_url(root):
        # Only a `latest` that is not there, or not a name, is none: a store that fails to answer
        # raises (StoreError), or a resume would take every step for a candidate, an abandoned
        # branch's newer ones first.
        try:
            name = objstore.read_bytes(os.path.join(root, "latest"), 64).decode().strip()
        except (FileNotFoundError, ValueError, objstore.TooLarge):
            return None
        return _step_name_or_none(name)
    try:
        with open_regular(os.path.join(root, "latest")) as f:
            name = f.read(64).strip()
    except (OSError, CheckpointError, ValueError):
        return None
    return _step_name_or_none(name)


def _step_name_or_none(name):
    if objstore.is_step_name(name):
        return name
    return None


def _step_of(name):
    return int(name[len("step-") :])


# ---- verifying: against damage (the manifest is no signature; README, "Checkpoints") -------------
def verify(path):
    """Return the manifest, or raise CheckpointError naming what is missing, cut, altered, not
    listed, not a regular file, or malformed (meta.json, RNG files). Reads regular files only,
    each no further than the size the manifest gives it; opens nothing else."""
    if objstore.is_url(path):
        return _verify_store(path)
    manifest, entries = _verify_layout(path)
    for rel, want in manifest["files"].items():
        _check_file(os.path.join(path, rel), want, rel in entries)
    read_meta(path, manifest["step"])
    _check_dcp_metadata(path)
    return manifest


def _check_dcp_metadata(path):
    """verify()'s last check: dcp/.metadata unpickles (safely) and every storage entry in it
    reads inside the checkpoint, as dcp_load will require; so `--resume latest` passes over a
    checkpoint whose metadata is damaged, as over any other damaged file."""
    reader = _SafeReader(os.path.join(path, "dcp"))
    if objstore.is_url(path):
        reader = _SafeStoreReader(os.path.join(path, "dcp"), _dcp_sizes(path))
    try:
        reader.read_metadata()
    except OSError as e:  # (the manifest listed it, or it is not there: a checkpoint has one)
        where = os.path.join(path, "dcp", ".metadata")
        raise CheckpointError(f"{where}: missing or unreadable ({e.strerror})")


def _verify_layout(path):
    """verify()'s first part, which reads no file but the manifest: (manifest, entries) of a
    local checkpoint folder whose entries are all regular files and all listed."""
    if os.path.islink(path):
        raise CheckpointError(f"{path}: a symlink, not a checkpoint folder")
    manifest = _read_manifest(path)
    entries = _entries(path)
    for rel, mode in sorted(entries.items()):
        where = os.path.join(path, rel)
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{where}: not a regular file (a symlink, FIFO or device)")
        if rel != "manifest.json" and rel not in manifest["files"]:
            raise CheckpointError(f"{where}: not listed in the manifest")
    for rel in manifest["files"]:
        _check_plain_name(path, rel)  # "../x" was "missing" (never read) where x was there
    return manifest, entries


def _check_plain_name(path, rel):
    """A manifest's or a store listing's name is a path inside the checkpoint: no part of it
    empty, "." or "..", which would name a file outside it."""
    if any(part in ("", ".", "..") for part in rel.split("/")):
        raise CheckpointError(f"{os.path.join(path, rel)}: not a plain name inside the checkpoint")


def _owners(sizes, world):
    """Which rank checks each file: the largest first, each to the rank with the fewest bytes so
    far, so that the ranks finish hashing at about the same time."""
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = load.index(min(load))
        owner[i] = rank
        load[rank] += sizes[i]
    return owner


def _check_share(path, files):
    """(index, line) of the first of this rank's share of files [(rel, want, exists)] that fails
    _check_file, or None."""
    owner = _owners([want["size"] for _, want, _ in files], dist.get_world_size())
    for i, (rel, want, exists) in enumerate(files):
        if owner[i] != dist.get_rank():
            continue
        try:
            _check_file(os.path.join(path, rel), want, exists)
        except (OSError, CheckpointError) as e:
            return i, _check_line(e)
    return None


def _check_line(e):
    """A failed file check's line: CheckpointError's own; an OSError's reason."""
    if isinstance(e, CheckpointError):
        return str(e)
    return f"{e.filename}: unreadable ({e.strerror})"


def _verify_collective(path):
    """Collective verify(): None if the checkpoint verifies, else the line verify() would raise
    (a StoreUnreachable itself when the store failed to answer).
    Rank 0 checks the layout and reads the manifest; every rank then hashes its share of the
    files at once (the sha256 sums are most of a resume's time, and hashing is one core's work
    per file); rank 0 reads meta.json last. The same first problem is named as verify() names."""
    # [error, [(rel, want, exists)] in the manifest's order, step]
    layout = [None, [], None]
    if dist.get_rank() == 0:
        layout = _layout_or_error(path)
    dist.broadcast_object_list(layout, src=0)  # every rank hashes what rank 0 read in the manifest
    error, files, step = layout
    if isinstance(error, StoreUnreachable):
        return error
    if error is None:
        found = [None] * dist.get_world_size()
        # every rank learns each rank's first failure: the manifest's earliest is the one named
        dist.all_gather_object(found, _check_share(path, files))
        failures = sorted(f for f in found if f)
        if failures:
            error = failures[0][1]
    verdict = [error]
    if dist.get_rank() == 0 and error is None and step is not None:
        verdict[0] = _meta_error(path, step)
    dist.broadcast_object_list(verdict, src=0)  # rank 0 alone read meta.json
    return verdict[0]


def _layout_or_error(path):
    """Rank 0: [None, files, step] for _verify_collective, or [error, [], None]; on a store, the
    whole verify() here (its sums are the store's reads, through objstore): [None, [], None]."""
    try:
        if objstore.is_url(path):
            verify(path)
            return [None, [], None]
        manifest, entries = _verify_layout(path)
    except StoreUnreachable as e:  # kept whole: _choose stops at it
        return [e, [], None]
    except CheckpointError as e:
        return [str(e), [], None]
    except OSError as e:  # a folder it may not list: this line on every rank, not a hang
        return [f"{path}: {e.strerror}: {e.filename}", [], None]
    files = [(rel, want, rel in entries) for rel, want in manifest["files"].items()]
    return [None, files, manifest["step"]]


def _meta_error(path, step):
    """Rank 0: verify()'s last checks, meta.json, the RNG files and DCP's metadata; its line, or
    None."""
    try:
        read_meta(path, step)
        _check_dcp_metadata(path)
    except CheckpointError as e:
        return str(e)
    except OSError as e:
        return f"{path}: {e.strerror}: {e.filename}"
    return None


def _read_manifest(path):
    """The checkpoint's manifest.json, read and checked (on a disk or a store alike)."""
    manifest_path = os.path.join(path, "manifest.json")
    try:
        manifest = _read_json(manifest_path)
    except StoreUnreachable:
        raise
    except (OSError, CheckpointError) as e:
        raise CheckpointError(
            f"{manifest_path}: missing or unreadable (not a checkpoint, or an unfinished one: {e})"
        )
    _check_manifest(manifest, manifest_path)
    name = os.path.basename(path.rstrip("/"))
    if objstore.is_step_name(name) and _step_of(name) != manifest["step"]:
        # a copy or rename under another step's name: `--resume latest` orders by the names,
        # and would take it for a step it is not (the name says 9, the weights are step 1's)
        raise CheckpointError(f"{manifest_path}: step {manifest['step']}, in a folder named {name}")
    return manifest


def checkpoint_bytes(path):
    """The bytes of a committed checkpoint's files, from its manifest (nothing else read)."""
    return sum(entry["size"] for entry in _read_manifest(path)["files"].values())


def _verify_store(path):
    """verify() for a checkpoint on a store: its manifest exists (the commit), lists exactly the
    objects under the prefix, each of plain relative name, of the listed size and sha256 (read no
    further than that size)."""
    manifest = _read_manifest(path)
    found = _store_call(objstore.listing, path)
    for rel in sorted(set(found) | set(manifest["files"])):
        where = os.path.join(path, rel)
        _check_plain_name(path, rel)
        if rel != "manifest.json" and rel not in manifest["files"]:
            raise CheckpointError(f"{where}: not listed in the manifest")
        if rel not in found:
            raise CheckpointError(f"{where}: missing")
    for rel, want in manifest["files"].items():
        where = os.path.join(path, rel)
        if found[rel] != want["size"]:
            raise CheckpointError(f"{where}: size {found[rel]}, manifest says {want['size']}")
        size, digest = _store_call(objstore.sha256, where, want["size"])
        if size != want["size"] or digest != want["sha256"]:
            raise CheckpointError(f"{where}: checksum mismatch")
    read_meta(path, manifest["step"])
    _check_dcp_metadata(path)
    return manifest


def _read_json(path):
    """The JSON value in the regular file path; CheckpointError if it is not JSON."""
    if objstore.is_url(path):
        # on a store: at most SMALL_CAP bytes (meta.json, RNG files: listed in a verified manifest)
        try:
            return json.loads(_store_call(objstore.read_bytes, path, objstore.SMALL_CAP))
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"{path}: malformed, not JSON ({type(e).__name__}: {e})")
    with open_regular(path, "rb") as f:
        # as on a store: a checkpoint's JSON files are small (a manifest of a thousand ranks'
        # files is under 1 MiB); a crafted 64 GiB one was read whole (a MemoryError traceback)
        data = f.read(objstore.SMALL_CAP + 1)
    if len(data) > objstore.SMALL_CAP:
        raise CheckpointError(f"{path}: over {objstore.SMALL_CAP >> 20} MiB, not a checkpoint's")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError too; [[[[... nested deep
        raise CheckpointError(f"{path}: malformed, not JSON ({type(e).__name__}: {e})")


def _check_manifest(manifest, where):
    files = None
    if type(manifest) is dict:
        files = manifest.get("files")
    ok = type(files) is dict and _is_count(manifest.get("step"))
    if not ok:
        files = {}
    for want in files.values():
        ok = ok and type(want) is dict and _is_count(want.get("size"))
        ok = ok and type(want.get("sha256")) is str
    if not ok:
        raise CheckpointError(
            f"{where}: malformed (expected {{'step': N, 'files': {{path: {{'size': N, "
            "'sha256': hex}}}}"
        )


def _check_file(where, want, listed_entry_exists):
    """The listed file is there, a regular file of the manifest's size (compared before reading
    it, so a file never costs more than the manifest says) and checksum."""
    if not listed_entry_exists:
        raise CheckpointError(f"{where}: missing")
    with open_regular(where, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != want["size"]:
            raise CheckpointError(f"{where}: size {size}, manifest says {want['size']}")
        if hashlib.file_digest(f, "sha256").hexdigest() != want["sha256"]:
            raise CheckpointError(f"{where}: checksum mismatch")


def read_meta(path, step=None):
    """meta.json of the checkpoint at path, its header checked (and its step == `step`, if
    given), and every rank's RNG file readable by set_rng_state: a crafted or malformed one is a
    damaged checkpoint (CheckpointError), not a traceback halfway through a resume."""
    where = os.path.join(path, "meta.json")
    try:
        meta = _read_json(where)
    except OSError as e:
        raise CheckpointError(f"{where}: missing or unreadable ({e.strerror})")
    if type(meta) is not dict:
        raise CheckpointError(f"{where}: malformed (expected a JSON object)")
    roles = meta.get("roles")
    saved_step = meta.get("step")
    checks = {
        "format_version": meta.get("format_version") == FORMAT_VERSION,
        "step": _is_count(saved_step) and saved_step >= 1 and step in (None, saved_step),
        "world_size": _is_count(meta.get("world_size")) and meta.get("world_size") >= 1,
        "roles": type(roles) is list and bool(roles) and all(type(r) is str for r in roles),
        "args": type(meta.get("args")) is dict,
        "scheduler": "scheduler" not in meta or _schedules_at(meta["scheduler"], saved_step),
        "frozen": "frozen" not in meta or _is_fingerprints(meta["frozen"]),
        "folders": "folders" not in meta or _is_folder_records(meta["folders"]),
        "engine": meta.get("engine", "hf") in ("hf", "vllm"),  # PPO's rollout engine
        "stage": type(meta.get("stage", "")) is str,  # the script that saved it
        "data": meta.get("data") is None or type(meta.get("data")) is str,  # --data's sha256
        "export_dtype": meta.get("export_dtype", "float32") in EXPORT_DTYPES,
    }
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        shown = ", ".join(f"{k} {meta.get(k)!r}" for k in bad)
        raise CheckpointError(f"{where}: malformed or from another version: {shown}")
    for rank in range(meta["world_size"]):
        rng_path = os.path.join(path, f"rng-rank{rank}.json")
        try:
            _check_rng(_read_json(rng_path))
        except OSError as e:
            raise CheckpointError(f"{rng_path}: missing or unreadable ({e.strerror})")
        except CheckpointError:  # _read_json's own (a StoreUnreachable among them) stays as it is
            raise
        except (LookupError, TypeError, ValueError, OverflowError, RuntimeError) as e:
            raise CheckpointError(f"{rng_path}: malformed RNG state ({type(e).__name__}: {e})")
    return meta


def _schedules_at(value, step):
    """Whether meta.json's "scheduler" (one LR scheduler's state, or {name: state} for PPO's
    two) stands where a run of `step` steps leaves it: every stage steps its schedulers once per
    step. A crafted position (a `last_epoch` of -1e9 trained at a negative rate, exit 0) is then
    damage, which `--resume latest` falls back from; the states' other fields are checked when
    they are restored (`restore_scheduler`)."""
    states = [value]
    if isinstance(value, dict) and "last_epoch" not in value:
        states = list(value.values())
    for state in states:
        if not isinstance(state, dict):
            return False
        if type(state.get("last_epoch")) is not int or state["last_epoch"] != step:
            return False
        if type(state.get("_step_count")) is not int or state["_step_count"] != step + 1:
            return False
    return bool(states)


def _is_fingerprints(value):
    """Whether meta.json's "frozen" is {flag: {parameter name: finite number}}, as
    `common.weights_fingerprint` makes them (compared by `load`)."""
    if type(value) is not dict:
        return False
    for sums in value.values():
        if type(sums) is not dict:
            return False
        for number in sums.values():
            # floats only: JSON reads 1e400 written as digits as an int, which isfinite cannot
            # take (an OverflowError, not a damaged checkpoint)
            if type(number) is not float or not math.isfinite(number):
                return False
    return True


def _is_folder_records(value):
    """Whether meta.json's "folders" is {flag: {"config": JSON object text, "generation": JSON
    object text or "null", "tokenizer": sha256 hex, "versions": text}}, as
    `common.folder_identity` makes them."""
    if type(value) is not dict:
        return False
    for record in value.values():
        keys = {"config", "generation", "tokenizer", "versions"}
        if type(record) is not dict or set(record) != keys:
            return False
        if not all(type(text) is str for text in record.values()):
            return False
        try:
            config = json.loads(record["config"])
            generation = json.loads(record["generation"])
        except (ValueError, RecursionError):
            return False
        if type(config) is not dict or type(generation) not in (dict, type(None)):
            return False
        if re.fullmatch(r"[0-9a-f]{64}", record["tokenizer"]) is None:
            return False
    return True


def _check_rng(state):
    """Raises unless set_rng_state takes `state`: tried on throwaway generators, so this process's
    own RNG streams are not touched."""
    version, internal, gauss_next = state["python"]
    random.Random().setstate((version, tuple(internal), gauss_next))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    keys = np.array(keys, dtype=np.uint32)
    np.random.RandomState().set_state((name, keys, pos, has_gauss, gauss))
    torch.Generator().set_state(_unb64(state["torch"]))
    if state["cuda"] is not None:
        # CUDA's Philox state: seed and offset (16 bytes), or an older seed alone (8): what
        # torch.cuda.set_rng_state accepts (CUDAGeneratorImpl::set_state), checked here on any
        # machine, so a crafted one fails verification, not a GPU resume after the weights load
        cuda = _unb64(state["cuda"])
        if cuda.numel() not in (8, 16):
            raise ValueError(f"a CUDA RNG state of {cuda.numel()} bytes, not 16")


# ---- saving: write on every rank, agree, then commit on rank 0 -----------------------------------
_pending = []  # the save in flight: (future or None, root, name, step, keep_last, on_error)
_last_save = [time.monotonic()]  # when the last save started, for --save_every_minutes
_async_group = []  # the gloo group DCP's background writes use (made on the first async save)
_run = {}  # "id": names this run's temp dirs (from resolve); "lock": rank 0's locked file


def one_line(text):
    """text with its line breaks written as \\n: an error names files, and a file named
    "x\\nTraceback (most recent call last):" inside a checkpoint made a second line of the one."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


def describe(e):
    """`type: first line` of an exception; of the first rank's own for DCP's CheckpointException,
    whose own text is a traceback per rank."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]  # DCP wraps each rank's own exception
    first_line = (str(e).splitlines() or [""])[0]
    return f"{type(e).__name__}: {first_line}"


def _describe_failure(e, tmp):
    """One line for a failed write: the error, and the free space where it was writing."""
    if objstore.is_url(tmp):
        return f"rank {dist.get_rank()}: {describe(e)}"
    disk = "."
    for candidate in (os.path.dirname(tmp), os.path.dirname(os.path.dirname(tmp))):
        if os.path.isdir(candidate):
            disk = candidate
            break
    free_mib = shutil.disk_usage(disk).free >> 20
    reason = describe(e)
    if free_mib == 0 and "No space left" not in reason:
        # torch's zip writer reports a full disk as "unexpected pos 704 vs 598": say it plainly
        reason = f"no space left on the device ({reason})"
    return f"rank {dist.get_rank()}: {reason} [{free_mib} MiB free]"


def _agree(fn, tmp, name, on_error):
    """Collective: run fn on this rank; if it failed on any rank, remove the temp dir and raise on
    all ranks (or, with on_error 'warn', print a warning and return False)."""
    err = None
    try:
        fn()
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is no Exception
        err = _describe_failure(e, tmp)
    # rank 0 commits: whether it did, for every rank's line (a failure after the commit, an
    # fsync of the folder, leaves the new checkpoint committed and, locally, latest)
    committed = _run.get("committed") == name
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, (err, committed))  # so every rank takes the same branch below
    bad = "; ".join(e for e, _ in errors if e)
    if not bad:
        return True
    committed = any(c for _, c in errors)
    _remove_unfinished(tmp)
    # Collective: every rank has finished removing the temp dir before any goes on. Each rank
    # removes the same (shared) folder, and a retry of the same step writes into the same path: a
    # rank fast to retry had its new files deleted by a slower rank's removal of the failed ones
    # (seen in tests/fault_check.py: rank 1's rng-rank1.json gone, FileNotFoundError).
    dist.barrier()
    try:
        previous = _read_latest(os.path.dirname(tmp))
    except (OSError, objstore.StoreError):
        previous = None  # the store unreachable: said from what this run knows, below
    kept = "no checkpoint is committed yet"
    if previous is None and objstore.is_url(tmp) and _run.get("latest"):
        # the store unreachable: `latest` was not replaced (that comes after every write)
        previous = _run["latest"]
    if previous:
        kept = f"the previous checkpoint, {previous}, is intact and latest"
    msg = f"{name} not saved ({bad}); {kept}"
    if committed:  # `latest` naming this step says nothing: a re-save of an abandoned branch's
        msg = f"{name}: the save failed after its commit ({bad}); it is committed"
        if previous == name:
            msg += " and latest"
    if on_error != "warn":
        raise CheckpointError(msg)
    if dist.get_rank() == 0:
        print(f"WARNING: {msg}; training goes on (--on_save_error warn)", flush=True)
    return False


def _remove_unfinished(tmp):
    """A failed save's writes: the local temp dir; on a store, the step's objects (rank 0, no
    manifest among them: the manifest comes last), as far as the store can be reached."""
    if not objstore.is_url(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        return
    if dist.get_rank() != 0:
        return
    try:
        # committed: the failure came after the manifest (its `latest` PUT), or the prefix is
        # another run's (`_publish_store` refuses to write over a manifest): not ours to delete
        if "manifest.json" in objstore.listing(tmp):
            return
        objstore.remove_prefix(tmp)
    except (OSError, objstore.StoreError):
        pass  # the next run's start deletes what is left: a prefix without a manifest


def _check_lock_kept(out_dir):
    """Collective, on a store: stop, whatever --on_save_error says, if another run has taken this
    run's lock over (rank 0's heartbeat found it there: this run went a lease without renewing,
    stalled or suspended). The folder is the other run's now: nothing is written or deleted."""
    lost = [objstore.lock_lost(out_dir)]
    dist.broadcast_object_list(lost, src=0)  # rank 0 holds the lock: every rank stops alike
    if lost[0] is not None:
        raise CheckpointError(
            f"{out_dir}: another run took this run's lock over ({repr(lost[0])[:200]}) after it "
            "went a lease without renewing it; nothing was saved or changed: this run stops"
        )


def _clear_step(tmp, name, on_error):
    """Collective, on a store: rank 0 deletes an abandoned branch's step-N (a run resumed from
    before it), manifest first; False if that failed (with on_error 'warn')."""

    def clear():
        if dist.get_rank() != 0:
            return
        root = os.path.dirname(tmp)
        if _read_latest(root) == name and _run.get("branch"):
            # `latest` names the step about to go: it names this run's own newest checkpoint
            # first (the one resumed from, or saved since), so that, should this save fail,
            # it never names a deleted step
            objstore.write_bytes(os.path.join(root, "latest"), (_run["branch"] + "\n").encode())
        objstore.remove_prefix(tmp)

    # the _agree() round makes every rank wait for rank 0's deletion before writing
    cleared = _agree(clear, tmp, name, on_error)
    if cleared and _run.get("latest") == name:
        # what a failed save calls latest when the store cannot be read: not the deleted step
        _run["latest"] = _run.get("branch")
    return cleared


def save(out_dir, step, roles, meta, hf_objs, keep_last, async_save=False, on_error="stop"):
    """Collective. roles = {name: (model, optimizer)}; meta: JSON; hf_objs (config, tokenizer,
    generation config) go to hf/. async_save: a thread writes a copy of the state while training
    goes on, and boundary() commits it later. Returns the committed path (None while in flight)."""
    commit()  # one save in flight at a time
    _run.pop("committed", None)  # set where this save commits (`_publish`, `_publish_store`)
    # DCP writes each tensor with torch.save, which adds a zip CRC32 of every record: a second
    # pass over bytes the manifest's sha256 already covers (`_hash_own_files`; a resume and an
    # export verify every file before they load one). Off for this process, whose only
    # torch.save calls are DCP's: torch.load reads such records (an unzip tool would warn).
    # ~10% of a save and of a load (bench/RESULTS.md, "Checkpoint I/O").
    torch.serialization.set_crc32_options(False)
    root = os.path.join(out_dir, "checkpoints")
    name = f"step-{step:08d}"
    tmp = _tmp_path(root, name)
    _last_save[0] = time.monotonic()
    if async_save and not _async_group:
        # DCP's thread runs collectives of its own: on a group of its own, not the trainer's
        _async_group.append(dist.new_group(backend="gloo"))
    future = []

    if objstore.is_url(tmp):
        _check_lock_kept(out_dir)
        if not _clear_step(tmp, name, on_error):
            return None

    # What can fail on one rank only is agreed on before DCP starts: a rank failing after it
    # would leave the others in DCP's collectives, or an async save's thread writing into a temp
    # dir that the failure removes. DCP raises on every rank when it fails on one (an async
    # save: when it is committed).
    prepare = functools.partial(_prepare, tmp, step, roles, meta, hf_objs)
    start = functools.partial(_start_dcp, tmp, roles, async_save, future)
    if not _agree(prepare, tmp, name, on_error):
        return None
    if not _agree(start, tmp, name, on_error):
        return None
    pending_future = None
    if async_save:
        pending_future = future[0]
    _pending.append((pending_future, root, name, step, keep_last, on_error))
    if async_save:
        return None
    return commit()


def _prepare(tmp, step, roles, meta, hf_objs):
    """A save's temp dir and its small files (RNG, meta.json, hf/) on this rank."""
    if not objstore.is_url(tmp):
        os.makedirs(tmp, exist_ok=True)  # every rank: a shared file system, or one per node
    if os.path.islink(tmp):  # the name is this run's own: nothing else may sit there
        raise CheckpointError(f"{tmp}: a symlink; refusing to write through it")
    _write_small_files(tmp, step, roles, meta, hf_objs)


def _start_dcp(tmp, roles, async_save, future):
    """DCP's save of every role's state into tmp/dcp; async: started, its future in `future`."""
    state = _state(roles)
    writer = dcp.FileSystemWriter(os.path.join(tmp, "dcp"))
    if objstore.is_url(tmp):
        writer = FsspecWriter(os.path.join(tmp, "dcp"))
    # Collective: DCP plans the save on every rank together (gathering each rank's plan to rank
    # 0 and scattering the final one back), so that no two ranks write the same shard; each rank
    # then writes its own files. The async save's collectives run on a group of their own, so
    # they never interleave with the training's.
    if async_save:
        future.append(dcp.async_save(state, storage_writer=writer, process_group=_async_group[0]))
    else:
        dcp.save(state, storage_writer=writer)


def _tmp_path(root, name):
    """Where a save writes before it is committed: named per run, so that a second run in the same
    folder (refused by the lock; or one on another machine) never writes into this one's."""
    if "id" not in _run:
        raise RuntimeError("checkpoint.resolve() starts the run (lock, run id) before any save")
    if objstore.is_url(root):  # no rename on a store: the final prefix, committed by its manifest
        return os.path.join(root, name)
    return os.path.join(root, f".tmp-{name}-{_run['id']}")


def _write_small_files(tmp, step, roles, meta, hf_objs):
    """Every rank its RNG state; rank 0 the run's meta.json and the HF config/tokenizer in hf/."""
    rank = dist.get_rank()
    _put(os.path.join(tmp, f"rng-rank{rank}.json"), json.dumps(rng_state()))
    if rank != 0:
        return
    header = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": dist.get_world_size(),
        "roles": list(roles),
    }
    _put(os.path.join(tmp, "meta.json"), json.dumps({**header, **meta}, indent=1))
    if not objstore.is_url(tmp):
        hf = os.path.join(tmp, "hf")
        for obj in hf_objs:
            obj.save_pretrained(hf)
        # save_pretrained does not fsync: each file here, as DCP's writer does its shards, before
        # the rename in `_publish` commits them (which fsyncs only the folders)
        for folder, _, names in os.walk(hf):
            for name in names:
                _durable(os.path.join(folder, name))
        return
    with tempfile.TemporaryDirectory() as local:  # save_pretrained writes local files only
        for obj in hf_objs:
            obj.save_pretrained(local)
        objstore.upload_folder(os.path.join(tmp, "hf"), local)


def _put(path, text):
    """A new small file, durable (local), or one object (a store)."""
    if objstore.is_url(path):
        objstore.write_bytes(path, text.encode())
    else:
        _durable(path, text)


def commit():
    """Collective: once the save in flight is on disk on every rank, rank 0 publishes it."""
    if not _pending:  # nothing in flight
        return None
    future, root, name, step, keep_last, on_error = _pending.pop()
    tmp = _tmp_path(root, name)
    final = os.path.join(root, name)

    own = {}

    def wait_for_writes():
        if future is not None:
            future.result()
        if not objstore.is_url(root):  # a store's objects are read back by _publish_store
            own.update(_hash_own_files(tmp))

    hashed = {}

    def publish():
        if dist.get_rank() == 0 and objstore.is_url(root):
            _publish_store(final, root, name, step, dist.get_world_size())
        elif dist.get_rank() == 0:
            _publish(tmp, final, root, name, step, hashed)

    # All ranks' shards written (and hashed), then rank 0 commits; a failure on any rank stops both.
    if not _agree(wait_for_writes, tmp, name, on_error):
        return None
    if objstore.is_url(root):
        # an async save's writes ended after another run took the folder over: its shards are
        # there, but no manifest, `latest` or pruning of the other run's checkpoints
        _check_lock_kept(os.path.dirname(root))
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, own)  # rank 0 writes the manifest: every rank's hashes to it
    for share in shares:
        hashed.update(share)
    if not _agree(publish, tmp, name, on_error):
        return None
    _run["latest"] = name  # every rank: `publish` succeeded on rank 0
    _run["branch"] = name
    _run.setdefault("written", set()).add(name)  # this run's history (`_of_this_history`)
    if dist.get_rank() == 0:
        _prune(root, step, keep_last)
    return final


def _publish(tmp, final, root, name, step, hashed):
    """Rank 0: manifest (hashed: the files every rank hashed already), fsync everything, rename to
    step-N, then point `latest` at it atomically."""
    manifest = {"step": step, "files": _manifest_files(tmp, hashed)}
    _durable(os.path.join(tmp, "manifest.json"), json.dumps(manifest))
    for folder, _, _ in os.walk(tmp):
        _durable(folder)
    if os.path.lexists(final) and _run.get("branch") and _read_latest(root) == name:
        # a save of this step by a run resumed from before it, while `latest` names the step
        # about to go (an abandoned branch's, or one passed over as damaged): `latest` names
        # this run's own newest checkpoint first, so that a kill between the removal and the
        # rename never leaves it naming a missing step (as `_clear_step` does on a store)
        _point_latest(root, _run["branch"])
        _durable(root)
    _remove_entry(final)
    os.rename(tmp, final)
    _durable(root)  # the rename is on disk before `latest` may point at it
    _durable(os.path.dirname(root))  # and checkpoints/ itself, after the run's first save
    _point_latest(root, name)
    _run["committed"] = name  # for `_agree`'s line, should the fsync below fail
    _durable(root)


def _point_latest(root, name):
    """Local: root/latest replaced atomically by one naming `name` (durable once root is)."""
    # a killed run's latest.tmp: removed (a symlink itself, not its target), never written through
    _remove_entry(os.path.join(root, "latest.tmp"))
    _durable(os.path.join(root, "latest.tmp"), name + "\n")
    os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))  # atomic


def _publish_store(final, root, name, step, world):
    """Rank 0, on a store: every object's size and sha256 (read back: what the store holds),
    every rank's objects among them (`_check_every_rank_listed`), the manifest written last (the
    commit), then the `latest` object replaced (one PUT)."""
    files = {}
    for rel, size in sorted(objstore.listing(final).items()):
        if rel == "manifest.json":  # an abandoned branch's: removed before this save wrote
            raise CheckpointError(f"{final}: holds a manifest already; another run writes here")
        seen, digest = objstore.sha256(os.path.join(final, rel), size)
        files[rel] = {"size": seen, "sha256": digest}
    _check_every_rank_listed(final, files, world)
    manifest = {"step": step, "files": files}
    objstore.write_bytes(os.path.join(final, "manifest.json"), json.dumps(manifest).encode())
    _run["committed"] = name  # the manifest is the commit on a store (`_agree`'s line)
    objstore.write_bytes(os.path.join(root, "latest"), (name + "\n").encode())


def _check_every_rank_listed(final, files, world):
    """Rank 0, before a store's commit: what rank 0 lists holds every rank's RNG file and every
    DCP shard the metadata names. A store whose listing lags behind other clients' writes, or one
    that is not shared (memory://, each process's own), would otherwise get a manifest, and a
    `latest`, naming a checkpoint that cannot be resumed."""
    for rank in range(world):
        if f"rng-rank{rank}.json" not in files:
            raise CheckpointError(
                f"{final}/rng-rank{rank}.json: rank {rank} wrote it, but the store does not list "
                f"it; every rank must write to one shared store"
            )
    sizes = {
        rel[len("dcp/") :]: want["size"] for rel, want in files.items() if rel.startswith("dcp/")
    }
    _SafeStoreReader(os.path.join(final, "dcp"), sizes).read_metadata()  # each shard listed


def _prune(root, step, keep_last):
    """Now that step-N is committed, keep the keep_last newest up to it (0: keep all). Checkpoints
    newer than step-N are an abandoned branch (a run resumed from before them): they stay until
    this run overwrites them. Those older than step-N that are not this run's history
    (`_of_this_history`: another branch's, or one `--resume latest` passed over as damaged) are
    pruned but never counted: a damaged step-6 counted as kept had this run's step-3, which it
    resumed from, pruned, leaving one checkpoint that verifies where --keep_last 2 promised two."""
    if not keep_last:
        return
    try:
        names, _ = _step_dirs(root)
        older = [n for n in names if _step_of(n) < step]  # newest first
        if objstore.is_url(root):
            # a store lists a failed save's prefix too (no manifest: never resumed from, deleted
            # at the next start); counted here, it would push a committed checkpoint out
            older = [n for n in older if objstore.is_object(f"{root}/{n}/manifest.json")]
    # out of reach: rank 0 alone must not fail here
    except (CheckpointError, OSError, objstore.StoreError) as e:
        print(f"WARNING: pruning old checkpoints skipped ({e}); the next save retries", flush=True)
        return
    # step-N is the newest kept: keep_last - 1 older ones of this run's history stay with it
    history = [n for n in older if _of_this_history(n)]
    pruned = history[keep_last - 1 :] + [n for n in older if n not in history]
    for name in pruned:
        if not objstore.is_url(root):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            continue
        # Not `_remove_unfinished`, which keeps any prefix holding a manifest: these are committed.
        # remove_prefix deletes the manifest first, so a kill leaves an uncommitted step.
        try:
            objstore.remove_prefix(os.path.join(root, name))
        except (OSError, objstore.StoreError) as e:
            print(f"WARNING: pruning {name} skipped ({e}); the next save retries", flush=True)
            return


def _of_this_history(name):
    """Whether checkpoint `name` is in this run's history: at or before the step it resumed from
    (its branch, `resolve`), or written by it since. One newer than that and not written by it is
    another branch's, or one the resume passed over as damaged. (A save without `resolve`, in
    the tests: every checkpoint counts.)"""
    if "since" not in _run:
        return True
    return _step_of(name) <= _run["since"] or name in _run.get("written", ())


def boundary(step, every, minutes, signalled, device):
    """Collective, at every step's end: (save?, stop?), one answer for all ranks; commits a
    finished async save."""
    busy = bool(_pending and _pending[0][0] and not _pending[0][0].done())
    clock = minutes > 0 and time.monotonic() - _last_save[0] >= 60 * minutes
    clock = clock and dist.get_rank() == 0  # rank 0's clock decides, so all ranks save together
    flags = torch.tensor([signalled, clock, busy], dtype=torch.float32, device=device)
    # One decision for all ranks: any rank's flag counts.
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    stop, clock, busy = flags.bool().tolist()
    if not busy:
        commit()
    return stop or clock or (every > 0 and step % every == 0), stop


# ---- resuming ------------------------------------------------------------------------------------
def resolve(out_dir, resume):
    """Collective, before the run writes anything to out_dir: rank 0 takes the run lock, removes
    what killed runs left, and lists the checkpoints to try; all ranks verify them together
    (_choose); every rank gets the pick ('' = start fresh) and the run's id (its temp dirs'
    names)."""
    _run["restarted"] = _agree_restarted()
    if _run["restarted"] and not resume:
        resume = "latest"  # torchrun --max-restarts restarted the group: carry on where it stopped
    plan = {"candidates": [], "error": None, "run_id": None, "latest": None}
    if dist.get_rank() == 0:
        plan.update(_start(out_dir, resume))
    # all ranks try the very same checkpoints and name temp dirs alike, or all fail
    shared = [plan]
    dist.broadcast_object_list(shared, src=0)
    plan = shared[0]
    if plan["error"]:
        raise CheckpointError(plan["error"])
    if not objstore.is_url(out_dir):
        _check_shared(out_dir, plan["run_id"])
    _run["id"] = plan["run_id"]
    _run["latest"] = plan["latest"]  # for a failed save's message when the store is unreachable
    mode = resume
    if resume not in ("", "latest") and plan["candidates"] != [resume]:
        mode = "latest"  # a restart of a run started from another run's checkpoint (_candidates)
    path, error = _choose(plan["candidates"], mode)
    if error:
        raise CheckpointError(error)
    root = os.path.join(out_dir, "checkpoints")
    _run["branch"] = _branch_of(path, root)
    _run["since"] = 0  # the step this run's history reaches to before its own saves
    if _run["branch"]:  # its manifest's: a copy under another name (`best/`) may be resumed
        _run["since"] = _read_manifest(path)["step"]
    _run["written"] = set()
    _run["branch_start"] = None
    if mode == resume and resume not in ("", "latest") and _run["branch"]:
        _run["branch_start"] = (root, _run["branch"])  # `begin_branch`, once the resume is checked
    return path


def begin_branch():
    """Collective, as the resumed run drops its predecessor's rows after the checkpoint
    (`common.MetricsLog.truncate`, after every check of the resume): a run resumed by --resume
    PATH from one of its folder's own checkpoints (a branch) has rank 0 point `latest` at PATH
    where it names a newer step. A branch that failed or was killed before its first save left
    `latest` on the newer step, whose rows were gone, and `--resume latest` went on from there
    with the branch's rows in their place. The newer checkpoints stay, as an abandoned branch's
    (passed over, replaced as the run saves)."""
    if not _run.get("branch_start"):
        return
    root, name = _run.pop("branch_start")
    error = None
    moved = False
    if dist.get_rank() == 0:
        try:
            top = _read_latest(root)
            # a copy under another name (`best/`) may be resumed; it orders with no step
            if top is not None and objstore.is_step_name(name) and _step_of(top) > _step_of(name):
                if objstore.is_url(root):
                    objstore.write_bytes(os.path.join(root, "latest"), (name + "\n").encode())
                else:
                    _point_latest(root, name)
                    _durable(root)
                moved = True
                print(f"note: {root}/latest names {name} now (was {top}): a branch from it")
        # anything, on rank 0 alone: the other ranks wait in the broadcast below for its outcome
        except Exception as e:
            error = f"{root}/latest: could not point it at {name}, the branch's start ({e})"
    outcome = [error, moved]
    dist.broadcast_object_list(outcome, src=0)  # every rank stops alike, or none
    if outcome[0]:
        raise CheckpointError(outcome[0])
    if outcome[1]:
        _run["latest"] = name  # what a failed save's line calls latest on an unreachable store


def _branch_of(path, root):
    """This run's newest checkpoint, by name, if `path` (resumed from) is one of root's: else ''
    (a fresh start, or a warm start from another run's)."""
    path = path.rstrip("/")  # a --resume PATH may end in one
    if not path:
        return ""
    parent = os.path.dirname(path)
    root = root.rstrip("/")
    if not objstore.is_url(path):
        parent = os.path.realpath(parent)
        root = os.path.realpath(root)
    if parent != root:
        return ""
    return os.path.basename(path)


# In a run folder: entries that, where present, must be regular files (never written through a
# symlink), and the folder that must be a folder.
RUN_FILES = ("metrics.jsonl", "samples.jsonl", os.path.join("checkpoints", "latest"))


def _start(out_dir, resume):
    """Rank 0: {"candidates": the checkpoints to try, "error": a line or None, "run_id": the name
    of this run's temp dirs, and on a store "latest": what its `latest` file names}."""
    if objstore.is_url(out_dir):
        return _start_store(out_dir, resume)
    root = os.path.join(out_dir, "checkpoints")
    run_id = uuid.uuid4().hex[:8]
    try:
        _lock(out_dir)
        _name_run_in_lock(run_id)
        for rel in RUN_FILES:
            path = os.path.join(out_dir, rel)
            if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
                raise CheckpointError(f"{path}: a symlink or not a regular file; remove it")
        if os.path.lexists(root) and not stat.S_ISDIR(os.lstat(root).st_mode):
            raise CheckpointError(f"{root}: a symlink or not a folder; remove it")
        _remove_stale_temps(root)
        paths, error = _candidates(root, resume)
    except CheckpointError as e:
        return {"candidates": [], "error": str(e)}
    except OSError as e:
        return {"candidates": [], "error": f"{out_dir}: {e.strerror}: {e.filename}"}
    return {"candidates": paths, "error": error, "run_id": run_id}


def _name_run_in_lock(run_id):
    """Rank 0, holding out_dir/.lock: this run's id in it, on disk, for `_check_shared`."""
    f = _run["lock"][1]
    f.truncate(0)  # the file is opened for appending: the id is then all it holds
    f.write(run_id + "\n")
    f.flush()
    os.fsync(f.fileno())


def _check_shared(out_dir, run_id):
    """Collective: every rank must see rank 0's out_dir. On several nodes with a folder of each
    node's own (a relative or node-local --out_dir), each node's ranks would write their shards to
    their own disk: the first save fails ("written by another rank, not here") hours in, and with
    --on_save_error warn every save fails, for days. Rank 0 wrote this run's id into out_dir/.lock
    (`_name_run_in_lock`); every rank reads it back, or all stop here, before any step."""
    seen = dist.get_rank() == 0 or _sees_run(out_dir, run_id)
    # and rank 0's flock: a filesystem that keeps locks per machine (BeeGFS without global locks,
    # NFS mounted local_lock=flock) lets the rank of another machine take it
    lockable = dist.get_rank() != 0 and seen and _can_lock(out_dir)
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (seen, lockable, socket.gethostname()))  # all stop, or none
    for rank, (ok, _, host) in enumerate(views):
        if not ok:
            raise CheckpointError(
                f"{out_dir}: rank {rank} (on {host}) does not see rank 0's files there (its .lock "
                "does not name this run); every rank must write to one folder all of them see "
                "(a shared filesystem), or to an object store (s3://...)"
            )
    lockers = [(rank, host) for rank, (_, lockable, host) in enumerate(views) if lockable]
    if lockers and dist.get_rank() == 0:
        rank, host = lockers[0]
        print(
            f"warning: {out_dir}: rank {rank} (on {host}) could take the run lock rank 0 holds: "
            "this filesystem keeps locks per machine, so a second run into this --out_dir from "
            "another machine would not be refused (README, Checkpoints)",
            file=sys.stderr,
        )


# A network filesystem may show another node's write a little late: this many tries, 0.25 s apart
SHARED_TRIES = 40


def _can_lock(out_dir):
    """Whether this process can flock out_dir/.lock, which rank 0 holds (released at once)."""
    try:
        with open_regular(os.path.join(out_dir, ".lock"), "rb") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (OSError, CheckpointError):  # EWOULDBLOCK: rank 0's lock holds here too
        return False
    return True


def _sees_run(out_dir, run_id):
    """Whether out_dir/.lock, read here, names run_id."""
    for _ in range(SHARED_TRIES):
        try:
            with open_regular(os.path.join(out_dir, ".lock"), "rb") as f:
                if f.read(64).decode("utf-8", "replace").strip() == run_id:
                    return True
        except (OSError, CheckpointError):
            pass  # not there (yet), or not a regular file: not rank 0's
        time.sleep(0.25)
    return False


def _start_store(out_dir, resume):
    """_start() on a store: the lock object, unfinished saves deleted, the checkpoints to try."""
    root = os.path.join(out_dir, "checkpoints")
    run_id = uuid.uuid4().hex[:8]
    world = 1
    if dist.is_initialized():
        world = dist.get_world_size()
    if out_dir.startswith("memory://") and world > 1:
        # fsspec's memory store lives in one process: the other ranks' objects would not be there
        error = (
            f"{out_dir}: memory:// is one process's memory; {world} ranks need a store they "
            "all reach (s3://...)"
        )
        return {"candidates": [], "error": error}
    try:
        if _run.get("lock", (None,))[0] != out_dir:  # this process took it already
            objstore.take_lock(out_dir, run_id)
            _run["lock"] = (out_dir, None)
        for name in objstore.step_names(root):
            # no manifest: an unfinished save (its run is gone, or it would hold the lock)
            if "manifest.json" not in objstore.listing(os.path.join(root, name)):
                objstore.remove_prefix(os.path.join(root, name))
        paths, error = _candidates(root, resume)
        latest = _read_latest(root)
    except CheckpointError as e:
        return {"candidates": [], "error": str(e)}
    except (OSError, objstore.StoreError) as e:
        return {"candidates": [], "error": f"{out_dir}: {describe(e)}"}
    return {"candidates": paths, "error": error, "run_id": run_id, "latest": latest}


def _lock(out_dir):
    """Rank 0: hold an exclusive flock on out_dir/.lock until this process ends (the kernel drops
    it when the process dies, however it dies); CheckpointError if another run holds it."""
    path = os.path.join(out_dir, ".lock")
    if _run.get("lock", (None,))[0] == path:  # this process took it already
        return
    for _ in range(3):
        f = open_regular(path, "a")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise CheckpointError(
                f"{out_dir}: another run is using this --out_dir (it holds {path}); nothing was "
                "changed: wait for it to end, or use another --out_dir"
            )
        if _same_file(f, path):
            _run["lock"] = (path, f)
            return
        # a start that failed while holding it unlinked it (`drop_lock_file`) between our open
        # and our flock: a lock on that orphan excludes no one, so take the file now there
        f.close()
    raise CheckpointError(f"{path}: replaced while this run took it, three times; try again")


def _same_file(f, path):
    """Whether the open file f is still the file at path (not unlinked or replaced)."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(f.fileno())
    return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)


def drop_lock_file():
    """After a failed start (`common.remove_empty_folders`): the run lock's file, where this
    process holds it and it is all its folder holds, so the folder is as the run found it (or,
    made by the run, empty, for the caller to remove). A folder with anything else in it keeps
    its lock file, as after a run that ends."""
    path, f = _run.get("lock", (None, None))
    if f is None:
        return  # not held here (another rank, a store's lock)
    try:
        if os.listdir(os.path.dirname(path)) != [".lock"]:
            return  # the run wrote more
        # still held: a run that opened it before this unlink finds, once it has the lock, no
        # file at the path (`_same_file`) and takes the new one, which the next run must share
        os.unlink(path)
    except OSError:
        return  # the folder removed or unreadable under the run (the error being reported)
    f.close()
    del _run["lock"]


def _remove_stale_temps(root):
    """Rank 0, holding the lock: what killed saves left (their runs are gone, or they would hold
    the lock) is removed; a symlink itself, never its target."""
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        if name.startswith(".tmp-") or name == "latest.tmp":  # never resumed from
            _remove_entry(os.path.join(root, name))


def _candidates(root, resume):
    """Rank 0: (the checkpoints to try for --resume `resume`, in order; error or None), from the
    checkpoints folder `root`."""
    names, top = _step_dirs(root)
    if resume and resume != "latest":  # --resume PATH: that one, or a clear error
        if not names or _branch_of(resume, root):
            # (a restart of a branch from PATH, one of this folder's own, starts from PATH
            # again: an earlier attempt of the same command, killed, may have saved newer
            # checkpoints with this very --resume, and a restart before this attempt's
            # `begin_branch` could not tell them from its own)
            return [resume], None
        if _restarted() and _started_from(os.path.join(root, top or names[0]), resume):
            # torchrun restarted a run that started from another run's checkpoint: the newest
            # here are its own (their meta.json has this very --resume), newer than PATH
            print(f"restarted: resuming from {root}'s newest checkpoint, not {resume}")
            resume = "latest"
        else:
            # another run's checkpoint into a folder of checkpoints: its saves would overwrite
            # those of the same step, and --keep_last prune the others
            return [], (
                f"--resume {resume}: not one of {root}'s checkpoints, and that folder holds a "
                "run's: --resume latest continues that run; to start from PATH, use a new "
                "--out_dir"
            )
    if not resume:
        if names:  # a fresh start must not mix its metrics and saves with an earlier run's
            hint = "--resume latest continues it; or use another --out_dir"
            return [], f"{root} holds an earlier run's checkpoints: {hint}"
        return [], None
    # `latest` first, then older ones; newer ones than `latest` are an abandoned branch
    error = _unusable_latest(root, names, top)
    if error:
        return [], error
    candidates = names
    if top in names:
        candidates = [top] + [n for n in names if _step_of(n) < _step_of(top)]
    return [os.path.join(root, name) for name in candidates], None


def _unusable_latest(root, names, top):
    """Rank 0, --resume latest, when root/latest is there and names no checkpoint of root (steps
    deleted by hand, a file overwritten): a note, and the resume tries the newest by name (which
    may be an abandoned branch's, so the user should know it is not what `latest` said); or,
    with no checkpoint left at all, the error line to stop with: a fresh start would have
    dropped the run's metrics.jsonl without a word. None if `latest` is fine or not there."""
    where = os.path.join(root, "latest")
    if top in names:
        return None
    said = f"{where} names {top}, which is not there"
    if top is None:
        if objstore.is_url(root):
            there = _store_call(objstore.is_object, where)
        else:
            there = os.path.lexists(where)
        if not there:
            return None  # a run killed before its first save: a fresh start
        said = f"{where} names no checkpoint"
    if not names:
        return f"{said}, and {root} holds none: to start over, remove it or use another --out_dir"
    print(f"note: {said}; trying the newest, {names[0]}")
    return None


def _started_from(path, resume):
    """Whether the checkpoint at path was saved by a run started with `--resume resume`."""
    try:
        meta = _read_json(os.path.join(path, "meta.json"))
    except (CheckpointError, OSError, ValueError, RecursionError):
        return False
    return (
        type(meta) is dict
        and type(meta.get("args")) is dict
        and meta["args"].get("resume") == resume
    )


def _agree_restarted():
    """Collective: whether torchrun --max-restarts restarted this process group, said alike on
    every rank. Each node counts its own restarts: on several nodes, one restarted because
    another node's rank failed still says 0 (TORCHELASTIC_RESTART_COUNT), and would start fresh
    where the others resume."""
    mine = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, mine)
    return any(flags)


def _restarted():
    """Whether torchrun restarted this process group (`resolve` agreed on it)."""
    return _run.get("restarted", False)


def _choose(paths, resume):
    """Collective: (the first of paths that verifies, None), or ('', error). --resume PATH: that
    one or its problem; --resume latest: the next older one, with a warning, while one fails."""
    failed = []
    for path in paths:
        error = _verify_collective(path)
        if error is None:
            return path, None
        if isinstance(error, StoreUnreachable):  # not damage: an older one is no answer
            return (
                "",
                f"{error}; the store did not answer: nothing was loaded or changed, try again",
            )
        if resume != "latest":
            return "", error
        name = os.path.basename(path)
        if dist.get_rank() == 0:
            print(f"WARNING: skipping checkpoint {name}: {error}", flush=True)
        failed.append(f"{name}: {error}")
    if failed:  # starting over would overwrite checkpoints a user may still repair
        root = os.path.dirname(paths[0])
        return "", (
            f"--resume latest: no checkpoint in {root} verifies ({'; '.join(failed)}); nothing "
            "was loaded or changed: repair one, or start over in another --out_dir"
        )
    return "", None


def _comma_list(value):
    """A comma-separated flag as train_ppo.py writes it since the thirty-fourth session: no
    spaces around its entries. Checkpoints before kept the user's spelling ("a:f, b:g"), which a
    resume compared with the new spelling and refused whatever the command line said."""
    if not isinstance(value, str):
        return value
    return ",".join(part.strip() for part in value.split(","))


# Flags whose saved spelling has changed, and how to read a checkpoint's in today's
OLDER_SPELLINGS = {"reward_fn": _comma_list, "reward_weights": _comma_list}


# Flags a resume may change that change the arithmetic's grouping, not what it computes: the
# same batches, accumulated in other pieces (every stage's loss is a mean over the global batch);
# a note says the run goes on, but not bitwise as it would have. One rank's micro-batch had to
# match, and a run of micro-batch = batch could then never move to more ranks.
NOTED_FLAGS = ["micro_batch_size"]


def _regrouping(k, value, args):
    """What a NOTED_FLAGS value does at this world size: a --micro_batch_size above a rank's
    share of --train_batch_size is the share (`common.micro_batch`), so 32 -> 64 at a
    share of 4 regroups nothing."""
    if k == "micro_batch_size" and isinstance(args.get("train_batch_size"), int):
        return min(value, max(args["train_batch_size"] // dist.get_world_size(), 1))
    return value


def _note_regrouped(path, saved_args, args):
    """Rank 0: a note for each NOTED_FLAGS flag the resumed run changes (in effect)."""
    for k in NOTED_FLAGS:
        saved = saved_args.get(k)
        if k not in args or saved is None or saved == args[k] or dist.get_rank() != 0:
            continue
        if _regrouping(k, saved, args) != _regrouping(k, args[k], args):
            print(
                f"note: --{k} {saved!r} -> {args[k]!r} (from {path}): the same batches in other "
                "pieces; the run goes on, not bitwise as it would have",
                flush=True,
            )


def _same_stage(path, meta, stage):
    """One line if another stage script saved the checkpoint (one from before the record says
    nothing, and is taken)."""
    saved_by = meta.get("stage", stage)
    if saved_by != stage:
        raise CheckpointError(
            f"{path} was saved by {saved_by}, not {stage}: a stage resumes its own checkpoints; "
            f"to start {stage} from it, export it (python checkpoint.py export {path} OUT) and "
            "give --model OUT"
        )


def _same_data(path, meta, data, flag_value):
    """One line if the --data file's bytes are not those the checkpoint trained on (sha256; one
    from before the record says nothing, and is taken)."""
    saved = meta.get("data", data)
    if saved != data:
        raise CheckpointError(
            f"{path} trained on other contents of --data {flag_value} (sha256 {saved!s:.12}..., "
            f"now {data!s:.12}...): the saved data position indexes those rows; restore the "
            "file, or start over in a new --out_dir from its export (checkpoint.py export)"
        )


def _same_settings(path, saved_args, args, must_match, defaults):
    """The flags in `must_match` as the checkpoint's run had them (its meta.json's args), or one
    line listing each that differs; then a note for each of NOTED_FLAGS that changed. A flag
    newer than the checkpoint, which its meta.json lacks, was in effect at its default
    (`defaults`, the stage's): such a checkpoint resumes under the default (a fork's new flag
    too), and is refused under another value."""
    diff = []
    for k in must_match:
        saved = saved_args.get(k, defaults.get(k))
        if k in OLDER_SPELLINGS:
            saved = OLDER_SPELLINGS[k](saved)
        if saved != args[k]:
            diff.append(f"--{k} {saved!r} -> {args[k]!r}")
    if diff:
        raise CheckpointError(
            f"{path} was saved by a different run; differing settings: {', '.join(diff)}"
        )
    _note_regrouped(path, saved_args, args)


def _checked_reads(path, args, must_match, frozen, folders, identity, defaults):
    """`load`'s checks of the checkpoint against this run, and its reads before DCP's: (meta.json,
    the DCP reader with .metadata read, this rank's RNG state)."""
    meta = read_meta(path)  # resolve() verified the whole checkpoint already
    if identity:  # a stage's run (a bench or a test may load without)
        _same_stage(path, meta, identity["stage"])
    _same_settings(path, meta["args"], args, must_match, defaults or {})
    if identity:
        _same_data(path, meta, identity["data"], args["data"])
    for flag, sums in (frozen or {}).items():
        _same_frozen_weights(path, meta.get("frozen", {}).get(flag), sums, f"--{flag}", args)
    for flag, record in (folders or {}).items():
        _same_folder(path, meta.get("folders", {}).get(flag), record, f"--{flag}", args)
    if meta["step"] > args["max_steps"]:  # the loop would not run, and nothing be exported
        raise CheckpointError(
            f"{path} is at step {meta['step']}, past --max_steps {args['max_steps']}: nothing to "
            "train; give a --max_steps of at least that to go on"
        )
    reader = metadata_reader(os.path.join(path, "dcp"), _dcp_sizes(path))
    rank_file = f"rng-rank{dist.get_rank() % meta['world_size']}.json"
    rng = _read_json(os.path.join(path, rank_file))  # read_meta checked it
    return meta, reader, rng


def _on_every_rank(fn):
    """Collective: fn()'s result on every rank, or, where it failed on any rank, a line on every
    rank. The checks and reads before a load's collectives fail alike on every rank, but for a
    read that fails on one rank only (a store erring once, a disk's I/O error): the others waited
    in DCP's collectives until --timeout_minutes."""
    error = None
    result = None
    try:
        result = fn()
    except (CheckpointError, OSError, objstore.StoreError) as e:
        error = e
    lines = [None] * dist.get_world_size()
    line = None
    if isinstance(error, CheckpointError):
        line = str(error)  # a line of its own already
    elif error is not None:
        line = describe(error)
    dist.all_gather_object(lines, line)  # every rank stops, or none
    if error is not None and len(set(lines)) == 1:  # every rank failed alike: its own error
        raise error
    failed = [(rank, line) for rank, line in enumerate(lines) if line]
    if failed:
        raise CheckpointError(f"rank {failed[0][0]}: {failed[0][1]}")
    return result


def load(path, roles, args, must_match, frozen=None, folders=None, identity=None, defaults=None):
    """Collective: every role's model and optimizer in place, then this rank's RNG (so call it
    after anything that draws from the RNG: engines, iterators); returns meta.json.
    identity: `common.run_identity` of this run, {"stage", "data"}: the script that saved the
    checkpoint and the sha256 of its --data, which must be this run's (`_same_stage`,
    `_same_data`).
    frozen: {flag: common.weights_fingerprint} of the frozen models this run loaded from the
    folders those flags name, checked against the run's start (the same on every rank).
    folders: {flag: common.folder_identity} of every folder this run loaded a model from, checked
    the same way (config, generation config, tokenizer).
    defaults: {flag: default} of the stage's Args (`common.arg_defaults`), what a checkpoint from
    before a flag ran with."""
    checks = functools.partial(
        _checked_reads, path, args, must_match, frozen, folders, identity, defaults
    )
    meta, reader, rng = _on_every_rank(checks)
    state = _state(roles)
    dcp_load(state, os.path.join(path, "dcp"), reader=reader)
    for role, (model, optim) in roles.items():
        flags = _hyperparameters(optim)
        set_state_dict(
            model,
            optim,
            model_state_dict=state[role]["model"],
            optim_state_dict=state[role]["optim"],
        )
        # load_state_dict replaced the param groups' settings with the saved run's: this run's
        # flags (--weight_decay, ...) again; the rate is the scheduler's (restore_scheduler)
        for group, own in zip(optim.param_groups, flags):
            group.update(own)
    set_rng_state(rng)
    if dist.get_rank() >= meta["world_size"]:
        # The checkpoint has no stream for this rank (a run resumed on more ranks): rank r % old's
        # again would give two ranks the same dropout masks from here on
        seed_new_stream(meta["args"].get("seed"), dist.get_rank(), meta["step"])
    if meta["world_size"] != dist.get_world_size() and dist.get_rank() == 0:
        # exact only at the same world size
        world = dist.get_world_size()
        ranks = f"{world} ranks"
        if world == 1:
            ranks = "1 rank"
        streams = "RNG streams cannot"
        if world > meta["world_size"]:
            streams += " (a rank the checkpoint has none for starts a new one)"
        print(
            f"WARNING: resuming a {meta['world_size']}-rank checkpoint on {ranks}: weights, "
            f"optimizer and data position carry over, {streams}",
            flush=True,
        )
    return meta


def seed_new_stream(seed, rank, step):
    """Python's, NumPy's and torch's RNGs (CUDA's too) seeded from (the run's seed, this rank, the
    checkpoint's step) alone: a stream no other rank draws, and the same for the same resume."""
    digest = hashlib.sha256(f"{seed}/{rank}/{step}".encode()).digest()
    value = int.from_bytes(digest[:4], "little")  # NumPy takes seeds below 2^32
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)  # every CUDA device's too


def _same_frozen_weights(path, saved, now, flag, args):
    """Raises unless the frozen model loaded from `flag`'s folder is the one the run at `path`
    started with: the same parameters, each's sum of squares within float64 rounding (a
    different sharding sums in another order). saved None: a checkpoint from before these were
    recorded, or a run that did not load that model (a --kl_coef 0 run has no reference)."""
    if saved is None:
        return
    changed = sorted(set(saved) ^ set(now))
    for name in now:
        if name in saved and not math.isclose(saved[name], now[name], rel_tol=1e-9):
            changed.append(name)
    if changed:
        raise CheckpointError(
            f"{flag} {args[flag[2:]]}: its weights are not those the run at {path} started with "
            f"({len(changed)} tensors differ, e.g. {changed[0]}): the run would go on against "
            "another frozen model; give the folder as it was, or start a new run from it"
        )


def _same_folder(path, saved, now, flag, args):
    """Raises unless `flag`'s folder still holds the config.json, generation_config.json and
    tokenizer the run at `path` started with (`common.folder_identity`), naming what changed.
    saved None: a checkpoint from before these were recorded (2026-11-27)."""
    if saved is None:
        return
    # Read by other versions of transformers or tokenizers (an upgrade between the start and the
    # resume), the same files may give other default keys and another tokenizer serialisation:
    # then only the values of keys both readings have are compared, and the tokenizer is not.
    same = saved["versions"] == now["versions"]
    changed = _changed_settings("config.json", saved["config"], now["config"], same)
    generation = (saved["generation"], now["generation"], same)
    changed += _changed_settings("generation_config.json", *generation)
    if same and saved["tokenizer"] != now["tokenizer"]:
        changed.append("the tokenizer (vocabulary, special tokens or chat template)")
    if changed:
        shown = "; ".join(changed[:3])
        if len(changed) > 3:
            shown += f"; {len(changed) - 3} more"
        raise CheckpointError(
            f"{flag} {args[flag[2:]]}: not the folder the run at {path} started with ({shown}): "
            "the run would go on with another model; give the folder as it was, or start a new "
            "run from it"
        )


def _changed_settings(name, saved, now, every_key):
    """["<name>'s <key> <old> -> <new>", ...] between two `common.settings_json` texts (or
    "null", no such file): of every key, or (every_key False) of the keys both have. read_meta
    checked the saved one parses."""
    old = json.loads(saved)
    new = json.loads(now)
    if old == new:
        return []
    if old is None:
        return [f"{name} added"]
    if new is None:
        return [f"{name} removed"]
    keys = set(old) & set(new)
    if every_key:
        keys = set(old) | set(new)
    changed = []
    for key in sorted(keys):
        if old.get(key, "(absent)") != new.get(key, "(absent)"):
            before = repr(old.get(key, "(absent)"))[:60]
            after = repr(new.get(key, "(absent)"))[:60]
            changed.append(f"{name}'s {key} {before} -> {after}")
    return changed


def _hyperparameters(optim):
    """Each param group's settings as this run's flags made them (weight decay, betas, eps, ...),
    less the learning rate, which restore_scheduler sets from the checkpoint's schedule position."""
    skip = ("params", "lr", "initial_lr")
    return [{k: v for k, v in group.items() if k not in skip} for group in optim.param_groups]


def _dcp_sizes(path):
    """On a store: the manifest's {name in dcp/: size} (what a reader may read); None locally."""
    if not objstore.is_url(path):
        return None
    where = os.path.join(path, "manifest.json")
    manifest = _read_json(where)
    _check_manifest(manifest, where)
    files = manifest["files"].items()
    return {rel[len("dcp/") :]: want["size"] for rel, want in files if rel.startswith("dcp/")}


def restore_scheduler(sched, state, where):
    """A learning-rate scheduler's state from meta.json, checked first. `load_state_dict` copies
    whatever dict it gets into the scheduler's __dict__, so a crafted meta.json (its manifest
    rewritten to match) could set any attribute; here the state must have the scheduler's own keys
    with values of the same kinds (lists of the same length), every number finite."""
    own = sched.state_dict()
    if not isinstance(state, dict) or sorted(state) != sorted(own):
        raise CheckpointError(f"{where}: the scheduler state is not a {type(sched).__name__}'s")
    for key, value in own.items():
        if not _same_kind(state[key], value):
            raise CheckpointError(f"{where}: scheduler field {key!r} is {state[key]!r}")
    sched.load_state_dict(state)
    follow_this_runs_lr(sched, own["base_lrs"])


def follow_this_runs_lr(sched, base_lrs):
    """The schedule's position comes from the checkpoint, its peak learning rates from this run's
    flags (as its shape does: the lambdas are this run's, built from --warmup_steps, --max_steps).
    Without this a resumed --lr would be ignored: load_state_dict restores the saved run's
    base_lrs, and the optimizer's restored param groups hold the saved run's rate. The same --lr
    gives the same numbers bit for bit: the rate set here is the one the scheduler set last."""
    sched.base_lrs = list(base_lrs)
    for group, base, lr_lambda in zip(sched.optimizer.param_groups, base_lrs, sched.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * lr_lambda(sched.last_epoch)
    sched._last_lr = [group["lr"] for group in sched.optimizer.param_groups]  # get_last_lr()


def _same_kind(value, like):
    """`value` has `like`'s type, and so do its items (a list: as many; a dict: the same keys);
    numbers finite."""
    if type(value) is not type(like):
        return False
    if isinstance(value, list):
        return len(value) == len(like) and all(map(_same_kind, value, like))
    if isinstance(value, dict):  # lr_lambdas: the state of each lambda object, [{}] for functions
        return sorted(value) == sorted(like) and all(_same_kind(value[k], like[k]) for k in like)
    if isinstance(value, float):
        return math.isfinite(value)
    return True


# ---- export: a checkpoint's model as an HF folder ------------------------------------------------
def _empty_model(hf, role):
    """The `role` model built from the checkpoint's hf/config.json, its weights allocated but not
    yet loaded: the critic as a token-classification (value) model, the reward model as a
    sequence-classification model (its config carries reward_mean and reward_std), else a causal
    LM. Never runs code from the folder."""
    # Built on the meta device, then given empty CPU memory: from_config's random initialisation
    # costs ~6 s per billion parameters here, all of it overwritten by the checkpoint's load.
    # Every tensor save_pretrained writes is in the state dict DCP fills (a key missing from the
    # checkpoint is an error there); the non-persistent buffers (RoPE's inv_freq) stay garbage,
    # which nothing saves. to_empty gives each parameter its own memory, so a tied head is tied
    # again (else it would be saved as a second tensor).
    with torch.device("meta"):
        model = _model_of_role(hf, role)
    model.to_empty(device="cpu")
    model.tie_weights()
    return model


def _model_of_role(hf, role):
    """_empty_model's model, on the device in use."""
    from transformers import AutoConfig
    from transformers import AutoModelForCausalLM
    from transformers import AutoModelForSequenceClassification
    from transformers import AutoModelForTokenClassification

    import common  # the stages' classifier classes (common imports this module at its top)

    if role == "critic":  # PPO's value model
        config = AutoConfig.from_pretrained(hf, num_labels=1, trust_remote_code=False)
        cls = common.classifier_class(config, AutoModelForTokenClassification)
        return cls._from_config(config)
    if role == "reward_model":  # train_rm.py's
        config = AutoConfig.from_pretrained(hf, num_labels=1, trust_remote_code=False)
        cls = common.classifier_class(config, AutoModelForSequenceClassification)
        return cls._from_config(config)
    config = AutoConfig.from_pretrained(hf, trust_remote_code=False)
    return AutoModelForCausalLM.from_config(config, trust_remote_code=False)


def export(path, out, role=None, dtype=None):
    """A checkpoint's `role` model -> an HF folder (safetensors, config, tokenizer, generation
    config) that transformers and vLLM load: for deployment, or the next stage. One process, DCP's
    no_dist mode. The critic exports as a token-classification (value) model with one label, the
    reward model (train_rm.py) as a sequence-classification model with one label. Either side may
    be on a store. A local `out` is written whole or not at all: into a sibling folder, fsynced,
    then renamed into place (`_install`), so a kill or a full disk never leaves a half export
    where the next stage would load it. A store's is uploaded with its config.json last
    (`objstore.upload_export`): a half upload is a prefix nothing loads."""
    if dtype is not None and dtype not in EXPORT_DTYPES:  # before verify reads the whole of it
        raise CheckpointError(f"--dtype {dtype}: expected one of {', '.join(EXPORT_DTYPES)}")
    manifest = verify(path)
    role, dtype = _export_settings(path, role, dtype)
    if objstore.is_url(out):
        _check_export_prefix(out, path)
        with tempfile.TemporaryDirectory() as local:
            _export_from(path, manifest, role, os.path.join(local, "out"), local, dtype)
            # config.json last, after the earlier export's stale weights are gone: a kill leaves
            # the earlier export whole, or a prefix without config.json, which nothing loads
            upload = os.path.join(local, "out")
            _store_call(objstore.upload_export, out, upload, _is_export_name)
        return
    _check_export_folder(out, path, manifest)
    parent, name = os.path.split(os.path.abspath(out))
    _remove_dead_staging(parent, name)
    # whose it is (host, pid), for `_remove_dead_staging` after a kill
    owner = f"{socket.gethostname()}-{os.getpid()}"
    staging = os.path.join(parent, f".{name}.tmp-{owner}-{uuid.uuid4().hex[:8]}")
    try:
        with tempfile.TemporaryDirectory() as local:
            _export_from(path, manifest, role, staging, local, dtype)
        _readable_as_umask_allows(staging)
        # save_pretrained does not fsync: an export that returned is on disk (the next stage, or
        # a deployment, may start from it right after a power loss)
        _durable_tree(staging)
        _install(staging, out)
    except OSError as e:  # named by the folder asked for, not the staging one
        reason = e.strerror or str(e).splitlines()[0]
        raise OSError(f"{out}: {reason}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    try:  # an earlier export a killed one set aside, kept above while it was the only copy
        _remove_dead_staging(parent, name)
    except OSError:  # the export is in place: a leftover that stays is no failed export
        pass


# What an export writes (model.save_pretrained, tokenizer.save_pretrained; the tokenizer files of
# every kind transformers saves), the only names a folder it replaces may hold.
EXPORT_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
}


def _is_export_name(rel):
    """Whether an object under a store export's prefix is named as an export's files are (a weight
    shard of any count, EXPORT_FILES, a named chat template): an earlier export's, which a new
    upload deletes where it does not overwrite it (`objstore.upload_export`)."""
    shard = rel.startswith("model-") and rel.endswith(".safetensors") and "-of-" in rel
    template = rel.startswith("additional_chat_templates/") and rel.endswith(".jinja")
    return rel in EXPORT_FILES or shard or template


def _is_export_file(root, name, tokenizer_files):
    """Whether root/name is what an export writes: a regular file of EXPORT_FILES, a weight shard
    of any count, or a file the checkpoint's own tokenizer saved (`tokenizer_files`: a Mistral
    tokenizer's tekken.json, a Japanese one's emoji.json), or the folder of a tokenizer's named
    chat templates (Command-R's), holding templates only."""
    path = os.path.join(root, name)
    mode = os.lstat(path).st_mode
    if stat.S_ISDIR(mode) and name == "additional_chat_templates":
        return all(n.endswith(".jinja") for n in os.listdir(path))
    if not stat.S_ISREG(mode):
        return False
    return _is_export_name(name) or name in tokenizer_files


# The kinds of file a tokenizer's save_pretrained writes beside EXPORT_FILES (tekken.json,
# emoji.json, vocab files of every format, a tokenizer's named templates).
TOKENIZER_SUFFIXES = (".json", ".model", ".txt", ".tiktoken", ".jinja")


def _checkpoints_around(out):
    """The local checkpoint (a folder of manifest.json, meta.json and dcp/) that `out` is or is
    inside, or the checkpoints/ folder (its `latest` naming a step) `out` would be a step of;
    None if neither. An export there replaces what a checkpoint's manifest lists (it fails
    verification: the fallback it was is lost), or makes a step folder a save or prune deletes."""
    here = os.path.realpath(out)
    if _read_latest(os.path.dirname(here)) is not None:
        return os.path.dirname(here)
    while True:
        marks = [os.path.join(here, name) for name in ("manifest.json", "meta.json")]
        if all(os.path.isfile(mark) for mark in marks) and os.path.isdir(f"{here}/dcp"):
            return here
        up = os.path.dirname(here)
        if up == here:
            return None
        here = up


def _check_export_prefix(out, path):
    """On a store, as `_check_export_folder` locally: OUT may not be the checkpoint exported or
    inside it, nor inside another checkpoint (a prefix holding manifest.json) or a step beside
    them (its parent's `latest` names a step): the upload would add objects its manifest does not
    list, and that checkpoint fail verification. (An upload deletes only objects named as an
    export's files, `_is_export_name`; others under OUT stay, whoever wrote them.)"""
    out = out.rstrip("/")
    if out == path.rstrip("/") or out.startswith(path.rstrip("/") + "/"):
        raise CheckpointError(f"{out}: inside the checkpoint {path}; export it somewhere else")
    parent = os.path.dirname(out)
    around = None
    if _store_call(_read_latest, parent) is not None:
        around = parent
    here = out
    while around is None and "/" in here.split("://", 1)[1]:  # up to the bucket
        if _store_call(objstore.is_object, os.path.join(here, "manifest.json")):
            around = here
        here = os.path.dirname(here)
    if around:
        raise CheckpointError(f"{out}: inside {around}; export it somewhere else")


def _within(inner, outer):
    """Whether the local path `inner` is `outer` or inside it (symlinks resolved)."""
    inner = os.path.realpath(inner)
    outer = os.path.realpath(outer)
    return os.path.commonpath([inner, outer]) == outer


def _check_export_folder(out, path, manifest):
    """`out` may be new, an empty folder, or an earlier export (only files an export writes, one
    of them config.json), which the export replaces whole; anything else (a file, a symlink, a
    folder that holds anything else: a base model's README, a user's notes, a run folder) is
    refused before any work: replacing it would delete what is not ours. So is a folder inside
    the checkpoint `path`: its manifest would no longer match (verification fails, and
    `--resume latest` falls back to an older checkpoint)."""
    if not objstore.is_url(path) and _within(out, path):
        raise CheckpointError(f"{out}: inside the checkpoint {path}; export it somewhere else")
    around = _checkpoints_around(out)
    if around:
        raise CheckpointError(f"{out}: inside {around}; export it somewhere else")
    if not os.path.lexists(out):
        return
    if os.path.islink(out) or not os.path.isdir(out):
        raise CheckpointError(f"{out}: not a folder (a file or a symlink); give a new folder")
    names = sorted(os.listdir(out))
    # what the checkpoint's hf/ holds (its tokenizer's files), from its verified manifest: of
    # the kinds tokenizers save, so that a crafted manifest listing hf/README.md cannot make a
    # base model's folder (README.md, LICENSE, config.json) one to replace
    tokenizer_files = set()
    for rel in manifest["files"]:
        if rel.startswith("hf/") and rel.endswith(TOKENIZER_SUFFIXES):
            tokenizer_files.add(rel[3:])
    others = [name for name in names if not _is_export_file(out, name, tokenizer_files)]
    if others:
        raise CheckpointError(
            f"{out}: holds {others[0]!r}, which no export writes; give a new or empty folder "
            "(an earlier export there is replaced whole)"
        )
    if names and "config.json" not in names:
        raise CheckpointError(
            f"{out}: holds files but no export (no config.json); give a new or empty folder"
        )


def _remove_dead_staging(parent, name):
    """What killed exports of `name` left beside it, `.NAME.tmp-HOST-PID-ID` (a staging folder)
    and `...ID.old` (an earlier export set aside): removed once that process is gone, if it ran
    on this machine (another machine's, on a shared disk, cannot be told from a live one).
    A model's size each, which nothing else would ever delete."""
    if not os.path.isdir(parent):  # the export makes it
        return
    prefix = f".{name}.tmp-"
    for entry in os.listdir(parent):
        if not entry.startswith(prefix):
            continue
        if entry.endswith(".old") and not os.path.lexists(os.path.join(parent, name)):
            continue  # killed between _install's renames: the only copy of the earlier export
        owner = entry[len(prefix) :].removesuffix(".old").rsplit("-", 2)
        if len(owner) != 3 or owner[0] != socket.gethostname():
            continue
        if not objstore.is_pid(owner[1]) or objstore.pid_alive(int(owner[1])):
            continue
        _remove_entry(os.path.join(parent, entry))


def _install(staging, out):
    """The finished export `staging` (a sibling of `out`) renamed to `out`. An earlier export there
    is renamed aside first and removed after: a kill in between leaves no `out` (and the earlier
    export aside, as .NAME.tmp-*.old), never a mix of the two."""
    aside = None
    if os.path.lexists(out):
        aside = staging + ".old"
        os.rename(out, aside)
    os.rename(staging, out)
    _durable(os.path.dirname(os.path.abspath(out)))  # both renames on disk
    if aside:
        shutil.rmtree(aside, ignore_errors=True)


def _export_settings(path, role, dtype):
    """export()'s (role, dtype) for the checkpoint `path`: those asked for, else its first role
    and the dtype its run's --export_dtype resolved to (`common.export_dtype`; fp32 for a
    checkpoint from before it was recorded)."""
    meta = read_meta(path)
    roles = meta["roles"]
    role = role or roles[0]
    if role not in roles:
        raise CheckpointError(f"--role {role}: checkpoint has roles {roles}")
    return role, dtype or meta.get("export_dtype", "float32")


def _export_from(path, manifest, role, dest, local, dtype):
    """_export of the checkpoint `path` into the local folder `dest`; from a store, its hf/ comes
    down into the local scratch folder `local` first (no further than the manifest's sizes)."""
    hf = os.path.join(path, "hf")
    if objstore.is_url(path):
        hf_files = {k[3:]: v["size"] for k, v in manifest["files"].items() if k[:3] == "hf/"}
        hf = os.path.join(local, "hf")
        _store_call(objstore.download, os.path.join(path, "hf"), hf_files, hf)
    _export(path, hf, dest, role, dtype)


def _export(path, hf, out, role, dtype):
    """export() once the checkpoint's hf/ folder is local (`hf`), to the local folder `out`."""
    from transformers import AutoTokenizer
    from transformers import GenerationConfig

    # trust_remote_code=False: an `auto_map` in hf/ never runs a .py file of the checkpoint's, nor
    # asks whether to (it fails here instead)
    try:
        model = _empty_model(hf, role)
        tok = AutoTokenizer.from_pretrained(hf, trust_remote_code=False)
        generation_config = None
        if os.path.lexists(os.path.join(hf, "generation_config.json")):  # a reward model has none
            generation_config = GenerationConfig.from_pretrained(hf)
            problems = unsaveable_generation_config(generation_config)
            if problems:  # save_pretrained's own check, below, raises a ValueError of a page
                raise CheckpointError(f"{hf}: generation_config.json: {problems}")
    except CheckpointError:
        raise
    # anything else transformers raises on a crafted hf/ (a config field of the wrong type,
    # num_attention_heads 0, a tokenizer_config.json that is a list): the folder's, in one line
    except Exception as e:
        raise CheckpointError(f"{hf}: cannot load ({describe(e)})")
    warnings.filterwarnings("ignore", "torch.distributed is disabled")  # no_dist says so: we know
    state = {role: {"model": model.state_dict()}}
    # fills the model's tensors in place
    dcp_load(state, os.path.join(path, "dcp"), no_dist=True, sizes=_dcp_sizes(path))
    _cast_for_export(model, dtype)
    if generation_config is not None:
        model.generation_config = generation_config
    # save_pretrained only logs an error and returns when `out` is a file: raise here instead
    os.makedirs(out, exist_ok=True)
    try:
        model.save_pretrained(out)
    except SafetensorError as e:  # a full disk, seen on a GPU machine: an OSError, said in a line
        raise OSError(str(e).splitlines()[0]) from None
    tok.save_pretrained(out)


# The dtypes an export saves weights in (a stage's --export_dtype, `checkpoint.py export --dtype`)
EXPORT_DTYPES = ("float32", "bfloat16", "float16")


def _cast_for_export(model, dtype):
    """The model's floating-point weights in `dtype` (a name in EXPORT_DTYPES), which
    save_pretrained writes and records in config.json (transformers and vLLM then load the
    weights as stored). The checkpoint keeps the fp32 master weights: an export in bf16 rounds
    them, as every bf16 release is rounded. float16 holds at most 65504: a weight beyond it would
    be saved as inf, so it is refused in one line."""
    if dtype == "float16":
        limit = torch.finfo(torch.float16).max
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point() and tensor.numel() and tensor.abs().max() > limit:
                raise CheckpointError(
                    f"--dtype float16: weight {name} holds values beyond float16's range "
                    f"(+-{limit:.0f}); export as bfloat16 or float32"
                )
    model.to(getattr(torch, dtype))


def unsaveable_generation_config(generation_config):
    """Why transformers' save_pretrained would refuse a generation config that it loads (its
    strict validation: `temperature` without `do_sample`, common in model folders), in one
    line, or None."""
    try:
        generation_config.validate(strict=True)
    except ValueError as e:
        problems = [line[2:] for line in str(e).splitlines() if line.startswith("- ")]
        return "transformers would refuse to save it (" + ("; ".join(problems) or describe(e)) + ")"
    return None


USAGE = (
    "usage: python checkpoint.py verify CKPT [CKPT...] | export CKPT OUT [--role NAME] "
    "[--dtype float32|bfloat16|float16]"
)


def _verify_each(ckpts):
    """`verify A B ...`: a line for each, ok or what is wrong (a damaged old checkpoint, first in
    `step-*`'s order, hid every newer one's state), then exit status 1 if any failed."""
    failed = False
    for ckpt in ckpts:
        try:
            print(f"{ckpt}: ok, step {verify(ckpt)['step']}", flush=True)
        # each its own line, whatever failed (a store out of reach: each says so)
        except (CheckpointError, OSError) as err:
            print(one_line(f"error: {err}"), file=sys.stderr, flush=True)
            failed = True
    if failed:
        sys.exit(1)


def cli(argv):
    import transformers.utils.logging

    # a quiet console, as a stage's (`common.quiet_console`): the lines of this command only, not
    # transformers' warnings about the files or its bar while it writes the weights
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    argv = [objstore.local_path(a) for a in argv]  # file:///x is the local /x
    if "" in argv:  # an empty OUT exported the whole model, then failed to write it
        sys.exit(f"error: an empty argument; {USAGE}")
    for arg in argv:
        objstore.fs_of(arg)  # a store's client is installed, or one line says which to install
        if os.path.basename(arg) == "latest" and os.path.isfile(arg):  # "Not a directory" else
            name = _read_latest(os.path.dirname(arg))
            sys.exit(
                f"error: {arg} is the file naming a run's newest checkpoint ({name}): give that"
            )
    match argv:
        case ["verify", *ckpts] if ckpts:
            _verify_each(ckpts)
        case ["export", ckpt, out, *options]:
            export(ckpt, out, **_export_options(options))
            print(f"exported {ckpt} -> {out}")
        case _:
            sys.exit(USAGE)


def _export_options(options):
    """`export`'s --role NAME and --dtype NAME, in either order, as export()'s keywords; the
    usage line for anything else. Without --dtype: the one the run recorded (--export_dtype)."""
    names = {"--role": "role", "--dtype": "dtype"}
    keywords = {}
    pairs = list(zip(options[::2], options[1::2]))
    flags = [flag for flag, _ in pairs]
    if len(options) % 2 or set(flags) - set(names) or len(set(flags)) < len(flags):
        sys.exit(USAGE)  # an odd word, another flag, or one given twice
    for flag, value in pairs:
        keywords[names[flag]] = value
    return keywords


if __name__ == "__main__":
    try:
        cli(sys.argv[1:])
    except (CheckpointError, OSError, objstore.StoreError) as err:
        sys.exit(one_line(f"error: {err}"))
    except CheckpointException as err:  # DCP's: no Exception, and its text is a traceback
        sys.exit(one_line(f"error: {describe(err)}"))
