"""Bad input to the command line is one line naming the problem and the fix, exit 2, and
nothing is written or destroyed (each case below was a traceback, a wrong exit status,
or a file emptied)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from libra.cli import main
from tests.conftest import ROOT

TRAIN = str(ROOT / "examples/cpu-train.toml")


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], says: str) -> None:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code  # type: ignore[assignment]
    err = capsys.readouterr().err.strip()
    assert code == 2, (argv, err)
    assert err.startswith("libra: error: ") and "\n" not in err, err
    assert says in err, err


def test_bad_values_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'out = "\xff\xfe"\n')
    cases = [
        (["train", str(latin), "--dry-run"], "not UTF-8 text"),
        (["train", str(tmp_path), "--dry-run"], "is not a file"),
        (["plan", "--gpus", "8", "--hardware", str(latin)], "cannot be read as UTF-8 text"),
        (["plan", "--gpus", "8", "--seed", "-1"], "expected an integer >= 0, got -1"),
        (["plan", "--gpus", "8", "--bins", "100000"], "bins: Input should be less than"),
        (["make-model", str(tmp_path / "m"), "--seed", "-1"], "expected an integer >= 0"),
        (["rollout", "--endpoint", "tp1=http://127.0.0.1:9", "--launch", "-1"],
         "argument --launch: expected an integer >= 0"),
        (["serve-engine", "--kv-cache-gib", "nan"], "--kv-cache-gib a number of GiB > 0"),
        (["serve-engine", "--kv-cache-gib", "inf"], "--kv-cache-gib a number of GiB > 0"),
        (["train", TRAIN, "--dry-run", "--set", "rollout.policy=nosuch"],
         "rollout.policy: Input should be 'cmlfq', 'mlfq', 'predictor' or 'static'"),
        (["train", TRAIN, "--dry-run", "--set", "rollout.routing={bogus=1}"],
         "routing: bogus: unknown key"),
        (["train", TRAIN, "--dry-run", "--set", "fleet.buckets=[]"], "fleet.buckets"),
        (["train", TRAIN, "--dry-run", "--set", 'fleet.buckets=[{name="a"},{name="a"}]'],
         "a is named twice"),
        (["train", TRAIN, "--dry-run", "--set", 'weights.host="not a host"'],
         "expected a host name or an IP address"),
        (["train", TRAIN, "--dry-run", "--set", "model.seed=-1"], "model.seed"),
        (["train", TRAIN, "--dry-run", "--set", "trainer.optim.lr=inf"], "trainer.optim.lr"),
        (["train", TRAIN, "--dry-run", "--set", "sft.lr=inf"], "sft.lr"),
        (["profile", "--endpoint", "tp1=http://127.0.0.1:9", "--out", str(tmp_path)],
         "--out"),
        (["bench", "train-ab", TRAIN, "--steps", "0"], "--steps"),
        (["train", TRAIN, "--dry-run", "--set", ".steps=1"],
         "--set .steps=1: the key '.steps' has an empty part"),
        (["train", TRAIN, "--dry-run", "--set", "planner..adapt=false"], "has an empty part"),
        (["train", TRAIN, "--dry-run", "--set", "steps=true"],
         "steps: expected a number, not true/false"),
    ]  # fmt: skip
    for argv, says in cases:
        one_line_error(capsys, argv, says)


def test_rollout_out_that_cannot_take_records_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder, a device or a path under a file as --out: a traceback each (after the
    engines started); --out naming the tasks file appended the records to the tasks."""
    tasks = tmp_path / "t.jsonl"
    tasks.write_text('{"id": "a", "question": "What is 1 + 1?", "answer": "2"}\n')
    base = ["rollout", "--env", "arith", "--endpoint", "tp1=http://127.0.0.1:9"]
    for out, says in ((tmp_path, "is not a regular file"), ("/dev/full", "is not a regular file"),
                      (tasks / "x", "cannot be written"), (tasks, "is the tasks file")):  # fmt: skip
        one_line_error(capsys, [*base, "--tasks", str(tasks), "--out", str(out)], says)
    assert tasks.read_text().count("\n") == 1


def test_eval_routing_needs_a_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["workload", "search-r1", "--out", str(trace), "--steps", "1",
                 "--prompts", "2", "--group", "2"]) == 0  # fmt: skip
    capsys.readouterr()
    one_line_error(capsys, ["eval-routing", str(trace), "--policy", ","], "names no policy")


def test_workload_writes_its_file_whole_or_not_at_all(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keep = tmp_path / "keep.jsonl"
    keep.write_text("important\n")
    one_line_error(capsys, ["workload", "nosuch", "--out", str(keep)], "unknown workload")
    one_line_error(capsys, ["workload", "search-r1", "--out", str(keep),
                            "--param", "nosuch=1"], "has no field")  # fmt: skip
    assert keep.read_text() == "important\n"  # it was emptied before the name was checked
    one_line_error(capsys, ["workload", "search-r1", "--out", str(tmp_path)], "is a folder")
    one_line_error(capsys, ["workload", "search-r1", "--out", str(keep / "x.jsonl")],
                   "its folder cannot be made")  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.jsonl"]  # no part left
    # generator fields that made a ZeroDivisionError, records of -5 tokens, or odds of 2
    for param, says in (("dataset_size=0", "dataset_size must be at least 1"),
                        ("max_context=-5", "max_context must be at least 1"),
                        ("p_give_up=2", "p_give_up is a probability")):  # fmt: skip
        one_line_error(capsys, ["workload", "search-r1", "--out", str(keep), "--param", param],
                       says)  # fmt: skip
    assert keep.read_text() == "important\n"
    # a pipe (as root, a device such as /dev/null) was replaced by a regular file
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    one_line_error(capsys, ["workload", "search-r1", "--out", str(fifo)], "not a regular file")
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    # a link is followed: its target is written, the link stays a link
    link = tmp_path / "link.jsonl"
    link.symlink_to(keep)
    small = ["--steps", "1", "--prompts", "1", "--group", "1"]
    assert main(["workload", "search-r1", "--out", str(link), *small]) == 0
    assert link.is_symlink() and keep.read_text().count("\n") == 1
    assert keep.read_text() != "important\n"


def test_a_dry_run_that_finds_what_stops_a_run_exits_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["train", TRAIN, "--dry-run", "--set", "data.train=/nonexistent.jsonl"]) == 2
    assert "a run stops here: data.train: tasks file '/nonexistent.jsonl' not found" in (
        capsys.readouterr().out
    )
    for change, says in (('sft.expert="garbage"', "sft.expert 'garbage'"),
                         ('model.path="/nonexistent"', "model.path '/nonexistent' is not a model folder")):  # fmt: skip
        assert main(["train", TRAIN, "--dry-run", "--set", change]) == 2
        assert f"a run stops here: {says}" in " ".join(capsys.readouterr().out.split())
    assert main(["train", TRAIN, "--dry-run"]) == 0


def test_tasks_without_the_env_s_fields_are_named_not_a_traceback(
    tmp_path: Path, tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A task file of other rows (say, trajectory records) crashed the warm start with
    `KeyError: 'question'` from deep in the env; the dry run passed it."""
    import asyncio

    from libra.chat import ChatTokenizer
    from libra.errors import ConfigError
    from libra.rollout.run import load_env
    from libra.train.demos import arith_expert, demonstrations

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": "x", "foo": 1}\n')
    assert main(["train", TRAIN, "--dry-run", "--set", f"data.train={rows}"]) == 2
    out = capsys.readouterr().out
    assert "a run stops here: data.train: the env cannot build a prompt from task 'x' " in out
    env = load_env("arith", {})
    with pytest.raises(ConfigError, match=r"sft: the arith env cannot run task 'x' \(KeyError"):
        asyncio.run(demonstrations(env, "arith", ChatTokenizer(tiny_model), [{"id": "x"}],
                                   arith_expert))  # fmt: skip


def test_traces_cut_or_of_other_rows_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import gzip

    trace = tmp_path / "t.jsonl.gz"
    assert main(["workload", "search-r1", "--out", str(trace), "--steps", "2",
                 "--prompts", "4", "--group", "2"]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["plan", "--gpus", "8", "--workload", str(trace)]) == 0  # plan reads .gz
    capsys.readouterr()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(trace.read_bytes()[:500])
    one_line_error(capsys, ["simulate", "--gpus", "8", "--steps", "1", "--systems", "libra",
                            "--workload", str(cut)], "cannot be read whole")  # fmt: skip
    one_line_error(capsys, ["plan", "--gpus", "8", "--workload", str(cut)], "cannot be read")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    one_line_error(capsys, ["simulate", "--gpus", "8", "--steps", "2", "--systems", "libra",
                            "--workload", str(empty)], "holds no trajectory records")  # fmt: skip
    weird = tmp_path / "weird.jsonl"
    weird.write_bytes(gzip.decompress(trace.read_bytes()).splitlines()[0][:-1] + b',"turns":5}\n')
    one_line_error(capsys, ["plan", "--gpus", "8", "--workload", str(weird)],
                   "not a trajectory record: turns: ")  # fmt: skip


def test_a_config_written_for_another_command_says_which(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A train config given to `libra rollout` was eleven 'unknown key' problems on one
    line; it is one sentence naming the command the file is for. A misspelled key in a
    config of the right command is still named as such."""
    rollout = str(ROOT / "examples/cpu-rollout.toml")
    service = str(ROOT / "examples/serve-rollout-vllm.toml")
    for argv, says in (
        (["rollout", TRAIN], "is a `libra train` config, not a `libra rollout` one"),
        (["serve-rollout", TRAIN], f"run `libra train {TRAIN}`"),
        (["train", rollout, "--dry-run"], "is a `libra rollout` config, not a `libra train`"),
        (["rollout", service], f"run `libra serve-rollout {service}`"),
    ):
        one_line_error(capsys, argv, says)
    typo = tmp_path / "typo.toml"
    typo.write_text((ROOT / "examples/cpu-rollout.toml").read_text() + "\nconcurency = 4\n")
    one_line_error(capsys, ["rollout", str(typo)], "concurency: unknown key")


def test_the_dry_run_calls_an_async_prompt_as_a_run_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An env whose `prompt` is `async def` runs (an episode awaits it), but the dry run
    called it plainly and said "env.prompt returned a coroutine": exit 2."""
    (tmp_path / "aprompt.py").write_text(
        "from libra.envs.arith import Arith\n\n\n"
        "class AsyncPrompt(Arith):\n"
        "    async def prompt(self, task):\n"
        "        return super().prompt(task)\n"
    )
    monkeypatch.chdir(ROOT)  # the config's data files are relative to it
    env = f'data.env="{tmp_path}/aprompt.py:AsyncPrompt"'
    assert main(["train", TRAIN, "--dry-run", "--set", env, "--set", "sft.steps=0"]) == 0, (
        capsys.readouterr().out
    )


def test_a_hardware_profile_with_numbers_out_of_range_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`train_mfu = nan` hung `libra plan`; `step_overhead_ms = -1000` printed a rollout
    of -2316 s; a zero efficiency or an intra-node bandwidth of 0 with 8 devices a node
    was a ZeroDivisionError; `memory_gib = inf` a ValueError traceback."""
    base = (ROOT / "libra/planner/data/hardware/a800-80g.toml").read_text().split("[sources]")[0]
    for old, new, says in (
        ("train_mfu = 0.50", "train_mfu = nan", "efficiency train_mfu must be a finite number > 0"),
        ("step_overhead_ms = 1.8", "step_overhead_ms = -1000.0", "step_overhead_s must be"),
        ("comm = 0.75", "comm = 0.0", "efficiency comm must be"),
        ("intra_node_gbps = 200.0", "intra_node_gbps = 0.0", "intra_node_bandwidth must be"),
        ("memory_gib = 80.0", "memory_gib = inf", "memory_bytes must be a finite number > 0"),
        ("hbm_tbps = 2.039", "hbm_tbps = nan", "hbm_bandwidth must be a finite number > 0"),
    ):  # fmt: skip
        hw = tmp_path / "hw.toml"
        assert old in base, old
        hw.write_text(base.replace(old, new))
        one_line_error(capsys, ["plan", "--gpus", "8", "--hardware", str(hw)], says)


def test_a_trace_of_negative_or_no_tokens_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Records of -50,000 tokens ran: `simulate` printed -54 token/s and `plan` a context
    range from -89,229; a trace of zero-token episodes was a ZeroDivisionError."""
    import orjson

    def trace(name: str, total: int, model: int) -> str:
        rec = {"id": "e", "batch_id": "b", "group_id": "g", "env": "x", "task_id": "t",
               "step": 0, "prompt_tokens": 10, "total_tokens": total,
               "turns": [{"start": 0, "model_tokens": model, "tool_tokens": 0, "bucket": "tp1",
                          "endpoint": "u", "policy_version": 0}]}  # fmt: skip
        f = tmp_path / name
        f.write_bytes(orjson.dumps(rec) + b"\n")
        return str(f)

    neg = trace("neg.jsonl", -50_000, -100_000)
    one_line_error(capsys, ["plan", "--gpus", "8", "--workload", neg], "must be finite and >= 0")
    one_line_error(capsys, ["simulate", "--workload", neg, "--gpus", "8", "--steps", "1",
                            "--systems", "libra", "--jobs", "1"], "must be >= 0")  # fmt: skip
    none = tmp_path / "none.jsonl"
    none.write_bytes(orjson.dumps({"id": "e", "batch_id": "b", "group_id": "g", "env": "x",
                                   "task_id": "t", "prompt_tokens": 0, "total_tokens": 0,
                                   "turns": []}) + b"\n")  # fmt: skip
    one_line_error(capsys, ["plan", "--gpus", "8", "--workload", str(none)], "hold no tokens")


def test_analysis_commands_refuse_what_they_cannot_use_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each was a traceback (an OverflowError, IsADirectoryError, NotADirectoryError after
    the whole simulation) or, for a mistyped --gpus, a simulation that never ended."""
    out = str(tmp_path / "w.jsonl")
    small = ["--steps", "1", "--prompts", "1", "--group", "1"]
    for param, says in (("turn_tokens=Infinity", "must be finite"),
                        ("sigma_turn=1e300", "too large to draw lengths")):  # fmt: skip
        one_line_error(capsys, ["workload", "search-r1", "--out", out, *small, "--param", param],
                       says)  # fmt: skip
    assert main(["workload", "search-r1", "--out", out, *small]) == 0
    capsys.readouterr()
    one_line_error(capsys, ["eval-routing", out, "--routing", f"tree_path={tmp_path}"],
                   "cannot be read")  # fmt: skip
    sim = ["simulate", "--steps", "1", "--systems", "libra", "--jobs", "1"]
    one_line_error(capsys, [*sim, "--gpus", "99999999999"], "at most 4096 GPUs")
    one_line_error(capsys, [*sim, "--gpus", "8", "--plot", f"{out}/plots"], "cannot be made")


def test_a_broken_model_config_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hidden_size` "abc", null or 2.9, `num_attention_heads` 0, a list for a file, a
    number for `text_config`, a file that is not UTF-8: tracebacks, or a fraction cut."""
    import json

    good = {"hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 2,
            "vocab_size": 1000, "intermediate_size": 512}  # fmt: skip
    model = tmp_path / "m"
    model.mkdir()
    for doc, says in (
        ({**good, "hidden_size": "abc"}, "hidden_size is 'abc'; expected a whole number"),
        ({**good, "num_hidden_layers": 2.9}, "num_hidden_layers is 2.9"),
        ({**good, "hidden_size": None}, "lacks 'hidden_size'"),
        ({**good, "num_attention_heads": 0}, "num_attention_heads must be >= 1"),
        ([good], "is not a JSON object"),
        ({"text_config": 5}, "text_config is not an object"),
    ):
        (model / "config.json").write_text(json.dumps(doc))
        one_line_error(capsys, ["plan", "--gpus", "8", "--model", str(model)], says)
    (model / "config.json").write_bytes(b'{"hidden_size": "\xff"}')
    one_line_error(capsys, ["plan", "--gpus", "8", "--model", str(model)], "not valid JSON")
