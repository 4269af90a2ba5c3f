"""Issue 14 acceptance: the dashboard in a real headless browser (Debian's Chromium, Playwright).

* live: a 4-rank GPT job under ``resilient-train run --dashboard`` with a slowed rank and a kill;
  the page flags the slow rank within a few report intervals, shows the kill on the recovery
  timeline split into its phases, and its toggle turns straggler detection off (the next
  report says so);
* export: a 4-rank job with four faults, watched live to its end (the page's last update says
  it finished), exported to one file and opened from disk with the network cut off, shows every
  fault (and the hung rank's stacks).

* token: on a finished run's directory (no job), the page reads nothing without the token (issue 26),
  asks for it, and shows the run once it is given; its export link downloads with the token too.

Screenshots are saved under the test's tmp dir (the paths are printed).
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from browser import SKIP_REASON, chromium
from jobs import GPT, REPO, SMALL_GPT, cli

from monitors.events import read_events

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

INTERVAL = 1.0
SLOW_RANK, SLOW_FROM = 2, 20
KILLED, KILL_AT = 1, 120
SEGMENTS = ("detect", "abort", "rendezvous", "heal", "first_step")


def _monitor_config(tmp_path: Path) -> Path:
    cfg = tmp_path / "monitor.json"
    cfg.write_text(json.dumps({"straggler": {"report_interval_s": INTERVAL, "patience": 2},
                               "metrics": {"prometheus": False, "tensorboard": False}}))
    return cfg


def _of(run: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in read_events(run) if e["event"] == name]


class _Agent:
    """``resilient-train run --dashboard`` in the background; its output is drained into a queue."""

    def __init__(self, run: Path, cfg: Path, faults: list[dict[str, Any]], steps: int = 100_000) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "resilient_train.cli", "run", "--dashboard", "--nproc-per-node", "4",
             "--run-dir", str(run), "--monitor-config", str(cfg), "--chaos", json.dumps(faults),
             str(GPT), "--steps", str(steps), *SMALL_GPT],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ),
        )
        threading.Thread(target=self._drain, name="agent-output", daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_line(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no line matching {pattern!r} within {timeout} s; output:\n{''.join(self.output)[-3000:]}")
            m = re.search(pattern, line)
            if m:
                return m

    def close(self) -> None:
        self.proc.kill()  # the workers die with it (PR_SET_PDEATHSIG)
        self.proc.wait(timeout=30)


@pytest.mark.timeout(420)
def test_live_page_flags_the_slow_rank_shows_the_kill_and_turns_detection_off(tmp_path: Path) -> None:
    run = tmp_path / "run"
    faults = [{"kind": "slow", "rank": SLOW_RANK, "step": SLOW_FROM, "phase": "forward", "duration_s": 3600},
              {"kind": "kill", "rank": KILLED, "step": KILL_AT, "phase": "backward"}]
    agent = _Agent(run, _monitor_config(tmp_path), faults)
    try:
        url = agent.wait_line(r"dashboard: (http://\S+)", 120).group(1)
        token = agent.wait_line(r"dashboard token \(reading the run and its controls need it\): (\S+)", 10).group(1)
        assert url.startswith("http://127.0.0.1:") and url.endswith(f"#token={token}")
        with chromium() as page:
            page.goto(url)
            page.wait_for_selector("body[data-ready='1']")
            assert "token=" not in page.url  # the page keeps the token out of the address bar

            # The slowed rank is flagged within a few report intervals, and is the worst row.
            page.wait_for_selector(f"#flagged tr[data-rank='{SLOW_RANK}']", timeout=180_000)
            reports = _of(run, "straggler_report")
            first_slow = next(r["interval"] for r in reports
                              if r["scores"].get(str(SLOW_RANK), {}).get("last_step", -1) >= SLOW_FROM)
            flagged = next(d for d in _of(run, "straggler_detected") if d["rank"] == SLOW_RANK)
            assert flagged["interval"] - first_slow + 1 <= 3, (flagged, first_slow)
            page.wait_for_selector(f"#heatmap[data-worst='{SLOW_RANK}']")

            # The kill is on the recovery timeline, split into its phases.
            row = page.wait_for_selector(
                f"#incidents tr.incident[data-faults='kill@{KILLED}'][data-state='recovered']",
                timeout=180_000)
            assert row.get_attribute("data-phase") == "backward"
            cells = {s: row.query_selector(f"td[data-seg='{s}']").inner_text().strip() for s in SEGMENTS}
            assert all(v not in ("", "–") for v in cells.values()), cells
            assert "agent: the rank exited (signal SIGKILL)" in row.inner_text()
            assert not page.locator("#timeline").is_hidden()

            # The toggle turns detection off; the next report says so, and so does the page.
            assert page.inner_text("#toggle-detection") == "Turn detection off"
            page.click("#toggle-detection")
            page.wait_for_selector("#control-msg[data-status='200']")
            applied = page.wait_for_selector("#control-msg[data-applied]", timeout=60_000)
            page.wait_for_selector("#detection-state[data-enabled='false']")
            [change] = _of(run, "straggler_control")
            assert change["enabled"] is False and change["source"] == "dashboard"
            after = [r for r in _of(run, "straggler_report") if r["control_read_at"] >= change["time"]]
            assert after and after[0]["enabled"] is False and after[0]["scores"] == {}, after[:1]
            assert int(applied.get_attribute("data-applied")) >= after[0]["interval"]
            assert page.inner_text("#toggle-detection") == "Turn detection on"

            shot = tmp_path / "dashboard-live.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"\nscreenshot: {shot}")
            assert page.errors == []  # type: ignore[attr-defined]
    finally:
        agent.close()


@pytest.mark.timeout(420)
def test_export_of_a_finished_run_opens_offline_and_shows_every_fault(tmp_path: Path) -> None:
    run = tmp_path / "run"
    faults = [{"kind": "kill", "rank": 1, "step": 20, "phase": "backward"},
              {"kind": "raise", "rank": 2, "step": 40, "phase": "forward"},
              {"kind": "block", "rank": 3, "step": 60, "phase": "forward"},
              {"kind": "hang", "rank": 0, "step": 80, "phase": "data"}]
    agent = _Agent(run, _monitor_config(tmp_path), faults, steps=100)
    try:
        url = agent.wait_line(r"dashboard: (http://\S+)", 120).group(1)
        with chromium() as page:  # watched live to the end: the page's last push says the job finished
            page.goto(url)
            page.wait_for_selector("#run-state[data-state='finished']", timeout=300_000)
        assert agent.proc.wait(timeout=60) == 0, "".join(agent.output)[-3000:]
    finally:
        agent.close()
    injected = [e for e in read_events(run) if e["event"] == "fault_injected"]
    assert len(injected) == len(faults)
    out = tmp_path / "report.html"
    p = cli("dashboard", str(run), "--export", str(out), timeout=60)
    assert p.returncode == 0, p.stderr

    with chromium(offline=True) as page:
        requested: list[str] = []
        page.on("request", lambda r: requested.append(r.url))
        page.goto(out.as_uri())
        page.wait_for_selector("body[data-ready='1']")
        assert page.get_attribute("#run-state", "data-state") == "finished"
        rows = page.query_selector_all("#incidents tr.incident")
        planted = [(r.get_attribute("data-faults") or "").split() for r in rows]
        assert sorted(sum(planted, [])) == sorted(f"{e['kind']}@{e['rank']}" for e in injected), planted
        for e in injected:  # each planted fault is on exactly one row, recovered, at its phase
            [row] = page.query_selector_all(f"#incidents tr.incident[data-faults~='{e['kind']}@{e['rank']}']")
            assert row.get_attribute("data-state") == "recovered", row.inner_text()
            assert e["phase"] in row.inner_text()
            cells = [row.query_selector(f"td[data-seg='{s}']").inner_text().strip() for s in SEGMENTS]
            assert all(v not in ("", "–") for v in cells), (e, cells)
        assert page.locator("#incidents summary", has_text="Python stacks of hung rank 3").count() == 1
        assert page.locator("#control-form").is_hidden()  # an export steers nothing
        assert all(u.startswith(("file:", "data:")) for u in requested), requested
        shot = tmp_path / "dashboard-export.png"
        page.screenshot(path=str(shot), full_page=True)
        print(f"\nscreenshot: {shot}")
        assert page.errors == []  # type: ignore[attr-defined]


@pytest.mark.timeout(120)
def test_the_page_reads_nothing_without_the_token_and_everything_with_it(tmp_path: Path) -> None:
    import io

    from monitors.dashboard import DashboardConfig, DashboardServer

    run = tmp_path / "run"
    run.mkdir()
    t0 = 1_800_000_000.0
    events = [{"time": t0, "event": "agent_start", "source": "agent", "world_size": 2},
              {"time": t0 + 1, "event": "fault_injected", "source": "rank1", "rank": 1, "kind": "kill",
               "phase": "forward", "step": 5},
              {"time": t0 + 1.1, "event": "fault_detected", "source": "agent", "rank": 1, "how": "signal SIGKILL",
               "generation": 0, "kind": "exit"},
              {"time": t0 + 3, "event": "agent_end", "source": "agent", "ok": True, "restarts": 1}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    with DashboardServer(run, DashboardConfig(refresh_s=0.2), out=io.StringIO()) as server, chromium() as page:
        refused: list[str] = []
        page.on("response", lambda r: refused.append(r.url) if r.status == 403 else None)
        page.goto(server.url)  # no token: nothing is read, the page asks for it
        page.wait_for_selector("#live:has-text('needs the token')")
        assert page.get_attribute("body", "data-ready") is None and not refused
        page.fill("#token", "not-the-token")
        page.dispatch_event("#token", "change")
        page.wait_for_selector("#live:has-text('refused: wrong token')")
        assert page.get_attribute("body", "data-ready") is None and refused, refused
        page.fill("#token", server.token)
        page.dispatch_event("#token", "change")
        page.wait_for_selector("#run-state[data-state='finished']")
        assert page.title() == "resilient-train: run"
        with page.expect_download() as download:
            page.click("#export-link")
        saved = tmp_path / "export.html"
        download.value.save_as(str(saved))
        assert "signal SIGKILL" in saved.read_text()

        assert page.errors == []  # type: ignore[attr-defined]
        tab = page.context.new_page()  # a new tab (nothing kept) opening the printed URL: served at once
        tab.goto(server.url_with_token)
        tab.wait_for_selector("body[data-ready='1']")
        assert "token=" not in tab.url
