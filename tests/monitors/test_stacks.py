"""The agent's stack dumps of a hung rank (monitors.stacks), against real processes."""

from __future__ import annotations

import os
import signal
import time

import pytest
from monhelp import CTX, Procs, wait_for

from monitors.stacks import StackDumps, install_stack_dump, is_stopped, stacks_path


def _spin_with_dump(run_dir: str, ready) -> None:
    f = install_stack_dump(run_dir, 0)
    assert f is not None
    ready.set()
    sum(range(10**18))  # one C call holding the GIL: only a C-level handler can answer


def _own_handler(run_dir: str, ready) -> None:
    signal.signal(signal.SIGUSR2, lambda *_: None)  # the script's own
    assert install_stack_dump(run_dir, 0) is None
    ready.set()
    time.sleep(600)


def _plain(ready) -> None:
    ready.set()
    time.sleep(600)


@pytest.mark.timeout(60)
def test_a_rank_spinning_with_the_gil_held_dumps_its_stack(tmp_path, procs: Procs) -> None:
    ready = CTX.Event()
    p = procs.start(_spin_with_dump, str(tmp_path), ready)
    assert ready.wait(30)
    dumps = StackDumps(tmp_path)
    assert not dumps.written(0)  # nothing asked yet
    assert dumps.request(0, p.pid)
    wait_for(lambda: dumps.written(0), 10.0, "the dump", every=0.05)  # as the agent polls
    text = dumps.collect(0)
    assert "_spin_with_dump" in text and "test_stacks.py" in text, text
    assert p.is_alive()  # the dump does not stop the process: the agent kills it next


@pytest.mark.timeout(60)
def test_no_signal_to_a_process_that_cannot_answer_it(tmp_path, procs: Procs) -> None:
    dumps = StackDumps(tmp_path)
    ready = CTX.Event()
    plain = procs.start(_plain, ready)  # no handler, no stacks file
    assert ready.wait(30)
    assert not dumps.request(0, plain.pid)

    ready = CTX.Event()
    own = procs.start(_own_handler, str(tmp_path), ready)  # its own SIGUSR2 handler: not replaced
    assert ready.wait(30)
    assert not stacks_path(tmp_path, 0).exists() and not dumps.request(0, own.pid)

    ready = CTX.Event()
    spinning = procs.start(_spin_with_dump, str(tmp_path), ready)
    assert ready.wait(30)
    os.kill(spinning.pid, signal.SIGSTOP)
    wait_for(lambda: is_stopped(spinning.pid), 10.0, "the stop")
    assert not dumps.request(0, spinning.pid)  # stopped: it cannot run a handler
    assert not dumps.request(0, plain.pid)  # a stacks file, but written by another process
