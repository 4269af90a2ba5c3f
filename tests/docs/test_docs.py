"""Issue 34 item 2: the docs are tested. Every snippet of README.md and docs/*.md is run, parsed or checked
(``registry.py`` says how; the long runs are in ``test_docs_commands.py``), every inline command names
flags its parser has, every path, module and config field the prose names exists, the README's layout names
every module, and docs/ddp.md's diff is the example's. All of it reads files and parsers: no job runs here.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib
import importlib.util
import io
import re
import shlex
import tokenize
from pathlib import Path

import pytest

import resilient_train as rt
from cliparsers import parsers
from docblocks import DOCS, REPO, Snippet, block, documented, inline_spans, snippets
from registry import REGISTRY, Checked, Parses, Runs

HERE = Path(__file__).resolve().parent
DDP_DOC = REPO / "docs" / "ddp.md"
PLAIN_DDP = HERE / "torchrun_train_ddp.py"  # examples/train_ddp.py as a plain torchrun script


def _key(s: Snippet) -> str:
    """The snippet's key in REGISTRY: a command by its text, anything else by FILE:KIND:WORDS it holds."""
    if s.kind == "command":
        return s.text
    keys = [k for k in REGISTRY if k.startswith(f"{s.file}:{s.kind}:") and k.split(":", 2)[2] in s.text]
    assert len(keys) <= 1, f"{s.where}: several registry keys hold it: {keys}"
    return keys[0] if keys else f"{s.file}:{s.kind}:<{s.text.splitlines()[0][:40]}>"


def _test_exists(ref: str) -> bool:
    path, _, name = ref.partition("::")
    tree = ast.parse((REPO / path).read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


def _test_source(ref: str) -> str:
    path, _, name = ref.partition("::")
    text = (REPO / path).read_text()
    node = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.get_source_segment(text, node) or ""


# ------------------------------------------------------------- inventory
@pytest.mark.timeout(60)
def test_the_extractor_finds_commands_fences_and_indented_blocks_but_not_list_paragraphs() -> None:
    found = {(s.kind, s.text) for s in snippets()}
    assert ("command", "resilient-train ckpt diff runs/a/final runs/b/final") in found
    assert any(k == "python" and "RunConfig.from_yaml" in t for k, t in found)
    assert any(k == "indented" and t.startswith("import resilient_train as rt\nfor it in") for k, t in found)
    # A continuation line joined, its comment dropped; a list item's indented paragraph is no code block.
    assert any(k == "command" and t.startswith("resilient-train run --nnodes 2") and "\\" not in t
               and "#" not in t for k, t in found)
    assert not any("the longest time any rank took" in t for _, t in found)


@pytest.mark.timeout(60)
def test_every_snippet_is_tested() -> None:
    """Every snippet is in REGISTRY (a new or changed one fails here), and every entry is still in the docs."""
    keys = [_key(s) for s in snippets()]
    missing = [f"{s.where}: {_key(s)!r}" for s, k in zip(snippets(), keys) if k not in REGISTRY]
    assert not missing, "snippets no test runs (add them to tests/docs/registry.py):\n" + "\n".join(missing)
    stale = sorted(set(REGISTRY) - set(keys))
    assert not stale, f"registry entries the docs no longer hold: {stale}"


@pytest.mark.timeout(60)
def test_every_test_the_registry_names_exists() -> None:
    for key, how in REGISTRY.items():
        ref = how.test
        if isinstance(how, Runs):  # a test of tests/docs: here, or among the long runs
            here = f"tests/docs/test_docs.py::{how.test}"
            ref = here if _test_exists(here) else f"tests/docs/test_docs_commands.py::{how.test}"
        assert _test_exists(ref), f"{key!r}: no test {ref}"
        if isinstance(how, Runs):  # it takes the snippet from the docs: documented(COMMAND) or block(KEY)
            source = " ".join(_test_source(ref).split()).replace('" "', "")  # implicit concatenation joined
            assert key in source or f'"{key}"' in source, f"{ref} does not take {key!r} from the docs"
        if isinstance(how, Checked) and how.fragment:
            (s,) = [s for s in snippets() if _key(s) == key]
            test_file = (REPO / ref.partition("::")[0]).read_text()
            assert how.fragment in s.text and how.fragment in test_file, (key, how.fragment)


@pytest.mark.timeout(120)
def test_the_commands_that_run_elsewhere_parse_with_their_placeholders_filled(tmp_path: Path) -> None:
    from resilient_train.base.cliargs import OneLineParser
    from resilient_train.launch import add_run_arguments
    from resilient_train.runflags import run_config

    for text, how in REGISTRY.items():
        if not isinstance(how, Parses):
            continue
        documented("command", text)
        for placeholder, value in how.fill:
            assert placeholder in text, (text, placeholder)
            text = text.replace(placeholder, value)
        words = shlex.split(text)
        assert words[0] == "resilient-train", text
        if words[1] == "run":
            p = OneLineParser(prog="resilient-train run")
            add_run_arguments(p)
            argv = [w.replace("/shared/runs", str(tmp_path)) for w in words[2:]]
            run = run_config(p.parse_args(argv), argv)  # every value checked, as `run` does before it starts
            assert run.agent.entry is not None, text
        else:
            parser = parsers()[tuple(words[1:3])]
            parser.parse_args(words[3:])


# ----------------------------------------------------- what the prose names
def _command_spans() -> list[tuple[str, int, str]]:
    return [(f, n, s) for f, n, s in inline_spans() if re.match(r"resilient-train [a-z]", s)]


@pytest.mark.timeout(120)
def test_every_inline_command_names_a_subcommand_and_flags_it_has() -> None:
    """`resilient-train straggler RUN_DIR --off` in the prose: the subcommand exists and takes each flag."""
    found = parsers()
    bad = []
    for file, line, span in _command_spans():
        words = span.replace("[", " ").replace("]", " ").split()[1:]
        path: tuple[str, ...] = ()
        for w in words:
            options = {p[len(path)] for p in found if len(p) > len(path) and p[:len(path)] == path}
            names = w.split("/")
            if not options or not all(n in options for n in names):
                break
            path += (names[0],)
        if path not in found:
            if not path or any(p[:len(path)] == path for p in found):
                continue  # a group named as a whole (`resilient-train ckpt`)
            bad.append(f"{file}:{line}: {span!r}: no subcommand {path}")
            continue
        known = {o for a in found[path]._actions for o in a.option_strings}
        flags = [f.split("=")[0] for w in words for f in w.split("/") if f.startswith("--")]
        bad += [f"{file}:{line}: {span!r}: {path} has no {f}" for f in flags
                if f not in known and not f.startswith("--SECTION")]
    assert len(_command_spans()) > 20
    assert not bad, "\n".join(bad)


_REPO_PATH = re.compile(r"^(\.ci|examples|resilient_train|monitors|checkpointing|chaos|tests|bench|docs)/[\w./-]*$")


@pytest.mark.timeout(60)
def test_every_repository_path_the_docs_name_exists() -> None:
    bad = []
    count = 0
    for file, line, span in inline_spans():
        path, _, test = span.partition("::")
        if not _REPO_PATH.match(path):
            continue
        count += 1
        if not (REPO / path).exists():
            bad.append(f"{file}:{line}: {span}")
        elif test and not _test_exists(f"{path}::{test.split('[')[0]}"):
            bad.append(f"{file}:{line}: {span}: no such test")
    assert count > 50
    assert not bad, "\n".join(bad)


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            obj = importlib.import_module(name)
            for attr in parts[cut:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
    return False


@pytest.mark.timeout(120)
def test_every_module_name_and_config_key_the_docs_name_exists() -> None:
    """`resilient_train.rank.buddy`, `checkpointing.DiskFullError`, `monitors.hang.idle_timeout_s` (a run config key),
    `python -m resilient_train.configdoc`, `rt.MeshSpec`, `sup.seed`, `ctx.data_rank`,
    `SupervisorConfig(buddy_every=k)`: each names something that exists."""
    from resilient_train.rank.context import StepContext
    from resilient_train.runconfig import RunConfig

    keys = {k for k, _, _ in RunConfig.keys()}
    sections = {k.rsplit(".", n)[0] for k in keys for n in range(1, k.count(".") + 1)}
    classes = {name: getattr(rt, name) for name in rt.__all__ if name.endswith("Config")}
    sources = {"rt": "", "sup": (REPO / "resilient_train" / "rank" / "supervisor.py").read_text(),  # attributes set in __init__
               "ctx": (REPO / "resilient_train" / "rank" / "context.py").read_text()}
    bad = []
    checked = 0
    for file, line, span in inline_spans():
        where = f"{file}:{line}: {span!r}"
        checked += len(re.findall(r"(?:resilient_train|monitors|checkpointing|chaos)\.\w|python -m |(?:rt|sup|ctx)\.\w"
                                  r"|Config\(\s*\w+=", span))
        for dotted in re.findall(r"(?<![\w./])((?:resilient_train|monitors|checkpointing|chaos)(?:\.\w+)+)", span):
            if not (_resolves(dotted) or dotted in keys or dotted in sections):
                bad.append(f"{where}: {dotted}")
        for module in re.findall(r"python -m ([\w.]+)", span):
            if not module.isupper() and importlib.util.find_spec(module) is None:  # MODULE: a placeholder
                bad.append(f"{where}: python -m {module}")
        for owner, name in re.findall(r"(?<![\w.])(rt|sup|ctx)\.(\w+)", span):
            holder = {"rt": rt, "sup": rt.Supervisor, "ctx": StepContext}[owner]
            if not hasattr(holder, name) and not re.search(rf"self\.{name}\b[^=]*=", sources[owner]):
                bad.append(f"{where}: {owner}.{name}")
        for cls, field in re.findall(r"(\w+Config)\(\s*(\w+)=", span):
            if cls in classes and field not in {f.name for f in dataclasses.fields(classes[cls])}:
                bad.append(f"{where}: {cls} has no field {field}")
    assert checked > 100, checked
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(60)
def test_every_extra_a_doc_installs_exists() -> None:
    import tomllib

    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = {e for f in DOCS for e in re.findall(r"(?:resilient-train|\.)\[(\w+)\]", (REPO / f).read_text())}
    assert named and named <= extras, named - extras


@pytest.mark.timeout(60)
def test_the_ci_runs_the_readmes_test_command() -> None:
    import tomllib

    ci = (REPO / ".ci" / "run").read_text()
    command = documented("command", "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest -q")
    assert command.text in ci.splitlines()
    documented("command", 'python -m pytest -q -m "not slow"')
    markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("slow:") for m in markers)


# ------------------------------------------------------------- the layout
def _layout_rows() -> dict[str, str]:
    """The README's layout rows of resilient_train/ and of each of its rooms, by the directory they name."""
    lines = (REPO / "README.md").read_text().splitlines()
    return {m.group(1): line for line in lines if (m := re.match(r"\| `(resilient_train/(?:\w+/)?)` \|", line))}


@pytest.mark.timeout(60)
def test_the_readme_layout_names_every_module() -> None:
    """The README's layout has a row for resilient_train/ and one for each of its rooms (rank/, agent/,
    protocol/, base/); each names every module and sub-package of its directory, and only modules that are there."""
    rows = _layout_rows()
    root = REPO / "resilient_train"
    rooms = [p for p in sorted(root.iterdir()) if (p / "__init__.py").exists() and p.name != "integrations"]
    assert set(rows) == {"resilient_train/", *(f"resilient_train/{p.name}/" for p in rooms)}, sorted(rows)
    for directory in [root, *rooms]:
        row = rows[f"{directory.relative_to(REPO)}/"]
        named = set(re.findall(r"`([\w/]+(?:\.py|/))`", row.split("|")[2]))
        missing = [p.name for p in directory.glob("*.py") if p.name != "__init__.py" and p.name not in named]
        missing += [f"{p.name}/" for p in directory.iterdir() if (p / "__init__.py").exists() and p not in rooms
                    and f"{p.name}/" not in named and not any(n.startswith(f"{p.name}/") for n in named)]
        assert not missing, f"README's layout row of {directory.name}/ does not name: {sorted(missing)}"
        gone = [n for n in named if n.endswith(".py") and not list(directory.rglob(n))]
        assert not gone, f"README's layout row of {directory.name}/ names modules that are not there: {gone}"


@pytest.mark.timeout(60)
def test_the_design_diagram_names_real_things() -> None:
    (diagram,) = [s for s in snippets() if s.file == "docs/design.md" and s.kind == "text"]
    assert "Supervisor(config).run(step_fn, state)" in diagram.text
    assert list(rt.Supervisor.run.__code__.co_varnames[1:3]) == ["step_fn", "state"]
    from resilient_train.rank.watch import GenerationWatcher  # the "watcher thread"

    assert GenerationWatcher


# ----------------------------------------------------------- docs/ddp.md
def _rt_lines(text: str) -> list[int]:
    """The lines holding a ``# rt:`` comment (a docstring that mentions one is no marker)."""
    return sorted({t.start[0] for t in tokenize.generate_tokens(io.StringIO(text).readline)
                   if t.type == tokenize.COMMENT and t.string.startswith("# rt:")})


def _diff() -> str:
    plain = PLAIN_DDP.read_text().splitlines()
    example = (REPO / "examples" / "train_ddp.py").read_text().splitlines()
    lines = list(difflib.unified_diff(plain, example, n=3, lineterm=""))[2:]  # without the ---/+++ header
    return "\n".join(lines) + "\n"


@pytest.mark.timeout(60)
def test_the_ddp_diff_is_the_examples() -> None:
    """docs/ddp.md's diff is examples/train_ddp.py against its plain torchrun version (tests/docs), its count of
    changed and marked lines is true, and every ``# rt:`` line of the example is one of the changes."""
    diff = block("docs/ddp.md:diff:@@")
    expected = _diff()
    assert diff.text == expected, "docs/ddp.md's diff is stale; it is:\n" + expected
    example = (REPO / "examples" / "train_ddp.py").read_text()
    added = [line[1:] for line in expected.splitlines() if line.startswith("+")]
    marked = [example.splitlines()[n - 1] for n in _rt_lines(example)]
    assert marked and all(line in added for line in marked), "a # rt: line that is no change"
    assert all(line in marked for line in added if "# rt:" in line)
    prose = DDP_DOC.read_text().split("```diff")[0]
    said = f"{len(added)} lines of a {len(example.splitlines())}-line script"
    assert said in prose, f"docs/ddp.md should say {said!r}"
    assert f"{len(marked)} lines marked `# rt:`" in prose, f"docs/ddp.md should count {len(marked)} # rt: lines"
    compile(PLAIN_DDP.read_text(), str(PLAIN_DDP), "exec")


# --------------------------------------------------- blocks run in-process
@pytest.mark.timeout(60)
def test_the_configuration_block(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code = block("README.md:python:RunConfig.from_yaml")
    monkeypatch.chdir(REPO)
    exec(compile(code.text, code.where, "exec"), {})
    printed = capsys.readouterr().out
    assert "checkpoint:\n" in printed and "interval: 50" in printed


@pytest.mark.timeout(60)
def test_the_scenario_block_is_a_scenario(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The chaos section's scenario file loads as a scenario, and `chaos plan` lists its faults."""
    from chaos.cli import main as chaos_main

    scenario = block("README.md:yaml:name: my-job-kill")
    path = tmp_path / "my-job-kill.yaml"
    path.write_text(scenario.text)
    (tmp_path / "train.py").write_text("")
    assert chaos_main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "kill" in out and "store-outage" in out, out
