"""Where a process's cgroup keeps a controller's files (cgroups.py): /proc/self/cgroup mapped through
/proc/self/mountinfo as cgroup v1, v2, containers with and without a cgroup namespace, nested ones and
a bare host lay them out; and the out-of-memory kill count the agent reads there (agent/failures.py).
The real thing is tests/faults/test_containers.py."""

from __future__ import annotations

import pytest

from ddprun.cgroups import Place, counter, oom_kills, places

HYBRID = "12:pids:/\n4:memory:/x/y\n3:cpuset:/\n2:cpu,cpuacct:/kubepods/pod1/c1\n1:name=systemd:/\n0::/\n"
"""cgroup v1 controllers beside v2's empty unified line (Docker on a v1 host, and this test machine)."""
HYBRID_MOUNTS = """31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:9 - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V2_MOUNTS = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def files(table: dict[str, str]):
    return lambda path: table.get(path)


def test_a_bare_hosts_cgroup_is_its_path_under_the_hierarchys_mount():
    assert places(HYBRID, HYBRID_MOUNTS, "cpu") == [
        Place("/sys/fs/cgroup/cpu,cpuacct/kubepods/pod1/c1", "/sys/fs/cgroup/cpu,cpuacct", False),
        Place("/sys/fs/cgroup/unified", "/sys/fs/cgroup/unified", True)]
    assert places(HYBRID, HYBRID_MOUNTS, "memory")[0] == Place("/sys/fs/cgroup/memory/x/y", "/sys/fs/cgroup/memory", False)
    assert places("0::/user.slice/job\n", V2_MOUNTS, "memory") == [
        Place("/sys/fs/cgroup/user.slice/job", "/sys/fs/cgroup", True)]


def test_a_container_without_a_cgroup_namespace_sees_its_host_path_as_the_mounts_root():
    """Docker on cgroup v1: /proc/self/cgroup shows /docker/ID, and that is what is mounted."""
    mounts = "700 699 0:29 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro - cgroup cgroup rw,cpu,cpuacct\n"
    assert places("2:cpu,cpuacct:/docker/abc\n", mounts, "cpu") == [
        Place("/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/cpu,cpuacct", False)]


def test_in_a_nested_container_the_mount_on_top_wins_and_a_mount_not_above_the_path_is_no_view():
    """The outer mount is shadowed by the container's own; in a cgroup namespace the host's mount
    root shows as /.. (outside it)."""
    mounts = ("52 51 0:29 /.. /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
              "68 52 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n")
    assert places("1:cpu:/\n", mounts, "cpu") == [Place("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu", False)]
    shadowed = ("52 51 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
                "68 52 0:29 /ddx /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n")
    assert places("1:cpu:/ddx\n", shadowed, "cpu") == [Place("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu", False)]
    # docker-in-docker: a "docker" directory for the inner containers exists, but is not this cgroup
    assert places("1:cpu:/docker/abc\n", "9 8 0:29 /docker/abc /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n",
                  "cpu")[0].dir == "/sys/fs/cgroup/cpu"


def test_what_is_not_mounted_or_not_a_cpu_line_is_no_place():
    assert places(HYBRID, "", "cpu") == []
    assert places("garbage\n5:cpuset:/a\n3:cpuacct:/b\n", HYBRID_MOUNTS, "cpu") == []
    assert places("1:cpu:/\n", "short line\n1 2 3 / /x rw - cgroup\n", "cpu") == []
    escaped = "9 8 0:29 / /mnt/my\\040cgroups rw - cgroup cgroup rw,cpu\n"
    assert places("1:cpu:/a\n", escaped, "cpu") == [Place("/mnt/my cgroups/a", "/mnt/my cgroups", False)]


def test_dirs_go_from_the_cgroup_up_to_the_mount_point():
    assert Place("/sys/fs/cgroup/a/b", "/sys/fs/cgroup", True).dirs() == [
        "/sys/fs/cgroup/a/b", "/sys/fs/cgroup/a", "/sys/fs/cgroup"]
    assert Place("/sys/fs/cgroup/memory", "/sys/fs/cgroup/memory", False).dirs() == ["/sys/fs/cgroup/memory"]


@pytest.mark.parametrize("text, want", [("low 0\noom 3\noom_kill 2\n", 2), ("oom_kill_disable 0\nunder_oom 0\noom_kill 7\n", 7),
                                        ("oom_kill x\n", None), ("", None), (None, None), ("oom_kill 1 2\n", None)])
def test_counter_reads_one_key_of_a_flat_keyed_file(text, want):
    assert counter(text, "oom_kill") == want


def test_oom_kills_reads_v1_memory_oom_control_and_v2_memory_events_of_its_own_cgroup_only():
    v1 = {"/proc/self/cgroup": HYBRID, "/proc/self/mountinfo": HYBRID_MOUNTS,
          "/sys/fs/cgroup/memory/x/y/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n"}
    assert oom_kills(files(v1)) == 1
    v2 = {"/proc/self/cgroup": "0::/job\n", "/proc/self/mountinfo": V2_MOUNTS,
          "/sys/fs/cgroup/job/memory.events": "low 0\nhigh 0\nmax 4\noom 1\noom_kill 3\n"}
    assert oom_kills(files(v2)) == 3
    # the memory controller is off in its own cgroup: an ancestor's count is other processes' too
    parent_only = {**v2, "/sys/fs/cgroup/job/memory.events": None, "/sys/fs/cgroup/memory.events": "oom_kill 9\n"}
    assert oom_kills(files(parent_only)) is None
    assert oom_kills(files({})) is None
