"""``resilient-train ckpt {ls,verify,inspect,diff}``: look at checkpoints from the shell.

Exit codes: 0 success (``diff``: bitwise equal), 1 a finding (``verify``: a bad
checkpoint; ``diff``: a difference), 2 an error (missing directory, unreadable
checkpoint, bad arguments). Errors are one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from checkpointing.catalog import iter_valid, list_steps, read_latest, step_dir
from checkpointing.dcp_io import METADATA_FILE, load_metadata
from checkpointing.diff import diff_all, diff_states
from checkpointing.manifest import MANIFEST_FILE, CheckpointError, verify_checkpoint
from checkpointing.tree import Skeleton
from resilient_train.base.cliargs import OneLineParser, integer

__all__ = ["build_parser", "main"]


def build_parser(prog: str = "resilient-train ckpt") -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description="Inspect and verify checkpoints.")
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="list the steps of a checkpoint root")
    ls.add_argument("dir", type=Path)
    v = sub.add_parser("verify", help="verify manifests and checksums; exit 1 naming the bad file")
    v.add_argument("dir", type=Path, help="a checkpoint root or one checkpoint directory")
    v.add_argument("--step", type=integer(low=0), default=None)
    i = sub.add_parser("inspect", help="tensors (shape, dtype, bytes) and plain values of a checkpoint")
    i.add_argument("dir", type=Path)
    i.add_argument("--step", type=integer(low=0), default=None)
    d = sub.add_parser("diff", help="bitwise comparison of two checkpoints; exit 0 only when equal")
    d.add_argument("a", type=Path)
    d.add_argument("b", type=Path)
    d.add_argument("--all", action="store_true", help="list every difference, not only the first")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed the usage error
        return 0 if e.code == 0 else 2
    try:
        return _COMMANDS[args.command](args)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _ls(args: argparse.Namespace) -> int:
    if not args.dir.is_dir():
        raise CheckpointError(args.dir, None, "no such directory")
    latest = read_latest(args.dir)
    for entry in list_steps(args.dir):
        status = "committed" if entry.has_manifest else "no manifest"
        size = sum(f.stat().st_size for f in entry.path.iterdir() if f.is_file())
        mark = "  <- latest" if entry.step == latest else ""
        print(f"step {entry.step:>8}  {status:<12} {size / 2**20:10.1f} MiB  {entry.path.name}{mark}")
    return 0


def _resolve(directory: Path, step: int | None) -> Path:
    if (directory / MANIFEST_FILE).exists() or (step is None and (directory / METADATA_FILE).exists()):
        return directory
    if step is None:
        raise CheckpointError(directory, None, "not a checkpoint directory; pass --step N for a checkpoint root")
    return step_dir(directory, step)


def _verify(args: argparse.Namespace) -> int:
    if not args.dir.is_dir():
        raise CheckpointError(args.dir, None, "no such directory")
    is_single = (args.dir / MANIFEST_FILE).exists() or (args.dir / METADATA_FILE).exists()
    if args.step is not None or is_single:
        path = _resolve(args.dir, args.step)
        try:
            m = verify_checkpoint(path)
        except CheckpointError as e:
            print(f"BAD {e}")
            return 1
        print(f"OK  {path} (step {m.step}, {len(m.files)} files)")
        return 0
    bad = 0
    results = list(iter_valid(args.dir))
    if not results:
        raise CheckpointError(args.dir, None, "no step-N checkpoints here")
    for entry, result in reversed(results):
        if isinstance(result, CheckpointError):
            bad += 1
            print(f"BAD {result}")
        else:
            print(f"OK  {entry.path} (step {result.step}, {len(result.files)} files)")
    return 1 if bad else 0


def _inspect(args: argparse.Namespace) -> int:
    path = _resolve(args.dir, args.step)
    m = verify_checkpoint(path)
    md = load_metadata(path / METADATA_FILE)
    print(f"{path}: step {m.step}, saved by {m.world_size} rank(s), run {m.run_id}")
    total = 0
    for key, entry in sorted(md.state_dict_metadata.items()):
        size = getattr(entry, "size", None)
        props = getattr(entry, "properties", None)
        if size is None or props is None:
            print(f"  {key}: non-tensor entry")
            continue
        nbytes = props.dtype.itemsize * _numel(size)
        total += nbytes
        chunks = len(getattr(entry, "chunks", None) or ())
        where = f" in {chunks} chunks" if chunks > 1 else ""  # a sharded tensor, written by the ranks holding it
        print(f"  {key}: {str(props.dtype).removeprefix('torch.')} {list(size)} {nbytes} bytes{where}")
    print(f"  total tensor bytes: {total}")
    for path_, value in _plain_values(m.tree, ""):
        print(f"  {path_} = {value!r}")
    for key, value in m.extras.items():
        print(f"  extras.{key} = {value!r}")
    return 0


def _diff(args: argparse.Namespace) -> int:
    for p in (args.a, args.b):
        if not p.is_dir():
            raise CheckpointError(p, None, "no such directory")
    found = diff_all(args.a, args.b) if args.all else [d for d in [diff_states(args.a, args.b)] if d is not None]
    if not found:
        print("identical")
        return 0
    for line in found:
        print(line)
    if args.all:
        print(f"{len(found)} difference(s)")
    return 1


def _numel(size: tuple[int, ...]) -> int:
    n = 1
    for s in size:
        n *= s
    return n


def _plain_values(node: Skeleton, path: str) -> list[tuple[str, object]]:
    if "V" in node:
        return [(path, node["V"])]
    out: list[tuple[str, object]] = []
    if "D" in node:
        for k, child in node["D"]:
            out += _plain_values(child, f"{path}.{k}" if path else str(k))
    for child_list in (node.get("L"), node.get("U")):
        for i, child in enumerate(child_list or []):
            out += _plain_values(child, f"{path}.{i}" if path else str(i))
    return out


_COMMANDS = {"ls": _ls, "verify": _verify, "inspect": _inspect, "diff": _diff}

if __name__ == "__main__":
    raise SystemExit(main())
