"""Issue 26: every flag of every subcommand that takes a value, given a bad one, is one line on stderr and
exit 2, before anything starts: no traceback, no process.

The table is checked against the parsers themselves (each subcommand's, captured as it parses): a flag
that takes a value and has no row here fails ``test_every_flag_that_takes_a_value_has_bad_values``, so a
new flag gets its bad values (or a reason in ``EXEMPT``) when it is added. The rows run in this process
(the command line's ``main``, its stderr read at the file descriptor); a few run as real commands too, to
prove the exit code and the single line end to end.
"""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

import pytest

from cliparsers import parsers as _parsers
from jobs import GPT
from oneline import assert_one_line_exit_2, cli
from resilient_train.cli import main


# Paths every row can use, made by the ``paths`` fixture: FILE a regular file, DIR a directory that is no
# run, RUN a finished run's directory, UNDER_FILE a path below a regular file (never creatable),
# OPEN_TOKEN a token file others can read, SHORT_TOKEN one too short to be a secret; QUICK, the script
# every ``run`` row names, exits at once (a row that is not refused runs it, and fails on its exit 0).
FILE, DIR, RUN, UNDER_FILE, OPEN_TOKEN, SHORT_TOKEN = ("{FILE}", "{DIR}", "{RUN}", "{FILE}/x", "{OPEN_TOKEN}",
                                                       "{SHORT_TOKEN}")
NUMBERS = ("abc", "nan", "inf", "-inf", "1e308", "-1")  # for a flag of seconds

# (subcommand path, flag) -> bad values, or (bad values, what the line must name) when it is not the flag.
ROWS: dict[tuple[tuple[str, ...], str], object] = {
    (("run",), "--nnodes"): ("abc", "0", "-1", "1:2", "inf", "2"),  # 2 nodes without a port to meet on
    (("run",), "--nproc-per-node"): ("abc", "0", "-1", "1.5", "100000", "xpu"),
    (("run",), "--rdzv-backend"): ("etcd",),
    (("run",), "--rdzv-endpoint"): ("999.1.1.1:29400", "localhost:abc", "localhost:99999", "localhost:-1"),
    (("run",), "--rdzv-conf"): ("join_timeout=abc", "join_timeout=nan", "join_timeout=inf", "read_timeout=-1",
                                "timeout=1e308", "is_host=maybe", "keep_alive_max_attempt=0", "bogus=1",
                                "join_timeout"),
    (("run",), "--max-restarts"): ("abc", "-1", "1.5"),
    (("run",), "--monitor-interval"): (*NUMBERS, "0", "61"),
    (("run",), "--start-method"): ("thread",),
    (("run",), "--event-log-handler"): ("file",),
    (("run",), "--log-dir"): (UNDER_FILE, FILE, "/dev/null/x"),
    (("run",), "-r"): (("4", "abc", "0:9", "x:1", "-1"), "--redirects"),
    (("run",), "-t"): (("4", "abc", "0:9", "x:1"), "--tee"),
    (("run",), "--local-ranks-filter"): ("abc", "5", "-1"),
    (("run",), "--duplicate-stdout-filters"): (("x",), "duplicate-stdout"),
    (("run",), "--duplicate-stderr-filters"): (("x",), "duplicate-stdout/stderr"),
    (("run",), "--node-rank"): ("abc", "-1", "1"),
    (("run",), "--master-addr"): ("999.1.1.1", ""),
    (("run",), "--master-port"): ("abc", "-1", "70000", "1e3"),
    (("run",), "--local-addr"): ("999.1.1.1", ""),
    (("run",), "--logs-specs"): ("x",),
    (("run",), "--numa-binding"): ("node",),
    (("run",), "--signals-to-handle"): ("SIGFOO", "SIGKILL"),
    # The grace after a forwarded signal: an infinite one never SIGKILLs a worker that ignores SIGTERM, nan
    # acted as 0 (issue 26, item 4). Helper "preempt" owns the shutdown path; this branch checks the flag.
    (("run",), "--shutdown-timeout"): NUMBERS,
    (("run",), "--run-dir"): ((UNDER_FILE, FILE), "run directory"),
    (("run",), "--job-token-file"): ("/nonexistent/token", DIR, OPEN_TOKEN, SHORT_TOKEN),
    (("run",), "--node-timeout"): (*NUMBERS, "0"),
    (("run",), "--max-replacements"): ("abc", "-1"),
    (("run",), "--spares"): ("abc", "-1", "65", "1.5"),
    (("run",), "--chaos"): ("{", '[{"kind": "melt", "rank": 0, "phase": "forward"}]',
                            '[{"kind": "slow", "rank": 0, "phase": "forward", "duration_s": 1e308}]'),
    (("run",), "--monitor-config"): ("/nonexistent.yaml", DIR),
    (("run",), "--dashboard-port"): ("abc", "-1", "70000"),
    (("run",), "--dashboard-host"): ("999.1.1.1", ""),
    (("run",), "--config"): ("/nonexistent.yaml", DIR, "{BAD_CONFIG}", "{OLD_MISTAKE}"),
    (("run",), "script"): ("/nonexistent.py", DIR),
    (("demo",), "--steps"): ("abc", "0", "5"),
    (("demo",), "--nproc-per-node"): ("abc", "0", "1", "100000"),
    (("demo",), "--run-dir"): (FILE, UNDER_FILE),
    (("ckpt", "ls"), "dir"): ("/nonexistent", FILE),
    (("ckpt", "verify"), "dir"): ("/nonexistent", FILE),
    (("ckpt", "verify"), "--step"): ("abc", "-1", "1.5"),
    (("ckpt", "inspect"), "dir"): ("/nonexistent", FILE),
    (("ckpt", "inspect"), "--step"): ("abc", "-1", "1.5"),
    (("ckpt", "diff"), "a"): ("/nonexistent", FILE),
    (("ckpt", "diff"), "b"): ("/nonexistent", FILE),
    (("status",), "run_dir"): ("/nonexistent", FILE),
    (("straggler",), "run_dir"): ("/nonexistent", FILE, DIR),
    (("straggler",), "--threshold"): (*NUMBERS, "0", "1.5"),
    (("dashboard",), "run_dir"): ("/nonexistent", FILE),
    (("dashboard",), "--port"): ("abc", "-1", "70000"),
    (("dashboard",), "--host"): ("999.1.1.1", ""),
    (("dashboard",), "--export"): ((UNDER_FILE, DIR), "export"),
    (("chaos", "run"), "scenario"): ("no-such-scenario", DIR),
    (("chaos", "run"), "--out"): (FILE, UNDER_FILE),
    (("chaos", "run"), "--cache-dir"): (FILE, UNDER_FILE),
    (("chaos", "run"), "--seed"): ("abc", "-1", str(2**70), "1.5"),
    (("chaos", "matrix"), "--kinds"): (("melt",), "kind"),
    (("chaos", "matrix"), "--phases"): (("nowhere",), "phase"),
    (("chaos", "matrix"), "--ranks"): ("abc", "0", "1", "100000"),
    (("chaos", "matrix"), "--out"): (FILE, UNDER_FILE),
    (("chaos", "matrix"), "--cache-dir"): (FILE, UNDER_FILE),
    (("chaos", "plan"), "scenario"): ("no-such-scenario", DIR),
    (("chaos", "plan"), "--seed"): ("abc", "-1", str(2**70)),
}
EXEMPT = {
    (("run",), "--rdzv-id"): "free text: the job's name (TORCHELASTIC_RUN_ID), no longer its secret",
    (("run",), "--role"): "free text: ROLE_NAME and the console prefix under --tee",
    (("run",), "script_args"): "the script's own arguments, passed on as they are",
}

# The run config's fields (--SECTION.FIELD VALUE, issue 25 item 4): a row per field, its bad values from its
# type (below), with these added for what the type does not say (a range, a choice, a file); a string field
# with no rule is free text.
FIELD_ROWS: dict[str, object] = {
    "supervisor.steps": ("-1",),
    "supervisor.backend": ("mpi",),
    "supervisor.snapshot_every": ("0",),
    "supervisor.buddy_every": ("0",),
    "supervisor.max_failed_generations": ("0",),
    "supervisor.max_recoveries": ("-1",),
    "supervisor.chunk_mb": ("0",),
    "supervisor.pg_timeout_s": ("0",),
    "supervisor.cupti.report_every_steps": ("0",),
    "supervisor.cupti.threshold": ("0", "1.5"),
    "supervisor.cupti.sections": ("[optimizer]",),
    "agent.script": ("/nonexistent.py",),  # not the positional SCRIPT the row gives too
    "agent.entry.target": ("/nonexistent.py",),
    "agent.nproc_per_node": ("0",),
    "agent.nnodes": (("0", "2"), "nnodes"),
    "agent.node_rank": ("-1", "1"),
    "agent.master_addr": ("999.1.1.1", ""),
    "agent.master_port": ("-1", "70000"),
    "agent.run_dir": ((FILE, UNDER_FILE), "run directory"),
    "agent.max_restarts": ("-1",),
    "agent.max_replacements": ("-1",),
    "agent.spares": ("-1", "65"),
    "agent.spare": (("true",), "spare"),  # on one node
    "agent.monitor_interval_s": ("0", "61"),
    "agent.monitor_state_every_s": ("0",),
    "agent.node_timeout_s": ("0",),
    "agent.chaos": (("{", '[{"kind": "melt", "rank": 0, "phase": "forward"}]'), "chaos"),
    "agent.signals": ("[SIGFOO]", "[SIGKILL]"),
    "agent.job_token_file": ("/nonexistent/token", OPEN_TOKEN, SHORT_TOKEN),
    "agent.output.log_dir": ((UNDER_FILE, FILE), "log-dir"),
    "agent.output.redirects": ("{0: 9}", "{5: 1}"),
    "agent.output.tee": ("{0: 9}", "{5: 1}"),
    "monitors.hang.timeouts_s": ("{nowhere: 1}", "{forward: 0}", "{forward: .nan}"),
    "monitors.hang.safety_factor": ("0", "101"),
    "monitors.hang.min_observations": ("0",),
    "monitors.hang.stopped_timeout_s": ("0",),
    "monitors.hang.idle_timeout_s": ("0",),
    "monitors.hang.busy_timeout_s": ("0",),
    "monitors.hang.collective_sections": ("[nowhere]",),
    "monitors.straggler.threshold": ("0", "1.5"),
    "monitors.straggler.patience": ("0",),
    "monitors.straggler.min_steps": ("0",),
    "monitors.straggler.policy": ("kill",),
    "monitors.straggler.sections": ("[nowhere]", "[]"),
    "monitors.straggler.scores": ("[fastest]",),
    "monitors.metrics.prometheus_host": ("",),
    "monitors.metrics.prometheus_port": ("-1", "70000"),
    "checkpoint.interval": ("-1",),
    "checkpoint.keep_last": ("0",),
    "checkpoint.keep_every": ("-1",),
    "checkpoint.timeout_s": ("0",),
    "checkpoint.piece_mb": ("0", "2e6"),
    "checkpoint.local_keys": ("['']",),
    "rerun.loss_spike_factor": ("1",),
    "rerun.grad_norm_spike_factor": ("0.5",),
    "rerun.determinism_interval": ("0",),
    "preemption.signals": ("[SIGUSR2]", "[SIGFOO]"),
    "preemption.grace_s": ("0", "1"),
    "preemption.on_grace_expiry": ("never",),
    "dashboard.host": ("",),
    "dashboard.port": ("-1", "70000"),
    "dashboard.refresh_s": ("0",),
}
FREE_TEXT = {
    "agent.run_id": "the job's name (TORCHELASTIC_RUN_ID)",
    "agent.role": "ROLE_NAME and the console prefix",
    "agent.output.role": "the console prefix",
    "monitors.metrics.tensorboard_dir": "made when TensorBoard is installed; a bad one is logged, not fatal",
    "checkpoint.directory": "made by the first save (a bad one fails the save, which is retried)",
    "checkpoint.run_id": "a name written into manifests",
    "checkpoint.store_prefix": "a prefix of store keys",
}
_BY_TYPE = {
    "bool": ("maybe", "2"),
    "int": ("abc", "1.5", str(10**10)),
    "float": ("abc", ".nan", ".inf", "nan"),
    "list[str]": ("abc", "[[1]]"),
    "list[int]": ("abc", "[x]"),
    "map[str: str]": ("abc", "{A: [1]}"),
    "map[str: float]": ("abc", "{forward: x}"),
    "map[int: one of: 0, 1, 2, 3]": ("abc", "{x: 1}"),
}


def _bad_field_values(key: str, tp: object) -> tuple[str, ...]:
    from resilient_train.base.configtree import type_name

    name = type_name(tp).removesuffix(" | null")
    if name.startswith("one of: ") and not name.startswith("one of: 0"):
        return ("bogus",)
    out = _BY_TYPE.get(name, ())
    if name == "float" and key.endswith("_s"):
        out = (*out, "-1", "1e308")  # a duration: finite, >= 0, at most a week
    return out


def _field_rows() -> tuple[dict, dict]:
    from resilient_train.runconfig import RunConfig

    rows: dict[tuple[tuple[str, ...], str], object] = {}
    exempt: dict[tuple[tuple[str, ...], str], str] = {}
    for key, tp, _ in RunConfig.keys():
        extra = FIELD_ROWS.get(key, ())
        values, needle = extra if isinstance(extra, tuple) and len(extra) == 2 and isinstance(extra[0], tuple) \
            else (extra, None)
        values = (*_bad_field_values(key, tp), *values)  # type: ignore[misc]
        if values:
            rows[(("run",), f"--{key}")] = (values, needle) if needle else values
        else:
            assert key in FREE_TEXT, f"{key}: give it bad values in FIELD_ROWS, or a reason in FREE_TEXT"
            exempt[(("run",), f"--{key}")] = f"free text: {FREE_TEXT[key]}"
    assert not set(FIELD_ROWS) - {k for (_, f) in rows for k in [f[2:]]}, "rows for fields that do not exist"
    return rows, exempt


_ROWS, _EXEMPT = _field_rows()
ROWS.update(_ROWS)
EXEMPT.update(_EXEMPT)

# What each command line needs besides the flag under test, so that the flag is the only thing wrong.
_BASE = {
    ("run",): (["--no-spare", "--run-dir", "{TMP}/run"], ["{QUICK}"]),
    ("demo",): (["--run-dir", "{TMP}/demo"], []),
    ("ckpt", "ls"): ([], ["{RUN}"]),
    ("ckpt", "verify"): ([], ["{RUN}"]),
    ("ckpt", "inspect"): ([], ["{RUN}"]),
    ("ckpt", "diff"): ([], ["{RUN}", "{RUN}"]),
    ("status",): ([], ["{RUN}"]),
    ("straggler",): ([], ["{RUN}"]),
    ("dashboard",): (["--port", "0"], ["{RUN}"]),
    ("chaos", "run"): (["--out", "{TMP}/out", "--cache-dir", "{TMP}/cache"], ["kill"]),
    ("chaos", "matrix"): (["--quick", "--out", "{TMP}/out", "--cache-dir", "{TMP}/cache"], []),
    ("chaos", "plan"): ([], ["kill"]),
}


def _value_flags(parser: argparse.ArgumentParser) -> list[str]:
    return [(a.option_strings[0] if a.option_strings else a.dest) for a in parser._actions
            if a.nargs != 0 and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]


@pytest.mark.timeout(60)
def test_every_flag_that_takes_a_value_has_bad_values() -> None:
    parsers = _parsers()
    assert set(_BASE) <= set(parsers), sorted(parsers)
    flags = {(path, flag) for path, p in parsers.items() for flag in _value_flags(p)}
    missing = sorted(flags - set(ROWS) - set(EXEMPT))
    assert not missing, f"flags with no bad values in ROWS (or a reason in EXEMPT): {missing}"
    assert not sorted((set(ROWS) | set(EXEMPT)) - flags), "rows for flags that no longer exist"


@pytest.fixture
def paths(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "a-file").write_text("")
    (tmp_path / "quick.py").write_text("")
    (tmp_path / "a-dir").mkdir()
    run = tmp_path / "finished-run"
    run.mkdir()
    (run / "events.jsonl").write_text('{"time": 1.0, "event": "agent_start", "source": "agent", "world_size": 1}\n')
    open_token = tmp_path / "open-token"
    open_token.write_text("0123456789abcdef0123456789abcdef\n")
    os.chmod(open_token, 0o644)
    short = tmp_path / "short-token"
    short.write_text("abc\n")
    os.chmod(short, 0o600)
    (tmp_path / "bad-config.yaml").write_text("checkpoint: {keep_last: 0}\n")
    (tmp_path / "old-mistake.yaml").write_text("monitors: {hang: {bogus_timeout: 1}}\n")
    return {"BAD_CONFIG": str(tmp_path / "bad-config.yaml"), "OLD_MISTAKE": str(tmp_path / "old-mistake.yaml"),
            "QUICK": str(tmp_path / "quick.py"), "FILE": str(tmp_path / "a-file"), "DIR": str(tmp_path / "a-dir"),
            "RUN": str(run), "TMP": str(tmp_path), "OPEN_TOKEN": str(open_token), "SHORT_TOKEN": str(short)}


def _children() -> tuple[set[int], float]:
    """This process's live children, and the CPU time of those it reaped (a refusal starts none: not one
    still running, not one that ran and ended)."""
    me, out = os.getpid(), set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                fields = Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me and fields[0] != b"Z":
                out.add(int(name))
    times = os.times()
    return out, times.children_user + times.children_system


def _argv(path: tuple[str, ...], flag: str, value: str, paths: dict[str, str]) -> list[str]:
    before, positionals = _BASE[path]
    if flag.startswith("-"):
        # The flag first: a nargs="*" flag would swallow what follows; a base option it repeats is dropped.
        before = [a for i, a in enumerate(before) if a != flag and (i == 0 or before[i - 1] != flag)]
        argv = [*path, flag, value, *before, *positionals]
    else:
        names = [f for f in _value_flags(_parsers_cache()[path]) if not f.startswith("-")]
        given = list(positionals)
        given[names.index(flag)] = value
        argv = [*path, *before, *given]
    return [_fill(a, paths) for a in argv]


def _fill(text: str, paths: dict[str, str]) -> str:
    for key, path in paths.items():
        text = text.replace("{" + key + "}", path)
    return text


_CACHE: dict[tuple[str, ...], argparse.ArgumentParser] = {}


def _parsers_cache() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    if not _CACHE:
        _CACHE.update(_parsers())
    return _CACHE


def _cases() -> list[tuple[tuple[str, ...], str, str, str]]:
    out = []
    for (path, flag), row in ROWS.items():
        values, needle = row if isinstance(row, tuple) and len(row) == 2 and isinstance(row[0], tuple) else (row, None)
        for value in values:  # type: ignore[union-attr]
            out.append((path, flag, value, needle))
    return out


@pytest.mark.timeout(120)
def test_a_bad_value_of_any_flag_is_one_line_and_exit_2(paths: dict[str, str], capfd: pytest.CaptureFixture[str]) -> None:
    cases = _cases()
    assert len(cases) > 150, len(cases)
    before = _children()
    failures = []
    for path, flag, value, needle in cases:
        argv = _argv(path, flag, value, paths)
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        err = capfd.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        name = needle or _long_name(path, flag)  # a positional's line names the value it was given
        named = len(lines) == 1 and (name in lines[0] if name else _fill(value, paths) in lines[0])
        ok = code == 2 and named and "Traceback" not in err and _children() == before
        if not ok:
            failures.append(f"{' '.join(argv)}: exit {code}, stderr {err[-600:]!r}")
    assert not failures, "\n".join(failures)


def _long_name(path: tuple[str, ...], flag: str) -> str | None:
    """The flag as a message names it (its long spelling without dashes); None for a positional."""
    for a in _parsers_cache()[path]._actions:
        if flag in a.option_strings:
            return next((o for o in a.option_strings if o.startswith("--")), a.option_strings[0]).lstrip("-")
    return None


@pytest.mark.timeout(120)
def test_real_commands_say_it_in_one_line_and_exit_2(paths: dict[str, str]) -> None:
    """The flags of the issue, as a user types them: one line, exit 2, nothing left behind."""
    script, run_dir = str(GPT), str(Path(paths["TMP"]) / "run")
    rows = [
        (["run", "--dashboard", "--dashboard-host", "999.1.1.1", "--run-dir", run_dir, script], "--dashboard-host"),
        (["run", "--log-dir", "/dev/null/x", "--run-dir", run_dir, script], "--log-dir"),
        (["run", "--rdzv-conf", "join_timeout=abc", "--run-dir", run_dir, script], "join_timeout"),
        (["run", "--shutdown-timeout", "inf", "--run-dir", run_dir, script], "--shutdown-timeout"),
        (["dashboard", paths["RUN"], "--host", "999.1.1.1"], "--host"),
    ]
    for argv, needle in rows:
        line = assert_one_line_exit_2(cli(*argv, timeout=60), needle)
        assert len(line) < 300, line
    assert not Path(run_dir).exists()  # refused before the run directory was made


@pytest.mark.timeout(30)
def test_a_job_token_file_must_be_private(paths: dict[str, str]) -> None:
    from resilient_train.protocol.jobtoken import read_token_file

    token = Path(paths["TMP"]) / "token"
    token.write_text("0123456789abcdef0123456789abcdef\n")
    os.chmod(token, 0o600)
    assert read_token_file(token, "--job-token-file") == "0123456789abcdef0123456789abcdef"
    for mode in (0o640, 0o604, 0o644):
        os.chmod(token, mode)
        with pytest.raises(ValueError, match=f"mode {mode:o} lets other users read"):
            read_token_file(token, "--job-token-file")
    link = Path(paths["TMP"]) / "link"
    os.chmod(token, 0o600)
    link.symlink_to(token)
    with pytest.raises(ValueError, match="cannot be read"):  # O_NOFOLLOW: a link is not the file
        read_token_file(link, "--job-token-file")
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
