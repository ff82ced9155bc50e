"""Checkpoints on an object store (`--out_dir s3://bucket/run`): the pieces of checkpoint.py's
commit protocol that a store without rename or directories needs done differently (README,
"Checkpoints on an object store").

A store has no atomic rename, so a save writes straight under its final prefix `step-N/` and the
manifest is the commit: rank 0 writes `step-N/manifest.json` (every object's size and sha256) only
once every rank's objects are written, then replaces the small `latest` object (one PUT replaces an
object whole: readers see the old or the new one). A prefix without a manifest is an unfinished
save: never resumed from, deleted by the next run under the run lock. Deleting a step deletes its
manifest first, so a half-deleted step is an unfinished one, never a damaged committed one.

Every path here is a URL; fsspec picks the client (s3:// -> s3fs, an optional dependency).
A checkpoint's objects are read no further than a size known in advance (the manifest's, or a
small cap); the run's own logs (`get_file`: metrics.jsonl on a resume) are read whole."""

import atexit
import functools
import hashlib
import json
import math
import os
import socket
import threading
import time

# A JSON object read before its size is known (manifest.json, the lock): at most this (`latest`,
# a step name, is read no further than 64 bytes).
SMALL_CAP = 16 << 20
# The run lock's lease: a live run rewrites its lock every LEASE_S / 4; another run takes over a
# lock older than LEASE_S (a run killed on another machine), or one whose process is gone on
# this machine.
LEASE_S = 600
# The largest pid Linux gives (/proc/sys/kernel/pid_max at most 2**22): a lock naming a pid
# beyond it was not written by a process here (os.kill would raise OverflowError on some).
PID_MAX = 1 << 22


class StoreError(RuntimeError):
    """The store refused, or could not be reached; checkpoint.py turns it into a CheckpointError."""


class TooLarge(StoreError):
    """An object larger than it may be: the store answered, and what it holds is wrong."""


def _translated(fn):
    """The store's client raises its own exceptions (botocore's EndpointConnectionError is no
    OSError): all but a missing or taken name become one StoreError naming the URL."""

    @functools.wraps(fn)
    def wrapper(url, *args, **kwargs):
        try:
            return fn(url, *args, **kwargs)
        except (FileNotFoundError, FileExistsError, StoreError):
            raise
        except Exception as e:  # noqa: BLE001 - whatever the client raises, one line
            first_line = (str(e).splitlines() or [""])[0]
            raise StoreError(f"{url}: {type(e).__name__}: {first_line}") from None

    return wrapper


def is_url(path):
    """An object-store URL (s3://...), as opposed to a local path; file:// counts as local."""
    return "://" in str(path) and not str(path).startswith("file://")


def local_path(path):
    """file:///x -> /x; anything else unchanged."""
    if str(path).startswith("file://"):
        return str(path)[len("file://") :]
    return path


def fs_of(url):
    """(fsspec filesystem, its path for url); one clear line when the client is missing."""
    import fsspec

    if not is_url(url):
        return fsspec.filesystem("file"), local_path(url)

    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:  # fsspec: "Install s3fs to access S3"
        scheme = url.split("://")[0]
        raise StoreError(
            f"{url}: no client for {scheme}:// ({e}); for s3:// run `pip install s3fs`"
        ) from None


@_translated
def listing(url):
    """{path relative to url: size} of every object under the prefix url/ (fresh, not cached),
    less folder markers: the empty objects named `folder/` that S3 consoles ("Create folder") and
    some sync tools make, which hold nothing (a checkpoint with one verified as damaged)."""
    objects = _objects(url)
    return {rel: size for rel, size in objects.items() if not _is_folder_marker(rel, size)}


def _objects(url):
    """listing() with the folder markers: what deleting the prefix must delete."""
    fs, path = fs_of(url)
    fs.invalidate_cache()  # s3fs caches listings; other ranks and runs write here
    found = fs.find(path.rstrip("/") + "/", detail=True)
    start = len(path.rstrip("/")) + 1
    return {name[start:]: info["size"] for name, info in found.items() if info["type"] == "file"}


def _is_folder_marker(rel, size):
    """An empty object whose name ends in /: a folder as S3 consoles make one (s3fs lists it as a
    file named `folder/`; the prefix's own marker, `step-N/`, as the empty name)."""
    return _folder_named(rel) and size == 0


def _folder_named(rel):
    """A name only a folder marker has: empty (the prefix's own) or ending in /."""
    return rel == "" or rel.endswith("/")


@_translated
def is_object(url):
    """Whether an object named url is there (fresh, not cached)."""
    fs, path = fs_of(url)
    fs.invalidate_cache()
    return fs.isfile(path)


@_translated
def read_bytes(url, limit):
    """The object's bytes, refused if it holds more than `limit` (a size known in advance)."""
    fs, path = fs_of(url)
    with fs.open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise TooLarge(f"{url}: larger than the {limit} bytes expected")
    return data


@_translated
def write_bytes(url, data, create=False):
    """One PUT: the object whole, or (the server failing) not at all. create: only if the name is
    free (If-None-Match: *), FileExistsError otherwise."""
    fs, path = fs_of(url)
    mode = "overwrite"
    if create:
        mode = "create"
    fs.pipe_file(path, data, mode=mode)


@_translated
def sha256(url, size):
    """(size read, sha256) of the object, reading no more than size + 1 bytes."""
    fs, path = fs_of(url)
    digest = hashlib.sha256()
    seen = 0
    with fs.open(path, "rb", block_size=8 << 20) as f:
        while seen <= size:
            chunk = f.read(min(8 << 20, size + 1 - seen))
            if not chunk:
                break
            digest.update(chunk)
            seen += len(chunk)
    return seen, digest.hexdigest()


@_translated
def remove_prefix(url):
    """Delete every object under url/: its manifest first (then the step is uncommitted, not
    damaged, whatever a kill leaves), then the rest."""
    fs, path = fs_of(url)
    names = _objects(url)  # folder markers too: else the emptied prefix would stay listed
    if "manifest.json" in names:
        fs.rm_file(os.path.join(path, "manifest.json"))
    rest = [n for n in names if n != "manifest.json" and not _folder_named(n)]
    if rest:
        fs.rm([os.path.join(path, n) for n in rest])
    for name in names:
        if _folder_named(name):
            # one by one: s3fs's rm of a list drops the trailing / and misses such a name
            fs.rm_file(os.path.join(path, name))


@_translated
def put_file(url, local):
    """The local file as the object url (one PUT for a small file)."""
    fs, path = fs_of(url)
    fs.put_file(local, path)


@_translated
def get_file(url, local):
    """The object as the local file, if it exists; False if it does not."""
    fs, path = fs_of(url)
    if not fs.exists(path):
        return False
    fs.get_file(path, local)
    return True


@_translated
def step_names(root):
    """The names of the step-N prefixes right under root (committed or not)."""
    fs, path = fs_of(root)
    fs.invalidate_cache()
    try:
        entries = fs.ls(path.rstrip("/") + "/", detail=False)
    except FileNotFoundError:
        return []
    names = [os.path.basename(e.rstrip("/")) for e in entries]
    return [n for n in names if is_step_name(n)]


def is_step_name(name):
    """step-N, N in ASCII digits: str.isdigit() takes '²' or '①' too, which int() refuses."""
    digits = name[len("step-") :]
    return name.startswith("step-") and digits.isascii() and digits.isdigit()


def download(url, files, local):
    """The listed objects {relative path: size} under url/ into the local folder, each read no
    further than its size. The store's errors are StoreErrors (`read_bytes`); the local folder's
    (a full disk) stay OSErrors naming the file: they said the store did not answer."""
    for rel, size in files.items():
        data = read_bytes(os.path.join(url, rel), size)
        target = os.path.join(local, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "xb") as f:
            f.write(data)


@_translated
def upload_folder(url, local):
    """Every file below the local folder to url/ (a save's hf/, tensorboard/; the final export
    goes up through `upload_export`)."""
    fs, path = fs_of(url)
    for folder, _, names in os.walk(local):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), local)
            fs.put_file(os.path.join(folder, name), os.path.join(path, rel))


@_translated
def upload_export(url, local, is_exports):
    """An HF folder (an export) to url/, config.json last. transformers and vLLM load no folder
    without one, so a failure or a kill mid-way leaves a prefix that loads nothing, never a mix of
    two exports that loads: an earlier export's config.json is deleted first, and, before the new
    one is written, its objects the new export does not write and `is_exports(name)` calls an
    export's (weights in another layout: a stale model.safetensors would be loaded in place of
    new shards). Objects not named as an export's stay, whoever wrote them."""
    fs, path = fs_of(url)
    config = os.path.join(path, "config.json")
    fs.invalidate_cache()
    if fs.isfile(config):
        fs.rm_file(config)
    written = set()
    for folder, _, names in os.walk(local):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), local)
            written.add(rel)
            if rel != "config.json":
                fs.put_file(os.path.join(folder, name), os.path.join(path, rel))
    for rel in _objects(url):
        if rel not in written and is_exports(rel):
            fs.rm_file(os.path.join(path, rel))
    fs.put_file(os.path.join(local, "config.json"), config)


# ---- the run lock: a conditional create, a lease, a heartbeat ------------------------------------
def take_lock(out_dir, run_id):
    """Create out_dir/.lock only if absent (If-None-Match: *); take over a stale one (its lease run
    out, or its process gone on this machine). StoreError naming the holder otherwise. A thread
    renews the lease until this process ends."""
    url = os.path.join(out_dir, ".lock")
    body = {"run": run_id, **pid_space(), "pid": os.getpid()}
    for _ in range(2):  # a stale lock is removed once, then created anew
        try:
            write_bytes(url, json.dumps({**body, "time": time.time()}).encode(), create=True)
        except FileExistsError:
            holder = _lock_holder(url)
            if holder is not None and not _stale(holder):
                raise StoreError(
                    f"{out_dir}: another run is using this --out_dir (it holds {url}: "
                    f"{repr(holder)[:200]}); "
                    "nothing was changed: wait for it to end, or use another --out_dir"
                ) from None
            if holder is not None:
                remove_object(url)
            continue
        thread = threading.Thread(target=_renew, args=(url, body), daemon=True)
        thread.start()
        atexit.register(_release, url, run_id)  # a clean exit frees it now, not at lease expiry
        return
    raise StoreError(f"{url}: another run took the lock just now; use another --out_dir")


def _lock_holder(url):
    """The lock's holder as a dict; {} for a lock that is no JSON object (a crafted one: nobody
    holds it); None if it is gone. A lock that cannot be read (the store erring) is one
    StoreError: taken for stale, it would let two runs share the --out_dir."""
    try:
        holder = json.loads(read_bytes(url, SMALL_CAP))
    except FileNotFoundError:
        return None
    except TooLarge:  # no lock a run writes: nobody holds it
        return {}
    except (OSError, StoreError) as e:
        raise StoreError(f"{url}: the run lock cannot be read ({e}); try again") from None
    except (ValueError, RecursionError):  # not JSON (UnicodeDecodeError is a ValueError)
        return {}
    if type(holder) is not dict:
        return {}
    return holder


def _stale(holder):
    """A lock nobody holds: its lease ran out, or its process in this pid space is gone. A time that
    is no finite number, or further ahead than a lease (crafted, or a clock far off), holds no
    lease; a pid that no process can have is not checked (its lease decides)."""
    when = holder.get("time")
    if type(when) not in (int, float):
        return True
    try:
        age = time.time() - float(when)
    except OverflowError:  # an integer of 400 digits
        return True
    if not math.isfinite(age) or abs(age) > LEASE_S:
        return True
    pid = holder.get("pid")
    here = pid_space()
    if any(holder.get(key) != value for key, value in here.items()) or type(pid) is not int:
        return False  # another machine's (or container's) live lease: only its expiry frees it
    if not is_pid(str(pid)):
        return False
    # our own pid: not a live holder (this process takes the lock once), but a dead run's whose
    # pid this restarted process was given again
    return pid == os.getpid() or not pid_alive(pid)


def pid_space():
    """What a pid in a lock is a pid of: the host, its boot (pids start again after a reboot) and
    the pid namespace (containers on one host, `--network host` ones even under its name, each
    count pids of their own). A process's pid is checked only where all three are ours; None
    where /proc does not say (then the host decides, as before)."""
    return {
        "host": socket.gethostname(),
        "boot": _proc_text("/proc/sys/kernel/random/boot_id"),
        "pidns": _proc_link("/proc/self/ns/pid"),
    }


def _proc_text(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _proc_link(path):
    try:
        return os.readlink(path)  # "pid:[4026531836]"
    except OSError:
        return None


def is_pid(text):
    """Whether `text` (ASCII digits) names a pid a process here can have: 1 to PID_MAX."""
    if not (text.isascii() and text.isdigit()):
        return False
    return 0 < int(text) <= PID_MAX


def pid_alive(pid):
    """Whether a process `pid` exists on this machine (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # a live process of another user
    return True


@_translated
def remove_object(url):
    """Delete one object; one already gone is fine (another run removed the stale lock first)."""
    fs, path = fs_of(url)
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass


def _release(url, run_id):
    """Delete the lock if it is still this run's (a killed process never gets here: its lock is
    taken over as stale). Under _heartbeat_mutex, and marked released first: a heartbeat that
    ran just after the deletion wrote the lock anew (a lock it found gone), and another run
    waited out a whole lease for a run that had ended."""
    with _heartbeat_mutex:
        _released.add(url)
        try:
            holder = _lock_holder(url)
            if holder is not None and holder.get("run") == run_id:
                remove_object(url)
        except Exception:  # noqa: BLE001 - exiting anyway; the lease frees it later
            pass


# lock URL -> the holder found in this run's place: another run took the lock over, this one
# having gone LEASE_S without a renewal (a stalled or suspended process); `lock_lost` reads it
_lost = {}
# the lock URLs this process has let go of (`_release`), and the mutex that keeps a heartbeat
# and the release from interleaving
_released = set()
_heartbeat_mutex = threading.Lock()


def _renew(url, body):
    """The heartbeat: rewrite the lock with a fresh time every LEASE_S / 4 (errors: next time),
    until another run is found holding it."""
    while True:
        time.sleep(LEASE_S / 4)
        if not renew_once(url, body):
            return


def renew_once(url, body):
    """One heartbeat; False once the lock is another run's. Rewriting it then (as it once did)
    would take it back from a run that took it over as stale, and both would write the folder.
    False too once this process has released it (`_release`)."""
    with _heartbeat_mutex:
        if url in _released:
            return False
        return _renew_held(url, body)


def _renew_held(url, body):
    """renew_once's work, under the mutex."""
    try:
        holder = _lock_holder(url)
        # None: gone (written anew below); {}: no run's (crafted, garbled): taken back as well
        if holder and holder.get("run", body["run"]) != body["run"]:
            _lost[url] = holder
            return False
        write_bytes(url, json.dumps({**body, "time": time.time()}).encode())
    except Exception:  # noqa: BLE001 - the store down for a while: the lease allows for it
        pass
    return True


def lock_lost(out_dir):
    """The run that took this process's lock of out_dir over (its lock as a dict), or None."""
    return _lost.get(os.path.join(out_dir, ".lock"))
