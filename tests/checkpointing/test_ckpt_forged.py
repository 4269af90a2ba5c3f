"""Issue 17: checkpoints forged by someone who can write the directory (and recompute the manifest's
self-checksum) are refused with a one-line reason: wrong types, infinite sizes, 100,000-deep JSON, a
metadata entry of 2**40 elements, a manifest entry that is a link out of the checkpoint. A bounded fuzz
of the manifest parser: a Manifest or a CheckpointError, never another exception."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpointing import CheckpointError, read_state, verify_checkpoint, write_state
from checkpointing.dcp_io import METADATA_FILE, load_metadata
from checkpointing.manifest import MANIFEST_FILE, Manifest, _canonical_digest
from ckpt_helpers import forge_manifest_entry, make_state
from oneline import BAD_NUMBERS, assert_one_line_exit_2, cli

pytestmark = pytest.mark.timeout(120)


def _resign(body: dict) -> str:
    """A manifest's JSON with a matching self-checksum, as a forger would write it."""
    body = {k: v for k, v in body.items() if k != "self_checksum"}
    body["self_checksum"] = _canonical_digest(body)
    return json.dumps(body)


def _forge(directory: Path, change) -> None:
    body = json.loads((directory / MANIFEST_FILE).read_text())
    change(body)
    (directory / MANIFEST_FILE).write_text(_resign(body))


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_state(tmp_path / "ck", make_state(1), step=3)


def _set_size_infinite(b: dict) -> None:
    b["files"][METADATA_FILE]["size"] = float("inf")


FORGERIES = {
    "size-infinity": (_set_size_infinite, "size must be an integer"),
    "files-a-list": (lambda b: b.__setitem__("files", list(b["files"])), "files must be an object"),
    "step-a-string": (lambda b: b.__setitem__("step", "3"), "step must be an integer"),
    "entry-escapes": (lambda b: b["files"].__setitem__("../../etc/passwd", {"size": 1, "sha256": "0" * 64}),
                      "not a file name inside the checkpoint"),
    "tree-junk": (lambda b: b.__setitem__("tree", {"Q": 1}), "unknown skeleton node"),
    "local-trees-bad-rank": (lambda b: b.__setitem__("local_trees", {"x": {"D": []}}), "is not a rank"),
}


@pytest.mark.parametrize("case", sorted(FORGERIES))
def test_forged_manifest_is_refused_in_one_line(ckpt: Path, case: str) -> None:
    change, needle = FORGERIES[case]
    _forge(ckpt, change)
    with pytest.raises(CheckpointError, match="invalid manifest"):
        verify_checkpoint(ckpt)
    r = cli("ckpt", "inspect", str(ckpt), timeout=60)
    assert_one_line_exit_2(r, needle, MANIFEST_FILE)
    v = cli("ckpt", "verify", str(ckpt), timeout=60)  # verify's contract: a bad checkpoint is exit 1, "BAD ..."
    assert v.returncode == 1 and "Traceback" not in v.stderr and v.stdout.startswith("BAD ")


def test_manifest_nested_100000_deep(ckpt: Path) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    raw = (ckpt / MANIFEST_FILE).read_text()
    (ckpt / MANIFEST_FILE).write_text(raw.replace('"extras": {}', f'"extras": {{"x": {deep}}}'))
    r = cli("ckpt", "inspect", str(ckpt), timeout=60)
    assert_one_line_exit_2(r, "nested")


def test_a_metadata_entry_of_2_pow_40_elements_is_refused_before_allocating(ckpt: Path, tmp_path: Path) -> None:
    md = load_metadata(ckpt / METADATA_FILE)
    key = "model.layer.weight"
    md.state_dict_metadata[key].size = torch.Size([2**20, 2**20])
    md.state_dict_metadata[key].chunks[0].sizes = torch.Size([2**20, 2**20])
    (ckpt / METADATA_FILE).write_bytes(pickle.dumps(md))
    forge_manifest_entry(ckpt, METADATA_FILE)
    with pytest.raises(CheckpointError, match="needs 4398046511104 bytes"):
        read_state(ckpt)
    other = write_state(tmp_path / "other", make_state(1), step=3)
    r = cli("ckpt", "diff", str(ckpt), str(other), timeout=60)
    assert_one_line_exit_2(r, "needs 4398046511104 bytes")


def test_metadata_pointing_at_a_file_the_manifest_does_not_list(ckpt: Path) -> None:
    md = load_metadata(ckpt / METADATA_FILE)
    index = next(iter(md.storage_data))
    md.storage_data[index].relative_path = "../../../etc/hostname"
    (ckpt / METADATA_FILE).write_bytes(pickle.dumps(md))
    forge_manifest_entry(ckpt, METADATA_FILE)
    with pytest.raises(CheckpointError, match="does not list"):
        read_state(ckpt)


def test_a_manifest_entry_that_links_out_of_the_checkpoint_does_not_verify(ckpt: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    shard = ckpt / "__0_0.distcp"
    outside.write_bytes(shard.read_bytes())  # same bytes: size and checksum match
    shard.unlink()
    shard.symlink_to(outside)
    with pytest.raises(CheckpointError, match="symbolic link"):
        verify_checkpoint(ckpt)
    assert_one_line_exit_2(cli("ckpt", "inspect", str(ckpt), timeout=60), "symbolic link")
    manifest_link = tmp_path / "m.json"
    os.replace(ckpt / MANIFEST_FILE, manifest_link)
    (ckpt / MANIFEST_FILE).symlink_to(manifest_link)
    with pytest.raises(CheckpointError, match="not a regular file"):
        verify_checkpoint(ckpt)


def _numbers(node: object, path: tuple = ()) -> list[tuple]:
    """The paths of every number in a manifest's JSON, outside the user's data (``tree``'s plain values)
    and the other packages' (``extras``, checked by their readers)."""
    if isinstance(node, dict):
        return [p for k, v in node.items() if path or k not in ("tree", "local_trees", "extras")
                for p in _numbers(v, (*path, k))]
    return [path] if isinstance(node, (int, float)) and not isinstance(node, bool) else []


def test_every_number_of_the_manifest_is_range_checked(ckpt: Path) -> None:
    """Issue 26: 1e308, inf, nan, -1 and 2**70 in each of the manifest's numbers (self checksum recomputed):
    refused in one line naming the field; the ranks of local_trees are checked against the world size."""
    good = json.loads((ckpt / MANIFEST_FILE).read_text())
    paths = _numbers(good)
    assert {p[0] for p in paths} == {"version", "step", "world_size", "created", "files"}, paths  # a new one needs a range
    for path in paths:
        for bad in BAD_NUMBERS:
            body = json.loads(json.dumps(good))
            node = body
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = bad
            (ckpt / MANIFEST_FILE).write_text(_resign(body))
            with pytest.raises(CheckpointError) as e:
                verify_checkpoint(ckpt, checksums=False)
            assert "invalid manifest" in str(e.value) and path[-1] in str(e.value), (path, bad, str(e.value))
            assert "\n" not in str(e.value) and len(str(e.value)) < 400, str(e.value)
    for rank in ("1", "9" * 9, "0" * 20):  # world_size is 1: rank 0 only
        body = json.loads(json.dumps(good))
        body["local_trees"] = {rank: {"D": []}}
        (ckpt / MANIFEST_FILE).write_text(_resign(body))
        with pytest.raises(CheckpointError, match="is not a rank of the 1 that saved it"):
            verify_checkpoint(ckpt, checksums=False)
    (ckpt / MANIFEST_FILE).write_text(_resign(good))
    verify_checkpoint(ckpt)  # the unforged manifest still verifies
    body = json.loads(json.dumps(good))
    body["created"] = 1e308
    (ckpt / MANIFEST_FILE).write_text(_resign(body))
    assert_one_line_exit_2(cli("ckpt", "inspect", str(ckpt), timeout=60), "created must be a finite number in")


# ---- fuzz ---------------------------------------------------------------------------------------------------

_scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
            | st.text(max_size=10) | st.sampled_from(["T", "V", "D", "L", "U", "0" * 64, "__0_0.distcp", ".metadata"]))
_json = st.recursive(_scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(
    st.text(max_size=6) | st.sampled_from(["T", "V", "D", "L", "U", "size", "sha256", "0"]), c, max_size=4),
    max_leaves=25)
_PATHS = [("step",), ("world_size",), ("version",), ("run_id",), ("created",), ("files",), ("tree",),
          ("local_trees",), ("extras",), ("files", "__0_0.distcp"), ("files", "__0_0.distcp", "size"),
          ("files", ".metadata", "sha256"), ("tree", "D"), ("local_trees", "0"), ("format",)]


@pytest.fixture(scope="module")
def valid_body(tmp_path_factory: pytest.TempPathFactory) -> dict:
    state = make_state(2)
    state["rng"] = torch.zeros(3)
    path = write_state(tmp_path_factory.mktemp("fz") / "ck", state, step=1)
    return json.loads((path / MANIFEST_FILE).read_text())


@settings(max_examples=500, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(changes=st.lists(st.tuples(st.sampled_from(_PATHS), _json), min_size=1, max_size=4), resign=st.booleans())
def test_fuzz_manifest_parsing_gives_a_manifest_or_a_value_error(valid_body: dict, changes, resign: bool) -> None:
    body = json.loads(json.dumps(valid_body))
    for path, value in changes:
        node = body
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node[path[-1]] = value
    data = json.loads(_resign(body)) if resign else body
    try:
        m = Manifest.from_json(data)
    except ValueError as e:
        assert "\n" not in str(e)
        return
    # What parses is usable: a round trip gives the same manifest.
    assert Manifest.from_json(m.to_json()).files == m.files


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(value=_json)
def test_fuzz_manifest_file_on_disk(tmp_path_factory: pytest.TempPathFactory, valid_body: dict, value) -> None:
    directory = tmp_path_factory.getbasetemp() / "fuzz-ck"
    directory.mkdir(exist_ok=True)
    body = json.loads(json.dumps(valid_body))
    body["tree"] = value
    (directory / MANIFEST_FILE).write_text(_resign(body))
    try:
        verify_checkpoint(directory, checksums=False)
    except CheckpointError as e:
        assert "\n" not in str(e)


def test_writing_never_goes_through_links_placed_in_the_directory(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("precious")
    (tmp_path / "final.tmp").symlink_to(victim)  # where write_state stages
    (tmp_path / "final").symlink_to(victim)  # what it replaces
    write_state(tmp_path / "final", make_state(1), step=1)
    assert sorted(p.name for p in victim.iterdir()) == ["keep"] and (victim / "keep").read_text() == "precious"
    assert not (tmp_path / "final").is_symlink() and read_state(tmp_path / "final")[1].step == 1
    # The temporaries of an atomic write (here the manifest's) are never written through either.
    (tmp_path / "final" / f"{MANIFEST_FILE}.tmp").symlink_to(victim / "keep")
    Manifest.read(tmp_path / "final").write(tmp_path / "final")
    assert (victim / "keep").read_text() == "precious"
