"""The Prometheus endpoint, the TensorBoard fallback, NodeMonitor's events and ``status``."""

from __future__ import annotations

import io
import re
import urllib.request

import pytest
from monhelp import CTX, Procs, wait_for, wait_step
from monitor_workers import train_loop

from monitors.cli import status_main
from monitors.events import EventLog, read_events
from monitors.metrics import PrometheusSink, Sample, TensorBoardSink, render_prometheus
from monitors.node import MetricsConfig, MonitorConfig, NodeMonitor
from monitors.progress import ProgressReporter
from monitors.progressreader import ProgressReader
from monitors.straggler import StragglerConfig

_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A strict reader of the text format: every line is a comment or a valid sample."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        m = _LINE.match(line)
        assert m, f"not a valid sample line: {line!r}"
        labels = tuple(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(4))
    return out


@pytest.mark.timeout(30)
def test_render_follows_the_text_format() -> None:
    text = render_prometheus([
        Sample(name="resilient_train_x_seconds", value=1.5, labels={"rank": "0"}, help="x"),
        Sample(name="resilient_train_x_seconds", value=float("nan"), labels={"rank": 'we"ird'}),
        Sample(name="resilient_train_hangs_total", value=2, kind="counter"),
    ])
    assert "# TYPE resilient_train_hangs_total counter" in text
    values = parse_prometheus(text)
    assert values[("resilient_train_x_seconds", (("rank", "0"),))] == 1.5
    assert values[("resilient_train_hangs_total", ())] == 2.0


@pytest.mark.timeout(60)
def test_node_monitor_serves_parseable_metrics_and_logs_reports(tmp_path, procs: Procs) -> None:
    run = str(tmp_path)
    barrier, stop = CTX.Barrier(2), CTX.Event()
    procs.keep += [barrier, stop]
    for rank in (0, 1):
        procs.start(train_loop, run, rank, {}, barrier, stop)
    wait_step(run, 1, 1, timeout=30.0)
    cfg = MonitorConfig(straggler=StragglerConfig(report_interval_s=0.3), metrics=MetricsConfig(tensorboard=False))
    mon = NodeMonitor(cfg, run, [0, 1])
    try:
        assert mon.prometheus_url is not None and mon.prometheus_url.startswith("http://127.0.0.1:")
        res = wait_for(lambda: (r := mon.poll()).report is not None and len(r.report.scores) == 2 and r,
                       30.0, "a report with both ranks", every=0.05)
        assert res.hangs == [] and res.kill == [] and res.replace == []
        with urllib.request.urlopen(mon.prometheus_url, timeout=10) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
            values = parse_prometheus(resp.read().decode())
        for rank in ("0", "1"):
            assert values[("resilient_train_straggler_relative_score", (("rank", rank),))] <= 1.0
            assert values[("resilient_train_step_seconds", (("rank", rank),))] > 0
            assert ("resilient_train_section_seconds", (("clock", "wall"), ("rank", rank), ("section", "backward"))) in values
        assert values[("resilient_train_straggler_enabled", ())] == 1.0
        names = [e["event"] for e in read_events(run)]
        assert names[0] == "monitor_start" and "straggler_report" in names
    finally:
        stop.set()
        mon.close()


@pytest.mark.timeout(30)
def test_prometheus_sink_binds_a_given_port_and_closes(tmp_path) -> None:
    first = PrometheusSink(port=0)
    port = first.port
    first.close()
    sink = PrometheusSink(port=port)
    try:
        sink.write([Sample(name="resilient_train_step", value=3)], step=3)
        with urllib.request.urlopen(sink.url, timeout=10) as resp:
            assert parse_prometheus(resp.read().decode()) == {("resilient_train_step", ()): 3.0}
    finally:
        sink.close()


@pytest.mark.timeout(30)
def test_tensorboard_sink_is_skipped_cleanly_or_writes(tmp_path) -> None:
    sink = TensorBoardSink.create(str(tmp_path / "tb"))
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        assert sink is None
        return
    assert sink is not None
    sink.write([Sample(name="resilient_train_step_seconds", value=0.1, labels={"rank": "0"})], step=1)
    sink.close()
    assert any((tmp_path / "tb").iterdir())


@pytest.mark.timeout(30)
def test_status_summarises_events_and_progress(tmp_path) -> None:
    run = tmp_path
    log = EventLog(run / "events.jsonl", source="test")
    log.emit("run_start", rank=0, world_size=2)
    log.emit("fault_detected", kind="hang", rank=1, step=7, phase="forward")
    log.emit("recovery_done", detect_s=0.1, abort_s=0.2, rendezvous_s=1.5, heal_s=0.3, steps_redone=1)
    log.emit("straggler_report", interval=1, enabled=True, threshold=0.75,
             scores={"0": {"relative": 1.0, "individual": 1.0, "step_s": 0.1}})
    rep = ProgressReporter(run, 0)
    for step in range(3):
        rep.enter("forward", step)
    out = io.StringIO()
    assert status_main([str(run)], out=out) == 0
    text = out.getvalue()
    assert "running" in text and "ranks: 1 (world size 2)" in text
    assert "hang rank 1 at step 7 (forward)" in text
    assert "rendezvous 1.50 s" in text and "steps redone 1" in text
    assert re.search(r"^\s+0\s+\d+ alive\s+2 forward", text, re.M), text
    rep.close()
    log.emit("run_end", rank=0)
    out = io.StringIO()
    assert status_main([str(run)], out=out) == 0
    assert "finished" in out.getvalue() and " done " in out.getvalue()
    assert status_main([str(run / "missing")], out=io.StringIO()) == 2


@pytest.mark.timeout(30)
def test_progress_slot_records_steps_and_survives_respawn(tmp_path) -> None:
    rep = ProgressReporter(tmp_path, 3)
    for step in range(5):
        for section in ("data", "forward", "backward", "all-reduce", "optimizer"):
            rep.enter(section, step)
    rep.enter("recovery", 2)  # a rollback: the partial step 4 is dropped
    rep.enter("data", 3)
    reader = ProgressReader(tmp_path, 3)
    snap = reader.read()
    assert (snap.step, snap.section, snap.steps_done) == (3, "data", 5)
    records = reader.steps(snap, 0)
    assert [r.step for r in records] == [0, 1, 2, 3, 2]
    assert records[-1].sections_s["recovery"] > 0 and records[-1].sections_s["forward"] == 0
    assert snap.section_count["forward"] == 5 and snap.section_count["recovery"] == 1
    assert snap.section_count["optimizer"] == 4  # step 4's was cut short by the fault
    assert all(r.device_sections_s is None and not r.device_pending for r in records)  # CPU: wall clock only
    with pytest.raises(ValueError, match="unknown section"):
        rep.enter("nap", 3)
    again = ProgressReporter(tmp_path, 3)  # the rank respawned
    fresh = reader.read()
    assert fresh.identity != snap.identity and fresh.counter == 0 and fresh.steps_done == 0
    again.close()
    assert reader.read().closed


@pytest.mark.timeout(60)
def test_a_slot_read_while_its_writer_races_is_always_consistent(tmp_path, procs: Procs) -> None:
    """The seqlock: every snapshot a reader accepts is one the writer published whole."""
    from monitor_workers import hammer_slot

    from monitors.progressreader import ProgressReader

    started, stop = CTX.Event(), CTX.Event()
    procs.start(hammer_slot, str(tmp_path), started, stop)
    assert started.wait(30)
    reader = ProgressReader(tmp_path, 0)
    wait_for(lambda: reader.read() is not None, 10.0, "the slot")
    counters: set[int] = set()
    reads = 0
    try:
        # At least 3000 reads, and on until they have seen 100 of the writer's updates (a loaded machine may
        # give the writer little CPU time: the race is made sure of by counting, not by timing).
        while reads < 3000 or len(counters) <= 100:
            reads += 1
            snap = reader.read()
            counters.add(snap.counter)
            # Updated together in one enter: the count of sections left equals the enters made,
            assert sum(snap.section_count.values()) == snap.counter, snap
            # the steps completed are those before the current one,
            assert snap.steps_done == max(snap.step, 0), (snap.steps_done, snap.step)
            # and the newest completed step ended no later than the last progress (unless the writer
            # has gone round the whole ring since: then the entry is left out, not returned reused).
            for last in reader.steps(snap, snap.steps_done - 1) if snap.steps_done else ():
                assert last.step == snap.step - 1 and last.end_s <= snap.last_progress_s, (last, snap)
    finally:
        stop.set()
    assert len(counters) > 100  # the reads really raced the writer
