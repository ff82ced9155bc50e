"""metrics.jsonl always; TensorBoard event files with --tensorboard;
`plot.py` draws a run's curves."""

import json

from conftest import run_py


def test_tensorboard_events_match_metrics_jsonl_and_plot_draws_them(tmp_path):
    out = tmp_path / "run"
    args = ("--out_dir", out, "--max_steps", 3, "--train_batch_size", 8, "--micro_batch_size", 8)
    args += ("--eval_samples", 8, "--eval_every", 2, "--tensorboard", "true")
    p = run_py("train_sft.py", *args)
    assert p.returncode == 0, p.stderr[-3000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    for key in ("train/loss", "train/lr", "eval/accuracy"):
        want = [(r["step"], r[key]) for r in rows if key in r]
        got = [(e.step, e.value) for e in events.Scalars(key)]
        same_steps = [s for s, _ in got] == [s for s, _ in want]
        close = all(abs(a[1] - b[1]) < 1e-6 * max(1, abs(b[1])) for a, b in zip(got, want))
        assert same_steps and close, (key, got, want)

    p = run_py("plot.py", out, tmp_path / "curves.png")
    assert p.returncode == 0, p.stderr
    png = (tmp_path / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    p = run_py("plot.py", tmp_path / "nothing-here")
    missing = tmp_path / "nothing-here" / "metrics.jsonl"
    expected = f"error: {missing}: no such file (expected a run's --out_dir)"
    assert p.returncode != 0 and p.stderr.strip() == expected
    # a store run's --out_dir: its logs are local, at --local_dir (said, not guessed at silently)
    p = run_py("plot.py", "s3://bucket/run")
    expected = (
        "error: s3://bucket/run: plot reads a local folder; a run on an object store writes its "
        "metrics.jsonl to its --local_dir (default runs/store/bucket/run): plot that"
    )
    assert p.returncode == 1 and p.stderr.strip() == expected, p.stderr


def test_plot_help_and_crafted_metrics_lines_are_one_line(tmp_path):
    """`plot.py --help` took --help for a run folder; a line that is not a metrics row (edited by
    hand, or another file) was a json or matplotlib traceback. Each is one line now, naming the
    file and line."""
    p = run_py("plot.py", "--help")
    assert p.returncode == 0 and "./launch.sh plot runs/demo/ppo" in p.stdout, p.stdout
    good = '{"step": 1, "train/loss": 0.5}\n'
    cases = {
        "{bad}\n": ":2: not a JSON object",
        "not json at all\n": ":2: not a JSON object",  # was skipped: only "}\n" lines were read
        "[1, 2]\n": ':2: expected a JSON object with an integer "step"',
        '{"step": "2"}\n': ':2: expected a JSON object with an integer "step"',
        '{"step": 2, "train/loss": "x"}\n': ":2: train/loss: expected a number, got 'x'",
        '{"step": 2, "eval/accuracy": true}\n': ":2: eval/accuracy: expected a number",
        '{"step": 2, "objective/rule/m.f": []}\n': ":2: objective/rule/m.f: expected a number",
    }
    for line, needle in cases.items():
        (tmp_path / "metrics.jsonl").write_text(good + line)
        p = run_py("plot.py", tmp_path, tmp_path / "curves.png")
        assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr
        assert p.stderr.startswith(f"error: {tmp_path / 'metrics.jsonl'}") and needle in p.stderr
    # a last line cut by a kill is no error: the whole lines are drawn
    (tmp_path / "metrics.jsonl").write_text(good + '{"step": 2, "train/lo')
    p = run_py("plot.py", tmp_path, tmp_path / "curves.png")
    assert p.returncode == 0, p.stderr
    # several reward rules: each one's score is drawn beside the sum's
    rules = (
        '{"step": 1, "objective/score": 1.5, "objective/rule/m.f": 1, "objective/rule/m.g": 0.5}'
    )
    (tmp_path / "metrics.jsonl").write_text(rules + "\n")
    p = run_py("plot.py", tmp_path, tmp_path / "curves.png")
    assert p.returncode == 0, p.stderr
