"""What `libra train` makes of a disk that fills up: the write error found behind
whatever carried it (a task group, an error raised while closing files), and a trainer
rank's error in one line."""

from __future__ import annotations

import errno
import os

from libra.train.run import disk_full
from libra.trainer.worker import brief


def test_a_full_disk_is_found_behind_groups_contexts_and_rust_libraries():
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert disk_full(full) is full
    assert disk_full(ExceptionGroup("run", [ValueError("x"), full])) is full
    try:
        try:
            raise full
        finally:
            raise OSError(errno.ENOSPC, "again, closing a file")  # what the run saw last
    except OSError as closing:
        assert disk_full(closing) is closing
    try:
        try:
            raise full
        except OSError:
            raise RuntimeError("cleanup failed") from None  # hides the cause, not the context
    except RuntimeError as wrapped:
        assert disk_full(wrapped) is full
    rust = RuntimeError("Error while serializing: I/O error: File too large (os error 27)")
    found = disk_full(rust)
    assert found is not None and found.errno == errno.EFBIG
    assert disk_full(OSError(errno.ECONNREFUSED, "refused")) is None
    assert disk_full(RuntimeError("(os error 111)")) is None
    assert disk_full(KeyboardInterrupt()) is None


def test_a_rank_s_error_of_many_lines_reaches_the_driver_in_one():
    many = RuntimeError(
        "ranks [0]\nTraceback (most recent call last):\n  File x\n\nOSError: boom\n"
    )
    assert brief(many) == (
        "RuntimeError: ranks [0] ... OSError: boom (the rank logged the whole traceback)"
    )
    assert brief(ValueError("plain")) == "ValueError: plain"


def test_any_command_whose_writes_the_disk_refuses_says_so_in_one_line(tmp_path):
    """`libra workload` writing a trace under a file size limit (as a full disk fails a
    write): one line and exit 2, not a traceback."""
    import resource
    import subprocess
    import sys

    from tests.conftest import ROOT

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))

    out = tmp_path / "trace.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "libra", "workload", "search-r1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
        preexec_fn=limited,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "libra: error: a file outgrew this process's file size limit (ulimit -f) "
        "(File too large); free space and try again"
    ]
