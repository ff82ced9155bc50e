"""Run by tests/test_units.py under torchrun (2 ranks): `common.encode_rows`, where each rank
encodes a share of the rows, gives every rank what one process encoding them all would (the same
ids, lists and other fields, in the same order), for sets smaller than the world too, and names
the data's first bad row whichever rank's share holds it, on every rank; a bug (an exception,
no error line) raises on its rank and stops the other with a line naming it. `common.check_rows`
likewise: `load_examples` checks the dialogues' lengths a share per rank, and names the first too
long for the context whichever rank's share holds it.

Argument: a tokenizer's folder (the tiny model's, `task.make_tokenizer`)."""

import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch.distributed as dist  # noqa: E402
from test_units import assistant  # noqa: E402
from test_units import gemma_style_tokenizer  # noqa: E402
from test_units import user  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import common  # noqa: E402
import task  # noqa: E402
import train_ppo  # noqa: E402
import train_rm  # noqa: E402
import train_sft  # noqa: E402


def alone(rows, encode):
    """The rows as one process encodes them (`encode_rows` without a process group)."""
    return common.TokenRows(encode(row, where=where) for where, row in rows)


def check_same(together, by_one):
    """Every row, and the flat storage behind them, as one process made them."""
    assert list(together) == list(by_one), (list(together)[:3], list(by_one)[:3])
    assert together.ids == by_one.ids
    assert together.ends == by_one.ends
    assert together.values == by_one.values
    assert together.layout == by_one.layout


def error_line(make, rows, encode):
    """The one line make(rows, encode) stops with (a SystemExit), or None."""
    try:
        make(rows, encode)
    except SystemExit as e:
        return e.code
    return None


def broken(encode, row, where):
    """encode, but a bug (a ValueError, no error line) at the 61st row, in rank 1's share."""
    if where == "embedded task:61":
        raise ValueError("a bug")
    return encode(row, where=where)


def raised(rows, encode):
    """What encode_rows raised."""
    try:
        common.encode_rows(rows, encode)
    except (SystemExit, ValueError) as e:
        return e
    raise AssertionError("encode_rows raised nothing")


def written(folder, name, rows):
    """rows as a JSONL file in folder, written by rank 0 before any rank reads it."""
    path = os.path.join(folder, name)
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    dist.barrier()  # the file is whole before any rank reads it
    return path


def check_dialogues(folder):
    """load_examples on 2 ranks: the 9 dialogues' lengths checked 4 on rank 0, 5 on rank 1
    (`common.check_rows`); the first too long in the file's order named on both."""
    tok = gemma_style_tokenizer()
    dialogue = {"messages": [user("1+1="), assistant("2"), user("1+2="), assistant("3")]}
    rows = [{"prompt": "2+2=", "response": "4"}] + [dialogue] * 9  # lines 2-10: the dialogues
    examples = common.load_examples(written(folder, "good.jsonl", rows), tok, 64)
    assert len(examples) == 19, examples
    too_long = {"messages": [user("1+1=" * 20), assistant("2")]}  # 80 tokens and more
    load = functools.partial(common.load_examples, max_len=64)
    for bad in ((7, 9), (3, 6), (5, 6), (2, 10)):  # on rank 1, on each side, on rank 0
        data = [too_long if line in bad else row for line, row in enumerate(rows, 1)]
        path = written(folder, f"bad-{bad[0]}-{bad[1]}.jsonl", data)
        line = error_line(load, path, tok)
        assert line is not None and line.startswith(f"error: {path}:{bad[0]}: the dialogue is")


def main(folder):
    common.init_distributed(seed=0)
    tok = AutoTokenizer.from_pretrained(folder)
    rows = common.numbered("embedded task", task.make_split("train")[:101])
    encode = functools.partial(train_sft.encode, tok, max_len=64)
    for n in (0, 1, 2, 3, 101):  # fewer rows than ranks too: a share may be empty
        check_same(common.encode_rows(rows[:n], encode), alone(rows[:n], encode))
    # a NamedTuple with a float beside the lists (the reward model's Pair)
    pairs = common.numbered("embedded task", task.make_pairs("train")[:31])
    rm = functools.partial(train_rm.encode_row, tok, max_len=64, margin=0.5, given=False)
    check_same(common.encode_rows(pairs, rm), alone(pairs, rm))
    # a row's dict beside its ids (PPO's prompts)
    ppo = functools.partial(
        train_ppo.encode_row, tok, max_new_tokens=4, context=64, reward_tok=None
    )
    check_same(common.encode_rows(rows, ppo), alone(rows, ppo))

    # rank 0 encodes rows 0-49, rank 1 rows 50-100: the first bad row named, whoever found it
    long = {"prompt": "1+2=", "response": "3" * 100}  # longer than the context of 64
    bad = [(where, long) for where, _ in rows]
    for first, second in ((70, 90), (10, 60), (49, 50), (50, 100)):
        data = rows[:first] + bad[first : first + 1] + rows[first + 1 : second]
        data += bad[second : second + 1] + rows[second + 1 :]
        line = error_line(common.encode_rows, data, encode)
        assert line is not None and line.startswith(f"error: embedded task:{first + 1}:"), line
        assert line == error_line(alone, data, encode), line  # the line one process gives
    # a bug's traceback on its rank; the other stops with a line naming the row and the rank,
    # where it would have waited for it in the next collective
    e = raised(rows, functools.partial(broken, encode))
    if dist.get_rank() == 1:
        assert isinstance(e, ValueError) and str(e) == "a bug", e
    else:
        line = "error: embedded task:61: rank 1 failed encoding it: ValueError('a bug')"
        assert isinstance(e, SystemExit) and e.code == line, e
    # a bad row before it, on rank 0, is the data's first
    e = raised(rows[:40] + bad[40:41] + rows[41:], functools.partial(broken, encode))
    assert isinstance(e, SystemExit) and e.code.startswith("error: embedded task:41: "), e
    check_dialogues(folder)
    dist.barrier()
    if dist.get_rank() == 0:
        print("encode_rows: ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
