"""Does a host snapshot overlap the next forward and backward? CUDA-event timings on one GPU.

For the example GPT (808M parameters by default) it times, each alone and then
together: forward + backward on the compute stream, and the snapshot's
device-to-host copy (``HostSnapshot.capture``) on its side stream. It also
reports how long the host spends inside ``capture`` (a copy that blocks the
host cannot overlap anything) and compares ways of issuing the copy.

    python bench/snapshot_overlap.py --batch 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)

    import torch

    from resilient_train.rank.snapshot import HostSnapshot
    from train_gpt import GPT, GPTConfig, batch

    if not torch.cuda.is_available():
        print("snapshot_overlap: needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    dev = torch.device("cuda", 0)
    cfg = GPTConfig(d_model=args.d_model, layers=args.layers, heads=args.heads, seq_len=args.seq_len, dropout=0.0)
    model = GPT(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = batch(0, 0, 0, size=args.batch, cfg=cfg, device=dev)

    def step() -> None:
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def fwd_bwd() -> None:
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    snap = HostSnapshot()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    snap.capture(0, state, b"")  # allocates the pinned buffers once
    snap.synchronize()
    print(f"state {snap.nbytes() / 2**30:.2f} GiB, batch {args.batch}")

    def timed(fn) -> tuple[float, float]:
        """(device ms from before fn to the end of all streams' work, host ms inside fn)."""
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host = (time.perf_counter() - t0) * 1e3
        end.record()
        end.synchronize()
        snap.synchronize()  # the copy too: its end is after the compute stream's when it is not hidden
        total = start.elapsed_time(end)
        if snap._copier is not None and snap._copier._done is not None:
            total = max(total, start.elapsed_time(snap._copier._done))
        return total, host

    def capture() -> None:
        snap.capture(1, {"model": model.state_dict(), "optimizer": opt.state_dict()}, b"")

    def both() -> None:
        capture()
        fwd_bwd()

    from resilient_train.rank.snapshot import flatten

    side = torch.cuda.Stream()

    def loop_copy() -> None:  # noqa: not through HostSnapshot: the copy as issued before the pacing
        """The same copy issued tensor by tensor with copy_(non_blocking=True), on a stream of its own."""
        _, tensors = flatten({"model": model.state_dict(), "optimizer": opt.state_dict()})
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for buf, t in zip(snap.buffers, tensors):
                buf.copy_(t.detach(), non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)

    def loop_both() -> None:
        _, tensors = flatten({"model": model.state_dict(), "optimizer": opt.state_dict()})
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for buf, t in zip(snap.buffers, tensors):
                buf.copy_(t.detach(), non_blocking=True)
        fwd_bwd()
        torch.cuda.current_stream().wait_stream(side)

    def both_reading_loss() -> None:
        """As a training loop that logs its loss: one scalar read back from the device (loss.item())."""
        capture()
        loss = model(x, y)
        loss.item()
        opt.zero_grad(set_to_none=True)
        loss.backward()

    pinned = torch.empty((), dtype=torch.float32, pin_memory=True)

    def both_loss_non_blocking() -> None:
        """The same loss read as a non-blocking copy into pinned memory, looked at later."""
        capture()
        loss = model(x, y)
        pinned.copy_(loss.detach(), non_blocking=True)
        opt.zero_grad(set_to_none=True)
        loss.backward()

    rows = {}
    for name, fn in (("forward+backward alone", fwd_bwd), ("snapshot copy alone", capture),
                     ("copy, then forward+backward", both), ("copy_ loop alone", loop_copy),
                     ("copy_ loop, then fwd+bwd", loop_both), ("copy, fwd+bwd with loss.item()", both_reading_loss),
                     ("copy, fwd+bwd, loss non-blocking", both_loss_non_blocking)):
        runs = [timed(fn) for _ in range(args.repeat)]
        rows[name] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))
    for name, (device_ms, host_ms) in rows.items():
        print(f"  {name:<30} device {device_ms:8.1f} ms   host inside the call {host_ms:8.1f} ms")
    alone = rows["forward+backward alone"][0] + rows["snapshot copy alone"][0]
    together = rows["copy, then forward+backward"][0]
    print(f"  serial sum {alone:.1f} ms vs together {together:.1f} ms: "
          f"{(alone - together) / rows['snapshot copy alone'][0]:.0%} of the copy hidden")
    print(f"  side-stream copy as timed by its own events: {snap.copy_seconds() * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
