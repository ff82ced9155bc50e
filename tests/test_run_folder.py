"""Crafted checkpoints and tampered run folders, with the real scripts (2 ranks under torchrun where
a run is needed; issue 12): no code from a checkpoint runs, nothing outside it is read, two runs
never share an --out_dir, nothing is written through a symlink, a damaged folder never hangs nor
starts over."""

import importlib.metadata
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess

import pytest
import safetensors.torch
import torch
from test_bad_input import assert_one_line_error
from test_sft_resume import Payload

import task
from conftest import CPU_ONLY
from conftest import PY
from conftest import REPO
from conftest import TORCHRUN
from conftest import latest
from conftest import logged_steps
from conftest import metrics
from conftest import rewrite_manifest
from conftest import run
from conftest import run_py
from conftest import wait_for
from conftest import workers
from conftest import write_dead_rows

pytestmark = pytest.mark.slow


def sft(out, data, *extra):
    args = ("--data", data, "--eval_data", data, "--eval_samples", 16, "--train_batch_size", 16)
    args += ("--micro_batch_size", 4, "--max_steps", 4, "--eval_every", 0, "--save_every", 2)
    args += ("--keep_last", 0, "--warmup_steps", 2, "--out_dir", out, *extra)
    return args


@pytest.fixture(scope="module")
def done(tmp_path_factory, addition_jsonl):
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    out = str(tmp_path_factory.mktemp("done") / "run")
    run("train_sft.py", *sft(out, addition_jsonl))
    return out


@pytest.fixture
def copy(done, tmp_path):
    out = str(tmp_path / "run")
    shutil.copytree(done, out, symlinks=True)
    return out


# torchrun's own report of a failed rank: its log lines (glog's "E1127 10:32:28.839000 1772
# torch/distributed/..." form), then a traceback from its own frame, or from tests/zygote.py's
# where conftest.run forked it (tests/forked_torchrun.py)
LAUNCHER_LOG = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ torch/(distributed|multiprocessing)/")
LAUNCHER_FRAME = re.compile(r'(/torchrun|tests/zygote\.py)", line')


def assert_ranks_error(p, *needles):
    """Under torchrun: the ranks end in an `error:` line naming the problem, with no traceback of
    theirs (torchrun then reports the failed exit with a traceback of its own: not counted)."""
    assert p.returncode != 0
    lines = p.stderr.splitlines()
    launcher = [i for i, line in enumerate(lines) if LAUNCHER_FRAME.search(line)]
    if launcher:
        lines = lines[: launcher[0] - 1]
    lines = [line for line in lines if not LAUNCHER_LOG.match(line)]
    assert not [line for line in lines if "Traceback" in line], p.stderr[-3000:]
    errors = [line for line in lines if line.startswith("error:")]
    assert errors and all(n in errors[0] for n in needles), p.stderr[-3000:]


def snapshot(root):
    """{relative path: bytes} of every file below root (to show nothing was changed), but the run
    lock: every run that takes it writes its id there (`checkpoint._name_run_in_lock`)."""
    found = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            found[os.path.relpath(path, root)] = open(path, "rb").read()
    found.pop(".lock", None)
    return found


EVIL = """
import pathlib
pathlib.Path({marker!r}).write_text("code from the checkpoint ran")
from transformers import LlamaConfig
class EvilConfig(LlamaConfig):
    model_type = "evil-llama"
"""


def plant_auto_map(folder, marker):
    """evil.py beside config.json, which names a model type transformers does not know and an
    auto_map to it: transformers would ask "run the custom code? [y/N]", and a 'y' runs it."""
    open(os.path.join(folder, "evil.py"), "w").write(EVIL.format(marker=str(marker)))
    config = json.load(open(os.path.join(folder, "config.json")))
    config["model_type"] = "evil-llama"
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.Evil"}
    json.dump(config, open(os.path.join(folder, "config.json"), "w"))


def test_a_model_folder_runs_no_code_either(tmp_path):
    """--model: the same auto_map in a model folder; stdin answers y to any prompt."""
    task.ensure_tiny_model()
    model = tmp_path / "model"
    shutil.copytree(task.TINY_MODEL, model)
    marker = tmp_path / "pwned"
    plant_auto_map(model, marker)
    cmd = [PY, "train_sft.py", "--model", str(model), "--out_dir", str(tmp_path / "out")]
    p = subprocess.run(cmd, input="y\n" * 5, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert not marker.exists(), "the model folder's code ran"
    assert_one_line_error(p, f"--model {model}: cannot load")


def test_export_runs_no_code_from_the_checkpoint(copy, tmp_path):
    """The checkpoint's hf/ with a planted auto_map: export must neither ask (stdin answers y) nor
    run it: one line, and no marker file."""
    ckpt = latest(copy)
    marker = tmp_path / "pwned"
    plant_auto_map(os.path.join(ckpt, "hf"), marker)
    rewrite_manifest(ckpt)
    cmd = [PY, "checkpoint.py", "export", ckpt, str(tmp_path / "export")]
    p = subprocess.run(cmd, input="y\n" * 5, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert not marker.exists(), "the checkpoint's code ran"
    assert_one_line_error(p, "hf: cannot load")


def test_an_export_that_cannot_be_written_is_one_line(done, tmp_path):
    """A write that fails inside safetensors (here the file-size limit, `ulimit -f`, below the
    model's 3.6 MB; a full disk alike, seen on a GPU machine) raised its own SafetensorError, a
    traceback wall: now one line naming the export folder and the reason."""
    import resource

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))  # 1 MiB per file

    out = tmp_path / "export"
    cmd = [PY, "checkpoint.py", "export", latest(done), str(out)]
    p = subprocess.run(
        cmd, capture_output=True, text=True, cwd=REPO, timeout=120, preexec_fn=limit_file_size
    )
    assert_one_line_error(p, f"error: {out}: Error while serializing", "File too large")


def test_an_export_is_fsynced(done, tmp_path, fsynced):
    """save_pretrained does not fsync: `checkpoint.export` fsyncs every file it wrote in its
    staging folder, then the parent after the rename into place, so that an export that returned
    (the next stage may start from it) survives a power loss."""
    import checkpoint

    out = tmp_path / "export"
    checkpoint.export(latest(done), str(out))
    written = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in written and len(written) > 3, written
    staged = [p for p in fsynced if os.path.basename(os.path.dirname(p)).startswith(".export.tmp-")]
    assert sorted(os.path.basename(p) for p in staged) == written
    assert fsynced[-1] == str(tmp_path)  # the rename into place, after every file
    assert sorted(os.listdir(tmp_path)) == ["export"]  # no staging folder left


def test_an_export_is_written_whole_or_not_at_all(done, tmp_path, monkeypatch):
    """An export replaces an earlier one whole (a file the new one does not write goes too); one
    that fails (here at its fsync; a kill or a full disk alike) leaves the earlier export as it
    was, never a mix; a folder of other files, or an export with anything beside it, is refused,
    not replaced, and so is a folder inside the checkpoint (its manifest would no longer match)."""
    import checkpoint

    out = tmp_path / "export"
    checkpoint.export(latest(done), str(out))
    stale = "model-00002-of-00002.safetensors"  # an earlier export, sharded
    (out / stale).write_bytes(b"from an earlier export")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    checkpoint.export(latest(done), str(out))
    assert stale not in os.listdir(out) and sorted(os.listdir(tmp_path)) == ["export"]
    (out / stale).write_bytes(b"from an earlier export")

    def full_disk(root):
        raise OSError(28, "No space left on device", root)

    monkeypatch.setattr(checkpoint, "_durable_tree", full_disk)
    with pytest.raises(OSError, match=f"{out}: No space left on device"):
        checkpoint.export(latest(done), str(out))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["export"]
    other = tmp_path / "notes"
    other.mkdir()
    (other / "mine.txt").write_text("not an export")
    with pytest.raises(checkpoint.CheckpointError, match="holds 'mine.txt', which no export"):
        checkpoint.export(latest(done), str(other))
    (other / "config.json").write_text("{}")  # a base model's folder, a project's: not ours
    with pytest.raises(checkpoint.CheckpointError, match="holds 'mine.txt', which no export"):
        checkpoint.export(latest(done), str(other))
    assert sorted(os.listdir(other)) == ["config.json", "mine.txt"]
    (out / "data").mkdir()
    with pytest.raises(checkpoint.CheckpointError, match="holds 'data', which no export"):
        checkpoint.export(latest(done), str(out))
    own = os.path.join(latest(done), "hf")
    files = sorted(os.listdir(own))
    with pytest.raises(checkpoint.CheckpointError, match="inside the checkpoint"):
        checkpoint.export(latest(done), own)
    assert sorted(os.listdir(own)) == files
    checkpoint.verify(latest(done))


def failing_export(path, manifest, role, dest, local, dtype):
    raise OSError(28, "No space left on device")


def test_what_a_killed_export_left_is_removed_by_the_next(done, tmp_path):
    """A kill during an export leaves its staging folder (or the earlier export set aside) beside
    the export, a model's size each. The next export of that folder removes those whose process
    is gone on this machine; a live one's, and another machine's, stay."""
    import socket
    import subprocess

    import checkpoint

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process has now
    host = socket.gethostname()
    left = [f".export.tmp-{host}-{gone.pid}-0a1b2c3d", f".export.tmp-{host}-{gone.pid}-9f8e.old"]
    kept = [f".export.tmp-{host}-{os.getpid()}-5e6f7a8b", ".export.tmp-elsewhere-1-1c2d3e4f"]
    for name in left + kept:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"half")
    # No export there yet: as after a kill between _install's renames, an earlier export set
    # aside may be the only copy: kept until an export is in place again, then removed (it
    # stayed until the export after that)
    with pytest.MonkeyPatch.context() as patch:  # an export that fails before it is in place
        patch.setattr(checkpoint, "_export_from", failing_export)
        with pytest.raises(OSError, match="export: No space left on device"):
            checkpoint.export(latest(done), str(tmp_path / "export"))
    assert sorted(os.listdir(tmp_path)) == sorted([left[1], *kept])
    checkpoint.export(latest(done), str(tmp_path / "export"))
    assert sorted(os.listdir(tmp_path)) == sorted(["export", *kept])
    # into a folder that does not exist yet, parents and all
    checkpoint.export(latest(done), str(tmp_path / "new" / "deeper" / "export"))
    assert os.path.isfile(tmp_path / "new" / "deeper" / "export" / "config.json")


def test_a_refused_pickle_is_one_line(copy, tmp_path, addition_jsonl):
    """DCP wraps the refusal in its CheckpointException (no Exception subclass): still one line."""
    ckpt = latest(copy)
    marker = tmp_path / "pwned"
    open(os.path.join(ckpt, "dcp", ".metadata"), "wb").write(pickle.dumps(Payload(marker)))
    rewrite_manifest(ckpt)
    p = run_py("checkpoint.py", "export", ckpt, tmp_path / "export")
    assert_one_line_error(p, "refusing to unpickle posix.system")
    p = run("train_sft.py", *sft(copy, addition_jsonl, "--resume", ckpt), check=False)
    assert_ranks_error(p, "refusing to unpickle posix.system")
    # verification reads .metadata too: --resume latest passes over it, from step 2 on
    p = run("train_sft.py", *sft(copy, addition_jsonl, "--resume", "latest"))
    assert "WARNING: skipping checkpoint step-00000004" in p.stdout + p.stderr
    assert "refusing to unpickle posix.system" in p.stdout + p.stderr
    assert "resumed from" in p.stdout + p.stderr and "at step 2" in p.stdout + p.stderr
    assert not marker.exists()


def test_resume_reads_nothing_outside_the_checkpoint(copy, tmp_path, addition_jsonl):
    """.metadata names a storage file outside the checkpoint: a copy of the real shard (the
    marker), so that loading it would succeed. The resume must refuse before reading."""
    ckpt = latest(copy)
    meta_path = os.path.join(ckpt, "dcp", ".metadata")
    md = pickle.loads(open(meta_path, "rb").read())  # our own file
    for index, info in md.storage_data.items():
        shutil.copy(os.path.join(ckpt, "dcp", info.relative_path), tmp_path / info.relative_path)
        outside = os.path.join("..", "..", "..", "..", info.relative_path)
        md.storage_data[index] = type(info)(outside, info.offset, info.length)
    open(meta_path, "wb").write(pickle.dumps(md))
    rewrite_manifest(ckpt)
    p = run("train_sft.py", *sft(copy, addition_jsonl, "--resume", ckpt), check=False)
    assert_ranks_error(p, "not a regular file in")


def test_a_second_run_into_the_same_out_dir_is_refused(tmp_path, addition_jsonl):
    """While a run trains (saving every step), a second one into its --out_dir exits with one line
    and touches nothing; the first then stops (SIGUSR1: checkpoint and exit 0), every checkpoint
    verifies, each step is logged once."""
    out = str(tmp_path / "run")
    args = sft(out, addition_jsonl, "--max_steps", 1000, "--save_every", 1, "--resume", "latest")
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", os.path.join(REPO, "train_sft.py")]
    first = subprocess.Popen(
        [*cmd, *map(str, args)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wait_for(lambda: logged_steps(out) >= 1 and len(workers(first.pid)) == 2, first)
    second = run("train_sft.py", *args, check=False)
    assert first.poll() is None, "the first run ended before the second was refused"
    assert_ranks_error(second, f"{out}: another run is using this --out_dir")
    workers(first.pid)[1].send_signal(signal.SIGUSR1)
    assert first.wait(timeout=600) == 0
    k = logged_steps(out)
    root = os.path.join(out, "checkpoints")
    steps = sorted(n for n in os.listdir(root) if n.startswith("step-"))
    assert steps == [f"step-{s:08d}" for s in range(1, k + 1)], os.listdir(root)
    p = run_py("checkpoint.py", "verify", *[os.path.join(root, s) for s in steps])
    assert p.returncode == 0, p.stderr
    assert [r["step"] for r in metrics(out)] == list(range(1, k + 1))


def test_a_start_refused_after_taking_the_lock_leaves_the_folder_as_it_was(
    tmp_path, addition_jsonl
):
    """A --resume PATH that is no checkpoint is refused after rank 0 has taken the run lock: a
    new --out_dir goes again, its .lock with it (`checkpoint.drop_lock_file`, then
    `common.remove_empty_folders`); an empty folder that was there stays, empty."""
    nothing = tmp_path / "nothing"
    new = tmp_path / "new" / "run"
    p = run("train_sft.py", *sft(str(new), addition_jsonl, "--resume", nothing), check=False)
    assert_ranks_error(p, str(nothing))
    assert os.listdir(tmp_path) == []
    there = tmp_path / "there"
    there.mkdir()
    p = run("train_sft.py", *sft(str(there), addition_jsonl, "--resume", nothing), check=False)
    assert_ranks_error(p, str(nothing))
    assert os.listdir(there) == []


# Two "nodes" on one machine: each rank starts in a folder of its own, picked by its RANK; with
# PLAINRLHF_TEST_NODE_NAMES, each also calls its host by its own name and imports from its folder
NODE_LOCAL_SITE = """
import os
import socket
import sys
if "RANK" in os.environ and "PLAINRLHF_TEST_NODE_DIRS" in os.environ:
    rank = int(os.environ["RANK"])
    os.chdir(os.environ["PLAINRLHF_TEST_NODE_DIRS"].split(",")[rank])
    if "PLAINRLHF_TEST_NODE_NAMES" in os.environ:
        name = os.environ["PLAINRLHF_TEST_NODE_NAMES"].split(",")[rank]
        socket.gethostname = lambda: name
        sys.path.append(os.getcwd())  # the node's own modules, as on a PYTHONPATH of each node
"""


def two_nodes(tmp_path, names=False):
    """([node0, node1], env): two folders, and the environment in which rank r of a run starts
    in node<r> (and, with names, calls its host node<r>)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NODE_LOCAL_SITE)
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    env = {"PYTHONPATH": str(site), "PLAINRLHF_TEST_NODE_DIRS": ",".join(map(str, nodes))}
    if names:
        env["PLAINRLHF_TEST_NODE_NAMES"] = "node0,node1"
    return nodes, env


def test_an_out_dir_a_rank_does_not_see_is_refused_before_any_step(tmp_path, addition_jsonl):
    """A relative --out_dir on two nodes names a folder on each node's own disk. Each rank wrote
    its shards there, and the first save failed on rank 0 ("written by another rank, not here")
    after its steps; with --on_save_error warn every save did, while the run trained on. Now the
    ranks read back the id rank 0 wrote into out_dir/.lock (`checkpoint._check_shared`): one line,
    before any step. Here each rank's working directory stands for its node."""
    nodes, env = two_nodes(tmp_path)
    args = sft("run", addition_jsonl, "--on_save_error", "warn")
    p = run("train_sft.py", *args, check=False, env=env)
    host = socket.gethostname()
    assert_ranks_error(p, f"run: rank 1 (on {host}) does not see rank 0's files there")
    assert not os.path.exists(nodes[0] / "run" / "metrics.jsonl")  # no step was taken
    assert not os.path.exists(nodes[1] / "run" / "checkpoints")


def test_a_data_file_whose_copies_differ_between_nodes_is_refused(tmp_path, addition_jsonl):
    """A relative --data on two nodes names a copy on each node's disk. Copies that differ (here
    node1's lacks the last row) trained each rank on its share of other rows, unannounced; now
    the ranks compare what they read (`common.read_on_every_rank`): one line, before any step."""
    nodes, env = two_nodes(tmp_path, names=True)
    rows = open(addition_jsonl).read().splitlines(keepends=True)
    (nodes[0] / "data.jsonl").write_text("".join(rows))
    (nodes[1] / "data.jsonl").write_text("".join(rows[:-1]))
    out = tmp_path / "run"
    p = run("train_sft.py", *sft(str(out), "data.jsonl"), check=False, env=env)
    assert_ranks_error(
        p,
        "error: data.jsonl: rank 1 (on node1) read other contents than rank 0 (on node0): each "
        "node reads its own copy of this path, and the copies differ",
    )
    assert not os.path.exists(out / "metrics.jsonl")


def test_a_reward_rule_whose_copies_differ_between_nodes_is_refused(tmp_path):
    """--reward_fn from a module on each node's own path, node1's copy another rule: one line
    naming the flag and the rule, before any model loads."""
    nodes, env = two_nodes(tmp_path, names=True)
    (nodes[0] / "node_rule.py").write_text("def score(prompt, response):\n    return 1.0\n")
    (nodes[1] / "node_rule.py").write_text("def score(prompt, response):\n    return 0.0\n")
    out = tmp_path / "run"
    args = ("--reward_fn", "node_rule:score", "--out_dir", out, "--max_steps", 1)
    p = run("train_ppo.py", *args, check=False, env=env)
    assert_ranks_error(
        p, "error: --reward_fn node_rule:score: rank 1 (on node1) read other contents than rank 0"
    )
    assert not os.path.exists(out / "metrics.jsonl")


# Rank 1 on a node with another transformers
OTHER_TRANSFORMERS_SITE = """
import importlib.metadata
import os
if os.environ.get("RANK") == "1":
    version = importlib.metadata.version
    importlib.metadata.version = lambda name: "4.0.0" if name == "transformers" else version(name)
"""


def test_nodes_with_other_packages_are_refused(tmp_path, addition_jsonl):
    """A node whose environment has another transformers (or torch, tokenizers, vLLM): one line
    naming both, before anything loads (`common.check_same_code`)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(OTHER_TRANSFORMERS_SITE)
    out = tmp_path / "run"
    p = run(
        "train_sft.py", *sft(str(out), addition_jsonl), check=False, env={"PYTHONPATH": str(site)}
    )
    host = socket.gethostname()
    ours = importlib.metadata.version("transformers")
    assert_ranks_error(
        p,
        f"error: rank 1 (on {host}) runs torch {torch.__version__}, transformers 4.0.0,",
        f"rank 0 (on {host}) runs torch {torch.__version__}, transformers {ours},",
        "every node must run the same packages",
    )
    assert not os.path.exists(out)


def test_nodes_with_other_code_are_refused(tmp_path, addition_jsonl):
    """Each node with a checkout of its own, node1's task.py changed: one line. Each rank runs
    /proc/self/cwd/train_sft.py, so it imports the stage and its modules from its own "node"
    (Python resolves the link: each rank names the folder it runs from)."""
    nodes, env = two_nodes(tmp_path, names=True)
    for node in nodes:
        for name in os.listdir(REPO):
            if name.endswith(".py"):
                shutil.copy(os.path.join(REPO, name), node / name)
        os.symlink(os.path.join(REPO, "assets"), node / "assets")
    with open(nodes[1] / "task.py", "a") as f:
        f.write("# a line node0's copy lacks\n")
    script = "/proc/self/cwd/train_sft.py"
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", script]
    cmd += [str(a) for a in sft(str(tmp_path / "run"), addition_jsonl)]
    p = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **CPU_ONLY, **env}
    )
    assert_ranks_error(
        p,
        "error: rank 1 (on node1) runs other plainrlhf code than rank 0 (on node0): the *.py "
        "files in ",
        "differ; give every node the same checkout",
    )


def test_a_data_file_missing_on_one_node_stops_every_rank_with_its_line(tmp_path, addition_jsonl):
    """node1 lacks the copy: its rank stops with "no such file", and rank 0, which read its own,
    stops with that line too (`common.read_on_every_rank` gathers the failure), where it waited
    for rank 1 in the next collective until torchrun ended it. Both name rank 1."""
    nodes, env = two_nodes(tmp_path, names=True)
    shutil.copy(addition_jsonl, nodes[0] / "data.jsonl")
    out = tmp_path / "run"
    p = run("train_sft.py", *sft(str(out), "data.jsonl"), check=False, env=env)
    assert_ranks_error(p, "data.jsonl: no such file")
    line = "error: rank 1 (on node1): data.jsonl: no such file (a relative path, read from "
    # every rank, failed or not, says the first failed rank's line: one line per node (here the
    # two ranks' host names differ), where rank 1 said its own and rank 0 named rank 1's
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and all(e.startswith(line) for e in errors), p.stderr[-3000:]


def test_a_model_folder_whose_copies_differ_between_nodes_is_refused(tmp_path, addition_jsonl):
    """A relative --model on two nodes: node1's copy has one weight one float step away. FSDP2
    would have built the model from both copies (each rank keeps its own slice), unannounced;
    now one line names the flag, before any step. Equal copies pass (every other run here)."""
    nodes, env = two_nodes(tmp_path, names=True)
    for node in nodes:
        shutil.copytree(task.TINY_MODEL, node / "model")
    weights = nodes[1] / "model" / "model.safetensors"
    tensors = safetensors.torch.load_file(weights)
    name = sorted(tensors)[0]
    first = tensors[name].view(-1)
    first[0] = torch.nextafter(first[0], torch.tensor(1.0))
    safetensors.torch.save_file(tensors, weights, metadata={"format": "pt"})
    out = tmp_path / "run"
    args = sft(str(out), addition_jsonl, "--model", "model")
    p = run("train_sft.py", *args, check=False, env=env)
    assert_ranks_error(
        p, "error: --model ", "model: rank 1 (on node1) read other contents than rank 0 (on node0)"
    )
    assert not os.path.exists(out / "metrics.jsonl")


# Rank 1 on a filesystem that keeps flock per machine: its flock always succeeds
LOCKS_PER_MACHINE_SITE = """
import fcntl
import os
if os.environ.get("RANK") == "1":
    fcntl.flock = lambda fd, operation: None
"""


def test_a_lock_another_rank_can_take_is_warned_of(tmp_path, addition_jsonl):
    """Where rank 1 can take the run lock rank 0 holds (locks kept per machine: a second run from
    another machine would not be refused), rank 0 says so once; the run goes on. Elsewhere (every
    other test) it cannot, and nothing is said."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(LOCKS_PER_MACHINE_SITE)
    out = tmp_path / "run"
    p = run("train_sft.py", *sft(out, addition_jsonl), env={"PYTHONPATH": str(site)})
    warnings = [line for line in p.stderr.splitlines() if line.startswith("warning:")]
    host = socket.gethostname()
    assert warnings == [
        f"warning: {out}: rank 1 (on {host}) could take the run lock rank 0 holds: this "
        "filesystem keeps locks per machine, so a second run into this --out_dir from another "
        "machine would not be refused (README, Checkpoints)"
    ], p.stderr[-3000:]
    assert logged_steps(out) == 4


# A restart seen by rank 1 only, as on a node torchrun restarted while another node's did not
RESTARTED_ON_ONE_NODE_SITE = """
import os
if os.environ.get("RANK") == "1":
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
"""


def test_a_restart_one_node_counted_resumes_on_every_rank(copy, tmp_path, addition_jsonl):
    """torchrun on several nodes: a node whose rank failed counts a restart, one restarted because
    of it counts none (TORCHELASTIC_RESTART_COUNT 0). Each rank decided alone: a rank 0 that said
    0 took the run for a fresh one, refused its folder of checkpoints ("holds an earlier run's"),
    and the group died instead of resuming. Now the ranks agree (`checkpoint._agree_restarted`):
    every rank resumes from latest. Per-round stores, as launch.sh sets on several nodes."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(RESTARTED_ON_ONE_NODE_SITE)
    env = {"PYTHONPATH": str(site), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    args = sft(copy, addition_jsonl, "--max_steps", 6, "--timeout_minutes", 1)
    p = run("train_sft.py", *args, check=False, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resumed from {copy}/checkpoints/step-00000004 at step 4" in p.stdout + p.stderr
    assert logged_steps(copy) == 6


def test_resume_latest_with_every_checkpoint_damaged_stops(copy, addition_jsonl):
    root = os.path.join(copy, "checkpoints")
    shard = os.path.join(root, "step-00000004", "dcp", "__0_0.distcp")
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 1
    open(shard, "wb").write(data)
    open(os.path.join(root, "step-00000002", "rng-rank1.json"), "r+").truncate(10)
    before = snapshot(copy)
    p = run("train_sft.py", *sft(copy, addition_jsonl, "--resume", "latest"), check=False)
    assert_ranks_error(
        p,
        "--resume latest: no checkpoint in",
        "step-00000004: ",
        "__0_0.distcp: checksum mismatch",
        "step-00000002: ",
        "rng-rank1.json: size 10",
    )
    assert snapshot(copy) == before  # nothing overwritten, truncated or started


@pytest.mark.parametrize("entry", ["metrics.jsonl", os.path.join("checkpoints", "latest")])
def test_a_symlinked_run_file_is_refused(copy, tmp_path, addition_jsonl, entry):
    target = tmp_path / "target"
    path = os.path.join(copy, entry)
    shutil.copy(path, target)
    os.unlink(path)
    os.symlink(target, path)
    before = target.read_bytes()
    p = run("train_sft.py", *sft(copy, addition_jsonl, "--resume", "latest"), check=False)
    assert_ranks_error(p, f"{path}: a symlink or not a regular file")
    assert target.read_bytes() == before


def test_stale_temp_symlinks_are_removed_not_followed(copy, tmp_path, addition_jsonl):
    """A killed run's latest.tmp and .tmp-step-N, planted as symlinks: the next run removes the
    links and never writes to their targets."""
    root = os.path.join(copy, "checkpoints")
    victim_file = tmp_path / "victim.txt"
    victim_file.write_text("keep me\n")
    victim_dir = tmp_path / "victim_dir"
    victim_dir.mkdir()
    (victim_dir / "keep").write_text("keep me too\n")
    os.symlink(victim_file, os.path.join(root, "latest.tmp"))
    for step in (5, 6):
        os.symlink(victim_dir, os.path.join(root, f".tmp-step-{step:08d}"))
    run("train_sft.py", *sft(copy, addition_jsonl, "--resume", "latest", "--max_steps", 6))
    assert victim_file.read_text() == "keep me\n"
    assert sorted(os.listdir(victim_dir)) == ["keep"]
    assert not [n for n in os.listdir(root) if n.startswith(".tmp-") or n == "latest.tmp"]
    assert latest(copy).endswith("step-00000006")


def test_a_fifo_in_the_newest_checkpoint_falls_back_without_hanging(copy, addition_jsonl):
    os.mkfifo(os.path.join(copy, "checkpoints", "step-00000004", "dcp", "pipe"))
    p = run("train_sft.py", *sft(copy, addition_jsonl, "--resume", "latest"), timeout=300)
    log = p.stdout + p.stderr
    assert "skipping checkpoint step-00000004" in log and "pipe: not a regular file" in log
    assert "resumed from" in log and "step-00000002 at step 2" in log


def test_a_run_killed_before_its_first_save_leaves_no_rows(tmp_path, addition_jsonl):
    """A dead run's rows (no checkpoint committed) are gone when the next run starts over."""
    out = tmp_path / "run"
    out.mkdir()
    dead = write_dead_rows(out, (1, 2))
    (out / "samples.jsonl").write_text(dead)
    run("train_sft.py", *sft(str(out), addition_jsonl, "--resume", "latest", "--max_steps", 2))
    rows = metrics(str(out))
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["train/loss"] != 99.0
    assert (out / "samples.jsonl").read_text() == ""


def test_resume_truncates_samples_like_metrics(copy, addition_jsonl):
    """samples.jsonl (train_ppo.py writes it at evaluations) loses the rows after the checkpoint
    resumed from, as metrics.jsonl does."""
    rows = [{"step": s, "prompt": "1+1=", "score": 1.0, "response": "2"} for s in (2, 3, 4)]
    lines = [json.dumps(r) + "\n" for r in rows]
    open(os.path.join(copy, "samples.jsonl"), "w").writelines(lines)
    step2 = os.path.join(copy, "checkpoints", "step-00000002")
    run("train_sft.py", *sft(copy, addition_jsonl, "--resume", step2))
    assert open(os.path.join(copy, "samples.jsonl")).readlines() == lines[:1]
    assert [r["step"] for r in metrics(copy)] == [1, 2, 3, 4]


def test_a_branch_that_fails_before_its_first_save_leaves_latest_at_its_start(copy, addition_jsonl):
    """--resume PATH of an older checkpoint of the run's own (a branch) drops the rows after
    PATH's step at once; one that failed before its first save (here a --lr that diverges at
    step 3) left `latest` on step 4, whose rows 3 and 4 were gone, and `--resume latest` went on
    from step 4 with the branch's row 3 in their place. `latest` now names PATH once the branch
    is checked and its rows go (`checkpoint.py: begin_branch`): the history stays one run's."""
    step2 = os.path.join(copy, "checkpoints", "step-00000002")
    # a branch refused (another --seed) changes nothing: `latest` moves only as rows go
    p = run("train_sft.py", *sft(copy, addition_jsonl, "--resume", step2, "--seed", 7), check=False)
    assert p.returncode != 0 and "--seed 42 -> 7" in p.stderr, p.stderr[-3000:]
    assert latest(copy).endswith("step-00000004")
    flags = ("--resume", step2, "--lr", "1e20", "--save_every", 100)
    p = run("train_sft.py", *sft(copy, addition_jsonl, *flags), check=False)
    assert p.returncode != 0 and "gradient norm is nan" in p.stderr, p.stderr[-3000:]
    assert latest(copy) == step2
    p = run("train_sft.py", *sft(copy, addition_jsonl, "--resume", "latest"))
    assert f"resumed from {step2} at step 2" in p.stdout + p.stderr
    assert [r["step"] for r in metrics(copy)] == [1, 2, 3, 4]
    assert all(r["train/lr"] < 1 for r in metrics(copy))  # no row of the branch's --lr 1e20


def test_a_copy_under_another_name_resumes(copy, addition_jsonl):
    """A checkpoint copied to checkpoints/best may be resumed (its step comes from its
    manifest, not its name): --keep_last's count of the run's history read the step from the
    name, a ValueError traceback at the start."""
    best = os.path.join(copy, "checkpoints", "best")
    shutil.copytree(os.path.join(copy, "checkpoints", "step-00000002"), best)
    flags = ("--resume", best, "--keep_last", 1, "--max_steps", 6)
    p = run("train_sft.py", *sft(copy, addition_jsonl, *flags))
    assert f"resumed from {best} at step 2" in p.stdout + p.stderr
    # steps 4 and 6 saved by this run; 1 kept: its own newest, and the copy (no step name) stays
    left = sorted(os.listdir(os.path.join(copy, "checkpoints")))
    assert [n for n in left if n != "latest"] == ["best", "step-00000006"], left


def test_a_crafted_hf_folder_in_a_checkpoint_is_one_line_on_export(copy, tmp_path):
    """checkpoint.py export loads the checkpoint's hf/ with transformers: a config field of the
    wrong value (the manifest rewritten to match) raised a ZeroDivisionError, not the line."""
    ckpt = latest(copy)
    config_path = os.path.join(ckpt, "hf", "config.json")
    config = json.load(open(config_path))
    config["num_attention_heads"] = 0
    json.dump(config, open(config_path, "w"))
    rewrite_manifest(ckpt)
    p = run_py("checkpoint.py", "export", ckpt, tmp_path / "export")
    assert_one_line_error(p, "hf: cannot load (ZeroDivisionError")
    assert not os.path.exists(tmp_path / "export")
