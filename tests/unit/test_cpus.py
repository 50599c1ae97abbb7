"""The CPUs a process may use (cpus.py): its cores, capped by its cgroup's CPU limit, read from the
files of cgroup v1 and v2 as a container and a bare host lay them out. The real thing, a job in a
CPU-limited container, is tests/faults/test_containers.py."""

from __future__ import annotations

import pytest

from ddprun.cgroups import Place
from ddprun.cluster.base import NodeFacts
from ddprun.cluster.detect import parse_nproc
from ddprun.cluster.kubernetes import KubernetesEnvironment
from ddprun.cpus import Cpus, cgroup_limit, probe

V2 = [Place("/sys/fs/cgroup/kubepods.slice/pod1/c1", "/sys/fs/cgroup", True)]
V2_ROOT = [Place("/sys/fs/cgroup", "/sys/fs/cgroup", True)]
V1_ROOT = [Place("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu", False)]


def files(table: dict[str, str]):
    return lambda path: table.get(path)


def test_a_v2_limit_is_quota_over_period_and_max_is_none():
    assert cgroup_limit(V2_ROOT, files({"/sys/fs/cgroup/cpu.max": "150000 100000\n"})) == 1.5
    assert cgroup_limit(V2_ROOT, files({"/sys/fs/cgroup/cpu.max": "max 100000\n"})) is None
    assert cgroup_limit(V2_ROOT, files({})) is None


def test_a_v1_limit_is_quota_over_period_and_minus_one_is_none():
    root = "/sys/fs/cgroup/cpu"
    v1 = {f"{root}/cpu.cfs_quota_us": "50000\n", f"{root}/cpu.cfs_period_us": "100000\n"}
    assert cgroup_limit(V1_ROOT, files(v1)) == 0.5
    v1[f"{root}/cpu.cfs_quota_us"] = "-1\n"
    assert cgroup_limit(V1_ROOT, files(v1)) is None


def test_the_smallest_limit_on_the_path_wins_and_a_level_without_one_is_skipped():
    """A pod-level limit above a container's; a level whose file is missing or says max."""
    table = {"/sys/fs/cgroup/kubepods.slice/pod1/cpu.max": "200000 100000",
             "/sys/fs/cgroup/kubepods.slice/pod1/c1/cpu.max": "400000 100000",
             "/sys/fs/cgroup/cpu.max": "max 100000"}
    assert cgroup_limit(V2, files(table)) == 2.0
    assert cgroup_limit(V2, files({"/sys/fs/cgroup/kubepods.slice/cpu.max": "300000 100000"})) == 3.0


@pytest.mark.parametrize("text", ["", "max", "1 2 3", "x 100000", "100000 0", "-5 100000", "0 100000"])
def test_what_cannot_be_parsed_is_no_limit(text):
    assert cgroup_limit(V2_ROOT, files({"/sys/fs/cgroup/cpu.max": text})) is None


@pytest.mark.parametrize("cores, limit, usable", [(96, None, 96), (96, 4.0, 4), (96, 3.5, 4), (96, 0.25, 1),
                                                  (2, 8.0, 2), (8, 2.0000000001, 2), (0, None, 1)])
def test_usable_cpus_are_the_cores_capped_by_the_limit_rounded_up(cores, limit, usable):
    assert Cpus(cores, limit).usable == usable


def test_the_note_says_why_only_when_the_limit_lowers_the_count():
    assert Cpus(96, 3.5).note() == "the cgroup's CPU limit (3.5 CPUs; 96 cores visible)"
    assert Cpus(2, 1.0).note() == "the cgroup's CPU limit (1 CPU; 2 cores visible)"
    assert Cpus(2, 1.5).note() == "" and Cpus(2, None).note() == "" and Cpus(2, 8.0).note() == ""


def test_probe_reads_this_process_cgroup_file_first():
    table = {"/proc/self/cgroup": "0::/job\n", "/sys/fs/cgroup/job/cpu.max": "100000 100000",
             "/proc/self/mountinfo": "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"}
    assert probe(files(table)).limit == 1.0
    assert probe(files({})).limit is None


def test_nproc_cpu_and_auto_count_the_limit_and_say_so():
    pod = NodeFacts("pod", cpus=4, cpus_note="the cgroup's CPU limit (3.5 CPUs; 96 cores visible)")
    for flag in ("cpu", "auto"):
        n, why = parse_nproc(flag, pod)
        assert n == 4 and "4 CPUs: the cgroup's CPU limit (3.5 CPUs; 96 cores visible)" in why, why
    reading = KubernetesEnvironment().read({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "cpu", "MASTER_ADDR": "m",
                                            "MASTER_PORT": "1", "PET_NODE_RANK": "0"}, pod)
    assert reading["nproc_per_node"].value == 4 and "3.5 CPUs" in reading["nproc_per_node"].source
    assert parse_nproc("cpu", NodeFacts("bare", cpus=1))[1] == "--nproc-per-node cpu (1 CPU)"
