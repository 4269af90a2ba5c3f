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


def _bad_run_configs(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a config, just words\n")
    broken = tmp_path / "broken.yaml"
    broken.write_text("supervisor: [\n")
    return {"words": text, "broken-yaml": broken, "gone": tmp_path / "gone.yaml", "a-directory": tmp_path}


@pytest.mark.timeout(120)
def test_a_run_config_variable_left_in_the_shell_is_read_neither_by_help_nor_by_the_agent(tmp_path):
    """An RT_RUN_CONFIG left in the user's shell (the agent sets it for its ranks) that names no run config:
    ``--help`` works without it, and so does ``run``: no config class reads it (issue 34), and the ranks get
    the agent's own file."""
    import json

    from oneline import cli as isolated

    from jobs import REPO

    env = {"RT_RUN_CONFIG": str(_bad_run_configs(tmp_path)["words"])}
    for help_args in (["--help"], ["run", "--help"]):
        r = isolated(*help_args, env=env, timeout=60)
        assert r.returncode == 0 and "usage: resilient-train" in r.stdout and not r.stderr, r.stderr
    script = REPO / "tests" / "runtime" / "print_config_script.py"
    r = isolated("run", "--no-spare", "--run-dir", str(tmp_path / "run"), str(script), env=env, timeout=90)
    assert r.returncode == 0, r.stderr
    (line,) = [json.loads(s) for s in r.stdout.splitlines() if s.startswith("{")]
    assert line["run_config"] == str((tmp_path / "run" / "run-config.yaml").resolve())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["words", "broken-yaml", "gone", "a-directory"])
def test_every_bad_run_config_variable_is_one_line_naming_it(tmp_path, case):
    from resilient_train.base.runfile import read_run_file
    from resilient_train.base.configtree import RunConfigVariableError

    path = _bad_run_configs(tmp_path)[case]
    with pytest.raises(RunConfigVariableError) as e:
        read_run_file(environ={"RT_RUN_CONFIG": str(path)})
    text = str(e.value)
    assert "\n" not in text and "$RT_RUN_CONFIG" in text and repr(str(path)) in text and "unset it" in text, text
