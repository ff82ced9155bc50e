"""Bad input gets one clear line naming the flag or file, not a traceback."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import task
from conftest import CPU_ONLY
from conftest import REPO
from conftest import THINKING_TEMPLATE
from conftest import latest
from conftest import rewrite_manifest
from conftest import run
from conftest import run_py

# What the project itself writes to stderr besides an error: its warnings and notes, and
# progress bars (tqdm's, on stderr: a bar's text holds "%|" or "it/s")
OWN_LINES = ("error:", "warning:", "WARNING:", "note:")


def assert_one_line_error(p, *needles):
    """The run failed with one `error:` line holding every needle, last on stderr; nothing else
    there but the project's own warnings, notes and bars (no third party's log lines, no
    traceback)."""
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and all(n in last for n in needles), p.stderr[-2000:]
    lines = p.stderr.replace("\r", "\n").splitlines()
    others = [x for x in lines if x.strip() and not x.startswith(OWN_LINES)]
    others = [x for x in others if "%|" not in x and "it/s" not in x]
    # torch's C++ warning of vLLM-CPU's engine start, which only the environment can turn down
    # (launch.sh sets TORCH_CPP_LOG_LEVEL; README, "Running")
    others = [x for x in others if "] Warning: NUMA binding: " not in x]
    assert not others, others[:5]


@pytest.mark.parametrize(
    "extra,needles",
    [
        (
            ["--train_batch_size", "10", "--micro_batch_size", "4"],
            ["--train_batch_size 10", "--micro_batch_size 4"],
        ),
        (["--model", "/nonexistent/model"], ["--model /nonexistent/model: no such folder"]),
        (["--model", "runs/nonexistent/hf"], ["--model runs/nonexistent/hf: no such folder"]),
        (["--model", "./README.md"], ["--model ./README.md: not a folder (a file)"]),
        (["--resume", "/tmp"], ["/tmp/manifest.json: missing"]),
        (["--data", "/nonexistent.jsonl"], ["/nonexistent.jsonl: no such file"]),
        # transformers' own refusal came as "--model ...: cannot load", the flag unnamed
        (["--attn_implementation", "foo"], ["--attn_implementation foo: expected one of auto"]),
    ],
)
def test_bad_flags(tmp_path, extra, needles):
    p = run_py("train_sft.py", "--out_dir", tmp_path, "--max_steps", 1, *extra)
    assert_one_line_error(p, *needles)


@pytest.mark.parametrize(
    "text,needles",
    [
        (
            '{"prompt": "1+1=", "response": "2"}\n{"prompt": "1+1=", \n',
            ["bad.jsonl:2: not valid JSON", "line 1 column"],  # the row's own line, not 2
        ),
        (
            '{"prompt": "1+1=", "response": "2"}\n{"prompt": "2+2="}\n',
            ["bad.jsonl:2: expected a string field 'response'"],
        ),
        ("\n", ["bad.jsonl: no examples"]),
        (
            '{"prompt": "1+1=", "response": "2"}\n{"prompt": "1+1=\\ud800", "response": "2"}\n',
            ["bad.jsonl:2: field 'prompt' holds a lone surrogate"],
        ),
        (
            '{"prompt": "1+1=", "response": "2", "prompt": "2+2="}\n',
            ["bad.jsonl:1: not valid JSON", "the key 'prompt' appears twice"],
        ),
        (
            '{"prompt": [{"role": "user", "content": "1+1="}], "response": "2"}\n',
            ["bad.jsonl:1: a conversation (a prompt", "has no chat template"],
        ),
        (
            '{"prompt": [{"role": "user", "text": "1+1="}], "response": "2"}\n',
            ["bad.jsonl:1: field 'prompt', message 0: expected a string 'content'"],
        ),
        (
            '{"messages": [{"role": "user", "content": "1+1="}]}\n',
            ["bad.jsonl:1: field 'messages' ends with a 'user' turn"],
        ),
    ],
    ids=[
        "malformed-line",
        "missing-field",
        "empty",
        "lone-surrogate",
        "duplicate-key",
        "conversation-without-template",
        "conversation-malformed",
        "messages-ending-with-the-user",
    ],
)
def test_bad_data_file(tmp_path, text, needles):
    (tmp_path / "bad.jsonl").write_text(text)
    p = run_py(
        "train_sft.py", "--out_dir", tmp_path, "--data", tmp_path / "bad.jsonl", "--max_steps", 1
    )
    assert_one_line_error(p, *needles)


def test_ppo_prompt_longer_than_the_context(tmp_path):
    """The line named is the file's (blank lines between rows count: they were not, and the
    error named the row's index, here 2)."""
    text = json.dumps({"prompt": "1+1="}) + "\n\n\n" + json.dumps({"prompt": "9" * 70}) + "\n"
    (tmp_path / "prompts.jsonl").write_text(text)
    import task

    task.ensure_tiny_model()
    args = ("--model", task.TINY_MODEL, "--out_dir", tmp_path / "out", "--rollout_engine", "hf")
    args += ("--data", tmp_path / "prompts.jsonl", "--max_steps", 1)
    p = run_py("train_ppo.py", *args)
    assert_one_line_error(p, "prompts.jsonl:4", "exceeds the model's context")


def test_a_held_out_prompt_without_room_to_decode(tmp_path):
    """The held-out prompts are checked before training (GPT-2's learned positions failed at the
    first evaluation, an IndexError, after --eval_every steps): the prompt and the longest
    held-out response must fit the context together."""
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"prompt": "1+1=", "response": "2"}) + "\n")
    held_out = tmp_path / "held_out.jsonl"
    rows = [{"prompt": "1+1=", "response": "2" * 30}, {"prompt": "9" * 40, "response": "2"}]
    held_out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    args = ("--out_dir", tmp_path, "--data", train, "--eval_data", held_out, "--max_steps", 1)
    p = run_py("train_sft.py", *args, "--train_batch_size", 1, "--micro_batch_size", 1)
    assert_one_line_error(p, "held_out.jsonl:2", "exceed the model's context (64)")


def test_a_held_out_response_without_room_is_the_row_named(tmp_path):
    """A held-out response too long for the context was blamed on the first row's prompt (row 1
    here), and tokenised before any size check (a 5 MB response: 2.3 GB and 13 s per rank)."""
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"prompt": "1+1=", "response": "2"}) + "\n")
    held_out = tmp_path / "held_out.jsonl"
    rows = [{"prompt": "1+1=", "response": "2"}, {"prompt": "2+2=", "response": "4" * 70}]
    held_out.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    args = ("--out_dir", tmp_path, "--data", train, "--eval_data", held_out, "--max_steps", 1)
    p = run_py("train_sft.py", *args, "--train_batch_size", 1, "--micro_batch_size", 1)
    assert_one_line_error(p, "held_out.jsonl:3: a held-out response of 70 tokens", "(64)")


def test_overlong_example(tmp_path):
    data = tmp_path / "long.jsonl"
    short = json.dumps({"prompt": "1+1=", "response": "2"}) + "\n"
    overlong = json.dumps({"prompt": "9" * 80, "response": "2"}) + "\n"
    data.write_text(short + "\n" + overlong)  # the blank line counts
    p = run_py("train_sft.py", "--out_dir", tmp_path, "--data", data, "--max_steps", 1)
    assert_one_line_error(p, "long.jsonl:3", "longer than the model's context")


def test_a_fresh_run_does_not_mix_with_an_earlier_one(tmp_path):
    args = ("--out_dir", tmp_path, "--max_steps", 1, "--train_batch_size", 8)
    args += ("--micro_batch_size", 8, "--eval_samples", 8)
    assert run_py("train_sft.py", *args).returncode == 0
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    p = run_py("train_sft.py", *args)
    assert_one_line_error(p, "holds an earlier run's checkpoints", "--resume latest")
    after = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert after == before  # nothing lost or added


def test_resume_with_changed_settings(tmp_path):
    args = ("--out_dir", tmp_path, "--max_steps", 1, "--train_batch_size", 8)
    args += ("--micro_batch_size", 8, "--eval_samples", 8)
    assert run_py("train_sft.py", *args).returncode == 0
    changed = ("--train_batch_size", 16, "--micro_batch_size", 4, "--eval_samples", 8)
    changed += ("--resume", "latest", "--seed", 7)
    p = run_py("train_sft.py", *args[:-6], *changed)
    assert_one_line_error(p, "differing settings", "--seed 42 -> 7", "--train_batch_size 8 -> 16")
    assert "micro_batch_size" not in p.stderr
    # --micro_batch_size only regroups the same batches: a note, and the run goes on (one rank
    # at micro-batch = batch could not otherwise move to two)
    regrouped = ("--max_steps", 2, "--train_batch_size", 8, "--micro_batch_size", 4)
    p = run_py("train_sft.py", *args[:2], *regrouped, "--eval_samples", 8, "--resume", "latest")
    assert p.returncode == 0, p.stderr[-2000:]
    note = "note: --micro_batch_size 8 -> 4 (from "
    assert note in p.stdout and "the same batches in other pieces" in p.stdout, p.stdout
    # above the share of 8 a --micro_batch_size is the share: 8 -> 64 regroups nothing
    regrouped = ("--max_steps", 3, "--train_batch_size", 8, "--micro_batch_size", 8)
    p = run_py("train_sft.py", *args[:2], *regrouped, "--eval_samples", 8, "--resume", "latest")
    assert "note: --micro_batch_size 4 -> 8 (from " in p.stdout, p.stdout
    regrouped = ("--max_steps", 4, "--train_batch_size", 8, "--micro_batch_size", 64)
    p = run_py("train_sft.py", *args[:2], *regrouped, "--eval_samples", 8, "--resume", "latest")
    assert p.returncode == 0 and "micro_batch_size" not in p.stdout, p.stdout


def test_another_stages_checkpoint_is_not_resumed(tmp_path):
    """A DPO checkpoint has SFT's one role (`model`) and every setting SFT compares: train_sft.py
    resumed it as its own (DPO's weights, Adam state and data position). Each checkpoint names
    the script that saved it (`common.run_identity`)."""
    short = ("--max_steps", 1, "--train_batch_size", 8, "--micro_batch_size", 8)
    short += ("--eval_samples", 8)
    dpo = tmp_path / "dpo"
    task.ensure_tiny_model()
    p = run_py("train_dpo.py", "--model", task.TINY_MODEL, "--out_dir", dpo, *short)
    assert p.returncode == 0, p.stderr[-2000:]
    ckpt = latest(dpo)
    assert json.load(open(os.path.join(ckpt, "meta.json")))["stage"] == "train_dpo.py"
    p = run_py("train_sft.py", "--out_dir", tmp_path / "sft", *short, "--resume", ckpt)
    assert_one_line_error(p, f"{ckpt} was saved by train_dpo.py, not train_sft.py")


def test_a_resume_checks_the_data_files_contents(tmp_path):
    """The saved data position indexes the --data file's rows: cut or rewritten under the same
    name, the resume drew its batches from other rows, silently. The checkpoint holds the file's
    sha256 (`common.run_identity`); the file as it was resumes."""
    data = tmp_path / "d.jsonl"
    rows = task.make_split("train")[:32]
    text = "".join(json.dumps(row) + "\n" for row in rows)
    data.write_text(text)
    args = ("--out_dir", tmp_path / "out", "--data", data, "--max_steps", 2)
    args += ("--train_batch_size", 8, "--micro_batch_size", 8, "--eval_samples", 8)
    assert run_py("train_sft.py", *args, "--stop_at_step", 1).returncode == 0
    data.write_text("".join(text.splitlines(keepends=True)[:24]))
    p = run_py("train_sft.py", *args, "--resume", "latest")
    assert_one_line_error(p, f"trained on other contents of --data {data} (sha256 ")
    data.write_text(text)
    p = run_py("train_sft.py", *args, "--resume", "latest")
    assert p.returncode == 0 and "done: 2 steps" in p.stdout, p.stderr[-2000:]


def test_resume_keeps_the_chat_template_kwargs(tmp_path):
    """--chat_template_kwargs decides every prompt's tokens: kept on a resume, and a checkpoint
    from before the flag (no such setting in its meta.json) counts as written under its
    default, '' (`common.arg_defaults`), whose resume goes on. The tiny model with a template that
    reads Qwen3's switch (`tests/test_units.py: THINKING_TEMPLATE`)."""
    from transformers import AutoTokenizer

    task.ensure_tiny_model()
    model = tmp_path / "model"
    shutil.copytree(task.TINY_MODEL, model)
    (model / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    args = ("--model", model, "--out_dir", tmp_path / "out", "--max_steps", 1)
    args += ("--train_batch_size", 8, "--micro_batch_size", 8, "--eval_samples", 8)
    assert run_py("train_sft.py", *args).returncode == 0
    thinking = ("--chat_template_kwargs", '{"enable_thinking":false}')
    p = run_py("train_sft.py", *args, "--resume", "latest", *thinking)
    assert_one_line_error(p, "--chat_template_kwargs '' -> '{\"enable_thinking\": false}'")
    ckpt = latest(tmp_path / "out")
    meta = json.load(open(os.path.join(ckpt, "meta.json")))
    del meta["args"]["chat_template_kwargs"]
    json.dump(meta, open(os.path.join(ckpt, "meta.json"), "w"))
    rewrite_manifest(ckpt)
    p = run_py("train_sft.py", *args, "--resume", "latest", *thinking)
    assert_one_line_error(p, "--chat_template_kwargs '' -> '{\"enable_thinking\": false}'")
    assert run_py("train_sft.py", *args, "--resume", "latest").returncode == 0
    # a run with them exports a template that renders as it did, untold
    # (`common.record_template_kwargs`)
    args = ("--model", model, "--out_dir", tmp_path / "with", "--max_steps", 1)
    args += ("--train_batch_size", 8, "--micro_batch_size", 8, "--eval_samples", 8)
    assert run_py("train_sft.py", *args, *thinking).returncode == 0
    tok = AutoTokenizer.from_pretrained(tmp_path / "with" / "hf")
    user = [{"role": "user", "content": "1+1="}]
    text = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    assert text == "user: 1+1= assistant: <think></think>"


@pytest.mark.parametrize(
    "given,needle",
    [
        ("{enable_thinking: false}", "--chat_template_kwargs {enable_thinking: false}: not valid"),
        ('["enable_thinking"]', "expected a JSON object of the template's variables"),
        ('{"tokenize": true}', "'tokenize' is an argument of apply_chat_template itself"),
        ('{"t": NaN}', "not valid JSON (NaN is no JSON value)"),
    ],
)
def test_bad_chat_template_kwargs(tmp_path, given, needle):
    p = run_py("train_sft.py", "--out_dir", tmp_path / "out", "--chat_template_kwargs", given)
    assert_one_line_error(p, needle)
    assert not (tmp_path / "out").exists()  # refused with the flags, before any folder is made


def test_chat_template_kwargs_for_a_model_without_a_template(tmp_path):
    """The embedded tiny model has no chat template: the flag would change nothing."""
    given = '{"enable_thinking": false}'
    p = run_py("train_sft.py", "--out_dir", tmp_path, "--chat_template_kwargs", given)
    line = f"--chat_template_kwargs {given}: --model {task.TINY_MODEL}'s tokenizer has no chat"
    assert_one_line_error(p, line)


REWARDS = """
def boom(prompt, response):
    raise ValueError("no")

def text(prompt, response):
    return "x"
"""


@pytest.mark.parametrize(
    "spec,needles",
    [
        ("badreward:boom", ["--reward_fn badreward:boom raised ValueError('no')"]),
        ("badreward:text", ["--reward_fn badreward:text returned 'x'", "finite in float32"]),
        ("nosuchmodule:f", ["--reward_fn nosuchmodule:f: expected module:function"]),
    ],
)
def test_ppo_bad_reward_fn(tmp_path, spec, needles):
    (tmp_path / "badreward.py").write_text(REWARDS)
    import task

    task.ensure_tiny_model()
    args = ("--model", task.TINY_MODEL, "--out_dir", tmp_path / "out", "--rollout_engine", "hf")
    args += ("--reward_fn", spec, "--eval_samples", 4, "--max_steps", 1)
    p = run_py("train_ppo.py", *args, env={"PYTHONPATH": str(tmp_path)})
    assert_one_line_error(p, *needles)


USER_MODULES = {
    "leaves.py": "import sys\ndef f(prompt, response):\n    sys.exit(0)\n",
    "huge.py": "def f(prompt, response):\n    return 10**400\n",
    "overflows.py": "def f(prompt, response):\n    return 1e39\n",
    "broken.py": "def f(prompt, response)\n    return 1.0\n",
    "numpy_scores.py": "import numpy\ndef f(prompt, response):\n    return numpy.float32(0.5)\n",
    "zero_d.py": (
        "import numpy, torch\n"
        "def tensor(prompt, response):\n    return torch.tensor(0.25)\n"
        "def array(prompt, response):\n    return numpy.array(0.75)\n"
        "def several(prompt, response):\n    return torch.tensor([0.5])\n"
        "def nan(prompt, response):\n    return torch.tensor(float('nan'))\n"
    ),
    "exact.py": (
        "import decimal, fractions\n"
        "def decimal_score(prompt, response):\n    return decimal.Decimal('0.125')\n"
        "def fraction(prompt, response):\n    return fractions.Fraction(3, 8)\n"
        "def decimal_nan(prompt, response):\n    return decimal.Decimal('NaN')\n"
        "def decimal_snan(prompt, response):\n    return decimal.Decimal('sNaN')\n"
        "def decimal_huge(prompt, response):\n    return decimal.Decimal('1e400')\n"
    ),
}


@pytest.mark.parametrize(
    "spec,needle",
    [
        ("leaves:f", "--reward_fn leaves:f raised SystemExit(0)"),  # ended PPO with exit 0
        ("huge:f", "returned 1000"),  # float()'s OverflowError, a traceback
        ("overflows:f", "returned 1e+39 for prompt"),  # inf in float32: blamed on --lr
        ("broken:f", "expected module:function importable"),  # a SyntaxError's traceback
        ("zero_d:several", "(one score: a rule scores one response per call)"),
        ("zero_d:nan", "returned nan for prompt '1+1='; expected a number finite in float32"),
        ("exact:decimal_nan", "returned Decimal('NaN') for prompt '1+1='; expected a number"),
        ("exact:decimal_snan", "returned Decimal('sNaN') for prompt '1+1='; expected a number"),
        ("exact:decimal_huge", "returned Decimal('1E+400') for prompt '1+1='; expected a num"),
    ],
)
def test_a_reward_function_that_misbehaves_is_one_line(tmp_path, monkeypatch, spec, needle):
    """In process: train_ppo.rule_scores on a user's module that exits, returns an int too large
    for a float or a float too large for float32, or does not parse. A NumPy scalar is a number,
    and so is a 0-d tensor or array (a rule computed with torch: it was refused as several), a
    Decimal and a Fraction."""
    import train_ppo

    for name, text in USER_MODULES.items():
        (tmp_path / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        train_ppo.rule_scores(spec, [{"prompt": "1+1="}], ["2"])
    line = exit_info.value.code
    assert line.startswith(f"error: --reward_fn {spec}") and needle in line, line
    assert train_ppo.rule_scores("numpy_scores:f", [{"prompt": "1+1="}], ["2"]).tolist() == [0.5]
    assert train_ppo.rule_scores("zero_d:tensor", [{"prompt": "1+1="}], ["2"]).tolist() == [0.25]
    assert train_ppo.rule_scores("zero_d:array", [{"prompt": "1+1="}], ["2"]).tolist() == [0.75]
    # exact arithmetic's numbers too (a Decimal is no numbers.Real: it was "expected a number")
    assert train_ppo.rule_scores("exact:decimal_score", [{"prompt": "1+1="}], ["2"]).tolist() == [
        0.125
    ]
    assert train_ppo.rule_scores("exact:fraction", [{"prompt": "1+1="}], ["2"]).tolist() == [0.375]


@pytest.mark.parametrize(
    "flags,needle",
    [
        (dict(reward_model="rm", reward_fn="mine:f"), "--reward_fn mine:f is not used with"),
        (dict(reward_norm=False), "--reward_norm applies to --reward_model's score only"),
        (dict(gold_reward_fn="task:reward_fn"), "give --reward_model too"),
        (dict(reward_model="rm", reward_weights="2"), "--reward_weights 2 weigh --reward_fn"),
    ],
)
def test_a_reward_flag_of_the_reward_not_in_use_is_refused(flags, needle, monkeypatch):
    """A --reward_fn beside a --reward_model was never called; --reward_norm without one did
    nothing: both silently ignored before, and still when spelt out at their defaults (the
    parsed Args alone cannot tell: `common.given_flags` reads the command line)."""
    import train_ppo

    monkeypatch.setattr(sys, "argv", ["train_ppo.py"])
    with pytest.raises(SystemExit, match=needle):
        train_ppo.check_reward_flags(train_ppo.Args(**flags))
    train_ppo.check_reward_flags(train_ppo.Args(reward_model="rm", gold_reward_fn="task:reward_fn"))
    train_ppo.check_reward_flags(train_ppo.Args())
    spelt_out = [
        (["--reward_fn", "task:reward_fn", "--reward_model", "rm"], dict(reward_model="rm")),
        (["--reward_norm=true"], dict()),
    ]
    for argv, parsed in spelt_out:
        monkeypatch.setattr(sys, "argv", ["train_ppo.py", *argv])
        with pytest.raises(SystemExit, match="is not used with|applies to --reward_model"):
            train_ppo.check_reward_flags(train_ppo.Args(**parsed))


@pytest.mark.parametrize(
    "flags,needle",
    [
        (dict(reward_fn="task:rewardfn"), "--reward_fn task:rewardfn: expected module:function"),
        (dict(reward_fn="task:TINY_MODEL"), "--reward_fn task:TINY_MODEL: a str, not a function"),
        (dict(reward_model="rm", gold_reward_fn="task:f"), "--gold_reward_fn task:f: expected"),
        (
            dict(reward_model="rm", gold_reward_fn="task:reward_fn,task:reward_fn"),
            "--gold_reward_fn task:reward_fn,task:reward_fn: expected one module:function",
        ),
        (dict(reward_fn="task:reward_fn,"), "--reward_fn task:reward_fn,: an empty entry"),
        (dict(reward_fn="task:f, task:f"), "--reward_fn task:f, task:f: task:f named twice"),
        (dict(reward_fn="task:reward_fn,task:rewardfn"), "--reward_fn task:rewardfn: expected"),
        (dict(reward_weights="1,2"), "--reward_weights 1,2: expected one finite number per"),
        (dict(reward_weights="one"), "--reward_weights one: expected comma-separated numbers"),
        (dict(reward_weights="inf"), "--reward_weights inf: expected one finite number per"),
    ],
)
def test_a_rule_that_is_no_function_is_refused_before_the_models_load(flags, needle):
    """A misspelt --reward_fn or --gold_reward_fn was found at the first scoring, after every
    model had loaded and the engine had started (and a name that is no function raised there)."""
    import train_ppo

    with pytest.raises(SystemExit, match=f"^error: {needle}"):
        train_ppo.check_reward_flags(train_ppo.Args(**flags))


def test_the_rule_lists_are_spelt_one_way_for_a_resume():
    """A resume compares --reward_fn and --reward_weights as the checkpoint's meta.json holds
    them: 'task:reward_fn, task:reward_fn_v2' against the same list without the space was
    refused as another run's. check_reward_flags writes each list one way."""
    import train_ppo

    args = train_ppo.Args(
        reward_fn=" tests.learnable:ones ,task:reward_fn", reward_weights="1, 0.5"
    )
    train_ppo.check_reward_flags(args)
    assert (args.reward_fn, args.reward_weights) == ("tests.learnable:ones,task:reward_fn", "1,0.5")


def test_max_new_tokens_beyond_the_context_names_the_flag():
    """It blamed the first prompt: "6 characters, more than -36 tokens can hold"."""
    from transformers import AutoTokenizer

    import task
    import train_ppo

    task.ensure_tiny_model()
    tok = AutoTokenizer.from_pretrained(task.TINY_MODEL)
    with pytest.raises(SystemExit, match="--max_new_tokens 100: the model's context holds 64"):
        train_ppo.load_prompts([("embedded task:1", {"prompt": "1+1="})], tok, 100, 64)


def test_ppo_batch_sizes(tmp_path):
    """One line naming the first relation that fails: prompts by ranks, responses by
    minibatches, a minibatch by micro-batches x ranks."""
    import train_ppo

    args = ("--out_dir", tmp_path, "--rollout_batch_size", 10, "--n_samples_per_prompt", 3)
    p = run_py("train_ppo.py", *args, "--train_batch_size", 4)
    line = (
        "--rollout_batch_size 10 x --n_samples_per_prompt 3 = 30 responses by --train_batch_size 4"
    )
    assert_one_line_error(p, "batch sizes do not divide", line)
    cases = [
        ((12, 2, 12, 2), 5, "--rollout_batch_size 12 by world size 5"),
        ((12, 2, 16, 2), 4, "= 24 responses by --train_batch_size 16"),
        ((12, 2, 12, 2), 4, "--train_batch_size 12 by --micro_batch_size 2 x world size 4"),
    ]
    for (rollout, n, train, micro), world, needle in cases:
        args = train_ppo.Args(
            rollout_batch_size=rollout,
            n_samples_per_prompt=n,
            train_batch_size=train,
            micro_batch_size=micro,
        )
        with pytest.raises(SystemExit, match=re.escape(needle)):
            train_ppo.check_args(args, world)
    args = train_ppo.Args(rollout_batch_size=12, train_batch_size=12, micro_batch_size=2)
    train_ppo.check_args(args, 3)


@pytest.mark.parametrize(
    "script,flag,value,needle",
    [
        ("train_sft.py", "--keep_last", -1, "expected a number >= 0"),  # kept one, silently
        ("train_sft.py", "--lr", "inf", "expected a finite number"),  # trained to NaN, exit 0
        ("train_sft.py", "--max_grad_norm", "nan", "expected a finite number"),
        ("train_sft.py", "--max_steps", 0, "expected a number >= 1"),  # did nothing, exit 0
        ("train_sft.py", "--max_steps", -3, "expected a number >= 1"),
        ("train_sft.py", "--train_batch_size", 0, "expected a number >= 1"),
        ("train_sft.py", "--async_save", "yes", "expected true or false, got 'yes'"),
        ("train_ppo.py", "--temperature", 0, "expected a number >= 0.01"),  # all-zero losses
        ("train_ppo.py", "--temperature", -1, "expected a number >= 0.01"),  # vLLM's traceback
        (
            "train_sft.py",
            "--seed",
            -1,
            "expected a number >= 0, <= 2147483647",
        ),  # NumPy's ValueError traceback
        ("train_dpo.py", "--seed", 2**32, "<= 2147483647"),
        ("train_ppo.py", "--temperature", 0.005, "expected a number >= 0.01"),  # vLLM: 0.01
        ("train_ppo.py", "--n_samples_per_prompt", 0, "expected a number >= 1"),
        ("train_ppo.py", "--max_new_tokens", 0, "expected a number >= 1"),
        ("train_ppo.py", "--gamma", 1.5, "expected a number >= 0, <= 1"),
        ("train_ppo.py", "--micro_batch_size", -2, "expected a number >= 1"),
        ("train_ppo.py", "--advantage_estimator", "ppo", "invalid choice: 'ppo'"),
        ("train_ppo.py", "--warmup_steps", -1, "expected a number >= 0"),
        ("train_ppo.py", "--cliprange_value", -0.2, "expected a number >= 0"),
        ("train_ppo.py", "--cliprange", 1, "expected a number > 0, < 1"),  # 1 - eps: no clip
        ("train_sft.py", "--max_step", 1, "unrecognized arguments: --max_step 1"),  # no prefixes
        ("train_rm.py", "--out_dir", "", "expected a folder or a store URL, got ''"),
        ("train_dpo.py", "--resume", "file://", "expected a path after file://"),
        # common.RunArgs' flags, checked against common.RUN_LIMITS in every stage
        ("train_dpo.py", "--keep_last", -2, "expected a number >= 0"),
        ("train_rm.py", "--timeout_minutes", 0, "expected a number > 0, <= 1e6"),
        ("train_ppo.py", "--stop_at_step", -1, "expected a number >= 0"),
        ("train_rm.py", "--save_every_minutes", -5, "expected a number >= 0"),
        # '' is what the flag's default means (the embedded task): given, it is `--data "$UNSET"`
        ("train_ppo.py", "--data", "", "expected a JSONL file, got ''"),
        ("train_sft.py", "--eval_data", "", "expected a JSONL file, got ''"),
        ("train_ppo.py", "--reward_model", "", "expected a reward model folder, got ''"),
    ],
)
def test_flags_out_of_range(tmp_path, monkeypatch, capsys, script, flag, value, needle):
    """Checked at parse time (`common.check_limits`), before any model loads. In this process:
    `common.run` as the script's last line calls it, with the script's Args and LIMITS (the
    subprocess test below runs two of these through the real command line)."""
    import importlib

    import common

    stage = importlib.import_module(script.removesuffix(".py"))
    monkeypatch.setattr("sys.argv", [script, "--out_dir", str(tmp_path), flag, str(value)])
    with pytest.raises(SystemExit) as exit_info:
        common.run(lambda args: None, stage.Args, stage.LIMITS)
    assert exit_info.value.code == 1
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and stderr.startswith("error:"), stderr  # no usage block
    # the limit in full: "expected a number >= 0" is also the start of ">= 0.01" and ">= 0, <= 1"
    end = stderr.rstrip().endswith(needle) or f"{needle} " in stderr or f"{needle};" in stderr
    assert flag in stderr and end, stderr


def test_a_diverging_run_stops_before_saving_nan(tmp_path):
    """An --lr that is finite but absurd passes the flag checks; the weights it makes give NaN
    gradients at step 2, which stop the run in one line instead of training to NaN, exiting 0
    and saving NaN checkpoints (which --keep_last would let replace the good ones)."""
    args = ("--out_dir", tmp_path, "--lr", 1e30, "--warmup_steps", 0, "--max_steps", 5)
    p = run_py("train_sft.py", *args, "--save_every", 1, "--keep_last", 1)
    assert_one_line_error(p, "the policy's gradient norm is nan", "training diverged")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step-00000001"]


def test_an_update_that_leaves_weights_not_finite_is_never_saved(tmp_path):
    """--lr 3e38 (step 1 trains at rate 0, the warmup's first): step 2's update overflows the
    weights while its gradient norm is finite, so only step 3's norm would have said so. Step 2
    was saved as latest, --keep_last 1 pruned step 1, the export failed and no resume could load
    what was left. Refused before the save now (`common.check_updated_weights`; helper 76)."""
    args = ("--out_dir", tmp_path, "--lr", 3e38, "--warmup_steps", 1, "--max_steps", 3)
    p = run_py("train_sft.py", *args, "--save_every", 1, "--keep_last", 1)
    assert_one_line_error(p, "step 2's update left weights that are not finite")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step-00000001"]


RANK_ONE_FAILS = """
import os

def f(prompt, response):
    if os.environ["RANK"] == "1":
        raise ValueError("on rank 1")
    return 1.0
"""


@pytest.mark.slow
def test_a_rule_failing_on_one_rank_stops_every_rank_with_its_line(tmp_path):
    """A rule that raises on one rank's responses only (a response only that rank sampled) stops
    both ranks with its one line; the other went on into the next collective and said a second
    line there ("collective all_reduce failed: Connection closed by peer") on gloo, or waited
    in it on NCCL (`common.on_every_rank`; helper 76)."""
    (tmp_path / "rank_rule.py").write_text(RANK_ONE_FAILS)
    task.ensure_tiny_model()
    args = ("--model", task.TINY_MODEL, "--out_dir", tmp_path / "out", "--rollout_engine", "hf")
    args += ("--reward_fn", "rank_rule:f", "--eval_samples", 4, "--max_steps", 1)
    args += ("--rollout_batch_size", 4, "--train_batch_size", 8, "--micro_batch_size", 4)
    # env: a torchrun of its own (torchrun's report follows the line here: launch.sh drops it)
    p = run("train_ppo.py", *args, check=False, env={"PYTHONPATH": str(tmp_path)})
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    needle = "--reward_fn rank_rule:f raised ValueError('on rank 1')"
    assert len(errors) == 1 and needle in errors[0], p.stderr[-3000:]


def test_the_documented_off_values_are_accepted(tmp_path, monkeypatch):
    """A flag whose help names 0 as "off" takes 0: --cliprange_value 0 (no value clipping) was
    refused by a limit of > 0, so value_loss's unclipped branch could not be reached."""
    import common
    import train_ppo

    parsed = []
    argv = ["train_ppo.py", "--out_dir", str(tmp_path), "--cliprange_value", "0"]
    monkeypatch.setattr("sys.argv", argv + ["--target_kl", "0", "--warmup_steps", "0"])
    common.run(parsed.append, train_ppo.Args, train_ppo.LIMITS)
    assert parsed[0].cliprange_value == 0 and parsed[0].target_kl == 0


@pytest.mark.parametrize(
    "script,flag,value,needle",
    [
        ("train_sft.py", "--lr", "inf", "expected a finite number"),
        ("train_ppo.py", "--temperature", 0, "expected a number >= 0.01"),
    ],
)
def test_flags_out_of_range_on_the_command_line(tmp_path, script, flag, value, needle):
    p = run_py(script, "--out_dir", tmp_path, flag, value)
    assert_one_line_error(p, flag, needle)
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_tokenizer_larger_than_the_embeddings(tmp_path):
    """Tokens added to a tokenizer without resizing the embeddings crashed the first forward with
    an IndexError; now one line says what to do."""
    import shutil

    from transformers import AutoTokenizer

    import task

    task.ensure_tiny_model()
    model_dir = tmp_path / "model"
    shutil.copytree(task.TINY_MODEL, model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.add_tokens([f"<extra_{i}>" for i in range(40)])  # 99 + 40 > the 128 embedding rows
    tok.save_pretrained(model_dir)
    p = run_py("train_sft.py", "--model", model_dir, "--out_dir", tmp_path / "out")
    assert_one_line_error(p, "139 tokens", "128 rows", "resize_token_embeddings")


@pytest.mark.slow
def test_eval_set_smaller_than_the_world_size(tmp_path):
    """One held-out example on 2 ranks divided by zero before the final save (SFT: a traceback, no
    last checkpoint, no export; PPO: NaN accuracy, exit 0). Now the short rank evaluates a padding
    copy that is not counted (`common.eval_share`), and every example counts exactly once."""

    from conftest import metrics
    from conftest import run

    sft = tmp_path / "sft"
    args = ("--max_steps", 2, "--train_batch_size", 8, "--micro_batch_size", 4)
    run("train_sft.py", "--out_dir", sft, *args, "--eval_samples", 1, "--eval_every", 1)
    accuracies = [row["eval/accuracy"] for row in metrics(sft)]
    assert len(accuracies) == 2 and all(a in (0.0, 1.0) for a in accuracies), accuracies
    assert (sft / "hf" / "model.safetensors").exists()
    ppo = tmp_path / "ppo"
    args = ("--model", sft / "hf", "--out_dir", ppo, "--rollout_engine", "hf", "--max_steps", 1)
    args += ("--rollout_batch_size", 4, "--n_samples_per_prompt", 2, "--train_batch_size", 8)
    run("train_ppo.py", *args, "--micro_batch_size", 4, "--eval_samples", 1)
    accuracies = [row["eval/accuracy"] for row in metrics(ppo)]
    # one example: right or wrong (no division by zero; that a padding copy is not counted is
    # tests/fault_check.py's check of `common.eval_share` on 2 ranks: a copy scores the same)
    assert len(accuracies) == 2 and all(a in (0.0, 1.0) for a in accuracies), accuracies


def test_a_20_mb_prompt_is_refused_before_it_is_tokenised(tmp_path):
    """It took 59 s and 8.4 GB per rank to tokenise before the length check said no; now the
    character count alone refuses it (`common.check_fits`): the message counts characters."""
    huge = json.dumps({"prompt": "1+" * 10_000_000, "response": "2"})
    (tmp_path / "huge.jsonl").write_text(json.dumps({"prompt": "1+1=", "response": "2"}) + "\n")
    with open(tmp_path / "huge.jsonl", "a") as f:
        f.write(huge + "\n")
    p = run_py("train_sft.py", "--out_dir", tmp_path / "out", "--data", tmp_path / "huge.jsonl")
    assert_one_line_error(p, "huge.jsonl:2: 20000001 characters", "more than 64 tokens can hold")


def test_invalid_utf8_in_data(tmp_path):
    (tmp_path / "bad.jsonl").write_bytes(
        b'{"prompt": "1+1=", "response": "2"}\n{"prompt": "\xff"}\n'
    )
    p = run_py("train_sft.py", "--out_dir", tmp_path / "out", "--data", tmp_path / "bad.jsonl")
    assert_one_line_error(p, "bad.jsonl:2: not valid UTF-8")


def test_an_out_dir_that_cannot_be_made(tmp_path):
    """An OSError from the run's folder (read-only, removed, not a folder) is one line naming the
    path, not a traceback."""
    (tmp_path / "file").write_text("")
    p = run_py("train_sft.py", "--out_dir", tmp_path / "file" / "out", "--max_steps", 1)
    assert_one_line_error(p, str(tmp_path / "file" / "out"), "Not a directory")
    p = run_py("train_sft.py", "--out_dir", tmp_path / "file", "--max_steps", 1)
    assert_one_line_error(p, f"--out_dir {tmp_path / 'file'}: not a folder (a file or link")
    p = run_py("train_sft.py", "--out_dir", f"{tmp_path / 'file'}/", "--max_steps", 1)
    assert_one_line_error(p, "not a folder (a file or link")


@pytest.mark.slow
def test_a_failed_final_export_keeps_the_checkpoint_and_says_how_to_redo_it(tmp_path):
    """Where the export cannot be written (here `hf` is a file; a full disk alike), the run ends
    with one line, the final checkpoint committed and verified, and the command that exports it."""
    from conftest import latest
    from conftest import run

    out = tmp_path / "out"
    out.mkdir()
    (out / "hf").write_text("in the way")
    args = ("--out_dir", out, "--max_steps", 2, "--train_batch_size", 8, "--micro_batch_size", 4)
    p = run("train_sft.py", *args, check=False)
    assert p.returncode != 0
    assert "[rank0]: Traceback" not in p.stderr, p.stderr[-3000:]
    assert "[rank1]" not in p.stderr, p.stderr[-3000:]  # rank 1 exits quietly: rank 0 says why
    final = latest(str(out))
    assert final.endswith("step-00000002")
    assert f"error: export of {final} to {out / 'hf'} failed" in p.stderr, p.stderr[-3000:]
    assert f"python checkpoint.py export {final} {out / 'hf'}" in p.stderr
    assert run_py("checkpoint.py", "verify", final).returncode == 0


@pytest.mark.parametrize(
    "text,needles",
    [
        ('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n{"prompt": ', ["pairs.jsonl:2"]),
        (
            '{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n'
            '{"prompt": "1+1=", "chosen": "2"}\n',
            ["pairs.jsonl:2: expected a string field 'rejected'"],
        ),
    ],
    ids=["malformed-line", "missing-field"],
)
def test_rm_bad_data_file(tmp_path, text, needles):
    import task

    task.ensure_tiny_model()
    (tmp_path / "pairs.jsonl").write_text(text)
    args = ("--model", task.TINY_MODEL, "--out_dir", tmp_path / "out", "--max_steps", 1)
    p = run_py("train_rm.py", *args, "--data", tmp_path / "pairs.jsonl")
    assert_one_line_error(p, *needles)


@pytest.mark.parametrize(
    "stage,row,flag",
    [
        ("train_sft.py", {"prompt": "1+1=", "response": "2"}, "--train_batch_size"),
        ("train_rm.py", {"prompt": "1+1=", "chosen": "2", "rejected": "3"}, "--train_batch_size"),
        ("train_dpo.py", {"prompt": "1+1=", "chosen": "2", "rejected": "3"}, "--train_batch_size"),
        ("train_ppo.py", {"prompt": "1+1=", "response": "2"}, "--rollout_batch_size"),
    ],
)
def test_a_data_file_smaller_than_one_batch(tmp_path, stage, row, flag):
    """One row against a batch of 2: the file, the flag and the count, in words that hold for a
    single row ("1 examples, fewer than ..." until the forty-sixth session)."""
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps(row) + "\n")
    task.ensure_tiny_model()  # RM and DPO start from a model folder: the tiny one
    args = ("--model", task.TINY_MODEL, "--out_dir", tmp_path / "out", "--max_steps", 1)
    args += ("--data", data, flag, 2, "--micro_batch_size", 1)
    if stage == "train_ppo.py":
        args += ("--train_batch_size", 2)  # the responses of one rollout batch
    p = run_py(stage, *args)
    assert_one_line_error(p, "one.jsonl: too few", f"for {flag} 2 (it has 1)")


def test_gold_reward_needs_a_reward_model(tmp_path):
    args = ("--out_dir", tmp_path, "--max_steps", 1, "--gold_reward_fn", "task:reward_fn")
    p = run_py("train_ppo.py", *args)
    assert_one_line_error(p, "--gold_reward_fn task:reward_fn", "give --reward_model")


@pytest.mark.parametrize(
    "extra,needles",
    [
        (["--beta", "0"], ["--beta"]),
        (["--loss_type", "ipo", "--label_smoothing", "0.1"], ["--label_smoothing", "ipo"]),
        (["--loss_type", "ipo", "--beta", "1e-30"], ["--beta 1e-30", "float32 cannot hold"]),
        (["--label_smoothing", "0.5"], ["--label_smoothing 0.5", "below 0.5"]),
        (["--train_batch_size", "10", "--micro_batch_size", "4"], ["--train_batch_size 10"]),
        (["--data", "PAIRS"], ["pairs.jsonl:2: expected a string field 'rejected'"]),
    ],
    ids=["beta", "ipo-smoothing", "ipo-beta", "smoothing-half", "batch-sizes", "missing-field"],
)
def test_dpo_bad_input(tmp_path, extra, needles):
    import task

    task.ensure_tiny_model()
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        '{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n{"prompt": "1+1=", "chosen": "2"}\n'
    )
    extra = [str(pairs) if a == "PAIRS" else a for a in extra]
    args = ("--model", task.TINY_MODEL, "--out_dir", tmp_path / "out", "--max_steps", 1)
    p = run_py("train_dpo.py", *args, *extra)
    assert_one_line_error(p, *needles)


def test_the_default_batch_sizes_run_on_one_to_sixteen_ranks():
    """--micro_batch_size bounds a forward: a rank's share of a step smaller than it is one
    micro-batch (the defaults, 64 or 128 a step at 32 a forward, stopped at start-up on 8 GPUs).
    A share larger than it must still be whole micro-batches, and the steps split over the ranks;
    each line names what does not divide."""
    import common
    import train_dpo
    import train_ppo
    import train_rm
    import train_sft

    for world in (1, 2, 4, 8, 16):
        for stage in (train_sft, train_rm, train_dpo):
            common.check_batch_sizes(stage.Args(), world)
        train_ppo.check_rollout_batch_sizes(train_ppo.Args(), world)
    args = train_sft.Args(train_batch_size=12, micro_batch_size=4)
    common.check_batch_sizes(args, 6)  # shares of 2: one micro-batch each
    with pytest.raises(SystemExit, match="--train_batch_size 12 must be divisible by world size 8"):
        common.check_batch_sizes(args, 8)
    with pytest.raises(SystemExit, match="--micro_batch_size 4 x world size 2"):
        common.check_batch_sizes(train_sft.Args(train_batch_size=12, micro_batch_size=4), 2)
    args = train_ppo.Args(rollout_batch_size=8, n_samples_per_prompt=3, train_batch_size=12)
    with pytest.raises(SystemExit, match="--train_batch_size 12 by world size 8"):
        train_ppo.check_rollout_batch_sizes(args, 8)


def test_gae_only_flags_with_grpo_are_refused():
    """grpo and rloo have no critic and no GAE: --gamma or --critic_lr there did nothing."""
    import train_ppo

    args = train_ppo.Args(advantage_estimator="grpo", critic_lr=1e-4, gamma=0.99)
    with pytest.raises(SystemExit, match="--gamma, --critic_lr apply to --advantage_estimator gae"):
        train_ppo.check_gae_only_flags(args)
    with pytest.raises(SystemExit, match="--gamma applies to --advantage_estimator gae"):
        train_ppo.check_gae_only_flags(train_ppo.Args(advantage_estimator="rloo", gamma=0.9))
    train_ppo.check_gae_only_flags(train_ppo.Args(advantage_estimator="rloo"))  # defaults: fine
    train_ppo.check_gae_only_flags(train_ppo.Args(gamma=0.99))  # gae takes them


def test_a_kl_estimator_that_would_do_nothing_is_refused():
    """--kl_estimator picks the KL in the reward: grpo's is a k3 loss term, and --kl_coef 0
    weighs none, with a --target_kl too (its controller scales beta from 0 to 0)."""
    import train_ppo

    args = train_ppo.Args(advantage_estimator="grpo", kl_estimator="k3")
    with pytest.raises(SystemExit, match="--kl_estimator k3 picks the KL in the reward"):
        train_ppo.check_args(args, 1)
    for target_kl in (0.0, 1.0):
        args = train_ppo.Args(kl_estimator="k3", kl_coef=0.0, target_kl=target_kl)
        with pytest.raises(SystemExit, match="--kl_estimator k3: --kl_coef 0 weighs no KL"):
            train_ppo.check_args(args, 1)
    train_ppo.check_args(train_ppo.Args(kl_estimator="k3"), 1)
    train_ppo.check_args(train_ppo.Args(kl_estimator="k3", kl_coef=0.01, target_kl=1.0), 1)


@pytest.mark.parametrize("estimator", ["gae", "rloo"])
def test_scale_rewards_outside_grpo_is_refused(estimator):
    """--scale_rewards picks grpo's std; gae whitens its advantages and rloo divides by none, so
    the flag would do nothing there."""
    import train_ppo

    args = train_ppo.Args(advantage_estimator=estimator, scale_rewards="none")
    # what the estimator does instead (gae's was said to divide by no std, as rloo's)
    does = {"gae": "gae whitens its advantages over the batch", "rloo": "rloo divides its advan"}
    line = f"--scale_rewards none applies to --advantage_estimator grpo only; {does[estimator]}"
    with pytest.raises(SystemExit, match=line):
        train_ppo.check_args(args, 1)
    train_ppo.check_args(train_ppo.Args(advantage_estimator="grpo", scale_rewards="batch"), 1)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--advantage_estimator", "grpo", "--gamma", "1.0"], "--gamma applies to"),
        (["--advantage_estimator", "grpo", "--kl_estimator", "k1"], "--kl_estimator k1 picks"),
        (["--scale_rewards", "group"], "--scale_rewards group applies to --advantage_estimator"),
        (["--rollout_engine", "hf", "--enforce_eager", "true"], "--enforce_eager is a setting"),
        (["--rollout_engine", "hf", "--gpu_memory_utilization", "0.5"], "--gpu_memory_util"),
        (["--offload_frozen", "true", "--kl_coef", "0"], "--offload_frozen offloads the frozen"),
        (["--local_dir", "logs"], "--local_dir logs applies to an object-store --out_dir"),
    ],
    ids=["gamma", "kl-estimator", "scale", "eager", "gpu-memory", "offload", "local-dir"],
)
def test_a_flag_with_nothing_to_do_is_refused_spelt_at_its_default_too(monkeypatch, argv, needle):
    """A flag of another mode, or one this command line leaves nothing to act on, is one line
    even at its default value (`common.flag_given`: as --reward_fn beside --reward_model), where
    it ran, silently ignored (helper 70's probe)."""
    import common
    import train_ppo

    monkeypatch.setattr("sys.argv", ["train_ppo.py", "--out_dir", "out", *argv])
    with pytest.raises(SystemExit, match=needle):
        args = common.parse_args(train_ppo.Args, train_ppo.LIMITS)
        train_ppo.check_args(args, 1)


def test_one_rule_under_a_weight_is_logged_on_its_own_and_not_called_accuracy():
    """--reward_weights 2 on the task's rule: the reward is twice the rule's score, so the held-out
    line says "score" (not an accuracy of 2.0) and the rule's own score is logged beside it."""
    import train_ppo

    args = train_ppo.Args(reward_weights="2")
    scores, parts = train_ppo.rule_reward(args, [{"prompt": "12+30="}], ["42"])
    assert scores.tolist() == [2.0] and parts["rule/task.reward_fn"].tolist() == [1.0]
    line = train_ppo.eval_line(args, 1, {"eval/accuracy": 2.0})
    assert line.startswith("step 1: held-out score 2.000"), line
    assert "accuracy" in train_ppo.eval_line(train_ppo.Args(), 1, {"eval/accuracy": 1.0})


def test_a_temperature_vllm_cannot_sample_at(one_rank):
    """vLLM 0.32 refuses a temperature above 2 in its SamplingParams, at the first rollout, in a
    traceback per rank: --rollout_engine vllm is refused before anything loads, and auto takes
    the HF engine, saying so (which has no such limit)."""
    import rollout
    import train_ppo

    args = train_ppo.Args(rollout_engine="vllm", temperature=2.5)
    line = "--temperature 2.5: vLLM samples at temperatures up to 2; use --rollout_engine hf"
    with pytest.raises(SystemExit, match=line):
        train_ppo.check_args(args, 1)
    train_ppo.check_args(train_ppo.Args(rollout_engine="vllm", temperature=2.0), 1)
    train_ppo.check_args(train_ppo.Args(rollout_engine="auto", temperature=2.5), 1)
    assert rollout._auto_engine(task_model(), 2.5) == "hf"
    assert rollout._auto_engine(task_model(), 2.0) == "vllm"


def task_model():
    import task

    task.ensure_tiny_model()
    return task.TINY_MODEL


def test_a_reward_model_input_longer_than_its_context(tmp_path):
    """PPO re-encodes each response with the reward model's own tokenizer, so the policy's context
    check (prompt + --max_new_tokens) does not bound it. Past its context a learned position table
    (GPT-2) fails with an IndexError, and a rotary one (this tiny Llama, its context set to 8
    tokens) scored positions it never saw, silently: the run exited 0."""
    from transformers import AutoModelForSequenceClassification
    from transformers import AutoTokenizer

    import task

    task.ensure_tiny_model()
    reward_dir = tmp_path / "rm"
    reward_model = AutoModelForSequenceClassification.from_pretrained(
        task.TINY_MODEL, num_labels=1, max_position_embeddings=8
    )
    reward_model.save_pretrained(reward_dir)
    AutoTokenizer.from_pretrained(task.TINY_MODEL).save_pretrained(reward_dir)
    args = ("--model", task.TINY_MODEL, "--out_dir", tmp_path / "out", "--rollout_engine", "hf")
    args += ("--reward_model", reward_dir, "--eval_samples", 4, "--max_steps", 1)
    p = run_py("train_ppo.py", *args)
    assert_one_line_error(p, f"--reward_model {reward_dir} takes at most 8 tokens", "come to")


def cut_weights(folder):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def other_shapes(folder):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["intermediate_size"] += 8
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "damage,needle",
    [
        (cut_weights, "incomplete metadata, file not fully covered"),
        (other_shapes, "weights whose shapes differ from those its config.json gives"),
    ],
    ids=["cut-safetensors", "shapes-unlike-config"],
)
def test_a_damaged_model_folder_is_one_line(tmp_path, damage, needle):
    """safetensors' own error for a cut file, and transformers' RuntimeError pointing at a report
    the quiet console hides, were tracebacks."""
    import shutil

    import task

    task.ensure_tiny_model()
    model_dir = tmp_path / "model"
    shutil.copytree(task.TINY_MODEL, model_dir)
    damage(model_dir)
    p = run_py("train_sft.py", "--model", model_dir, "--out_dir", tmp_path / "out")
    assert_one_line_error(p, f"--model {model_dir}: cannot load", needle)


def edit_json(name, change):
    """A damage: the model folder's `name` rewritten, `change` a text or a dict update."""

    def damage(folder):
        path = folder / name
        if isinstance(change, str):
            path.write_text(change)
            return
        data = json.loads(path.read_text())
        data.update(change)
        path.write_text(json.dumps(data))

    return damage


def edit_weights(change):
    """A damage: the model folder's model.safetensors, `change`d ({name: tensor} in place)."""

    def damage(folder):
        import safetensors.torch

        path = str(folder / "model.safetensors")
        tensors = safetensors.torch.load_file(path)
        change(tensors)
        safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})

    return damage


def make_folder(name):
    """A damage: a folder named `name` in the model folder (transformers passes over it)."""

    def damage(folder):
        (folder / name).mkdir()

    return damage


def a_nan_weight(tensors):
    tensors["model.norm.weight"][3] = float("nan")


def a_weight_stored_as_int32(tensors):
    tensors["model.norm.weight"] = tensors["model.norm.weight"].view(torch.int32)


def an_unused_weight(tensors):
    tensors["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)


class RunsCode:
    """A pickle whose loading would run a command (it touches a file beside it)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def pickled_weights_that_run_code(folder):
    """A damage: the weights as pytorch_model.bin, a payload among the tensors."""
    import safetensors.torch

    tensors = safetensors.torch.load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    tensors["payload"] = RunsCode(folder / "pwned")
    torch.save(tensors, folder / "pytorch_model.bin")


@pytest.mark.parametrize(
    "damage,needle",
    [
        (
            # transformers says the field on one line and what is wrong on the next: both
            edit_json("config.json", {"hidden_size": "abc"}),
            "cannot load (StrictDataclassFieldValidationError: Validation error for field "
            "'hidden_size': TypeError: Field 'hidden_size' expected int, got str",
        ),
        (
            edit_json("config.json", {"attention_dropout": 5.0}),
            "config.json: attention_dropout 5.0, expected a probability in [0, 1]",
        ),
        (
            edit_json("config.json", {"rope_parameters": {"rope_theta": -1.0}}),
            "config.json: rope_parameters.rope_theta -1.0, expected a positive number",
        ),
        (
            edit_json("config.json", {"rms_norm_eps": -1e-6}),
            "config.json: rms_norm_eps -1e-06, expected a number >= 0",
        ),
        (edit_weights(a_nan_weight), "weight model.norm.weight holds NaN or inf"),
        (
            # the header says I32 over a float's bytes: it loaded as huge whole numbers
            edit_weights(a_weight_stored_as_int32),
            "model.safetensors: weight model.norm.weight is stored as I32, expected a "
            "floating-point dtype",
        ),
        (
            edit_weights(an_unused_weight),
            "the model its config.json describes leaves weights of the folder unused: "
            "model.layers.9.mlp.up_proj.weight (1 in all)",
        ),
        (
            # an empty model.layers: no weight of the model was named like the folder's layers,
            # and a model of no layers trained (`common.in_own_blocks`)
            edit_json("config.json", {"num_hidden_layers": 0}),
            "the model its config.json describes leaves weights of the folder unused: "
            "model.layers.0.input_layernorm.weight",
        ),
        (
            # transformers honours the key (save_pretrained never writes it): FlexAttention has
            # no backward on the CPU, a traceback at the first step
            edit_json("config.json", {"attn_implementation": "flex_attention"}),
            "config.json: attn_implementation 'flex_attention'; remove it, or choose one with "
            "--attn_implementation",
        ),
        (
            # a Hub kernel's name: transformers would fetch that code and run it
            edit_json("config.json", {"attn_implementation": "kernels-community/flash-attn3"}),
            "config.json: attn_implementation 'kernels-community/flash-attn3'",
        ),
        (
            edit_json("tokenizer_config.json", {"model_max_length": "abc"}),
            "tokenizer_config.json: model_max_length 'abc', expected a number",
        ),
        (edit_json("config.json", {"num_attention_heads": 0}), "cannot load (ZeroDivisionError"),
        (edit_json("generation_config.json", "[]"), "cannot load (TypeError"),
        (
            # a null among the ids: it became a stop id, or a TypeError sorting them
            edit_json("generation_config.json", {"eos_token_id": [None, 2]}),
            "eos_token_id None is no token of the model",
        ),
        # transformers keeps both as they are: the reward model's check failed on them
        (
            edit_json("config.json", {"architectures": 5}),
            "config.json: architectures 5, expected a list of class names",
        ),
        (
            edit_json("config.json", {"architectures": ["LlamaForCausalLM", 5]}),
            "config.json: architectures ['LlamaForCausalLM', 5], expected a list of class names",
        ),
        (
            edit_json("config.json", {"architectures": [None]}),
            "config.json: architectures [None], expected a list of class names",
        ),
        (edit_json("generation_config.json", "{"), "generation_config.json: cannot load"),
        (edit_json("tokenizer_config.json", "[1]"), "cannot load (AttributeError"),
        (edit_json("tokenizer.json", '{"a": 1}'), "cannot load (KeyError"),
        (
            edit_json("tokenizer_config.json", {"chat_template": "{{ raise_exception('no') }}"}),
            "its chat template fails on a user turn (TemplateError: no)",
        ),
        (make_folder("chat_template.jinja"), "chat_template.jinja is a folder, expected a file"),
        (
            edit_json("tokenizer_config.json", {"chat_template": "{% for %}"}),
            "its chat template fails on a user turn (TemplateSyntaxError",
        ),
        (
            edit_json("generation_config.json", {"eos_token_id": "x"}),
            "eos_token_id 'x' is no token of the model (expected ids 0 to 127)",
        ),
        (
            edit_json("generation_config.json", {"eos_token_id": [2, 10**6]}),
            "eos_token_id 1000000 is no token of the model",
        ),
        (
            # transformers loads it, and refuses to save it: every checkpoint failed
            edit_json("generation_config.json", {"temperature": 0.7}),
            "transformers would refuse to save it (`temperature`: `do_sample` is not set to "
            "`True`.",
        ),
        (
            # 99 tokens, 128 embedding rows: transformers adds it at id 99, an untrained row
            edit_json("tokenizer_config.json", {"eos_token": "<|end|>"}),
            "eos_token '<|end|>' is not in tokenizer.json: transformers would add it as a new "
            "token (id 99) the model never trained",
        ),
        (
            edit_json("tokenizer_config.json", {"bos_token": "<bos>"}),
            "bos_token '<bos>' is not in tokenizer.json",
        ),
        (
            # transformers allocated and initialised the layers the weights lack (4,000 layers:
            # 3.9 GB) before check_all_loaded refused them (`common.check_weights_cover_config`)
            edit_json("config.json", {"num_hidden_layers": 400}),
            "its config.json describes a model of 85,332,096 parameters, its weights hold 885,888",
        ),
        (
            # the meta build itself took ~36 KB and 0.7 ms a layer: 10**6 layers, 36 GB
            edit_json("config.json", {"num_hidden_layers": 10**6}),
            "its config.json describes a model of more than 10,624 weight tensors, its weights "
            "hold 39",
        ),
        (
            # 10 GB per rank, refused only by a MemoryError (`common.render_memory_limit`)
            edit_json("tokenizer_config.json", {"chat_template": "{{ 'x' * 10**10 }}"}),
            "the chat template takes more than 1 GiB to render",
        ),
        (
            edit_json(
                "tokenizer_config.json",
                {
                    "chat_template": "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
                    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}"
                },
            ),
            "the chat template takes more than 1 GiB to render",
        ),
        (
            # torch's own text advised loading it with the unsafe loader
            pickled_weights_that_run_code,
            "cannot load (its pickled weights hold the global posix.system: torch's weights-only "
            "loader refuses them, and plainrlhf unpickles nothing else)",
        ),
    ],
    ids=[
        "config-field-type",
        "dropout-not-a-probability",
        "rope-theta-negative",
        "eps-negative",
        "a-nan-weight",
        "a-weight-stored-as-int32",
        "an-unused-weight",
        "no-layers",
        "attention-flex-in-config",
        "attention-a-hub-kernel-in-config",
        "model-max-length-text",
        "zero-heads",
        "generation-config-a-list",
        "eos-a-null-in-a-list",
        "architectures-a-number",
        "architectures-a-number-in-a-list",
        "architectures-a-null",
        "generation-config-cut",
        "tokenizer-config-a-list",
        "tokenizer-json-other",
        "template-raises",
        "template-a-folder",
        "template-syntax",
        "eos-a-string",
        "eos-outside-the-vocabulary",
        "sampling-without-do-sample",
        "eos-token-not-in-tokenizer-json",
        "bos-token-not-in-tokenizer-json",
        "layers-beyond-the-weights",
        "layers-a-million",
        "template-a-huge-string",
        "template-a-doubling-string",
        "pickled-weights-running-code",
    ],
)
def test_a_crafted_model_folder_is_one_line(tmp_path, damage, needle):
    """Crafted fields in a model folder were tracebacks from deep in transformers or Jinja, some
    at load, some at the first prompt or the first evaluation (a stop id outside the vocabulary:
    hours in, for SFT; vLLM's request check, for PPO), or went on silently (an EOS that
    tokenizer.json lacks, added by transformers on an untrained row). In process: the loader."""
    import shutil

    from transformers import AutoModelForCausalLM

    import common
    import task

    task.ensure_tiny_model()
    model_dir = tmp_path / "model"
    shutil.copytree(task.TINY_MODEL, model_dir)
    damage(model_dir)
    with pytest.raises(SystemExit) as exit_info:
        common.load_model_and_tokenizer(str(model_dir), AutoModelForCausalLM)
    line = exit_info.value.code
    assert line.startswith(f"error: --model {model_dir}") and needle in line, line
    assert not (model_dir / "pwned").exists(), "the folder's pickle ran"


def test_a_config_transformers_accepts_but_cannot_run_is_one_line(tmp_path):
    """phi-2's partial_rotary_factor 0.4 at a head of 64 (phi-2's own heads are 80): 25.6 rotary
    dimensions, which transformers' config and loader accept and its forward cannot compute. The
    first step stopped in a traceback from every rank; the loader now runs two tokens through
    the model (`common.check_forward`). The tiny model's tokenizer, a 1-layer phi."""
    from transformers import AutoModelForCausalLM
    from transformers import PhiConfig
    from transformers import PhiForCausalLM

    import common

    task.ensure_tiny_model()
    model_dir = tmp_path / "phi"
    model_dir.mkdir()
    for name in os.listdir(task.TINY_MODEL):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            shutil.copy(os.path.join(task.TINY_MODEL, name), model_dir)
    shape = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=1)
    config = PhiConfig(
        **shape, num_attention_heads=2, partial_rotary_factor=0.4, bos_token_id=1, eos_token_id=2
    )
    PhiForCausalLM(config).save_pretrained(model_dir)
    with pytest.raises(SystemExit) as exit_info:
        common.load_model_and_tokenizer(str(model_dir), AutoModelForCausalLM)
    line = exit_info.value.code
    assert line == (
        f"error: --model {model_dir}: transformers cannot run the model its config.json "
        "describes (a forward pass of two tokens fails: RuntimeError: The size of tensor a (25) "
        "must match the size of tensor b (26) at non-singleton dimension 3)"
    ), line


def test_a_read_error_names_the_file():
    """An I/O error while reading a data file (a failing disk, a network mount; here the kernel's
    EIO from /proc/self/mem) carries no file name: the line said only "[Errno 5] Input/output
    error"."""
    import common

    with pytest.raises(SystemExit, match="error: /proc/self/mem: Input/output error"):
        common.load_jsonl("/proc/self/mem", ["prompt"])


def test_a_line_too_long_to_be_a_row_is_one_line_read_no_further(tmp_path, monkeypatch):
    """A whole dataset minified onto one line (a JSON array, not JSONL) or a binary file: the
    line was read whole, decoded and parsed before its shape was checked (minutes, and the
    machine's memory, for gigabytes). Now one line once MAX_LINE_BYTES are read (1 MiB here)."""
    import common

    monkeypatch.setattr(common, "MAX_LINE_BYTES", 2**20)
    path = tmp_path / "array.json"
    row = '{"prompt": "1+1=", "response": "2"}'
    path.write_text(row + "\n[" + ", ".join([row] * 40_000) + "]")  # 1.4 MB, no newline
    with pytest.raises(SystemExit) as exit_info:
        common.load_jsonl(str(path), ["prompt", "response"])
    assert exit_info.value.code == (
        f"error: {path}:2: a line longer than 1 MiB; expected JSONL, one JSON object of one "
        "example per line"
    )
    path.write_text(row + "\n" + row)  # the last line without its newline is a row
    assert len(common.load_jsonl(str(path), ["prompt", "response"])) == 2
    # a row of exactly the limit is one, whatever its line ending (CRLF: the limit + 2 bytes)
    fill = 2**20 - len('{"prompt": "", "response": "2"}')
    longest = '{"prompt": "' + "x" * fill + '", "response": "2"}'
    path.write_bytes(f"{longest}\r\n{longest}\n{row}".encode())
    assert len(common.load_jsonl(str(path), ["prompt", "response"])) == 3


def test_restarts_on_several_nodes_through_one_shared_store_are_refused(tmp_path):
    """torchrun on 2 nodes with --max-restarts and its default store, shared by every round: each
    node counts its own restarts, so a restarted group waited under two store prefixes until the
    timeout (`common.check_restarts_can_meet`). One line instead, before any rendezvous; the
    environment is what torchrun gives a rank of such a run."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "2"}
    env.update({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"})
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})  # never reached
    p = run_py("train_sft.py", "--out_dir", tmp_path / "out", env=env)
    assert_one_line_error(
        p,
        "torchrun on 2 nodes with --max-restarts 3 shares one store",
        "Use --rdzv-backend c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node",
    )


def test_a_byte_order_mark_is_not_bad_input(tmp_path):
    """A JSONL file that starts with a UTF-8 byte-order mark (Notepad, PowerShell) is read."""
    import common

    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "1+1=", "response": "2"}\n')
    assert common.load_jsonl(str(path), ["prompt", "response"]) == [
        (f"{path}:1", {"prompt": "1+1=", "response": "2"})
    ]


def ppo_with_classifier_as_reward_model(tmp_path, auto_class, num_labels):
    """(its folder, the run): a tiny classifier of the given transformers class and outputs,
    saved with a tokenizer, given to a one-step PPO run as --reward_model."""
    from transformers import AutoTokenizer

    import task

    task.ensure_tiny_model()
    reward_dir = tmp_path / "classifier"
    model = auto_class.from_pretrained(task.TINY_MODEL, num_labels=num_labels)
    model.save_pretrained(reward_dir)
    AutoTokenizer.from_pretrained(task.TINY_MODEL).save_pretrained(reward_dir)
    args = ("--model", task.TINY_MODEL, "--out_dir", tmp_path / "out", "--rollout_engine", "hf")
    args += ("--reward_model", reward_dir, "--eval_samples", 4, "--max_steps", 1)
    return reward_dir, run_py("train_ppo.py", *args)


def test_a_classifier_of_two_labels_is_no_reward_model(tmp_path):
    """A 2-label sequence classifier (a sentiment model, say) given as --reward_model failed on its
    head's shape with transformers' RuntimeError; one line names the flag and the outputs."""
    from transformers import AutoModelForSequenceClassification

    auto_class = AutoModelForSequenceClassification
    reward_dir, p = ppo_with_classifier_as_reward_model(tmp_path, auto_class, 2)
    assert_one_line_error(p, f"--reward_model {reward_dir}: a classifier with 2 outputs")


def test_a_token_classifier_is_no_reward_model(tmp_path):
    """A PPO critic's export (a token classifier: a value per token, its head with a bias) given
    as --reward_model loaded as a sequence classifier, its head's bias dropped without a word,
    and PPO trained on the value at the last token as its reward; one line names the flag."""
    from transformers import AutoModelForTokenClassification

    auto_class = AutoModelForTokenClassification
    critic_dir, p = ppo_with_classifier_as_reward_model(tmp_path, auto_class, 1)
    assert_one_line_error(p, f"--reward_model {critic_dir}: a token classifier", "not a reward")


@pytest.mark.slow
def test_a_memory_store_under_two_ranks_is_refused_at_the_start(tmp_path):
    """fsspec's memory:// store is one process's own memory: under two ranks each wrote its own
    objects where the other could not see them, and the first save failed (or, before the
    commit checked every rank's objects, committed a checkpoint missing rank 1's). Now the start
    says so in one line (launch.sh: torchrun's own report left out; `common.first_to_say`)."""
    cmd = ["bash", os.path.join(REPO, "launch.sh"), "sft", "--out_dir", "memory://two/sft"]
    cmd += ["--max_steps", "2", "--save_every", "2", "--eval_every", "0", "--local_dir", tmp_path]
    env = {**os.environ, **CPU_ONLY}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert_one_line_error(p, "memory:// is one process's memory; 2 ranks need a store")
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, p.stderr  # both ranks' line, once, and nothing else


def test_several_nodes_without_master_addr_is_one_line(tmp_path):
    """`NNODES=2 ./launch.sh sft` without MASTER_ADDR: each node hosted its own rendezvous on its
    loopback and waited for the others there, then failed with a traceback after 10 minutes."""
    cmd = ["bash", os.path.join(REPO, "launch.sh"), "sft", "--out_dir", tmp_path / "out"]
    env = {**os.environ, **CPU_ONLY, "NNODES": "2"}
    env.pop("MASTER_ADDR", None)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert p.returncode == 2
    assert_one_line_error(
        p, "error: NNODES=2 needs MASTER_ADDR: one node's address (it hosts the rendezvous)"
    )
    assert not (tmp_path / "out").exists()


def test_several_nodes_never_install_the_venv_at_once(tmp_path):
    """On several nodes, a .venv that is missing or not current for the machine (setup run on a
    login node without GPUs) was installed by every node at once into one shared folder. Now
    each node stops with one line: run setup once, on one node. (A copy of the launcher, in a
    folder without .venv.)"""
    for name in ("launch.sh", "requirements.txt", "requirements-cpu.txt"):
        shutil.copy(os.path.join(REPO, name), tmp_path / name)
    env = {**os.environ, **CPU_ONLY, "NNODES": "2", "MASTER_ADDR": "127.0.0.1"}
    cmd = ["bash", str(tmp_path / "launch.sh"), "sft"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert p.returncode == 2
    assert_one_line_error(
        p, "error: .venv is missing or not current for this machine", "once on one"
    )
    assert not (tmp_path / ".venv").exists()


def test_the_default_rule_on_prompts_that_are_no_sums_is_refused_at_the_start(tmp_path):
    """--data of a user's prompts with the default --reward_fn, the embedded task's rule, failed
    at the first scoring ("not enough values to unpack"), after the engine had started."""
    data = tmp_path / "chat.jsonl"
    data.write_text('{"prompt": "12+30="}\n{"prompt": "Say hi"}\n')
    args = ("--model", task.TINY_MODEL, "--data", data, "--out_dir", tmp_path / "out")
    p = run_py("train_ppo.py", *args, "--max_steps", 1, "--rollout_engine", "hf")
    assert_one_line_error(
        p, f"{data}:2: --reward_fn task:reward_fn, the embedded task's rule, scores 'a+b='"
    )


# Nested loops of 10**10 steps in all: hours of rendering (Jinja's sandbox caps one range only)
ENDLESS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def test_a_chat_template_that_never_ends_is_one_line(tmp_path, monkeypatch):
    """A crafted template that loops for hours hung the start, and SIGTERM could not end it (a
    signal during setup is kept for the first step's save): its rendering is stopped after
    `common.TEMPLATE_SECONDS` (1 s here), at load and on a row's prompt alike."""
    from transformers import AutoModelForCausalLM
    from transformers import AutoTokenizer

    import common

    monkeypatch.setattr(common, "TEMPLATE_SECONDS", 1)
    task.ensure_tiny_model()
    model_dir = tmp_path / "model"
    shutil.copytree(task.TINY_MODEL, model_dir)
    edit_json("tokenizer_config.json", {"chat_template": ENDLESS})(model_dir)
    with pytest.raises(SystemExit) as exit_info:
        common.load_model_and_tokenizer(str(model_dir), AutoModelForCausalLM)
    assert exit_info.value.code == (
        f"error: --model {model_dir}: the chat template is still rendering after 1 s (a loop "
        "without end?)"
    )
    # a template that loops on one row's prompt only: named by the row
    tok = AutoTokenizer.from_pretrained(task.TINY_MODEL)
    tok.chat_template = "{% if messages[0].content == 'x' %}" + ENDLESS + "{% endif %}ok"
    assert common.render_prompt(tok, "1+1=", "d.jsonl:1", tokenize=False) == "ok"
    with pytest.raises(SystemExit) as exit_info:
        common.render_prompt(tok, "x", "d.jsonl:2", tokenize=False)
    assert exit_info.value.code.startswith("error: d.jsonl:2: the chat template is still")
    # one that loops on an assistant turn only, which the stop id's rendering asks for
    tok.chat_template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}" + ENDLESS + "{% endif %}"
        "{% endfor %}ok"
    )
    with pytest.raises(SystemExit) as exit_info:
        common.response_end_id(tok)
    assert exit_info.value.code.startswith(
        f"error: {task.TINY_MODEL}: an assistant turn: the chat template is still rendering"
    )
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL  # the handler before, restored
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    # a timer already running (a harness's) goes on with what was left of it
    signal.setitimer(signal.ITIMER_REAL, 100)
    try:
        assert common.render_prompt(tok, "1+1=", "d.jsonl:1", tokenize=False) == "ok"
        assert 99 < signal.getitimer(signal.ITIMER_REAL)[0] <= 100
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def test_a_bin_folder_with_an_adapter_beside_it_loads(tmp_path):
    """from_pretrained reads pytorch_model.bin where the folder has no model.safetensors: an
    adapter_model.safetensors kept beside a merged model is not its weights, and was counted as
    them (`common.check_weights_cover_config`: "describes a model of 885,888 parameters, its
    weights hold 512")."""
    import safetensors.torch
    from transformers import AutoModelForCausalLM

    import common

    task.ensure_tiny_model()
    folder = tmp_path / "model"
    shutil.copytree(task.TINY_MODEL, folder)
    tensors = safetensors.torch.load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save(tensors, folder / "pytorch_model.bin")
    adapter = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64)}
    safetensors.torch.save_file(adapter, str(folder / "adapter_model.safetensors"))
    common.load_model_and_tokenizer(str(folder), AutoModelForCausalLM)
