"""The train state: what a step boundary must capture to be replayed exactly.

Two parts, because they heal differently:

* *replicated*: the model and the optimizer. Data-parallel ranks hold the same
  values, so a replacement rank copies them from any healthy peer.
* *local*: the step (the data position), the RNG states and the user's own
  per-rank state (a data loader's position, say). Each rank publishes its own
  after every step (a few KB), so a replacement takes over the state of the rank
  it replaces.
"""

from __future__ import annotations

import io
import random
import sys
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Stateful", "TrainState", "capture_rng", "restore_rng"]


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def capture_rng() -> dict[str, Any]:
    """The RNG states of torch (CPU and every initialised CUDA device), ``random`` and NumPy."""
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _to_plain(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        rng["numpy"] = [name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(_to_tuple(rng["python"]))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if "numpy" in rng:
        import numpy as np

        name, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def _to_plain(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _to_tuple(state: list) -> tuple:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


class TrainState:
    """The model, its optimizer, the data position and the RNG states of one rank.

    ``step`` counts completed steps; with data that is a function of
    ``(seed, step, rank)`` it is the whole data position. ``extra`` is any
    per-rank object with ``state_dict``/``load_state_dict`` (a data loader).
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        extra: Stateful | None = None,
        step: int = 0,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if extra is not None and not isinstance(extra, Stateful):
            raise ValueError("extra must have state_dict() and load_state_dict()")
        self.model = model
        self.optimizer = optimizer
        self.extra = extra
        self.step = step
        # Per-rank state the runtime keeps for itself (the rerun machine): saved and restored beside the user's.
        self.runtime: dict[str, Stateful] = {}

    def replicated_state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"model": self.model.state_dict()}
        if self.optimizer is not None:
            sd["optimizer"] = self.optimizer.state_dict()
        return sd

    def load_replicated(self, sd: dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(sd["optimizer"])

    def local_state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"step": self.step, "rng": capture_rng()}
        if self.extra is not None:
            sd["extra"] = self.extra.state_dict()
        for name, obj in self.runtime.items():
            sd[name] = obj.state_dict()
        return sd

    def load_local(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        restore_rng(sd["rng"])
        if self.extra is not None and "extra" in sd:
            self.extra.load_state_dict(sd["extra"])
        for name, obj in self.runtime.items():
            if name in sd:
                obj.load_state_dict(sd[name])

    def state_dict(self, *, local_states: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """The whole job's state: replicated once, each rank's local state by rank."""
        return {**self.replicated_state_dict(), "ranks": {str(r): s for r, s in sorted(local_states.items())}}


def encode_local(sd: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(sd, buf)
    return buf.getvalue()


def decode_local(data: bytes) -> dict[str, Any]:
    # weights_only: plain data and tensors only, nothing is executed.
    return torch.load(io.BytesIO(data), weights_only=True)


def as_float(x: Any) -> float | None:
    """A step's output as a plain number for logs and validators (None if it is not one)."""
    if isinstance(x, torch.Tensor):
        return float(x.detach().float().item())
    if isinstance(x, (int, float)):
        return float(x)
    return None
