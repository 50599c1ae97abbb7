"""--hostfile: DeepSpeed/MPI `host slots=N` lines; this node's line is its rank."""

import pytest

from ddprun.cluster.base import NodeFacts
from ddprun.cluster.detect import resolve
from ddprun.cluster.hostfile import HostfileEnvironment, parse_hostfile
from ddprun.config import LaunchConfig
from ddprun.errors import ClusterError

HOSTFILE = """\
# three nodes of four GPUs
worker-1 slots=4
worker-2 slots=4   # the second

10.0.0.3 slots=4 max_slots=8
"""


def write(tmp_path, text=HOSTFILE):
    path = tmp_path / "hostfile"
    path.write_text(text)
    return str(path)


def read(path, hostname="worker-2", addresses=()):
    return HostfileEnvironment(path).read({}, NodeFacts(hostname=hostname, cpus=8, addresses=addresses))


def test_never_detected_from_the_environment():
    assert not HostfileEnvironment.detect({"DDPRUN_HOSTFILE": "x"})


def test_parses_comments_blank_lines_and_extra_items():
    hosts = parse_hostfile(HOSTFILE, "hf")
    assert [(h.host, h.slots, h.line) for h in hosts] == [("worker-1", 4, 2), ("worker-2", 4, 3), ("10.0.0.3", 4, 5)]


def test_node_rank_is_the_line_matching_the_hostname(tmp_path):
    path = write(tmp_path)
    r = read(path)
    assert r["node_rank"].value == 1 and "worker-2" in r["node_rank"].source
    assert r["min_nodes"].value == r["max_nodes"].value == 3
    assert r["master_addr"].value == "worker-1"
    assert r["nproc_per_node"].value == 4 and "slots=4" in r["nproc_per_node"].source
    assert r["rdzv_backend"].value == "static"


def test_matches_short_name_fqdn_and_addresses(tmp_path):
    path = write(tmp_path)
    assert read(path, hostname="WORKER-1.cluster.local")["node_rank"].value == 0
    assert read(path, hostname="ip-10-0-0-3", addresses=("127.0.0.1", "10.0.0.3"))["node_rank"].value == 2


def test_resolve_picks_the_hostfile_from_the_flag(tmp_path):
    path = write(tmp_path)
    spec = resolve(LaunchConfig(hostfile=path), {}, NodeFacts(hostname="10.0.0.3", cpus=8))
    assert (spec.environment, spec.node_rank, spec.max_nodes, spec.nproc_per_node) == ("hostfile", 2, 3, 4)
    assert (spec.master_addr, spec.master_port, spec.rdzv_backend) == ("worker-1", 29500, "static")


def test_host_not_in_file_lists_the_hosts_and_this_nodes_names(tmp_path):
    with pytest.raises(ClusterError) as e:
        read(write(tmp_path), hostname="worker-9", addresses=("10.0.0.9",))
    msg = str(e.value)
    assert "worker-1, worker-2, 10.0.0.3" in msg and "worker-9" in msg and "10.0.0.9" in msg and "HINT" in msg


def test_different_slots_are_an_error(tmp_path):
    with pytest.raises(ClusterError) as e:
        read(write(tmp_path, "worker-1 slots=4\nworker-2 slots=2\n"))
    assert "worker-1 slots=4, worker-2 slots=2" in str(e.value) and "HINT" in str(e.value)


def test_no_slots_leaves_the_default(tmp_path):
    r = read(write(tmp_path, "worker-1\nworker-2\n"))
    assert "nproc_per_node" not in r and r["node_rank"].value == 1


def test_localhost_is_this_node_in_a_one_host_file_only(tmp_path):
    assert read(write(tmp_path, "localhost slots=2\n"))["node_rank"].value == 0
    with pytest.raises(ClusterError, match="loopback"):
        read(write(tmp_path, "localhost slots=2\nworker-2 slots=2\n"))


@pytest.mark.parametrize("text, match", [
    ("", "names no host"),
    ("worker-1 slots=four\n", "slots is not a positive number"),
    ("worker-1 4\n", "not `host slots=N`"),
    ("worker-1 slots=4\nworker-1 slots=4\n", "repeats a host"),
])
def test_malformed_files_are_errors_naming_the_line(tmp_path, text, match):
    with pytest.raises(ClusterError, match=match) as e:
        read(write(tmp_path, text))
    assert "HINT" in str(e.value)


def test_missing_file_is_an_error_naming_the_path(tmp_path):
    with pytest.raises(ClusterError) as e:
        read(str(tmp_path / "nope"))
    assert "nope" in str(e.value) and "HINT" in str(e.value)
