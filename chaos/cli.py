"""``resilient-train chaos``: prove that a job survives faults.

    resilient-train chaos run SCENARIO.yaml [--out DIR]   reference + faulted run + invariants + report
    resilient-train chaos matrix [--quick]                  every fault kind at every phase, pass/fail table
    resilient-train chaos plan SCENARIO.yaml                the faults a scenario fires (its schedule, expanded)
    resilient-train chaos list                              the scenario library (chaos/scenarios/)

Exit codes: 0 every invariant holds (every cell passes), 1 one broke, 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from pathlib import Path

from chaos.schedule import MAX_SEED
from resilient_train.base.cliargs import OneLineParser, integer

__all__ = ["LIBRARY", "main", "resolve_scenario"]

LIBRARY = Path(__file__).resolve().parent / "scenarios"


def resolve_scenario(name: str) -> Path:
    """A path, or the name of a library scenario (``kill`` for ``chaos/scenarios/kill.yaml``)."""
    p = Path(name)
    if p.is_file():
        return p
    lib = LIBRARY / f"{name}.yaml"
    if lib.is_file():
        return lib
    raise ValueError(f"no scenario file {name!r} (and no library scenario of that name; see: resilient-train chaos list)")


_SEED = integer(low=0, high=MAX_SEED)


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="resilient-train chaos", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="run a scenario: fault-free reference, faulted run, invariants, report")
    run.add_argument("scenario", help="a scenario YAML file, or the name of a library scenario")
    run.add_argument("--out", default=None, help="report directory (default runs/chaos/NAME)")
    run.add_argument("--cache-dir", default=None, help="where fault-free references are cached "
                     "(default ~/.cache/resilient-train/chaos-references)")
    run.add_argument("--no-cache", action="store_true", help="run the reference again even when cached")
    run.add_argument("--seed", type=_SEED, default=None, help="override the seed of a random schedule")
    mx = sub.add_parser("matrix", help="every fault kind at every phase on a small job; a pass/fail table")
    mx.add_argument("--quick", action="store_true", help="every kind once (rotating phases): the CI matrix")
    mx.add_argument("--kinds", default=None, help="comma-separated kinds (default: every kind the runtime survives)")
    mx.add_argument("--phases", default=None, help="comma-separated phases (default: all)")
    mx.add_argument("--ranks", type=integer(low=2), default=2, help="ranks of the small job (default 2)")
    mx.add_argument("--out", default="runs/chaos/matrix", help="reports go here (default runs/chaos/matrix)")
    mx.add_argument("--cache-dir", default=None, help="where the fault-free reference is cached")
    plan = sub.add_parser("plan", help="print the faults a scenario fires")
    plan.add_argument("scenario")
    plan.add_argument("--seed", type=_SEED, default=None)
    sub.add_parser("list", help="the scenario library")
    return p


def _load(name: str, seed: int | None):  # -> Scenario
    from chaos.scenario import load_scenario
    from chaos.schedule import RandomSchedule

    scn = load_scenario(resolve_scenario(name))
    if seed is not None:
        if not isinstance(scn.schedule, RandomSchedule):
            raise ValueError("--seed applies to scenarios with a random schedule only")
        scn = scn.with_changes(schedule=dataclasses.replace(scn.schedule, seed=seed))
        scn.plan()
    return scn


def _cmd_run(args: argparse.Namespace) -> int:
    from chaos.reference import default_cache_dir
    from resilient_train.base.safefiles import writable_dir
    from chaos.runner import run_scenario

    scn = _load(args.scenario, args.seed)
    out = writable_dir(args.out or Path("runs") / "chaos" / scn.name, "--out")
    writable_dir(args.cache_dir or default_cache_dir(), "--cache-dir")
    print(f"chaos: {scn.name}: {len(scn.plan())} fault(s) on {scn.job.ranks} ranks, {scn.job.steps} steps", flush=True)
    try:
        result = run_scenario(scn, out_dir=out, cache_dir=args.cache_dir, use_cache=not args.no_cache)
    except RuntimeError as e:
        print(f"resilient-train chaos: {e}", file=sys.stderr)
        return 1
    print(result.summary())
    print(f"  goodput {result.progress.goodput:.1%}; wall {result.run.wall_s:.1f} s")
    return 0 if result.ok else 1


def _cmd_matrix(args: argparse.Namespace) -> int:
    from chaos.matrix import MatrixConfig, run_matrix
    from resilient_train.base.safefiles import writable_dir

    kw = {}
    if args.kinds:
        kw["kinds"] = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if args.phases:
        kw["phases"] = tuple(p.strip() for p in args.phases.split(",") if p.strip())
    config = MatrixConfig(quick=args.quick, ranks=args.ranks, **kw)
    writable_dir(args.out, "--out")
    if args.cache_dir:
        writable_dir(args.cache_dir, "--cache-dir")
    try:
        result = run_matrix(config, out_dir=args.out, cache_dir=args.cache_dir)
    except RuntimeError as e:
        print(f"resilient-train chaos: {e}", file=sys.stderr)
        return 1
    print(result.table())
    print(f"chaos matrix: {'PASS' if result.ok else 'FAIL'}; reports under {args.out}")
    return 0 if result.ok else 1


def _cmd_plan(args: argparse.Namespace) -> int:
    scn = _load(args.scenario, args.seed)
    for i, f in enumerate(scn.plan()):
        print(f"{i:3d}  {f.label()}" + (f"  ({f.duration_s:g} s)" if f.duration_s else ""))
    return 0


def _cmd_list() -> int:
    from chaos.scenario import load_scenario

    for path in sorted(LIBRARY.glob("*.yaml")):
        scn = load_scenario(path)
        first = " ".join(scn.description.split())[:90]
        print(f"{path.stem:<22} {scn.job.ranks} ranks {len(scn.plan()):3d} faults  {first}")
    return 0


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum: int, frame: object) -> None:
    raise _Interrupted(signum)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    # SIGTERM and Ctrl-C unwind the runner, whose job (in its own session) is taken down on the way out.
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        if args.command == "run":
            return _cmd_run(args)
        if args.command == "matrix":
            return _cmd_matrix(args)
        if args.command == "plan":
            return _cmd_plan(args)
        return _cmd_list()
    except ValueError as e:
        print(f"resilient-train chaos: error: {e}", file=sys.stderr)
        return 2
    except _Interrupted as e:
        print(f"resilient-train chaos: received {e}: the job under test was stopped; no verdict", file=sys.stderr)
        return 128 + e.signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
