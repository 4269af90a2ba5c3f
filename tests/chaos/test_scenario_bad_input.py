"""Issue 17: bad scenario files and flags of ``chaos run`` are one line and exit 2, before any job runs;
scenario parsing never raises anything but ``ValueError`` on any input (a bounded fuzz)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chaos.scenario import load_scenario, scenario_from_dict
from oneline import BAD_NUMBERS, assert_one_line_exit_2, cli

GPT = str(Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py")
JOB = f"job: {{script: {json.dumps(GPT)}, ranks: 2, steps: 20}}\n"
FAULTS = "schedule: {faults: [{kind: kill, rank: 1, step: 3, phase: forward}]}\n"

SCENARIOS = {
    "timeout-a-list": (JOB + FAULTS + "timeout_s: [1, 2]\n", "timeout_s must be a number"),
    "invariants-a-list": (JOB + FAULTS + "invariants: [1, a]\n", "invariants must be a mapping"),
    "timeout-nan": (JOB + FAULTS + "timeout_s: .nan\n", "timeout_s must be a finite number"),
    "a-million-ranks": (JOB.replace("ranks: 2", "ranks: 1000000") + FAULTS, "job.ranks 1000000: at most"),
    "20000-faults": (JOB + "schedule: {faults: [" + ", ".join(["{kind: kill, rank: 1, step: 3, phase: forward}"] * 20000)
                     + "]}\n", "20000 faults; at most 1000"),
    "20000-random": (JOB + "schedule: {random: {seed: 1, count: 20000, mtbf_steps: 1}}\n", "count 20000; at most"),
    "billion-laughs": ("a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                       "c: [*b, *b, *b, *b, *b, *b, *b, *b, *b]\n" + JOB + FAULTS, "anchors and aliases"),
    "deep": ("x: " + "[" * 5000 + "]" * 5000 + "\n", "nested deeper than"),
    "not-utf8": (b"\xff\xfe job".decode("latin-1"), "not UTF-8"),
    "bad-monitor": (JOB.replace("steps: 20", "steps: 20, monitor: {hang: [1, 2]}") + FAULTS, "job.monitor"),
    "name-escapes": ("name: ../../elsewhere\n" + JOB + FAULTS, "plain name"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(SCENARIOS))
def test_bad_scenario_file(tmp_path: Path, case: str) -> None:
    text, needle = SCENARIOS[case]
    path = tmp_path / f"{case}.yaml"
    path.write_bytes(text.encode("latin-1") if case == "not-utf8" else text.encode())
    r = cli("chaos", "run", str(path), "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"))
    line = assert_one_line_exit_2(r, needle)
    assert f"{case}.yaml" in line
    assert not (tmp_path / "out").exists()  # nothing ran


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", ["--out", "--cache-dir"])
def test_out_or_cache_dir_that_is_a_file(tmp_path: Path, flag: str) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    other = "--cache-dir" if flag == "--out" else "--out"
    r = cli("chaos", "run", "kill", flag, str(blocker), other, str(tmp_path / "other"))
    assert_one_line_exit_2(r, flag, "exists and is not a directory")
    r = cli("chaos", "matrix", "--quick", "--out", str(blocker))
    assert_one_line_exit_2(r, "--out", "exists and is not a directory")


def _numeric_fields(cls: type) -> list[tuple[str, str]]:
    """``(field, shape)`` for each field of ``cls`` that holds numbers: "one", "list" or "map" of them."""
    import dataclasses
    import typing

    out = []
    for name, hint in typing.get_type_hints(cls).items():
        if name not in {f.name for f in dataclasses.fields(cls)}:
            continue
        text = str(hint)
        if "dict[str, float]" in text:
            out.append((name, "map"))
        elif "tuple[int, ...]" in text:
            out.append((name, "list"))
        elif hint in (int, float) or any(a in (int, float) for a in typing.get_args(hint)):
            out.append((name, "one"))
    return out


def _number_cases() -> list[tuple[str, tuple[str, ...], str]]:
    """Every number a scenario file can hold, derived from the dataclasses it is read into: a new numeric
    field gets its rows here without anyone writing them."""
    from chaos.scenario import Invariants, JobSpec
    from chaos.schedule import PlannedFault, RandomSchedule
    from monitors.hangconfig import HangConfig
    from monitors.node import MetricsConfig
    from monitors.straggler import StragglerConfig

    where = {JobSpec: ("job",), Invariants: ("invariants",), PlannedFault: ("schedule", "faults", 0),
             RandomSchedule: ("schedule", "random"), HangConfig: ("job", "monitor", "hang"),
             StragglerConfig: ("job", "monitor", "straggler"), MetricsConfig: ("job", "monitor", "metrics")}
    cases = [("timeout_s", (), "one")]
    for cls, prefix in where.items():
        cases += [(name, prefix, shape) for name, shape in _numeric_fields(cls)]
    return cases


def _with(base: dict, prefix: tuple, name: str, shape: str, value) -> dict:
    d = json.loads(json.dumps(base))
    if prefix[:2] == ("schedule", "random"):
        d["schedule"] = {"random": {"seed": 1, "count": 2, "mtbf_steps": 5}}
        if name in ("mtbf_s",):  # seconds instead of steps
            d["schedule"]["random"] = {"seed": 1, "count": 2, "mtbf_s": 5.0}
    node = d
    for key in prefix:
        node = node.setdefault(key, {}) if isinstance(key, str) else node[key]
    if prefix[:2] == ("schedule", "faults") and name in ("at_s",):
        node.pop("step", None)
    if name == "ranks" and prefix[:2] == ("schedule", "faults"):
        node.pop("rank", None)
    if value is not _KEEP:
        node[name] = value if shape == "one" else ([value] if shape == "list" else {"forward": value})
    return d


_KEEP = object()  # _with: leave the field as the base has it


@pytest.mark.timeout(60)
def test_every_number_of_a_scenario_is_range_checked() -> None:
    """Issue 26: 1e308, inf, nan, -1 and 2**70 in each numeric field of a scenario (the job, its monitor
    config, the invariants, a fixed fault, a random schedule): each refused with one line naming the field."""
    cases = _number_cases()
    assert len(cases) >= 30, cases
    for name, prefix, shape in cases:
        scenario_from_dict(_with(_base(), prefix, name, shape, _KEEP))  # valid: each refusal below is the field's
        for bad in BAD_NUMBERS:
            with pytest.raises(ValueError) as e:
                scenario_from_dict(_with(_base(), prefix, name, shape, bad))
            why = str(e.value)
            assert "\n" not in why and (name in why or (name == "ranks" and "rank" in why)), (prefix, name, bad, why)


@pytest.mark.timeout(60)
def test_every_number_of_a_chaos_fault_is_range_checked() -> None:
    """The same for ``run --chaos``'s faults (chaos.faults.Fault), as the agent's preflight parses them."""
    import dataclasses

    from chaos.faults import Fault, parse_faults

    base = {"kind": "slow", "rank": 0, "phase": "forward", "step": 1, "not_before": 0.0, "duration_s": 1.0}
    numeric = [n for n, shape in _numeric_fields(Fault)]
    assert sorted(numeric) == sorted(f.name for f in dataclasses.fields(Fault) if f.name not in ("kind", "phase"))
    parse_faults(json.dumps([base]), world_size=2)
    for name in numeric:
        for bad in BAD_NUMBERS:
            with pytest.raises(ValueError) as e:
                parse_faults(json.dumps([{**base, name: bad}]), world_size=2)
            assert "\n" not in str(e.value) and name in str(e.value), (name, bad, str(e.value))


# ---- fuzz: any data, any text -> a Scenario or a ValueError, nothing else ---------------------------------

_scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=12)
_json = st.recursive(_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8) | st.integers(), c,
                                                                                  max_size=4), max_leaves=20)
_FIELDS = {
    "": ["name", "description", "job", "schedule", "invariants", "timeout_s"],
    "job": ["script", "args", "ranks", "steps", "steps_arg", "monitor", "env", "max_restarts", "spare"],
    "invariants": ["completes", "bitwise", "detect_timeout_s", "recover_timeout_s", "max_steps_redone", "min_faults"],
    "fault": ["kind", "rank", "ranks", "phase", "step", "at_s", "duration_s", "detect_timeout_s"],
    "random": ["seed", "count", "mtbf_steps", "mtbf_s", "start", "kinds", "phases", "duration_s", "ranks",
               "min_gap_steps"],
}


def _base() -> dict:
    return {"job": {"script": GPT, "ranks": 2, "steps": 20}, "invariants": {"detect_timeout_s": 10},
            "schedule": {"faults": [{"kind": "kill", "rank": 1, "step": 3, "phase": "forward"}]}, "timeout_s": 60}


@st.composite
def _mutated(draw: st.DrawFn) -> dict:
    """A valid scenario with a few fields replaced by arbitrary data (deeper than random dicts reach)."""
    d = _base()
    for _ in range(draw(st.integers(1, 4))):
        where = draw(st.sampled_from(sorted(_FIELDS)))
        name = draw(st.sampled_from(_FIELDS[where]))
        value = draw(_json)
        if where == "":
            d[name] = value
        elif where == "fault":
            if isinstance(d.get("schedule"), dict) and isinstance(d["schedule"].get("faults"), list) \
                    and d["schedule"]["faults"] and isinstance(d["schedule"]["faults"][0], dict):
                d["schedule"]["faults"][0][name] = value
        elif where == "random":
            d["schedule"] = {"random": {"seed": 1, "count": 2, "mtbf_steps": 5, name: value}}
        elif isinstance(d.get(where), dict):
            d[where][name] = value
    return d


@pytest.mark.timeout(120)
@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=_mutated() | _json)
def test_fuzz_scenario_data_gives_a_scenario_or_a_value_error(data) -> None:
    try:
        scenario_from_dict(data)
    except ValueError as e:
        assert "\n" not in str(e)


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.lists(st.sampled_from(list("ab:&*[]{}!-,|> \n\t'\"#0.9") + ["job", "&a", "*a", "<<", "!!python/name:os.system"]),
                     max_size=60).map("".join) | _mutated().map(lambda d: yaml.safe_dump(d)))
def test_fuzz_scenario_text_gives_a_scenario_or_a_value_error(tmp_path_factory, text: str) -> None:
    path = tmp_path_factory.getbasetemp() / "fuzz-scenario.yaml"
    path.write_text(text)
    try:
        load_scenario(path)
    except ValueError as e:
        assert "\n" not in str(e)
