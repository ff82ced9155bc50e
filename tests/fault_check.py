"""Run by tests/test_faults.py under torchrun with 2 ranks: checkpoint.save's cross-rank agreement,
the async snapshot, and boundary()'s one decision for all ranks, on the real FSDP2 model and DCP."""

import errno
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import checkpoint  # noqa: E402
import common  # noqa: E402
import task  # noqa: E402
from conftest import read_tensors  # noqa: E402


def main(out):
    rank, world, device = common.init_distributed(0)
    model = common.shard_model(AutoModelForCausalLM.from_pretrained(task.TINY_MODEL), device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.ones(1, 4, dtype=torch.long)).logits.sum().backward()
    optim.step()  # AdamW state exists
    args = (
        out,
        {"model": (model, optim)},
        {"args": {"seed": 0}},
        (model.config, AutoTokenizer.from_pretrained(task.TINY_MODEL), model.generation_config),
    )
    root = os.path.join(out, "checkpoints")
    assert checkpoint.resolve(out, "") == ""  # the run starts: its lock and id, nothing to resume

    def latest():
        return open(os.path.join(root, "latest")).read().strip()

    def failed_save(step):
        """The line of a save of `step` that must fail."""
        try:
            checkpoint.save(args[0], step, *args[1:], keep_last=0)
        except checkpoint.CheckpointError as e:
            return str(e)
        raise AssertionError(f"the save of step {step} did not fail")

    real = checkpoint.rng_state

    def full():
        raise OSError(errno.ENOSPC, "No space left on device")

    # 0. The first save fails on rank 1: the error claims no previous checkpoint. Rank 0 removes
    # the failed temp dir slowly: rank 1's retry of the same step (below) writes into the same
    # path, and must not begin before every rank's removal has ended.
    if rank == 1:
        checkpoint.rng_state = full
    rmtree = checkpoint.shutil.rmtree

    def slow_rmtree(*a, **k):
        if rank == 0:
            time.sleep(1)
        rmtree(*a, **k)

    checkpoint.shutil.rmtree = slow_rmtree
    message = failed_save(1)
    assert "no checkpoint is committed yet" in message and "intact" not in message, message
    checkpoint.shutil.rmtree = rmtree
    checkpoint.rng_state = real
    assert checkpoint.save(args[0], 1, *args[1:], keep_last=0).endswith("step-00000001")

    # 1. A write that fails on rank 1 only fails the save on both ranks; step 1 stays latest.
    if rank == 1:
        checkpoint.rng_state = full
    message = failed_save(2)
    assert "rank 1: OSError" in message and "No space left" in message, message
    assert "step-00000001, is intact and latest" in message, message
    # on_error="warn": no raise
    assert checkpoint.save(args[0], 2, *args[1:], keep_last=0, on_error="warn") is None
    checkpoint.rng_state = real
    dist.barrier()  # every rank has seen the failures before rank 0 looks at the directory
    assert latest() == "step-00000001", os.listdir(root)
    assert sorted(os.listdir(root)) == ["latest", "step-00000001"], os.listdir(root)

    # 2. Async: the checkpoint holds the weights of the moment of the call, although training goes
    # on at once, and it is published (latest) only by commit(), once all ranks have written it.
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    assert checkpoint.save(args[0], 3, *args[1:], keep_last=0, async_save=True) is None
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert latest() == "step-00000001"
    path = checkpoint.commit()
    assert path.endswith("step-00000003") and latest() == "step-00000003"
    if rank == 0:
        saved = read_tensors(path)
        same = all(torch.equal(saved[f"model.model.{k}"], v) for k, v in before.items())
        assert same, "async save saw later weights"
        assert json.load(open(os.path.join(path, "meta.json")))["step"] == 3

    # 3. A failure after the commit (rank 0's fsync of checkpoints/ once `latest` names step 4):
    # the line says the checkpoint is committed and latest, not that it was not saved.
    real_durable = checkpoint._durable

    def durable(path, text=None):
        if path == root and latest() == "step-00000004":
            raise OSError(errno.EIO, "Input/output error")
        real_durable(path, text)

    if rank == 0:
        checkpoint._durable = durable
    message = failed_save(4)
    assert "step-00000004: the save failed after its commit" in message, message
    assert "it is committed and latest" in message, message
    checkpoint._durable = real_durable
    dist.barrier()
    assert latest() == "step-00000004"
    assert checkpoint.verify(os.path.join(root, "step-00000004"))["step"] == 4

    # 4. A resume takes this run's optimizer flags (AdamW's weight decay: the checkpoint's 0.01,
    # this run's 0.5), which load_state_dict replaced with the saved ones; a checkpoint past
    # --max_steps is refused in one line.
    step_4 = os.path.join(root, "step-00000004")
    for group in optim.param_groups:
        group["weight_decay"] = 0.5
    assert checkpoint.load(step_4, {"model": (model, optim)}, {"max_steps": 4}, [])["step"] == 4
    assert [group["weight_decay"] for group in optim.param_groups] == [0.5], optim.param_groups
    assert optim.state, "the AdamW state was not loaded"
    try:
        checkpoint.load(step_4, {"model": (model, optim)}, {"max_steps": 3}, [])
        raise AssertionError("a checkpoint past --max_steps was loaded")
    except checkpoint.CheckpointError as e:
        assert "is at step 4, past --max_steps 3" in str(e), e
    # A read before DCP's that fails on rank 1 only (a disk's I/O error, a store erring once)
    # stops both ranks with rank 1's line: rank 0 waited in DCP's collectives until the timeout.
    real_read_json = checkpoint._read_json

    def rng_read_fails_on_rank_1(where):
        if rank == 1 and "rng-rank" in where:
            raise OSError(errno.EIO, "Input/output error", where)
        return real_read_json(where)

    checkpoint._read_json = rng_read_fails_on_rank_1
    try:
        checkpoint.load(step_4, {"model": (model, optim)}, {"max_steps": 4}, [])
        raise AssertionError("a load that failed on rank 1 went on")
    except checkpoint.CheckpointError as e:
        line = str(e)
        assert line.startswith("rank 1: ") and "missing or unreadable (Input/output" in line, e
    checkpoint._read_json = real_read_json

    # Evaluation shares (`common.eval_share`): every rank as many items, the short ones padded
    # with copies of the first that are not counted, so each item counts once.
    assert common.eval_share(list("abc")) == [(["a", "c"], 2), (["b", "a"], 1)][rank]
    assert common.eval_share(["a"]) == [(["a"], 1), (["a"], 0)][rank]

    # 5. boundary(): a signal on one rank makes every rank save and stop; the clock is rank 0's.
    assert checkpoint.boundary(7, 100, 0, rank == 1, device) == (True, True)
    assert checkpoint.boundary(7, 100, 0, False, device) == (False, False)
    assert checkpoint.boundary(7, 100, 1e-9, False, device) == (True, False)
    # 6. A run resumed from step 3 saves step 4 again while `latest` names the old step 4 (an
    # abandoned branch's). A failure before the commit is no "failed after its commit" (it was,
    # whenever `latest` named the step); `latest` names step 3 before the old step 4 goes, so a
    # failure (or a kill) between the removal and the rename leaves it naming a checkpoint.
    checkpoint._run["branch"] = "step-00000003"
    if rank == 1:
        checkpoint.rng_state = full
    message = failed_save(4)
    assert "step-00000004 not saved" in message and "after its commit" not in message, message
    checkpoint.rng_state = real
    real_rename = checkpoint.os.rename

    def rename(src, dst):
        if dst == step_4:
            raise OSError(errno.EIO, "Input/output error")
        real_rename(src, dst)

    if rank == 0:
        checkpoint.os.rename = rename
    message = failed_save(4)
    assert "the previous checkpoint, step-00000003, is intact and latest" in message, message
    checkpoint.os.rename = real_rename
    dist.barrier()
    assert latest() == "step-00000003"
    assert checkpoint.save(args[0], 4, *args[1:], keep_last=0) == step_4
    assert latest() == "step-00000004"
    print(f"rank {rank}: FAULT_CHECK_OK", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    common.release_collectives()  # as the stages end (common.run)


if __name__ == "__main__":
    main(sys.argv[1])
