"""Issue 25 item 4, one root config: ``RunConfig`` in Python, YAML and flags with the same names; the effective
config reaches the ranks; every duration ends in ``_s`` (the old names warn); the reference is generated.

The precedence tests parse real command lines with ``resilient-train run``'s own parser; one test runs a real
two-rank job whose ranks print the configs they built.
"""

from __future__ import annotations

import json
import os
import stat
import warnings
from pathlib import Path

import pytest
import yaml

import resilient_train as rt
from jobs import REPO
from resilient_train.base import configtree
from resilient_train.base.cliargs import OneLineParser
from oneline import assert_one_line_exit_2, cli
from resilient_train.launch import add_run_arguments
from resilient_train.runconfig import SECTIONS, RunConfig
from resilient_train.runflags import run_config
from resilient_train.agent.workerio import Std

PRINT_CONFIG = Path(__file__).resolve().parent / "print_config_script.py"


@pytest.fixture
def fresh_warnings() -> None:
    """Each old name warns once per process: forget which did, so this test sees its own warnings."""
    configtree._WARNED.clear()


def _parse(*argv: str) -> RunConfig:
    p = OneLineParser(prog="resilient-train run")
    add_run_arguments(p)
    return run_config(p.parse_args(list(argv)), list(argv))


def _one_line(e: pytest.ExceptionInfo[ValueError], *needles: str) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    for n in needles:
        assert n in text, text
    return text


# ------------------------------------------------------------------ shape
@pytest.mark.timeout(60)
def test_every_config_class_is_exported_from_resilient_train() -> None:
    names = ["RunConfig", "SupervisorConfig", "AgentConfig", "CheckpointConfig", "MonitorConfig", "HangConfig",
             "StragglerConfig", "MetricsConfig", "RerunConfig", "PreemptionConfig", "DashboardConfig", "CuptiConfig",
             "OutputConfig"]
    for name in names:
        assert name in rt.__all__ and isinstance(getattr(rt, name), type), name
    assert [f.name for f in __import__("dataclasses").fields(RunConfig)] == list(SECTIONS)
    for cls in SECTIONS.values():
        assert getattr(rt, cls.__name__) is cls


@pytest.mark.timeout(60)
def test_every_duration_ends_in_s() -> None:
    """A float field of seconds is named ``*_s``: the old names of the hang detector's are aliases only."""
    for key, _, _ in RunConfig.keys():
        name = key.rpartition(".")[2]
        assert "timeout" not in name or name.endswith("_s"), key
        assert "interval" not in name or name.endswith("_s") or name in ("interval", "determinism_interval"), key


@pytest.mark.timeout(60)
def test_sections_held_by_a_component_are_the_roots() -> None:
    ckpt = rt.CheckpointConfig(directory="/tmp/x", interval=3)
    run = RunConfig(supervisor=rt.SupervisorConfig(steps=5, checkpoint=ckpt))
    assert run.checkpoint == ckpt and run.supervisor.checkpoint is run.checkpoint
    run = RunConfig(checkpoint=ckpt, monitors=rt.MonitorConfig(hang=rt.HangConfig(idle_timeout_s=4.0)))
    assert run.supervisor.checkpoint is ckpt and run.agent.monitor.hang.idle_timeout_s == 4.0
    with pytest.raises(ValueError, match="supervisor.checkpoint and checkpoint differ") as e:
        RunConfig(supervisor=rt.SupervisorConfig(checkpoint=ckpt),
                  checkpoint=rt.CheckpointConfig(directory="/tmp/y"))
    _one_line(e)


# -------------------------------------------------------------- YAML trip
@pytest.mark.timeout(60)
def test_yaml_round_trip(tmp_path: Path) -> None:
    run = RunConfig(
        supervisor=rt.SupervisorConfig(steps=40, pg_timeout_s=12.5, cupti=rt.CuptiConfig(report_every_steps=7)),
        agent=rt.AgentConfig(script=str(PRINT_CONFIG), nproc_per_node=2, max_restarts=2, env={"A": "1"},
                             output=rt.OutputConfig(redirects={1: Std.ALL},
                                                    local_ranks_filter=frozenset({0}))),
        monitors=rt.MonitorConfig(hang=rt.HangConfig(timeouts_s={"forward": 9.0}, idle_timeout_s=20.0),
                                  straggler=rt.StragglerConfig(policy="replace", sections=("forward",))),
        checkpoint=rt.CheckpointConfig(directory=tmp_path / "ck", interval=5, async_mode="disabled",
                                       local_keys=("rng",)),
        rerun=rt.RerunConfig(mode="validate_results", loss_spike_factor=None),
        preemption=rt.PreemptionConfig(grace_s=45.0, signals=("SIGTERM",)),
    )
    path = run.write(tmp_path / "run.yaml")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = RunConfig.from_yaml(path)
    assert again == run
    assert again.to_dict() == run.to_dict() == yaml.safe_load(path.read_text())
    assert again.supervisor.checkpoint is again.checkpoint and again.agent.monitor is again.monitors
    assert RunConfig.from_yaml(REPO / "examples" / "run.yaml") == RunConfig()  # the example: every default


@pytest.mark.timeout(60)
def test_overrides_keep_what_only_python_holds() -> None:
    def check(result: rt.StepResult) -> str | None:
        return None

    run = RunConfig(rerun=rt.RerunConfig(checks=[check]))
    new = run.with_overrides(["--checkpoint.interval=5", "rerun.window=9", "--monitors.hang.timeouts_s={forward: 4}",
                              "--agent.signals=[SIGTERM]", "--supervisor.steps=3", "--agent.run_dir=/tmp/r"])
    assert new.checkpoint is not None and new.checkpoint.interval == 5
    assert str(new.checkpoint.directory) == "/tmp/r/checkpoints"  # a run config's default
    assert new.rerun.checks == [check] and new.supervisor.rerun is new.rerun and new.rerun.window == 9
    assert new.monitors.hang.timeouts_s == {"forward": 4.0} and new.agent.signals == ("SIGTERM",)
    assert run.checkpoint is None  # a copy


BAD_OVERRIDES = {
    "--checkpoint.bogus=1": "checkpoint.bogus",
    "--bogus.x=1": "bogus",
    "--supervisor.checkpoint={directory: x}": "set checkpoint.* instead",
    "--rerun.checks=[]": "set it in Python",
    "--supervisor.pg_timeout_s=.nan": "supervisor.pg_timeout_s must be a finite number",
    "--supervisor.pg_timeout_s=1e308": "supervisor.pg_timeout_s must be in [0, 604800]",
    "--supervisor.pg_timeout_s=0": "supervisor.pg_timeout_s must be > 0",
    "--agent.nproc_per_node=two": "agent.nproc_per_node must be an integer",
    "--checkpoint.keep_last=0": "checkpoint.keep_last must be an int >= 1",
    "--monitors.hang.enabled=maybe": "monitors.hang.enabled must be true or false",
    "--rerun.mode=sometimes": "rerun.mode must be one of",
    "--monitors.straggler.threshold=2": "monitors.straggler.threshold must be",
    "supervisor.steps": "expected --SECTION.FIELD=VALUE",
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("item", sorted(BAD_OVERRIDES))
def test_a_bad_override_is_one_line_naming_the_key(item: str) -> None:
    with pytest.raises(ValueError) as e:
        RunConfig().with_overrides([item])
    _one_line(e, BAD_OVERRIDES[item])


BAD_FILES = {
    "not-a-mapping": ("[1, 2]", "mapping of sections"),
    "unknown-section": ("superviser: {steps: 1}", "unknown key(s) ['superviser']"),
    "unknown-field": ("agent: {nproc: 2}", "agent: unknown key(s) ['nproc']"),
    "wrong-type": ("supervisor: {steps: ten}", "supervisor.steps must be an integer"),
    "nan": ("monitors: {hang: {idle_timeout_s: .nan}}", "monitors.hang.idle_timeout_s must be a finite number"),
    "range": ("agent: {master_port: 70000}", "agent.master_port"),
    "week": ("preemption: {grace_s: 1.0e+9}", "preemption.grace_s must be in [0, 604800]"),
    "section-type": ("checkpoint: 5", "checkpoint must be a mapping"),
    "linked": ("supervisor: {checkpoint: {interval: 1}}", "supervisor: unknown key(s) ['checkpoint']"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_file_is_one_line_naming_the_key(tmp_path: Path, case: str) -> None:
    text, needle = BAD_FILES[case]
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        RunConfig.from_yaml(path)
    _one_line(e, needle, "run.yaml")


# -------------------------------------------------------------- precedence
@pytest.mark.timeout(60)
def test_flags_win_over_the_file_and_the_file_over_srun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monitor = tmp_path / "monitor.yaml"
    monitor.write_text("hang: {startup_timeout_s: 50}\n")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "supervisor": {"steps": 10},
        "agent": {"max_restarts": 3, "nproc_per_node": 2, "run_dir": str(tmp_path / "from-file"), "run_id": "mine"},
        "monitors": {"hang": {"idle_timeout_s": 4, "startup_timeout_s": 40}},
        "checkpoint": {"interval": 5, "keep_last": 4},
    }))
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("SLURM_NODEID", "0")
    monkeypatch.setenv("SLURM_NNODES", "1")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "localhost")
    run = _parse("--config", str(path), "--max-restarts", "1", "--monitor-config", str(monitor),
                 "--checkpoint.interval=7", "--supervisor.steps", "12", str(PRINT_CONFIG), "--x", "1")
    a = run.agent
    assert a.max_restarts == 1  # the flag, over the file
    assert a.nproc_per_node == 2 and a.run_dir == str(tmp_path / "from-file")  # the file: no flag typed
    assert a.run_id == "mine" and a.master_addr == "localhost" and a.master_port == 29623  # file, then srun
    assert a.script == str(PRINT_CONFIG) and a.script_args == ["--x", "1"]
    assert run.monitors.hang.idle_timeout_s == 4 and run.monitors.hang.startup_timeout_s == 50  # --monitor-config
    assert run.checkpoint is not None and (run.checkpoint.interval, run.checkpoint.keep_last) == (7, 4)
    assert run.supervisor.steps == 12 and run.supervisor.checkpoint is run.checkpoint
    # --SECTION.FIELD wins over torchrun's flag for the same field; no flag and no file: the field's default.
    run = _parse("--max-restarts", "1", "--agent.max_restarts=2", str(PRINT_CONFIG))
    assert run.agent.max_restarts == 2 and run.agent.run_id == "slurm-123" and run.agent.run_dir == "runs/latest"


@pytest.mark.timeout(120)
def test_bad_values_are_one_line_and_exit_2_from_the_real_command(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("checkpoint: {keep_last: 0}\n")
    run_dir = tmp_path / "run"
    for argv, needles in [
        (["--config", str(bad)], ("bad.yaml", "checkpoint.keep_last")),
        (["--monitors.hang.idle_timeout_s", "nan"], ("monitors.hang.idle_timeout_s",)),
        (["--agent.nnodes=0"], ("agent.nnodes",)),
    ]:
        assert_one_line_exit_2(cli("run", "--run-dir", str(run_dir), *argv, str(PRINT_CONFIG), timeout=60), *needles)
    assert not run_dir.exists()


# ------------------------------------------------------------ in the ranks
@pytest.mark.timeout(60)
def test_a_config_is_what_its_constructor_was_given_and_from_run_config_takes_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 34: no constructor reads RT_RUN_CONFIG (``CheckpointConfig(directory=...)`` took the file's
    ``keep_last``); the file reaches a rank through ``SupervisorConfig.from_run_config`` only, ``given`` over it."""
    path = RunConfig(supervisor=rt.SupervisorConfig(steps=9, max_recoveries=2, reproducible=True),
                     checkpoint=rt.CheckpointConfig(directory=tmp_path / "ck", keep_last=5),
                     preemption=rt.PreemptionConfig(grace_s=33.0)).write(tmp_path / "run-config.yaml")
    monkeypatch.setenv(configtree.RT_RUN_CONFIG, str(path))
    monkeypatch.setenv("RT_REPRODUCIBLE", "1")
    assert rt.SupervisorConfig() == rt.SupervisorConfig(steps=None, reproducible=False, checkpoint=None)
    assert rt.CheckpointConfig(directory="elsewhere").keep_last == 2  # the field's default, not the file's 5
    assert rt.PreemptionConfig().grace_s is None and rt.RerunConfig() == rt.RerunConfig(mode="disabled")
    sup = rt.SupervisorConfig.from_run_config(max_recoveries=7)
    assert (sup.steps, sup.max_recoveries, sup.reproducible) == (9, 7, True)  # the file's, the script's over it
    assert sup.checkpoint == rt.CheckpointConfig(directory=tmp_path / "ck", keep_last=5)
    assert sup.preemption.grace_s == 33.0
    assert rt.SupervisorConfig.from_run_config(checkpoint=None).checkpoint is None  # given: wins, even as None
    own = rt.CheckpointConfig(directory="elsewhere")
    assert rt.SupervisorConfig.from_run_config(checkpoint=own).checkpoint is own  # whole: no keep_last from the file
    assert rt.SupervisorConfig.from_run_config(path) == rt.SupervisorConfig.from_run_config()
    # What a script's own config leaves out of the run config is said (by the Supervisor, on rank 0).
    from resilient_train.rank.config import unused_run_config

    run = rt.SupervisorConfig.from_run_config()
    assert unused_run_config(run, run) == []
    assert unused_run_config(rt.SupervisorConfig(steps=9, reproducible=True, preemption=sup.preemption), run) == [
        "the run config's supervisor.max_recoveries=2 is not used: the script's SupervisorConfig has max_recoveries=32",
        "the run config's checkpoint is not used: the script's SupervisorConfig has checkpoint=None"]
    monkeypatch.delenv(configtree.RT_RUN_CONFIG)
    assert rt.SupervisorConfig.from_run_config(steps=3) == rt.SupervisorConfig(steps=3)  # no run config: defaults


@pytest.mark.timeout(60)
def test_a_supervisor_needs_its_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(configtree.RT_RUN_CONFIG, raising=False)
    with pytest.raises(rt.UsageError, match="SupervisorConfig.steps is not set"):
        rt.Supervisor(rt.SupervisorConfig())
    with pytest.raises(rt.UsageError, match="SupervisorConfig.steps is not set"):
        rt.Supervisor()  # no config: the run config's, here none


@pytest.mark.timeout(240)
def test_the_effective_config_reaches_every_rank(tmp_path: Path, fresh_warnings: None) -> None:
    run_dir = tmp_path / "run"
    monitor = tmp_path / "monitor.yaml"
    monitor.write_text("hang: {default_timeout: 30}\nmetrics: {prometheus: false, tensorboard: false}\n")
    config = tmp_path / "f.yaml"
    config.write_text(yaml.safe_dump({
        "supervisor": {"steps": 12, "pg_timeout_s": 99.0},
        "checkpoint": {"interval": 4, "keep_last": 3},
        "preemption": {"grace_s": 30.0},
    }))
    r = cli("run", "--nproc-per-node", "2", "--no-spare", "--run-dir", str(run_dir), "--config", str(config),
            "--monitor-config", str(monitor), "--checkpoint.keep_last=5", str(PRINT_CONFIG), timeout=200)
    assert r.returncode == 0, r.stderr
    # The old name in --monitor-config: one warning line, and it still counts.
    assert "resilient-train: warning: hang.default_timeout is deprecated: use hang.idle_timeout_s" in r.stderr
    written = run_dir / "run-config.yaml"
    assert stat.S_IMODE(written.stat().st_mode) == 0o600
    effective = RunConfig.from_yaml(written)
    assert effective.monitors.hang.idle_timeout_s == 30.0 and effective.agent.nproc_per_node == 2
    ranks = sorted((json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")),
                   key=lambda d: d["rank"])
    assert [d["rank"] for d in ranks] == [0, 1], r.stdout
    for d in ranks:
        assert d["run_config"] == str(written.resolve())
        sup = d["supervisor"]
        assert sup["steps"] == 12  # the file's: the script left it out
        assert sup["pg_timeout_s"] == 7.0  # the script's: it passed it
        assert sup["checkpoint"]["interval"] == 4 and sup["checkpoint"]["keep_last"] == 5  # file, then the flag
        assert sup["checkpoint"]["directory"] == str(run_dir / "checkpoints")
        assert sup["preemption"]["grace_s"] == 30.0 and d["preemption"]["grace_s"] is None  # the constructor's
        assert d["own_checkpoint"]["directory"] == "elsewhere" and d["own_checkpoint"]["keep_last"] == 2
    # The script's pg_timeout_s wins over the file's: said once (rank 0), not per rank.
    said = [line for line in r.stderr.splitlines() if "is not used" in line]
    assert said == ["resilient-train: the run config's supervisor.pg_timeout_s=99.0 is not used: the script's "
                    "SupervisorConfig has pg_timeout_s=7.0, which wins (SupervisorConfig.from_run_config(...) takes "
                    "the run config's for every field not passed to it)"], r.stderr
    assert os.environ.get(configtree.RT_RUN_CONFIG) is None


def _committed(run_dir: Path) -> list[str]:
    return sorted((p.name for p in (run_dir / "checkpoints").glob("step-*")), key=lambda n: int(n.split("-")[1]))


_SMALL_FSDP = ["--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--batch", "4", "--dataset",
               "256", "--log-every", "0", "--reproducible"]
# Every example, with its own small sizes: the run config's checkpoint section must take effect in each
# (train_ddp.py: tests/docs/test_docs_commands.py runs the README's command, the same run config at interval 20).
EXAMPLES = {
    "gpt": ("train_gpt.py", ["--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--batch", "4",
                             "--log-every", "0", "--reproducible"]),
    "fsdp": ("train_fsdp.py", [*_SMALL_FSDP, "--buddy-every", "1"]),
    "tp": ("train_tp.py", [*_SMALL_FSDP, "--tp", "2"]),
    "megatron": ("train_megatron_gpt.py", ["--arch", "mlp", "--hidden", "32", "--layers", "2", "--seq-len", "16",
                                           "--vocab", "64", "--batch", "4", "--reproducible", "--backend", "gloo"]),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_the_run_configs_checkpoint_takes_effect_with_every_example(tmp_path: Path, example: str) -> None:
    """``--config examples/run.yaml --checkpoint.interval=2`` and nothing else: every example leaves the
    checkpoint out when its own flag is not given, so the run config's section is the one used (train_gpt,
    train_fsdp and train_tp passed ``checkpoint=None``, which won, and wrote nothing; train_ddp's ranks died: the
    section lacked the supervisor's own ``local`` key)."""
    from jobs import run_script

    if example == "megatron":
        pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install "
                                                    "'resilient-train[megatron]')")
    script, small = EXAMPLES[example]
    job = run_script(tmp_path / "run", REPO / "examples" / script, ["--steps", "4", *small], nproc=2, timeout=200,
                     agent_args=["--no-spare", "--config", str(REPO / "examples" / "run.yaml"),
                                 "--checkpoint.interval=2"])
    assert job.returncode == 0, job.stderr[-3000:]
    assert _committed(job.run_dir) == ["step-2", "step-4"]
    assert "is not used" not in job.stderr, job.stderr


@pytest.mark.timeout(240)
def test_a_scripts_own_checkpoint_over_the_flag_is_said_once(tmp_path: Path) -> None:
    from jobs import run_gpt

    job = run_gpt(tmp_path / "run", nproc=2, steps=10, extra=["--ckpt-every", "5"],
                  agent_args=["--no-spare", "--checkpoint.interval=10"])
    assert job.returncode == 0, job.stderr[-3000:]
    assert _committed(job.run_dir) == ["step-5", "step-10"]  # the script's interval
    said = [line for line in job.stderr.splitlines() if "is not used" in line]
    assert said == ["resilient-train: the run config's checkpoint is not used: the script's SupervisorConfig has "
                    "checkpoint=CheckpointConfig(...), which wins (SupervisorConfig.from_run_config(...) takes the "
                    "run config's for every field not passed to it)"], job.stderr


# -------------------------------------------------------------- old names
@pytest.mark.timeout(60)
def test_old_duration_names_work_and_warn_once(fresh_warnings: None) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = rt.HangConfig(min_timeout=2.0, timeouts={"forward": 5.0})
        b = rt.HangConfig(min_timeout=2.5)
        assert (a.idle_timeout_s, a.timeouts_s, b.idle_timeout_s) == (2.0, {"forward": 5.0}, 2.5)
        assert a.min_timeout_s == 2.0 and a.longest_timeout == a.longest_timeout_s
        c = rt.HangConfig(default_timeout_s=30.0)  # the old floor of a section not yet computed: the idle floor now
        assert c.idle_timeout_s == 30.0
        m = rt.MonitorConfig.from_dict({"hang": {"startup_timeout": 7, "long_section_timeout": 8}})
        assert (m.hang.startup_timeout_s, m.hang.long_section_timeout_s) == (7.0, 8.0)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert sorted(messages) == sorted([
        "HangConfig(min_timeout=...) is deprecated: use HangConfig(idle_timeout_s=...) (the old name goes in the next "
        "release)",
        "HangConfig(timeouts=...) is deprecated: use HangConfig(timeouts_s=...) (the old name goes in the next release)",
        "HangConfig.min_timeout_s is deprecated: use HangConfig.idle_timeout_s (the old name goes in the next "
        "release)",
        "HangConfig(default_timeout_s=...) is deprecated: use HangConfig(idle_timeout_s=...) (the old name goes in "
        "the next release)",
        "HangConfig.longest_timeout is deprecated: use HangConfig.longest_timeout_s (the old name goes in the next "
        "release)",
        "hang.startup_timeout is deprecated: use hang.startup_timeout_s (the old name goes in the next release)",
        "hang.long_section_timeout is deprecated: use hang.long_section_timeout_s (the old name goes in the next "
        "release)",
    ])  # once each: the second HangConfig(min_timeout=...) said nothing
    with pytest.raises(TypeError, match="min_timeout and idle_timeout_s are one field"):
        rt.HangConfig(min_timeout=1.0, idle_timeout_s=1.0)


# ---------------------------------------------------------- the reference
@pytest.mark.timeout(60)
def test_the_readme_table_and_the_example_are_generated() -> None:
    from resilient_train.configdoc import BEGIN, END, markdown, yaml_example

    readme = (REPO / "README.md").read_text()
    assert readme.count(BEGIN) == 1 and readme.count(END) == 1
    table = readme.split(BEGIN, 1)[1].split(END, 1)[0].lstrip("\n")
    assert table == markdown(), "README's table is stale: python -m resilient_train.configdoc --write"
    assert (REPO / "examples" / "run.yaml").read_text() == yaml_example(), \
        "examples/run.yaml is stale: python -m resilient_train.configdoc --write"
    for key, _, _ in RunConfig.keys():
        assert f"| `{key}` |" in table, key
