"""Schedules, scenario files, timelines and the PNG writer: pure functions, no processes."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest

from chaos.cli import LIBRARY
from chaos.png import progress_plot
from chaos.scenario import load_scenario, scenario_from_dict
from chaos.schedule import PlannedFault, RandomSchedule, all_kinds
from chaos.timeline import build_timelines, progress

GPT = str(Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py")


def _scn(**over):
    d = {"job": {"script": GPT, "ranks": 2, "steps": 20}, "schedule": {"faults": [{"kind": "kill", "rank": 1, "step": 3, "phase": "forward"}]}}
    d.update(over)
    return d


@pytest.mark.timeout(30)
def test_random_schedule_is_reproducible_from_its_seed() -> None:
    s = RandomSchedule(seed=7, count=30, mtbf_steps=20, kinds=("kill", "raise", "hang"))
    a, b = s.plan(world_size=4, steps=2000), s.plan(world_size=4, steps=2000)
    assert a == b and len(a) == 30
    assert a != RandomSchedule(seed=8, count=30, mtbf_steps=20, kinds=("kill", "raise", "hang")).plan(world_size=4, steps=2000)
    assert [f.step for f in a] == sorted(f.step for f in a)
    assert {f.kind for f in a} == {"kill", "raise", "hang"} and {r for f in a for r in f.ranks} == {0, 1, 2, 3}
    timed = RandomSchedule(seed=7, count=5, mtbf_s=3.0, start=10).plan(world_size=2, steps=10)
    assert all(f.at_s is not None and f.at_s > 10 and f.step is None for f in timed)
    assert timed[0].to_faults(launch_time=100.0)[0].not_before == pytest.approx(100.0 + timed[0].at_s)


@pytest.mark.timeout(30)
def test_random_schedule_keeps_its_minimum_gap_between_faults() -> None:
    dense = RandomSchedule(seed=3, count=40, mtbf_steps=3)
    steps = [f.step for f in dense.plan(world_size=4, steps=2000)]
    assert min(b - a for a, b in zip(steps, steps[1:])) < 2  # the draw alone puts some faults a step apart
    spaced = [f.step for f in RandomSchedule(seed=3, count=40, mtbf_steps=3, min_gap_steps=2).plan(world_size=4, steps=2000)]
    assert len(spaced) == 40 and min(b - a for a, b in zip(spaced, spaced[1:])) >= 2
    with pytest.raises(ValueError, match="min_gap_steps applies to mtbf_steps"):
        RandomSchedule(seed=3, count=4, mtbf_s=2.0, min_gap_steps=2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "over,message",
    [
        ({"schedule": {"faults": [{"kind": "melt", "rank": 0, "phase": "forward"}]}}, "unknown fault kind 'melt'"),
        ({"schedule": {"faults": [{"kind": "kill", "rank": 0, "phase": "lunch"}]}}, "unknown phase 'lunch'"),
        ({"schedule": {"faults": [{"kind": "kill", "rank": 0}]}}, "a phase is required"),
        ({"schedule": {"faults": [{"kind": "kill", "rank": 5, "phase": "forward"}]}}, "rank out of range"),
        ({"schedule": {"faults": [{"kind": "kill", "rank": 0, "step": 99, "phase": "forward"}]}}, "never reached"),
        ({"schedule": {"faults": [{"kind": "store-outage"}]}}, "give it a step or an at_s"),
        ({"schedule": {"faults": [], "random": {}}}, "exactly one of 'faults'"),
        ({"schedule": {"random": {"seed": 1, "count": 3}}}, "exactly one of mtbf_steps and mtbf_s"),
        ({"schedule": {"random": {"seed": 1, "count": 50, "mtbf_steps": 5}}}, "past the job's 20 steps"),
        ({"invariants": {"bitwize": True}}, "unknown field(s) ['bitwize']"),
        ({"job": {"script": "/no/such.py"}}, "does not exist"),
        ({"job": {"script": GPT, "ranks": 0}}, "job.ranks must be >= 1"),
        ({"timeout_s": -1}, "timeout_s must be > 0"),
        ({"extra": 1}, "unknown field(s) ['extra']"),
    ],
)
def test_bad_scenarios_raise_value_errors_that_say_what_is_wrong(over, message) -> None:
    with pytest.raises(ValueError) as e:
        scenario_from_dict(_scn(**over))
    assert message in str(e.value)


@pytest.mark.timeout(30)
def test_bad_yaml_file_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("job: [unclosed\n")
    with pytest.raises(ValueError, match="bad.yaml.*not valid YAML"):
        load_scenario(p)
    with pytest.raises(ValueError, match="does not exist"):
        load_scenario(tmp_path / "missing.yaml")


@pytest.mark.timeout(30)
def test_library_loads_and_covers_every_fault_kind() -> None:
    kinds = set()
    for path in LIBRARY.glob("*.yaml"):
        scn = load_scenario(path)
        kinds |= {f.kind for f in scn.plan()}
    missing = set(all_kinds()) - kinds
    assert missing <= {"corrupt-ckpt"}, f"no library scenario for {sorted(missing)}"
    everyone = load_scenario(LIBRARY / "kill-all-no-ckpt.yaml").plan()[0]
    assert everyone.ranks == (0, 1)


@pytest.mark.timeout(30)
def test_timeline_and_goodput_from_events() -> None:
    t = 1000.0
    ev = [{"time": t + 1.0 + 0.1 * s, "event": "step_done", "step": s, "generation": 0} for s in range(1, 6)]
    ev += [
        {"time": t + 1.55, "event": "fault_injected", "rank": 1, "kind": "kill", "phase": "forward", "step": 5, "source": "rank1"},
        {"time": t + 1.6, "event": "fault_detected", "rank": 0, "source": "rank0"},
        {"time": t + 2.5, "event": "recovery_done", "generation": 2, "steps_redone": 0, "source": "rank0"},
    ]
    ev += [{"time": t + 2.6 + 0.1 * (s - 5), "event": "step_done", "step": s, "generation": 2} for s in range(5, 9)]
    ev.append({"time": t + 3.0, "event": "final_state_written"})
    plan = [PlannedFault(kind="kill", ranks=(1,), phase="forward", step=5),
            PlannedFault(kind="raise", ranks=(0,), phase="forward", step=7)]
    tl = build_timelines(ev, plan, [], launch=t)
    assert (tl[0].injected, tl[0].detected, tl[0].recovered) == (pytest.approx(1.55), pytest.approx(1.6), pytest.approx(2.6))
    assert tl[0].steps_redone == 0 and tl[1].injected is None
    p = progress(ev, t)
    assert p.productive_s == pytest.approx(0.8)  # 8 steps of 0.1 s; step 5 counted once
    assert 0 < p.goodput < 1


@pytest.mark.timeout(60)
def test_png_is_a_png_of_the_asked_size_with_the_fault_marks(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="progress.png needs the chaos extra (matplotlib)")
    from matplotlib.image import imread

    out = tmp_path / "p.png"
    progress_plot(out, [(0.0, 0), (5.0, 10), (9.0, 20)], [(4.0, (255, 0, 0))], total_s=10, total_steps=20,
                  width=240, height=120)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (240, 120)
    px = imread(out)  # floats in [0, 1], RGB(A)
    red = (px[..., 0] > 0.9) & (px[..., 1] < 0.2) & (px[..., 2] < 0.2)
    assert red.any()  # the fault mark is drawn


@pytest.mark.timeout(30)
def test_png_without_matplotlib_is_a_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from chaos.png import PlotUnavailable

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if it were not installed
    with pytest.raises(PlotUnavailable, match=r"pip install 'resilient-train\[chaos\]'") as e:
        progress_plot(tmp_path / "p.png", [], [], total_s=1, total_steps=1)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "p.png").exists()


@pytest.mark.timeout(30)
def test_matrix_packs_every_cell_once_heal_after_a_trigger() -> None:
    from chaos.matrix import UNSUPPORTED, MatrixConfig, _pack, _scenario

    full = MatrixConfig()
    groups = _pack(full)
    cells = [c for g in groups for c in g]
    assert sorted(cells) == sorted(full.cells()) and len(cells) == len(set(cells))
    assert not {k for k, _ in cells} & set(UNSUPPORTED)
    for g in groups:
        phases = [p for _, p in g]
        assert "heal" not in phases or phases.index("heal") > 0 or len(g) == 1  # behind a fault that causes a recovery
        assert len({k == "spike" for k, _ in g}) == 1  # the spike (not bitwise) never shares a job
    quick = _pack(MatrixConfig(quick=True))
    assert sorted(k for g in quick for k, _ in g) == sorted(k for k in all_kinds() if k not in UNSUPPORTED)
    alone = _scenario(full, "x", [("hang", "heal")], 60).plan()
    assert [f.kind for f in alone] == ["hang", "raise"] and alone[1].ranks != alone[0].ranks
