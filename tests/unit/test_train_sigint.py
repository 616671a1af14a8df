"""A Ctrl-C at a terminal goes to the whole process group: the trainer's processes,
spawned under `libra.train.handle.no_sigint`, must not get it (`libra train` saves its
checkpoint and stops them itself). The first spawn of a process starts multiprocessing's
resource tracker, which unblocked SIGINT in the spawning thread: every process spawned
after it in that call got the Ctrl-C, and `core replica core0 rank 0 died`."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = """
import multiprocessing as mp, time
from libra.train.handle import no_sigint

def spawn():
    ctx = mp.get_context("spawn")
    ps = [ctx.Process(target=time.sleep, args=(3,)) for _ in range(2)]
    for p in ps:
        p.start()
    return ps

if __name__ == "__main__":
    for p in no_sigint(spawn)():
        with open(f"/proc/{p.pid}/status") as f:
            blocked = next(int(ln.split()[1], 16) for ln in f if ln.startswith("SigBlk"))
        print(bool(blocked & 2))  # SIGINT is signal 2: bit 1
        p.kill()
"""


def test_processes_spawned_without_sigint_keep_it_blocked(tmp_path) -> None:
    script = tmp_path / "spawn.py"  # a fresh process: no resource tracker running yet
    script.write_text(SCRIPT)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       cwd=ROOT, timeout=60, check=True)  # fmt: skip
    assert p.stdout.split() == ["True", "True"], p.stdout + p.stderr
