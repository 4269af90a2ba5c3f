"""Disk checkpoints as the ranks report them: saves, the stall, the durable time, failures.

Per save (a step), from the ``checkpoint_*`` events of every rank:

- *stall*: the longest time a rank's training was blocked staging it
  (``checkpoint_staged.seconds``: the copy into host buffers);
- *durable*: the longest time from the save call to ``checkpoint_committed``
  (written, fsynced, manifest and ``latest`` renamed) on any rank;
- failed saves (``checkpoint_failed``, with the reason), skipped ones (the
  previous save still in flight), and checkpoints that did not verify on load
  (``checkpoint_invalid``: the file and the reason).
"""

from __future__ import annotations

from typing import Any

__all__ = ["CheckpointLog"]

_ROWS = 200  # saves shown; the totals count all of them


class CheckpointLog:
    def __init__(self) -> None:
        self._saves: dict[int, dict[str, Any]] = {}
        self.failed: list[dict[str, Any]] = []
        self.invalid: list[dict[str, Any]] = []
        self.loaded: list[dict[str, Any]] = []
        self.skipped = 0
        self.waited = 0

    def add(self, e: dict[str, Any]) -> bool:
        """Takes a ``checkpoint_*`` event; False for one it does not know."""
        name = e.get("event")
        step = e.get("step")
        if name == "checkpoint_skipped":
            self.skipped += 1
        elif name == "checkpoint_waiting":
            self.waited += 1
        elif name == "checkpoint_invalid":
            self.invalid.append(_pick(e, "time", "step", "rank", "file", "reason"))
        elif name == "checkpoint_loaded":
            self.loaded.append(_pick(e, "time", "step", "rank", "saved_world_size", "world_size"))
        elif name == "checkpoint_failed":
            self.failed.append(_pick(e, "time", "step", "rank", "reason"))
            if _is_int(step):
                self._save(step)["failed"] = True
        elif name in ("checkpoint_staged", "checkpoint_committed") and _is_int(step):
            s = self._save(step)
            secs = e.get("seconds")
            key = "stall_s" if name == "checkpoint_staged" else "durable_s"
            if _is_num(secs):
                s[key] = max(s.get(key) or 0.0, float(secs))
            if name == "checkpoint_staged":
                s["bytes"] += int(e["bytes"]) if _is_int(e.get("bytes")) else 0
                s["t"] = min(s["t"], float(e["time"])) if _is_num(e.get("time")) else s["t"]
            else:
                s["committed_ranks"] += 1
        else:
            return False
        return True

    def _save(self, step: int) -> dict[str, Any]:
        return self._saves.setdefault(step, {"step": step, "t": float("inf"), "stall_s": None, "durable_s": None,
                                             "bytes": 0, "committed_ranks": 0, "failed": False})

    def view(self, t0: float) -> dict[str, Any]:
        saves = [dict(s) for _, s in sorted(self._saves.items())]
        for s in saves:
            s["t"] = None if s["t"] == float("inf") else round(s["t"] - t0, 2)
            s["committed"] = s["committed_ranks"] > 0 and not s["failed"]
        stalls = [s["stall_s"] for s in saves if s["stall_s"] is not None]
        durables = [s["durable_s"] for s in saves if s["durable_s"] is not None and s["committed"]]
        return {
            "saves": saves[-_ROWS:], "total": len(saves), "committed": sum(s["committed"] for s in saves),
            "failed": _since(self.failed[-_ROWS:], t0), "failed_total": len(self.failed), "skipped": self.skipped,
            "waited": self.waited, "invalid": _since(self.invalid[-_ROWS:], t0), "loaded": _since(self.loaded[-_ROWS:], t0),
            "stall_max_s": max(stalls, default=None), "stall_mean_s": sum(stalls) / len(stalls) if stalls else None,
            "durable_max_s": max(durables, default=None),
            "durable_mean_s": sum(durables) / len(durables) if durables else None,
        }


def _since(rows: list[dict[str, Any]], t0: float) -> list[dict[str, Any]]:
    """Event times as seconds since the run's start, like every time on the page."""
    return [{**{k: v for k, v in r.items() if k != "time"},
             "t": round(r["time"] - t0, 2) if _is_num(r.get("time")) else None} for r in rows]


def _pick(e: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: e.get(k) for k in keys}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
