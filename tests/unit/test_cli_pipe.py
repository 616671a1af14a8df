"""`libra ... | head`: a reader that leaves early ends the command quietly, as in a shell."""

from __future__ import annotations

import subprocess
import sys


def test_a_closed_pipe_is_not_a_traceback() -> None:
    # `libra plan --json` prints a long document; the reader closes before it is written
    proc = subprocess.Popen(
        [sys.executable, "-m", "libra", "plan", "--gpus", "48", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err
