"""`libra rollout --workers N` (#22): episodes run in N worker processes behind one
front; against fake vLLM servers on loopback (only the model is scripted)."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

from libra.endpoints.config import BucketConfig
from libra.record import Trajectory, read_jsonl
from libra.rollout import rollout
from tests.integration.test_rollout import cfg, run_cli


def worker_pids() -> list[int]:
    """This process's children that are rollout workers."""
    pids = []
    me = os.getpid()
    for tid in os.listdir(f"/proc/{me}/task"):
        with open(f"/proc/{me}/task/{tid}/children") as f:
            pids += [int(p) for p in f.read().split()]
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"libra.rollout.worker" in f.read():
                    out.append(pid)
        except FileNotFoundError:
            pass
    return out


async def test_a_worker_killed_mid_batch_loses_and_repeats_nothing(
    tmp_path: Path, tiny_model: Path, spawn_fake, capfd
) -> None:
    url, _ = spawn_fake(delay=0.05)
    c = cfg(tmp_path, tiny_model, [BucketConfig(name="tp1", endpoints=[url])],
            env="arith", group_size=4, concurrency=16, workers=2)  # fmt: skip
    killed: list[int] = []

    def on_record(rec: Trajectory) -> None:
        if len(killed) == 0 and rec.seq == 40:
            pids = worker_pids()
            assert len(pids) == 2
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])

    summary = await rollout(c, on_record=on_record, progress=False)
    recs = read_jsonl(c.out)
    assert killed
    assert summary["episodes"] == len(recs) == 64 * 4
    assert len({r.id for r in recs}) == 256  # each episode once
    assert [r.seq for r in recs] == list(range(256))
    assert all(r.status == "ok" and r.reward == 1.0 for r in recs), {r.status for r in recs}
    assert summary["status"] == {"ok": 256} and summary["mean_reward"] == 1.0
    # The killed worker had episodes running; they ran again (on a live worker).
    err = capfd.readouterr().err
    assert re.search(r"exited with -9; its [1-9]\d* running episodes run again", err), err


def test_cli_workers_flag(tmp_path: Path, tiny_model: Path, spawn_fake) -> None:
    url, _ = spawn_fake()
    out = tmp_path / "out.jsonl"
    r = run_cli("rollout", "--env", "arith", "--num-tasks", "6", "--group-size", "2",
                "--workers", "2", "--model", str(tiny_model), "--endpoint", f"tp1={url}",
                "--out", str(out), "--quiet", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    recs = read_jsonl(out)
    assert sorted(r.seq for r in recs) == list(range(12))
    assert all(r.status == "ok" for r in recs)
    assert r.stderr.count("rollout worker") == 2, r.stderr  # two started, none died


KILLER_ENV = '''
import os

import libra
from libra.envs.arith import Arith, calculator


@libra.tool(name="calculator")
def deadly(expression: str, ctx: libra.Context) -> str:
    """Ends its whole process for one task.

    Args:
        expression: what to evaluate.
    """
    if ctx.task["id"] == "bad":
        os._exit(7)
    return calculator.fn(expression)


class Killer(Arith):
    tools = [deadly]
'''


async def run_killer(
    tmp_path: Path, model: Path, spawn_fake, env_text: str, innocent: int, concurrency: int
) -> tuple[dict, dict[str, Trajectory]]:
    """`libra rollout` on two workers of the env in `env_text` (class `Killer`): task
    `bad` and `innocent` others, `concurrency` at once. (summary, records by task id)."""
    import orjson

    url, _ = spawn_fake()
    (tmp_path / "killer.py").write_text(env_text)
    tasks = tmp_path / "tasks.jsonl"
    rows = [{"id": "bad", "question": "What is 2 + 3?", "answer": "5"}] + [
        {"id": f"q{i}", "question": f"What is {i} + 1?", "answer": str(i + 1)}
        for i in range(innocent)
    ]
    tasks.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    c = cfg(tmp_path, model, [BucketConfig(name="tp1", endpoints=[url])],
            env=f"{tmp_path}/killer.py:Killer", tasks=str(tasks), concurrency=concurrency,
            workers=2)  # fmt: skip
    summary = await rollout(c, progress=False)
    return summary, {r.task_id: r for r in read_jsonl(c.out)}


async def test_an_episode_that_kills_its_worker_is_an_error_record_and_the_batch_goes_on(
    tmp_path: Path, tiny_model: Path, spawn_fake
) -> None:
    """It killed the worker at every try; after MAX_LOST the batch itself raised, its
    other episodes aborted, no summary."""
    from libra.rollout.workers import MAX_LOST

    summary, recs = await run_killer(tmp_path, tiny_model, spawn_fake, KILLER_ENV, 6, 2)
    assert summary["episodes"] == len(recs) == 7
    bad = recs.pop("bad")
    assert bad.status == "error"
    assert bad.error == (f"{MAX_LOST} rollout workers died while running it (a process exit "
                         "or crash in the env's code?); it is not run again")  # fmt: skip
    assert {r.status for r in recs.values()} == {"ok"}


SLOW_KILLER_ENV = KILLER_ENV.replace(
    "        os._exit(7)\n",
    "        os._exit(7)\n    time.sleep(0.5)  # the others are still running when it strikes\n",
).replace("import os\n", "import os\nimport time\n")


async def test_episodes_that_shared_a_worker_with_a_killer_are_not_its_victims(
    tmp_path: Path, tiny_model: Path, spawn_fake, capfd
) -> None:
    """Two workers, twelve episodes at once, one of which kills its worker at every try.
    The episodes that died with it ran again beside it, died with it again and, at the
    third death, were recorded as errors with it (which one killed the worker cannot be
    told). Now the ones that died together are kept apart at their last try: only the
    killer's record is an error."""
    summary, recs = await run_killer(tmp_path, tiny_model, spawn_fake, SLOW_KILLER_ENV, 11, 12)
    assert summary["episodes"] == len(recs) == 12
    assert recs.pop("bad").status == "error"
    assert {t: r.status for t, r in recs.items() if r.status != "ok"} == {}
    assert {r.reward for r in recs.values()} == {1.0}
    # the innocent ones did die with it (else this shows nothing)
    died = re.findall(
        r"exited with 7; its (\d+) running episodes run again", capfd.readouterr().err
    )
    assert len(died) >= 3 and sum(map(int, died)) > 3, died
