"""Bad input gets one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import socket

import pytest

from jobs import GPT, cli


def _one_line_error(p, *needles: str) -> None:
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.timeout(60)
def test_missing_script(tmp_path):
    _one_line_error(cli("run", "--run-dir", str(tmp_path), str(tmp_path / "nope.py")), "nope.py", "does not exist")


@pytest.mark.timeout(60)
def test_zero_ranks(tmp_path):
    _one_line_error(cli("run", "--nproc-per-node", "0", "--run-dir", str(tmp_path), str(GPT)), "--nproc-per-node")


@pytest.mark.timeout(60)
def test_port_in_use(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = cli("run", "--master-port", str(port), "--run-dir", str(tmp_path), str(GPT))
    _one_line_error(p, str(port), "in use")


@pytest.mark.timeout(60)
def test_run_dir_not_writable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    # A path under a regular file cannot be created, even by root.
    _one_line_error(cli("run", "--run-dir", str(blocker / "run"), str(GPT)), "not writable")


@pytest.mark.timeout(60)
def test_cupti_backend_where_it_cannot_run(tmp_path):
    import subprocess
    import sys

    from monitors.cupti_kernels import unavailable_reason

    why = unavailable_reason()
    if why is None:
        pytest.skip("NVRx and CUDA are both here: the backend can run")
    p = subprocess.run([sys.executable, str(GPT), "--cupti-every", "10", "--steps", "1"],
                       capture_output=True, text=True, timeout=50)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1] == f"train_gpt.py: error: --cupti-every: {why}"
