"""``resilient-train status`` and ``resilient-train straggler``: read and steer a run from RUN_DIR.

Both work on a live or a finished run and need only the run directory: the
event log (``events.jsonl``) and the ranks' progress slots.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from resilient_train.base.cliargs import OneLineParser, number
from monitors.control import read_control, write_control
from monitors.events import read_events
from monitors.progressreader import ProgressReader
from monitors.stacks import innermost_frame

__all__ = ["status_main", "straggler_main"]


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    try:
        return parser.parse_args(argv)
    except SystemExit as e:  # argparse exits on --help and on errors; a code is friendlier here
        return int(e.code or 0)


def straggler_main(argv: list[str], out: TextIO | None = None) -> int:
    """``resilient-train straggler RUN_DIR [--on | --off] [--threshold X]``."""
    out = out or sys.stdout
    p = OneLineParser(prog="resilient-train straggler",
                                description="Switch straggler detection of a running job on or off, "
                                            "or change its threshold; effective at the next report.")
    p.add_argument("run_dir")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--on", dest="enabled", action="store_const", const=True)
    g.add_argument("--off", dest="enabled", action="store_const", const=False)
    p.add_argument("--threshold", type=number(above=0, high=1), default=None, help="score in (0, 1] below which a rank is slow")
    args = _parse(p, argv)
    if isinstance(args, int):
        return args
    run = Path(args.run_dir)
    if not run.is_dir():
        print(f"resilient-train straggler: no such run directory: {args.run_dir}", file=sys.stderr)
        return 2
    # It writes into the directory: only into a run's, and never through a link.
    if not (run / "events.jsonl").is_file() and not (run / ".monitors").is_dir():
        print(f"resilient-train straggler: {args.run_dir} is not a run directory (no events.jsonl, no .monitors/)",
              file=sys.stderr)
        return 2
    if (run / ".monitors").is_symlink():
        print(f"resilient-train straggler: {run / '.monitors'} is a symbolic link; refusing to write through it",
              file=sys.stderr)
        return 2
    try:
        ctl = write_control(args.run_dir, enabled=args.enabled, threshold=args.threshold)
    except ValueError as e:
        print(f"resilient-train straggler: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"resilient-train straggler: cannot write to {run / '.monitors'}: {e.strerror or e}", file=sys.stderr)
        return 2
    enabled = "unchanged (config)" if ctl.enabled is None else ("on" if ctl.enabled else "off")
    threshold = "unchanged (config)" if ctl.threshold is None else f"{ctl.threshold:g}"
    print(f"straggler detection: {enabled}; threshold: {threshold}", file=out)
    return 0


def _process_state(pid: int) -> str:
    """"alive", "stopped" (SIGSTOP, a debugger: state T or t) or "exited"; a zombie has exited."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        state = stat[stat.rindex(")") + 2]
    except (OSError, ValueError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "exited"
        except PermissionError:
            return "alive"
        return "alive"
    return {"T": "stopped", "t": "stopped", "Z": "exited", "X": "exited"}.get(state, "alive")


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def status_main(argv: list[str], out: TextIO | None = None) -> int:
    """``resilient-train status RUN_DIR``: ranks, step rate, straggler scores, faults, recoveries."""
    out = out or sys.stdout
    p = OneLineParser(prog="resilient-train status", description="Summarise a live or finished run.")
    p.add_argument("run_dir")
    args = _parse(p, argv)
    if isinstance(args, int):
        return args
    run = Path(args.run_dir)
    if not run.is_dir():
        print(f"resilient-train status: no such run directory: {run}", file=sys.stderr)
        return 2
    try:
        return _status(run, out)
    except OSError as e:
        print(f"resilient-train status: cannot read {run}: {e}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # records that are not a run's: one line
        print(f"resilient-train status: {run} does not hold a readable run ({type(e).__name__}: {e})",
              file=sys.stderr)
        return 2


def _status(run: Path, out: TextIO) -> int:
    log = run / "events.jsonl"
    events = list(read_events(log))
    if not events and log.is_file() and log.stat().st_size > 0:
        raise ValueError(f"{log} holds no event records ({log.stat().st_size} bytes): not a run's event log")
    kinds: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        kinds.setdefault(str(e.get("event")), []).append(e)
    w = lambda s="": print(s, file=out)  # noqa: E731

    start = kinds.get("run_start", [{}])[0]
    # The agent's end is the job's (a plain script has no run_end); without an agent, the ranks' run_end.
    ended = kinds.get("agent_end", []) or kinds.get("run_end", [])
    state = "finished" if ended else ("running" if events else "no events yet")
    if ended and ended[-1].get("event") == "agent_end" and not ended[-1].get("ok", True):
        state = f"stopped: {ended[-1].get('reason', '?')} (exit code {ended[-1].get('exit_code', 1)})"
    elif ended and "status" in ended[-1]:
        state += f" ({ended[-1]['status']})"
    w(f"run {run}: {state}")
    if "time" in start:
        end_t = ended[-1]["time"] if ended else time.time()
        w(f"  started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(start['time']))}, "
          f"{end_t - start['time']:.1f} s {'total' if ended else 'so far'}")

    last_report = kinds.get("straggler_report", [None])[-1]
    # The newest report that scored someone (the one after the ranks finished scores nobody).
    scored = next((r for r in reversed(kinds.get("straggler_report", [])) if r.get("scores")), None)
    scores = (scored or {}).get("scores", {})
    slot_ranks = sorted(int(m.group(1)) for f in (run / ".monitors").glob("rank*.progress")
                        if (m := re.fullmatch(r"rank(\d+)\.progress", f.name)))
    ranks = sorted(set(slot_ranks) | {int(r) for r in scores})
    world = start.get("world_size")
    w(f"ranks: {len(ranks)}" + (f" (world size {world})" if world else ""))
    width = kinds.get("width_changed", [None])[-1]
    if width is not None:  # an elastic job: who computes which logical rank now
        w(f"width: {width.get('width')} logical ranks on {width.get('processes')} processes (generation "
          f"{width.get('generation')}, {width.get('cause')}): "
          + ", ".join(f"rank {m} computes {sorted(x)}" for m, x in sorted(width.get("logical", {}).items(),
                                                                          key=lambda kv: int(kv[0]))))
    now = time.monotonic()
    rates = []
    w(f"  {'rank':>4} {'pid':>8} {'state':<8} {'step':>7} {'section':<14} {'idle s':>7} "
      f"{'step s':>8} {'relative':>8} {'individ.':>8}")
    for rank in ranks:
        reader = ProgressReader(run, rank)
        snap = reader.read()
        sc = scores.get(str(rank), {})
        if snap is None:
            w(f"  {rank:>4} {'-':>8} {'-':<8} {'-':>7} {'-':<14} {'-':>7} "
              f"{_fmt(sc.get('step_s'), '.4f'):>8} {_fmt(sc.get('relative')):>8} {_fmt(sc.get('individual')):>8}")
            continue
        live = "done" if snap.closed else _process_state(snap.pid)
        idle = now - snap.last_progress_s if live in ("alive", "stopped") else None
        recs = reader.steps(snap, snap.steps_done - 50)
        if len(recs) >= 2 and recs[-1].end_s > recs[0].end_s:
            rates.append((len(recs) - 1) / (recs[-1].end_s - recs[0].end_s))
        w(f"  {rank:>4} {snap.pid:>8} {live:<8} {snap.step:>7} {snap.section:<14} {_fmt(idle, '.1f'):>7} "
          f"{_fmt(sc.get('step_s'), '.4f'):>8} {_fmt(sc.get('relative')):>8} {_fmt(sc.get('individual')):>8}")
        reader.close()
    if rates:
        w(f"step rate: {min(rates):.2f} steps/s (slowest rank, over its last 50 steps)")
    ctl = read_control(run)
    on = "on" if ctl.enabled is not False and (last_report or {}).get("enabled", True) else "off"
    thr = ctl.threshold if ctl.threshold is not None else (last_report or {}).get("threshold")
    clocks = sorted({sc.get("clock", "wall") for sc in scores.values()})
    timed = " and ".join({"cuda": "CUDA events", "wall": "the wall clock"}.get(c, c) for c in clocks)
    w(f"straggler detection: {on}, threshold {_fmt(thr, 'g')}{f', sections timed by {timed}' if timed else ''}; "
      f"reports: {len(kinds.get('straggler_report', []))}; flagged: "
      + (", ".join(f"rank {d['rank']} ({d.get('action')}, relative {d.get('relative', 0):.2f})"
                   for d in kinds.get("straggler_detected", [])) or "none"))

    hangs = kinds.get("hang_detected", [])
    faults = kinds.get("fault_detected", [])
    w(f"faults: {len(faults)}" + (f"; hangs detected: {len(hangs)}" if hangs else ""))
    stacks = {(e.get("rank"), e.get("pid")): e.get("stacks", "") for e in kinds.get("hang_stacks", [])}
    for f in faults[-10:]:
        where = innermost_frame(stacks.get((f.get("rank"), f.get("pid")), ""))
        w(f"  {f.get('kind', '?')} rank {f.get('rank', '?')} at step {f.get('step', '?')} "
          f"({f.get('phase', '?')})" + (f", stuck in {where}" if where else ""))
    recs = kinds.get("recovery_done", [])
    w(f"recoveries: {len(recs)}")
    for r in recs[-10:]:
        parts = [f"{k.removesuffix('_s')} {r[k]:.2f} s" for k in ("detect_s", "abort_s", "rendezvous_s", "heal_s")
                 if isinstance(r.get(k), (int, float))]
        w("  " + ", ".join(parts) + (f"; steps redone {r['steps_redone']}" if "steps_redone" in r else ""))
    if kinds.get("final_state_written"):
        w("final state written")
    return 0

