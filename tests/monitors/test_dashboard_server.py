"""The dashboard server (in a thread, real sockets) and its CLI: loopback by default, the token
guards every change, and an export is one file that loads nothing from a network."""

from __future__ import annotations

import io
import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the dashboard server needs the dashboard extra")
pytest.importorskip("uvicorn", reason="the dashboard server needs the dashboard extra")
pytest.importorskip("sse_starlette", reason="the dashboard server needs the dashboard extra")

from monitors.control import control_path, read_control  # noqa: E402
from monitors.dashboard import DashboardConfig, DashboardServer  # noqa: E402
from monitors.dashboard.app import TOKEN_HEADER  # noqa: E402
from monitors.dashboard.cli import dashboard_main  # noqa: E402
from monitors.events import read_events  # noqa: E402

T0 = 1_800_000_000.0


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    events = [
        {"time": T0, "event": "agent_start", "source": "agent", "world_size": 2},
        {"time": T0 + 1, "event": "fault_injected", "source": "rank1", "rank": 1, "kind": "kill", "phase": "forward", "step": 5},
        {"time": T0 + 1.1, "event": "fault_detected", "source": "agent", "rank": 1, "how": "signal SIGKILL",
         "generation": 0, "kind": "exit"},
        {"time": T0 + 2, "event": "recovery_done", "source": "rank0", "rank": 0, "generation": 1, "resume_step": 5,
         "detect_s": 0.1, "abort_s": 0.0, "rendezvous_s": 0.5, "heal_s": 0.1, "steps_redone": 0},
        {"time": T0 + 3, "event": "agent_end", "source": "agent", "ok": True, "restarts": 1},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run


def _request(url: str, *, body: Any = None, token: str | None = None) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers[TOKEN_HEADER] = token
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.timeout(60)
def test_binds_loopback_serves_the_page_and_its_state(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    out = io.StringIO()
    with DashboardServer(run, out=out) as server:
        assert server.host == "127.0.0.1" and server._sock.getsockname()[0] == "127.0.0.1"
        printed = out.getvalue()
        assert f"http://127.0.0.1:{server.port}/#token={server.token}" in printed
        assert printed.count(server.token) == 2  # the URL and the token line, once each
        with urllib.request.urlopen(server.url, timeout=10) as r:
            page = r.read().decode()
        assert 'src="static/echarts.min.js"' in page and "rt-data" not in page
        with urllib.request.urlopen(server.url + "static/echarts.min.js", timeout=10) as r:
            assert r.status == 200 and len(r.read()) > 500_000
        status, state = _request(server.url + "api/state", token=server.token)
        assert status == 200 and state["run"]["state"] == "finished"
        assert [i["kind"] for i in state["incidents"]] == ["kill"]
        assert _request(server.url + "api/state?metric=nonsense", token=server.token)[0] == 400
        # A page on another site that rebinds its name to 127.0.0.1 gets nothing.
        req = urllib.request.Request(server.url + "api/state", headers={"Host": f"evil.example:{server.port}",
                                                                        TOKEN_HEADER: server.token})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 400
        req = urllib.request.Request(server.url + "api/state", headers={"Host": f"localhost:{server.port}",
                                                                        TOKEN_HEADER: server.token})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200


@pytest.mark.timeout(60)
def test_a_wrong_or_missing_token_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    with DashboardServer(run, out=io.StringIO()) as server:
        url = server.url + "api/straggler"
        for token in (None, "", "wrong", server.token[:-1], server.token + "x"):
            status, body = _request(url, body={"enabled": False}, token=token)
            assert status == 403 and body["ok"] is False, token
        assert not control_path(run).exists()
        assert not [e for e in read_events(run) if e["event"] == "straggler_control"]
        # With the token: bad values are refused too, and nothing is written.
        for bad in ({"enabled": "no"}, {"threshold": 1.5}, {"threshold": True}, {"other": 1}, {}, b"not json"):
            assert _request(url, body=bad, token=server.token)[0] == 400, bad
        assert not control_path(run).exists()
        status, body = _request(url, body={"enabled": False}, token=server.token)
        assert status == 200 and body["requested"] == {"enabled": False, "threshold": None}
        status, body = _request(url, body={"threshold": 0.5}, token=server.token)
        assert status == 200 and body["requested"] == {"enabled": False, "threshold": 0.5}
        ctl = read_control(run)
        assert (ctl.enabled, ctl.threshold) == (False, 0.5)
        changes = [e for e in read_events(run) if e["event"] == "straggler_control"]
        assert [(e["source"], e["enabled"], e["threshold"]) for e in changes] == [
            ("dashboard", False, None), ("dashboard", False, 0.5)]
        # A second server on the same run has its own token: the first one's is worth nothing there.
        with DashboardServer(run, out=io.StringIO()) as other:
            assert _request(other.url + "api/straggler", body={"enabled": True}, token=server.token)[0] == 403
        assert read_control(run).enabled is False


def _get(url: str, token: str | None) -> tuple[int, bytes]:
    """Status and the first bytes of a GET (a stream is cut after its first event)."""
    headers = {} if token is None else {TOKEN_HEADER: token}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status, r.read(4096) if "event-stream" not in r.headers["Content-Type"] else r.readline()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.timeout(60)
def test_reading_the_run_needs_the_token_on_every_api_route(tmp_path: Path) -> None:
    """Issue 26: the run directory is private, so is what the dashboard serves from it. Every /api/ route the
    app has (taken from the app itself: a new one is covered without a new row) refuses a request without
    the token, or with a wrong one, with 403; with the token, its reads are served. The page and its
    assets need no token and hold nothing of the run."""
    from starlette.routing import Mount, Route

    from monitors.dashboard.app import build_app

    run = _run_dir(tmp_path).rename(tmp_path / "private-job-7f3a")
    routes = build_app(run, token="t").routes
    api = [(r.path, sorted(r.methods or ())) for r in routes if isinstance(r, Route) and r.path.startswith("/api/")]
    reads = [path for path, methods in api if "GET" in methods]
    assert sorted(reads) == ["/api/export", "/api/state", "/api/stream"], api
    assert all(path in reads or methods == ["POST"] for path, methods in api), api
    with DashboardServer(run, DashboardConfig(refresh_s=0.2), out=io.StringIO()) as server:
        for path in reads:
            for token in (None, "", "wrong", server.token[:-1], server.token + "x", server.token.upper()):
                status, body = _get(server.url + path.lstrip("/"), token)
                assert status == 403 and b"SIGKILL" not in body and b"private-job" not in body, (path, token)
            status, body = _get(server.url + path.lstrip("/"), server.token)
            assert status == 200 and body, path
        export = urllib.request.urlopen(urllib.request.Request(
            server.url + "api/export", headers={TOKEN_HEADER: server.token}), timeout=10).read()
        assert b"signal SIGKILL" in export and b"private-job-7f3a" in export
        # The page and its assets: to anyone, and nothing of the run in them (not even its name).
        for path in [""] + [f"static/{name}" for name in ("dashboard.js", "dashboard.css")]:
            status, body = _get(server.url + path, None)
            assert status == 200 and b"private-job" not in body and b"SIGKILL" not in body, path
        assert any(isinstance(r, Mount) and r.path == "/static" for r in routes)


@pytest.mark.timeout(60)
def test_the_live_stream_pushes_snapshots_as_server_sent_events(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    with DashboardServer(run, DashboardConfig(refresh_s=0.2), out=io.StringIO()) as server:
        req = urllib.request.Request(server.url + "api/stream?metric=individual", headers={TOKEN_HEADER: server.token})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            lines = []
            while not any(line.startswith(b"data: ") for line in lines):
                lines.append(r.readline())
        data = json.loads(next(line for line in lines if line.startswith(b"data: "))[6:])
        assert b"event: state\r\n" in lines or b"event: state\n" in lines
        assert data["straggler"]["metric"] == "individual" and data["run"]["state"] == "finished"


@pytest.mark.timeout(60)
def test_cli_export_is_one_self_contained_file(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    out = tmp_path / "report.html"
    assert dashboard_main([str(run), "--export", str(out)], out=io.StringIO()) == 0
    text = out.read_text()
    # Nothing is loaded from anywhere: no external script, style, image or font.
    assert not re.search(r'(src|href)\s*=\s*["\']?(https?:)?//', text)
    assert "@import" not in text and "echarts" in text
    data = json.loads(re.search(r'<script id="rt-data" type="application/json">(.*?)</script>', text, re.S)
                      .group(1).replace("<\\/", "</"))
    assert [i["kind"] for i in data["incidents"]] == ["kill"]
    assert set(data["straggler"]["heatmaps"]) == set(data["straggler"]["metrics"])  # every metric, no server to ask


@pytest.mark.timeout(60)
def test_cli_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert dashboard_main(["--help"]) == 0
    helptext = capsys.readouterr().out
    assert "--export" in helptext and "token" in helptext and "127.0.0.1" in helptext
    assert dashboard_main([str(tmp_path / "missing")]) == 2
    run = _run_dir(tmp_path)
    with DashboardServer(run, out=io.StringIO()) as server:  # its port is taken
        assert dashboard_main([str(run), "--port", str(server.port)]) == 2
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_run_dashboard_without_the_extra_is_a_one_line_error_before_anything_starts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import monitors.dashboard.server as server_module
    from resilient_train.agent import AgentConfig

    script = str(Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py")
    monkeypatch.setattr(server_module, "_MODULES", (*server_module._MODULES, "no_such_module_for_this_test"))
    with pytest.raises(ValueError, match=r"needs no_such_module_for_this_test: pip install 'resilient-train\[dashboard\]'"):
        AgentConfig(script=script, dashboard=DashboardConfig())
    AgentConfig(script=script)  # without --dashboard nothing needs it
    with pytest.raises(ValueError, match=r"DashboardConfig.port must be in \[0, 65535\]"):
        DashboardConfig(port=70000)
