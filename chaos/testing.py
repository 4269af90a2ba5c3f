"""Running a job under a scenario from pytest.

In a test module (or ``conftest.py``): ``pytest_plugins = ["chaos.testing"]``, then

    @pytest.mark.timeout(600)
    def test_my_job_survives(chaos_run):
        chaos_run("tests/scenarios/my_job_kill.yaml")          # fails the test, naming what broke

or without the fixture: ``result = run_scenario_checked(path, out_dir=tmp_path)``.
References are cached per test session (a fresh directory), so a session
compares against a reference computed by the code under test.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator

import pytest

from chaos.runner import ScenarioResult, run_scenario
from chaos.scenario import Scenario, load_scenario

__all__ = ["ScenarioFailed", "chaos_run", "chaos_reference_cache", "run_scenario_checked"]


class ScenarioFailed(AssertionError):
    """A scenario whose invariants did not all hold; the message names them."""


def run_scenario_checked(
    scenario: Scenario | str | os.PathLike[str], *, out_dir: str | os.PathLike[str],
    cache_dir: str | os.PathLike[str] | None = None, expect_broken: set[str] | None = None,
) -> ScenarioResult:
    """Runs a scenario; raises :class:`ScenarioFailed` unless every invariant holds
    (or, with ``expect_broken``, unless exactly those invariants broke)."""
    scn = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    result = run_scenario(scn, out_dir=Path(out_dir), cache_dir=cache_dir)
    if expect_broken is None and not result.ok:
        raise ScenarioFailed(result.summary())
    if expect_broken is not None and set(result.broken()) != set(expect_broken):
        raise ScenarioFailed(f"expected broken {sorted(expect_broken)}, got {result.broken()}\n{result.summary()}")
    return result


@pytest.fixture(scope="session")
def chaos_reference_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chaos-references")


@pytest.fixture
def chaos_run(tmp_path: Path, chaos_reference_cache: Path) -> Iterator[Callable[..., ScenarioResult]]:
    """``chaos_run(scenario, expect_broken=None)``: runs it in the test's tmp_path, fails the test unless it holds."""
    def run(scenario: Scenario | str | os.PathLike[str], *, expect_broken: set[str] | None = None) -> ScenarioResult:
        name = scenario.name if isinstance(scenario, Scenario) else Path(scenario).stem
        return run_scenario_checked(scenario, out_dir=tmp_path / name, cache_dir=chaos_reference_cache,
                                    expect_broken=expect_broken)

    yield run
