"""A command's exit code survives a thread still inside a C++ store call (resilient_train.base.exitfast.end_process).

CI caught a cut-off agent that decided 94 (fenced) and died of SIGABRT instead: its beat thread's store call to
the unreachable host returned while the interpreter tore down, and the runtime's ending of that thread unwound
through C++ ("terminate called without an active exception"). The script reproduces it every time with a real
store host, SIGSTOPped then killed in the teardown.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("exit_in_call_script.py")


def _run(how: str) -> subprocess.CompletedProcess:
    job = subprocess.Popen([sys.executable, str(SCRIPT), how], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    host = None
    try:
        out, err = job.communicate(timeout=60)
        host = int(out.split()[0])
    finally:
        job.kill()
        if host is not None:
            try:
                os.kill(host, signal.SIGKILL)  # stopped and still there when the script left without its teardown
            except ProcessLookupError:
                pass
    return subprocess.CompletedProcess(job.args, job.returncode, out, err)


@pytest.mark.timeout(120)
def test_sys_exit_with_a_thread_returning_from_a_store_call_in_the_teardown_aborts():
    """The hazard, shown: a plain exit loses the code to SIGABRT."""
    done = _run("exit")
    assert done.returncode == -signal.SIGABRT, done.stderr[-2000:]
    assert "terminate called without an active exception" in done.stderr


@pytest.mark.timeout(120)
def test_end_process_keeps_the_code_whatever_the_threads_are_doing():
    done = _run("end")
    assert done.returncode == 94, done.stderr[-2000:]
    assert "terminate called" not in done.stderr


@pytest.mark.timeout(60)
def test_the_command_line_ends_through_end_process():
    """The installed ``resilient-train`` and ``python -m resilient_train.cli`` both end by ``entry``."""
    import tomllib

    root = Path(__file__).resolve().parents[2]
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["resilient-train"] == "resilient_train.cli:entry"
    done = subprocess.run([sys.executable, "-m", "resilient_train.cli", "ckpt", "ls", "/nonexistent/run"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no such directory" in done.stderr
