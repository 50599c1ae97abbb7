"""Where a process's cgroup keeps a controller's files (cgroups.py), as cgroup v1, v2, a container
and a bare host lay them out, and the out-of-memory kill count the agent reads from them
(agent/failures.py). The real thing is tests/faults/test_containers.py."""

from __future__ import annotations

import pytest

from ddprun.agent.failures import oom_kills
from ddprun.cgroups import Place, counter, places

HYBRID = "12:pids:/\n4:memory:/x/y\n3:cpuset:/\n2:cpu,cpuacct:/kubepods/pod1/c1\n1:name=systemd:/\n0::/\n"
"""cgroup v1 controllers beside v2's empty unified line (Docker on a v1 host, and this test machine)."""


def files(table: dict[str, str]):
    return lambda path: table.get(path)


def test_a_controller_is_found_in_its_v1_line_and_in_v2s():
    assert places(HYBRID, "cpu") == [Place("/sys/fs/cgroup/cpu", "/kubepods/pod1/c1", False),
                                     Place("/sys/fs/cgroup", "/", True)]
    assert places(HYBRID, "memory")[0] == Place("/sys/fs/cgroup/memory", "/x/y", False)
    assert places("0::/user.slice/job\n", "memory") == [Place("/sys/fs/cgroup", "/user.slice/job", True)]
    assert places("garbage\n5:cpuset:/a\n3:cpuacct:/b\n", "cpu") == []


def test_dirs_go_from_the_cgroup_up_to_the_mount_point():
    assert Place("/sys/fs/cgroup", "/a/b", True).dirs() == ["/sys/fs/cgroup/a/b", "/sys/fs/cgroup/a", "/sys/fs/cgroup"]
    assert Place("/sys/fs/cgroup/memory", "/", False).dirs() == ["/sys/fs/cgroup/memory"]


def test_own_is_the_nearest_cgroup_that_has_the_file():
    """A container without a cgroup namespace shows its host's path; its mount has only its own files."""
    place = Place("/sys/fs/cgroup/memory", "/docker/abc", False)
    assert place.own("memory.oom_control", files({"/sys/fs/cgroup/memory/memory.oom_control": "oom_kill 2"})) \
        == "oom_kill 2"
    assert place.own("memory.oom_control", files({})) is None


@pytest.mark.parametrize("text, want", [("low 0\noom 3\noom_kill 2\n", 2), ("oom_kill_disable 0\nunder_oom 0\noom_kill 7\n", 7),
                                        ("oom_kill x\n", None), ("", None), (None, None), ("oom_kill 1 2\n", None)])
def test_counter_reads_one_key_of_a_flat_keyed_file(text, want):
    assert counter(text, "oom_kill") == want


def test_oom_kills_reads_v1_memory_oom_control_and_v2_memory_events():
    v1 = {"/proc/self/cgroup": "4:memory:/\n0::/\n",
          "/sys/fs/cgroup/memory/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n"}
    assert oom_kills(files(v1)) == 1
    v2 = {"/proc/self/cgroup": "0::/job\n", "/sys/fs/cgroup/job/memory.events": "low 0\nhigh 0\nmax 4\noom 1\noom_kill 3\n"}
    assert oom_kills(files(v2)) == 3
    assert oom_kills(files({"/proc/self/cgroup": "4:memory:/\n0::/\n"})) is None
    assert oom_kills(files({})) is None
