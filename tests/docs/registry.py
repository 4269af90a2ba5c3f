"""How each snippet of README.md and docs/*.md is tested: every one is listed here.

A command is listed by its text; any other snippet (a fenced block, an indented
fragment or output) by ``FILE:KIND:WORDS``, words it holds. A snippet the docs
gain or change is missing here and fails ``test_every_snippet_is_tested``; one
they lose is stale here and fails it too. Three ways to be tested:

* :class:`Runs`: the test named (of ``tests/docs``) runs it, taking its text
  from the docs (``docblocks.documented``), with small sizes and the same flags;
* :class:`Parses`: the command's own parser takes it, its placeholders filled
  (a job on many nodes, a chaos scenario), and the test named runs the same
  thing for real;
* :class:`Checked`: not a command to run here (an output, a diagram, a fragment
  of a loop, sbatch), checked as ``why`` says by the test named; ``fragment``,
  when given, is in the snippet and in that test's file.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Checked", "Parses", "REGISTRY", "Runs"]


@dataclass(frozen=True)
class Runs:
    test: str  # a test function of tests/docs


@dataclass(frozen=True)
class Parses:
    test: str  # PATH::FUNCTION of the test that runs it for real
    fill: tuple[tuple[str, str], ...] = ()  # placeholder -> a value the parser takes


@dataclass(frozen=True)
class Checked:
    test: str  # PATH::FUNCTION
    why: str
    fragment: str = ""


_TWO_NODES = "tests/runtime/test_nodes.py::test_two_nodes_a_killed_rank_is_replaced_by_its_node_and_the_run_is_bitwise"
_SPARE_NODE = "tests/runtime/test_nodes.py::test_a_lost_node_is_taken_over_by_the_spare_and_the_run_is_bitwise"
_SLURM = ("tests/cluster/test_slurm_template.py::"
          "test_the_template_preempted_by_either_signal_requeues_itself_resumes_and_completes_bitwise")
_SOAK = "tests/chaos/test_chaos_e2e.py::test_soak_short_random_faults_bitwise"
_CI = "tests/docs/test_docs.py::test_the_ci_runs_the_readmes_test_command"
_DDP = "test_the_ddp_example_with_the_run_config_commits_every_interval_and_ends_bitwise"
_NODE = (("node0", "127.0.0.1"), ("train.py", "examples/train_gpt.py"))

REGISTRY: dict[str, Runs | Parses | Checked] = {
    # README: set up
    "pip install torch==2.13.0 && pip install -e . && resilient-train demo": Runs("test_the_demo"),
    "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest -q": Checked(_CI, "CI's own command"),
    'python -m pytest -q -m "not slow"': Checked(_CI, "the slow marker is declared"),
    # README: quick start
    "README.md:python:batch_for": Runs("test_the_quick_start_block_trains_under_the_agent"),
    "resilient-train run --nproc-per-node 4 --run-dir runs/demo examples/train_ddp.py --steps 200": Runs(_DDP),
    "resilient-train ckpt diff runs/a/final runs/b/final": Runs(_DDP),
    # README: the dashboard
    "pip install -e '.[dashboard]'": Checked("tests/docs/test_docs.py::test_every_extra_a_doc_installs_exists",
                                             "the extra exists"),
    "resilient-train run --dashboard --nproc-per-node 4 --run-dir runs/demo examples/train_gpt.py --steps 2000":
        Runs("test_the_dashboard_commands"),
    "resilient-train dashboard runs/demo [--port 8470] [--host 127.0.0.1]": Runs("test_the_dashboard_commands"),
    "resilient-train dashboard runs/demo --export report.html": Runs("test_the_dashboard_commands"),
    "README.md:indented:dashboard token": Runs("test_the_dashboard_commands"),
    # README: configuration
    "README.md:python:RunConfig.from_yaml": Runs("test_the_configuration_block"),
    "resilient-train run --config examples/run.yaml --nproc-per-node 4 --checkpoint.interval=20 examples/train_ddp.py":
        Runs(_DDP),
    # README: torchrun scripts
    "resilient-train run --standalone --nproc-per-node 8 train.py config/train_gpt2.py": Parses(
        "tests/runtime/test_dropin.py::test_nanogpt_shaped_script_is_killed_restarts_and_resumes_from_its_checkpoint",
        (("train.py", "tests/runtime/dropin/nanogpt_like.py"),)),
    "README.md:indented:rt.heartbeat": Checked(
        "tests/runtime/test_dropin.py::test_heartbeat_turns_hang_detection_on_and_the_kill_is_said",
        "a fragment of a loop (start, max_iters are the script's): the test runs such a loop"),
    # README: many nodes (node0, R and ... are the user's)
    "resilient-train run --nnodes 2 --node-rank R --master-addr node0 --master-port 29500 --rdzv-id my-job "
    "--nproc-per-node 8 --run-dir /shared/runs/my-job train.py": Parses(_TWO_NODES, (("R", "1"), *_NODE)),
    "resilient-train run --spare --nnodes 2 --master-addr node0 --master-port 29500 --rdzv-id my-job ... train.py":
        Parses(_SPARE_NODE, (("... ", ""), *_NODE)),
    # README: Slurm (the test starts a Slurm cluster on this machine, as root)
    "sbatch examples/slurm/train.sbatch": Checked(_SLURM, "sbatch runs the file on a Slurm cluster", "sbatch"),
    "sbatch --nodes=4 examples/slurm/train.sbatch train.py --lr 3e-4": Checked(_SLURM, "the same file", "sbatch"),
    "RT_NPROC_PER_NODE=1 sbatch --gpus-per-node=0 --cpus-per-task=1 examples/slurm/train.sbatch train.py":
        Checked(_SLURM, "the test's CPU sizes", "RT_NPROC_PER_NODE"),
    # README: chaos testing
    "README.md:yaml:name: my-job-kill": Runs("test_the_scenario_block_is_a_scenario"),
    "resilient-train chaos run my-job-kill.yaml": Parses(_SOAK, (("my-job-kill.yaml", "kill"),)),
    "README.md:python:chaos_run": Checked(_SOAK, "a test module's fragment (its fixtures import): the chaos tests "
                                                 "use chaos_run the same way", "chaos_run("),
    # docs/
    "docs/ddp.md:diff:@@": Runs("test_the_ddp_diff_is_the_examples"),
    "docs/design.md:text:node agent": Checked("tests/docs/test_docs.py::test_the_design_diagram_names_real_things",
                                              "a diagram of the process model"),
    "docs/megatron.md:python:rtm.attach": Checked(
        "tests/integrations/test_megatron_supervised.py::test_kill_and_exception_recover_bitwise_with_no_group_left",
        "a fragment (cfg, V, S, train_step are the script's): examples/train_megatron_gpt.py is the whole script"),
    "docs/security.md:indented:is in use by another job": Checked(
        "tests/runtime/test_bad_input.py::test_a_second_job_on_a_run_dir_is_refused_and_a_crashed_one_leaves_no_lock",
        "the message", "in use by another job (pid"),
    "docs/security.md:indented:disk full": Checked(
        "tests/checkpointing/test_ckpt_disk_full.py::test_a_full_disk_is_named_and_stops_checkpointing",
        "the message", "disk full: no space left on the device holding"),
    "docs/sharded.md:python:sup.sharded": Runs("test_the_sharded_block_trains_under_the_agent"),
    "resilient-train run --nproc-per-node 4 --run-dir runs/fsdp examples/train_fsdp.py --steps 100 --ckpt-every 10":
        Runs("test_the_sharded_commands_reshard_4_ranks_to_2"),
    "resilient-train run --nproc-per-node 2 --run-dir runs/fsdp examples/train_fsdp.py --steps 100 --ckpt-every 10":
        Runs("test_the_sharded_commands_reshard_4_ranks_to_2"),
}
