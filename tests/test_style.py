"""The house style, where ruff cannot see it (README, "House style"), and the docs kept true.

ruff (ruff.toml; `./launch.sh test` runs `ruff check` and `ruff format --check` before pytest) holds
line length, formatting, one statement and one import per line. This file holds what makes code hard
to read yet passes ruff: walrus operators, nested conditional expressions, loops over conditional or
sliced expressions, side effects inside comprehensions, several values or calls packed into one
statement, and helpers longer than 50 lines.
"""

import ast
import dataclasses
import glob
import os
import re
import subprocess
import sys

import pytest

from conftest import PY
from conftest import REPO

# The product's files: the rules hold everywhere, the 50-line limit for helpers here.
PRODUCT = [
    "common.py",
    "checkpoint.py",
    "rollout.py",
    "task.py",
    "train_sft.py",
    "train_rm.py",
    "train_ppo.py",
    "train_dpo.py",
    "objstore.py",
]
MAX_HELPER_LINES = 50
# Methods whose call changes something: a comprehension that calls them is a loop in disguise.
MUTATORS = {
    "append",
    "extend",
    "add",
    "update",
    "pop",
    "remove",
    "discard",
    "insert",
    "clear",
    "setdefault",
    "write",
    "writelines",
    "send_signal",
    "kill",
    "put",
    "backward",
    "step",
    "zero_grad",
    "copy_",
    "add_",
    "mul_",
}


def python_files():
    found = []
    for pattern in ("*.py", "tests/*.py", "bench/*.py"):
        found.extend(glob.glob(os.path.join(REPO, pattern)))
    return sorted(found)


def called_name(node):
    """The name of the function or method a Call calls, or None."""
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    if isinstance(node.func, ast.Name):
        return node.func.id
    return None


def is_sliced(node):
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice)


def is_mutating_call(node):
    """A call that changes something: a known mutator, an in-place tensor method (`zero_`,
    `clamp_`: a name ending in one underscore), print/exec/setattr, or any torch.distributed
    call (`dist.all_reduce`: a collective)."""
    name = called_name(node)
    if name is None:
        return False
    in_place = name.endswith("_") and not name.startswith("__")
    func = node.func
    collective = isinstance(func, ast.Attribute) and ast.unparse(func.value) == "dist"
    return name in MUTATORS or name in ("print", "exec", "setattr") or in_place or collective


def comprehension_problems(node):
    problems = []
    # elt: list/set/generator comprehensions; key and value: dict comprehensions; and the
    # generators' `if` clauses, where a side effect hides as well as in the element
    parts = [getattr(node, field, None) for field in ("elt", "key", "value")]
    for generator in node.generators:
        if isinstance(generator.iter, ast.IfExp) or is_sliced(generator.iter):
            problems.append("a comprehension over a conditional or sliced expression")
        parts.extend(generator.ifs)
    for part in parts:
        if part is None:
            continue
        for inner in ast.walk(part):
            if isinstance(inner, ast.Call) and is_mutating_call(inner):
                problems.append(f"a side effect ({called_name(inner)}) inside a comprehension")
    return problems


def statement_problems(node):
    problems = []
    if isinstance(node, (ast.For, ast.AsyncFor)):
        if isinstance(node.iter, ast.IfExp) or is_sliced(node.iter):
            problems.append("a for loop over a conditional or sliced expression")
    if isinstance(node, ast.Expr):
        if isinstance(node.value, ast.Tuple):
            problems.append("several expressions packed into one statement")
        comprehensions = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
        if isinstance(node.value, comprehensions):
            problems.append("a comprehension used for its side effects")
    if isinstance(node, ast.Assign):
        sequences = (ast.Tuple, ast.List)
        packed = isinstance(node.value, sequences) and len(node.value.elts) > 1
        if packed and any(isinstance(t, sequences) for t in node.targets):
            problems.append("unrelated values sharing one assignment (a, b = x, y)")
        if len(node.targets) > 1:
            problems.append("one value for several names (a = b = x)")
    return problems


def nested_conditional(node):
    """An IfExp anywhere inside another IfExp (`f(1 if a else 2) if b else 3` too)."""
    children = [n for n in ast.walk(node) if n is not node]
    return any(isinstance(child, ast.IfExp) for child in children)


def function_length(node):
    """Lines from the first decorator (they are the function's too) to the end."""
    first = node.lineno
    if node.decorator_list:
        first = node.decorator_list[0].lineno
    return node.end_lineno - first + 1


def style_problems(path, check_length):
    """[(line, what)] for one file."""
    tree = ast.parse(open(path).read(), path)
    problems = []
    for node in ast.walk(tree):
        found = statement_problems(node)
        if isinstance(node, ast.NamedExpr):
            found.append("a walrus operator")
        if isinstance(node, ast.IfExp) and nested_conditional(node):
            found.append("a nested conditional expression")
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            found.extend(comprehension_problems(node))
        is_function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        if check_length and is_function and node.name != "main":
            length = function_length(node)
            if length > MAX_HELPER_LINES:
                found.append(f"{node.name}() is {length} lines (helpers: <= {MAX_HELPER_LINES})")
        for what in found:
            problems.append((node.lineno, what))
    return problems


@pytest.mark.parametrize("path", python_files(), ids=lambda p: os.path.relpath(p, REPO))
def test_house_style(path):
    check_length = os.path.basename(path) in PRODUCT and os.path.dirname(path) == REPO
    problems = style_problems(path, check_length)
    lines = [f"{os.path.relpath(path, REPO)}:{line}: {what}" for line, what in sorted(problems)]
    assert not lines, "\n".join(lines)


def test_the_style_checker_catches_each_trick(tmp_path):
    """Each trick the style test exists for, in a file of its own: each must be found."""
    tricks = {
        "if (n :" + "= 3):\n    pass\n": "walrus",  # split, so that a grep for walruses stays quiet
        "x = 1 if a else 2 if b else 3\n": "nested conditional",
        "for x in [1, 2][:1]:\n    raise ValueError\n": "sliced",
        "for x in (a if b else c):\n    pass\n": "conditional or sliced",
        "ys = [out.append(x) for x in xs]\n": "side effect (append)",
        "[print(x) for x in xs]\n": "for its side effects",
        "random.seed(1), np.random.seed(1)\n": "packed into one statement",
        "start, path = 0, resolve()\n": "one assignment",
        "def f():\n" + "    x = 1\n" * 50: "helpers",
        # the gaps a style audit found (2026-11-25), each a trick the checks above let through
        "ys = [x for x in xs if seen.add(x) is None]\n": "side effect (add)",
        "ys = [t.zero_() for t in ts]\n": "side effect (zero_)",
        "ys = [dist.all_reduce(t) for t in ts]\n": "side effect (all_reduce)",
        "x = f(1 if a else 2) if b else 3\n": "nested conditional",
        "x = (1 if a else 2) + 1 if b else 3\n": "nested conditional",
        "a, b = [0, []]\n": "one assignment",
        "[a, b] = 0, []\n": "one assignment",
        "a = b = []\n": "several names",
        "@decorator\n@decorator\ndef f():\n" + "    x = 1\n" * 48: "helpers",
    }
    for i, (source, needle) in enumerate(tricks.items()):
        path = tmp_path / f"trick{i}.py"
        path.write_text(source)
        found = [what for _, what in style_problems(str(path), check_length=True)]
        assert any(needle in what for what in found), (source, found)


def test_plain_code_passes_the_style_checker(tmp_path):
    path = tmp_path / "plain.py"
    path.write_text(
        "a, b = pair\n"
        "x = 1 if a else 2\n"
        "for x in range(3):\n"
        "    ys = [y * 2 for y in xs if y]\n"
        "    first = xs[:1]\n"
        "total, count = sum_and_count.unbind()\n"
        "ys = [x.__len__() for x in xs]\n"
    )
    assert style_problems(str(path), check_length=True) == []


def test_no_unsafe_loading():
    """Nothing the product runs unpickles (the tests build crafted pickles on purpose)."""
    product = [f for f in python_files() if os.sep + "tests" + os.sep not in f]
    for f in product:
        src = open(f).read()
        assert "weights_only=False" not in src.replace("torch.load(weights_only=False)", ""), f
        assert not re.search(r"pickle\.loads?\(", src), f"{f}: plain pickle.load"


def test_help_documents_every_flag():
    cmd = [PY, "train_sft.py", "--help"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
    flags = ("--model", "--data", "--out_dir", "--max_steps", "--save_every", "--keep_last")
    flags += ("--resume", "--seed", "--train_batch_size", "--micro_batch_size", "--lr")
    for flag in flags:
        assert flag in out
    assert "examples per optimizer step, over all ranks" in out


def test_readme_cites_functions_that_exist():
    """The README cites code as `file.py: name` (a function, class or constant), never by line
    number; every cited name must exist in that file, so a rename must update the README."""
    readme = open(os.path.join(REPO, "README.md")).read()
    assert not re.search(r"\.py#L\d+", readme), "the README links to line numbers"
    refs = re.findall(r"`(\w+\.py): (\w+)`", readme)
    assert len(refs) >= 20, refs
    missing = []
    for f, name in refs:
        tree = ast.parse(open(os.path.join(REPO, f)).read())
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            if isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        if name not in names:
            missing.append(f"{f}: {name}")
    assert not missing, f"the README cites names that do not exist: {missing}"


def test_readme_documents_every_flag_and_metric():
    readme = open(os.path.join(REPO, "README.md")).read()
    sys.path.insert(0, REPO)
    import train_dpo
    import train_ppo
    import train_rm
    import train_sft

    for cls in (train_sft.Args, train_rm.Args, train_ppo.Args, train_dpo.Args):
        missing = [f.name for f in dataclasses.fields(cls) if f"`--{f.name}`" not in readme]
        assert not missing, f"flags missing from the README: {missing}"
    keys = set()
    pattern = r'"((?:objective|policy|val|train|eval|time|rollout|rewards|logps)/\w+)"'
    for f in ("train_sft.py", "train_rm.py", "train_ppo.py", "train_dpo.py"):
        keys |= set(re.findall(pattern, open(os.path.join(REPO, f)).read()))
    missing = [k for k in keys if k not in readme]
    assert len(keys) > 20 and not missing, missing


def test_stages_share_their_common_flags_without_copying_them():
    """Every stage's Args derives the flags all stages have from common.RunArgs instead of
    declaring them again, and --help lists the stage's own flags first, then the shared ones."""
    sys.path.insert(0, REPO)
    import common
    import train_dpo
    import train_ppo
    import train_rm
    import train_sft

    shared = [f.name for f in dataclasses.fields(common.RunArgs)]
    for stage in (train_sft, train_rm, train_ppo, train_dpo):
        assert issubclass(stage.Args, common.RunArgs), stage.__name__
        own = stage.Args.__annotations__
        assert not set(own) & set(shared), (stage.__name__, set(own) & set(shared))
        text = common.build_parser(stage.Args).format_help()
        own_group = text.index(f"{stage.__name__}.py's flags")
        shared_group = text.index("flags every stage has (common.RunArgs)")
        model_help = text.index("--model ", own_group)
        assert model_help < shared_group < text.index("--resume ", shared_group), text
        assert all(text.count(f"--{name} ") == 2 for name in shared), text  # usage + help


def test_readme_commands_and_flag_values_parse(monkeypatch, tmp_path):
    """Every `./launch.sh <stage> ...` command the README shows parses with that stage's flags
    (a renamed flag, a choice that is gone, a value out of range would fail the reader's first
    try), a PPO command passes `train_ppo.check_args` too (flags that do not go together, batch
    sizes that do not divide at launch.sh's 2 ranks; its `my_rewards.py` is the README's own),
    and every `--flag value` it quotes of a flag with choices (a Literal or a bool) names one of
    them."""
    sys.path.insert(0, REPO)
    readme = open(os.path.join(REPO, "README.md")).read().replace("\\\n", " ")
    example = re.search(r"```python\n( *)(# my_rewards\.py.*?)```", readme, re.S)
    assert example, "README: the my_rewards.py example is gone"
    code = re.sub(f"(?m)^{example.group(1)}", "", example.group(2))  # the list item's indent
    (tmp_path / "my_rewards.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    import common
    import train_dpo
    import train_ppo
    import train_rm
    import train_sft

    stages = {"sft": train_sft, "rm": train_rm, "ppo": train_ppo, "dpo": train_dpo}
    # up to the end of the code span or line, a comment or the shell's & | ; < >
    commands = re.findall(r"\./launch\.sh (sft|rm|ppo|dpo)( --[^`#\n&|;<>]*)", readme)
    assert len(commands) >= 10, commands
    for stage, line in commands:
        words = re.sub(r"\[[^\]]*\]", "", line).replace("...", "").split()
        try:
            monkeypatch.setattr(sys, "argv", [f"train_{stage}.py", *words])
            args = common.parse_args(stages[stage].Args, stages[stage].LIMITS)
            if stage == "ppo":
                train_ppo.check_args(args, 2)  # launch.sh's process count on a CPU machine
        except SystemExit as e:
            raise AssertionError(f"README: ./launch.sh {stage}{line}: {e.code}") from None
    choices = {}
    for stage in stages.values():
        for action in common.build_parser(stage.Args)._actions:
            if action.choices:
                choices[action.option_strings[0]] = set(map(str, action.choices))
            if action.type is common.parse_bool:
                choices[action.option_strings[0]] = {"true", "false"}
    quoted = re.findall(r"`(--\w+) ([\w|.-]+)`", readme)
    checked = [(flag, value) for flag, value in quoted if flag in choices]
    assert len(checked) >= 15, checked
    wrong = [f"{flag} {value}" for flag, value in checked if set(value.split("|")) - choices[flag]]
    assert not wrong, f"the README quotes values these flags do not take: {wrong}"
