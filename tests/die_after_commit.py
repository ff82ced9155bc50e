"""train_sft.py as it is, but rank 0 SIGKILLs itself right after the save of step DIE_AT (the
first argument) has committed, before anything else runs: the moment between a checkpoint
becoming `latest` and whatever the step does next (on an object store: the logs' upload, the
pruning). Run under torchrun: `die_after_commit.py DIE_AT train_sft.py's flags`."""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch.distributed as dist  # noqa: E402

import checkpoint  # noqa: E402
import common  # noqa: E402
import train_sft  # noqa: E402

DIE_AT = int(sys.argv.pop(1))
SAVE = checkpoint.save


def save(out_dir, step, *args, **kwargs):
    saved = SAVE(out_dir, step, *args, **kwargs)
    if step == DIE_AT and dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return saved


if __name__ == "__main__":
    checkpoint.save = save
    common.run(train_sft.main, train_sft.Args, train_sft.LIMITS)
