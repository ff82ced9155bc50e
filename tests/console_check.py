"""Run by tests/test_console.py under torchrun with 2 ranks: error lines through
common.print_error, the ranks' own or alike, with rank 0's progress bar on the console or not."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]
import torch.distributed as dist  # noqa: E402

import common  # noqa: E402


def main(mode):
    rank, _, _ = common.init_distributed(0)
    bars = []  # kept open (a closed bar ends its own line) until rank 1 has said its line
    if mode in ("bar", "closed") and rank == 0:
        bars.append(common.progress_bar(10, 0, "check"))
    if mode == "closed" and rank == 0:
        common.close_progress_bar(bars.pop())
    dist.barrier()  # the bar is on the console before rank 1 says its line
    line = "error: every rank's alike"
    if mode == "own":
        line = f"error: rank {rank}'s own"
    if mode not in ("bar", "closed") or rank == 1:
        common.print_error(line)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
