"""A process that ties its life to its parent's (PR_SET_PDEATHSIG) after that parent already died ends
at once, also where a subreaper (slurmstepd, tini -s, systemd, Ray's raylet) adopted it instead of
pid 1: the kernel would never send the signal for a parent that is already gone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "adopted_child.py")


def _adopted_child(how: str) -> list[str]:
    """What the subreaper and the adopted child printed (scripts/adopted_child.py)."""
    out = subprocess.run([sys.executable, SCRIPT, how], capture_output=True, text=True, timeout=40)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    return out.stdout.split("\n")[:-1]


@pytest.mark.parametrize("how", ["agent", "fork"])
def test_a_child_adopted_by_a_subreaper_before_it_tied_itself_to_its_parent_exits(how):
    # agent: a worker orphaned while its interpreter started; fork: a DataLoader worker
    assert _adopted_child(how) == ["exit 1"]


def test_an_exec_started_child_given_no_parent_pid_cannot_tell_a_subreaper_from_its_parent():
    # why the agent gives its workers DDPRUN_AGENT_PID: without it only a pid-1 parent is seen as gone
    assert _adopted_child("exec") == ["still running", "exit 0"]
