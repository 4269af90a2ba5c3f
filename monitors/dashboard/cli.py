"""``resilient-train dashboard RUN_DIR [--port P] [--host H] | --export FILE``."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import TextIO

from resilient_train.base.cliargs import OneLineParser, host, port

__all__ = ["dashboard_main"]

DESCRIPTION = """\
The straggler and recovery dashboard of a running or finished job: a page that
updates every second from RUN_DIR/events.jsonl.

Panels: step rate (faults marked); straggler scores over time as a heatmap of
the worst k ranks (relative, individual, or per section), their distribution
over all ranks and the flagged ranks; the recovery timeline (each fault as a
bar split into detect / abort / rendezvous / heal / other / first step, with
its cause, rank, phase, steps redone, and a hung rank's Python stacks); disk
checkpoints (saves, stall, durable time, failures, verify failures).

Controls: straggler detection on/off and its threshold, as `resilient-train
straggler` sets them (effective at the detector's next report). Reading the
run and the controls need the token printed on the console at start (the
printed URL carries it, the page sends it in the X-Dashboard-Token header);
requests without it are refused with 403, read nothing and change nothing.

The server binds 127.0.0.1 unless --host says otherwise. `--export FILE` writes
one self-contained HTML file instead (no server, no network needed to open it).
Serving needs the dashboard extra: pip install 'resilient-train[dashboard]'.
"""


def dashboard_main(argv: list[str], out: TextIO | None = None) -> int:
    out = out or sys.stdout
    p = OneLineParser(prog="resilient-train dashboard", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="the job's --run-dir")
    p.add_argument("--port", type=port, default=8470, help="port to serve on (default 8470; 0: a free one)")
    p.add_argument("--host", type=host("--host"), default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 exposes the page)")
    p.add_argument("--export", metavar="FILE", default=None,
                   help="write a self-contained HTML file of the run and exit, instead of serving")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:  # --help and usage errors: a code, not an exit
        return int(e.code or 0)
    run = Path(args.run_dir)
    if not run.is_dir():
        print(f"resilient-train dashboard: no such run directory: {run}", file=sys.stderr)
        return 2
    if args.export:
        from monitors.dashboard.export import export_html

        try:
            path = export_html(run, args.export)
        except (OSError, ValueError) as e:
            print(f"resilient-train dashboard: cannot export: {e}", file=sys.stderr)
            return 2
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, self-contained: open it in a browser)", file=out)
        return 0
    from monitors.dashboard.server import DashboardConfig, DashboardServer, DashboardUnavailable

    try:
        server = DashboardServer(run, DashboardConfig(host=args.host, port=args.port), out=out)
    except (DashboardUnavailable, ValueError) as e:
        print(f"resilient-train dashboard: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server.start()
    print("dashboard: Ctrl-C stops it", file=out, flush=True)
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.close()
    return 0
