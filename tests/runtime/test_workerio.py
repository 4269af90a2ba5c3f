"""The agent's relay of a worker's stderr: a chain of exceptions is one traceback on the console.

Real worker processes print real tracebacks into real pipes; the console
writes into a buffer the test reads.
"""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
import time

import pytest

from resilient_train.workerio import Console, OutputConfig, WorkerOutput

# A collective fails because a peer was interrupted, then this rank's own Ctrl-C arrives while it handles that.
CHAINED = textwrap.dedent("""
    try:
        raise RuntimeError("Connection closed by peer [127.0.0.1]:21889")
    except RuntimeError:
        raise KeyboardInterrupt
""")
LIVES_ON = textwrap.dedent("""
    import sys, time, traceback
    try:
        raise ValueError("caught and printed")
    except ValueError:
        traceback.print_exc()
    sys.stderr.flush()
    time.sleep(60)
""")


def _relay(tmp_path, code: str, console: Console) -> tuple[subprocess.Popen, WorkerOutput]:
    out = WorkerOutput(rank=0, local_rank=0, attempt=0, config=OutputConfig(), console=console, log_dir=tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", code], **out.popen_kwargs())
    out.start(proc)
    return proc, out


@pytest.mark.timeout(60)
def test_a_chained_keyboard_interrupt_after_ctrl_c_is_one_line(tmp_path):
    err = io.BytesIO()
    console = Console(out=io.BytesIO(), err=err)
    console.interrupt()
    proc, out = _relay(tmp_path, CHAINED, console)
    proc.wait(30)
    out.drain()
    assert err.getvalue().decode().splitlines() == ["[rank0]: interrupted (KeyboardInterrupt)"]
    assert out.last_exception == "KeyboardInterrupt"


@pytest.mark.timeout(60)
def test_a_chained_traceback_is_shown_whole_once(tmp_path):
    err = io.BytesIO()
    proc, out = _relay(tmp_path, CHAINED, Console(out=io.BytesIO(), err=err))
    proc.wait(30)
    out.drain()
    text = err.getvalue().decode()
    assert text.count("Traceback (most recent call last):") == 2
    assert "During handling of the above exception, another exception occurred:" in text
    assert text.index("RuntimeError: Connection closed") < text.index("During handling") < text.index(
        "KeyboardInterrupt")


@pytest.mark.timeout(60)
def test_a_traceback_of_a_worker_that_lives_on_is_shown_while_it_runs(tmp_path):
    err = io.BytesIO()
    proc, out = _relay(tmp_path, LIVES_ON, Console(out=io.BytesIO(), err=err))
    try:
        deadline = time.monotonic() + 30
        while b"ValueError: caught and printed" not in err.getvalue():
            assert time.monotonic() < deadline, err.getvalue()
            time.sleep(0.05)
        assert proc.poll() is None  # shown while the worker still runs: no chain was waited for past its end
        assert out.last_exception == "ValueError: caught and printed"
    finally:
        proc.kill()
        proc.wait(30)
        out.drain()
