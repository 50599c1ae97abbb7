"""`ddprun --help` is written for users: one line per command, examples that parse, no internal docstrings."""

import argparse
import shlex

import pytest

import ddprun.cli
from ddprun.cli import build_parser, main
from ddprun.cli_help import EPILOGS, HELP

COMMANDS = ("run", "doctor", "plan", "report", "slurm-template", "demo")


@pytest.fixture
def help_of(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "100")

    def run(*argv):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--help"])
        assert e.value.code == 0
        return capsys.readouterr().out
    return run


def subparsers(parser):
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_top_help_says_what_ddprun_is_and_not_its_module_docstring(help_of):
    out = help_of()
    assert out.splitlines()[2].startswith("Multi-node PyTorch DDP on torch's elastic launcher.")
    assert ddprun.cli.__doc__.splitlines()[0] not in out
    assert "``" not in out and "->" not in out


def test_every_command_is_listed_with_its_one_line_help(help_of):
    lines = help_of().splitlines()
    for name in COMMANDS:
        line = next(x for x in lines if x.strip().startswith(name + " "))  # name and help on one line
        assert line.split(None, 1)[1].strip() == HELP[name]
        assert len(line) <= 100


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_help_ends_with_examples_kept_verbatim(help_of, name):
    out = help_of(name)
    assert "\nexamples:\n" in out and out.rstrip().endswith(EPILOGS[name].rstrip().splitlines()[-1])
    assert EPILOGS[name] in out  # RawDescriptionHelpFormatter: line breaks and indents as written
    assert isinstance(subparsers(build_parser())[name].formatter_class(prog="x"), argparse.RawDescriptionHelpFormatter)
    assert "``" not in out and ":func:" not in out


def test_run_examples_cover_the_five_by_four_launch_slurm_and_sagemaker_and_plan_a_dry_run():
    run, plan = EPILOGS["run"], EPILOGS["plan"]
    assert "ddprun run --nnodes 5 --nproc-per-node 4 --rdzv-id job1 --rdzv-endpoint node1:29500 train.py" in run
    assert "srun --ntasks-per-node=1 ddprun run train.py" in run and "SageMaker" in run
    assert "ddprun plan --nnodes 5 --nproc-per-node 4 " in plan


def example_commands():
    for name, text in EPILOGS.items():
        for line in text.splitlines():
            code = line.split("#", 1)[0].split(">", 1)[0].strip()
            if "ddprun " in code:
                yield name, shlex.split(code[code.index("ddprun "):])[1:]


@pytest.mark.parametrize("name, argv", list(example_commands()))
def test_every_example_parses(name, argv):
    args = build_parser().parse_args(argv)
    if args.command in ("run", "doctor", "plan"):
        ddprun.cli.config_from_args(args)  # and is a valid launch config


def test_the_dry_run_plan_example_runs(capsys):
    assert main(["plan", "--nnodes", "5", "--nproc-per-node", "4"]) == 0
    assert "rendezvous: unresolved" in capsys.readouterr().out


def test_the_help_that_lsf_errors_point_to_shows_blaunch_starting_one_ddprun_per_host():
    import inspect

    import ddprun.cluster.lsf as lsf

    assert "see `ddprun run --help`" in inspect.getsource(lsf)
    line = next(line for line in EPILOGS["run"].splitlines() if line.lstrip().startswith("blaunch"))
    assert "$LSB_MCPU_HOSTS" in line and line.rstrip().endswith("ddprun run train.py")
