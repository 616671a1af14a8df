"""Regenerate `swe_repair.jsonl`: injected bugs in real projects, validated by their tests.

For each project in `libra.envs.swe_projects.PROJECTS` (sources fetched from PyPI,
pinned by sha256): run its own test suite in a `python` sandbox for the pristine pass
set; then try single-line mutations of its library code in a seeded random order and
keep a mutation when it breaks between 1 and 30 tests (and the suite still finishes in
time). `fail_to_pass` lists the tests it breaks; `pristine_passed` how many pass
without it.

    python envs/data/make_swe_repair.py [--per-project toolz=16 ...] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path
from typing import Any

from libra.envs.swe_projects import PROJECTS, mutations, run_tests, source_dir
from libra.sandboxes import SandboxSpec, open_backend

HERE = Path(__file__).parent
DEFAULT = {"toolz": 16, "inflection": 12, "tabulate": 12, "boltons": 8}


async def bugs_for(backend: Any, name: str, n: int, seed: int) -> list[dict[str, Any]]:
    project = PROJECTS[name]
    src = await asyncio.to_thread(source_dir, project)
    root = f"/work/{name}"
    tests = list(project.tests)
    async with await backend.create(SandboxSpec(image="python", memory_mb=1024)) as sb:
        await sb.copy_in(src, root)
        pristine = await run_tests(sb, root, tests)
        assert pristine.passed and not pristine.failed, f"{name}: pristine suite fails"
        candidates = [m for f in project.sources for m in mutations(f, (src / f).read_text())]
        random.Random(seed).shuffle(candidates)
        out: list[dict[str, Any]] = []
        for m in candidates:
            if len(out) >= n:
                break
            text = (src / m.file).read_text()
            await sb.write_file(f"{root}/{m.file}", m.apply(text))
            run = await run_tests(sb, root, tests, timeout=120)
            await sb.write_file(f"{root}/{m.file}", text)
            broken = sorted(pristine.passed - run.passed)
            if run.timed_out or not 1 <= len(broken) <= 30:
                continue
            out.append(
                {
                    "id": f"swe-{name}-{Path(m.file).stem}-{m.line}-{len(out)}",
                    "project": name,
                    "file": m.file,
                    "line": m.line,
                    "before": m.before,
                    "after": m.after,
                    "kind": m.kind,
                    "fail_to_pass": broken,
                    "pristine_passed": len(pristine.passed),
                }
            )
            print(
                f"{name}: {len(out)}/{n} {m.file}:{m.line} {m.kind} breaks {len(broken)}",
                flush=True,
            )
        return out


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per-project", nargs="*", default=[f"{k}={v}" for k, v in DEFAULT.items()])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="auto")
    p.add_argument("--out", type=Path, default=HERE / "swe_repair.jsonl")
    args = p.parse_args()
    wanted = {k: int(v) for k, v in (item.split("=") for item in args.per_project)}
    backend = await open_backend(args.backend)
    try:
        results = await asyncio.gather(
            *(bugs_for(backend, name, n, args.seed) for name, n in wanted.items())
        )
    finally:
        await backend.aclose()
    lines = [json.dumps(r) + "\n" for rows in results for r in rows]
    args.out.write_text("".join(lines), encoding="utf-8")
    print(f"{sum(map(len, results))} tasks -> {args.out}")


if __name__ == "__main__":
    asyncio.run(main())
