"""MPI launchers (Open MPI, MPICH/Intel MPI, MVAPICH): one process per rank, node-major placement."""

import pytest

from ddprun.cluster.base import NodeFacts
from ddprun.cluster.detect import resolve
from ddprun.cluster.mpi import MpiEnvironment
from ddprun.config import LaunchConfig
from ddprun.errors import ClusterError, ConfigError

NODE = NodeFacts(hostname="n2", cpus=32, cuda_devices=4)


def ompi(rank, size, local_rank, local_size, **extra):
    env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
           "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
           # Open MPI's NODE_RANK is the rank on the node across all jobs, not the node index.
           "OMPI_COMM_WORLD_NODE_RANK": str(local_rank)}
    env.update(extra)
    return env


def test_detects_each_flavour_and_nothing_else():
    assert MpiEnvironment.detect(ompi(0, 1, 0, 1))
    assert MpiEnvironment.detect({"PMI_RANK": "0", "PMI_SIZE": "2"})
    assert MpiEnvironment.detect({"MV2_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_SIZE": "2"})
    assert not MpiEnvironment.detect({"PMI_RANK": "0"})
    assert not MpiEnvironment.detect({"RANK": "0", "WORLD_SIZE": "2"})


def test_open_mpi_two_nodes_of_four():
    r = MpiEnvironment().read(ompi(6, 8, 2, 4, MASTER_ADDR="n1"), NODE)
    assert (r["rank"].value, r["local_rank"].value, r["world_size"].value) == (6, 2, 8)
    assert r["rank"].source == "OMPI_COMM_WORLD_RANK=6"
    assert r["min_nodes"].value == r["max_nodes"].value == 2
    assert r["nproc_per_node"].value == 4 and r["nproc_per_node"].source == "OMPI_COMM_WORLD_LOCAL_SIZE=4"
    assert r["node_rank"].value == 1 and "OMPI_COMM_WORLD_RANK=6 // OMPI_COMM_WORLD_LOCAL_SIZE=4" in r["node_rank"].source
    assert (r["master_addr"].value, r["master_addr"].source) == ("n1", "MASTER_ADDR=n1")
    assert r["master_port"].value == 29500 and r["rdzv_backend"].value == "static"


def test_mpich_hydra_variables():
    env = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29611"}
    r = MpiEnvironment().read(env, NODE)
    assert (r["rank"].value, r["node_rank"].value, r["nproc_per_node"].value) == (3, 1, 2)
    assert r["local_rank"].source == "MPI_LOCALRANKID=1" and r["master_port"].value == 29611


def test_cray_pals_mpiexec_variables():
    """PBS's mpiexec on HPE Cray systems (ALCF Polaris): PMI_LOCAL_RANK/PMI_LOCAL_SIZE, no MPI_LOCALRANKID."""
    env = {"PMI_RANK": "5", "PMI_SIZE": "8", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "4", "MASTER_ADDR": "x3000c0s1b0n0"}
    spec = resolve(LaunchConfig(), env, NODE)
    assert (spec.environment, spec.rank, spec.local_rank, spec.world_size) == ("mpi", 5, 1, 8)
    assert (spec.max_nodes, spec.nproc_per_node, spec.node_rank) == (2, 4, 1)
    assert spec.sources["local_rank"] == "PMI_LOCAL_RANK=1" and spec.sources["nproc_per_node"] == "PMI_LOCAL_SIZE=4"
    # Hydra's pair, where both are set, is read as before
    hydra = MpiEnvironment().read({**env, "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}, NODE)
    assert hydra["local_rank"].source == "MPI_LOCALRANKID=1"


def test_mvapich_variables():
    env = {"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "1",
           "MV2_COMM_WORLD_LOCAL_SIZE": "2"}
    r = MpiEnvironment().read(env, NODE)
    assert (r["world_size"].value, r["max_nodes"].value) == (2, 1)
    assert r["world_size"].source == "MV2_COMM_WORLD_SIZE=2"


def test_single_node_world_needs_no_master_addr():
    r = MpiEnvironment().read(ompi(1, 4, 1, 4), NODE)
    assert r["master_addr"].value == "127.0.0.1"


def test_multi_node_without_master_addr_is_an_error_naming_mpirun_x():
    with pytest.raises(ConfigError) as e:
        resolve(LaunchConfig(), ompi(6, 8, 2, 4), NODE)
    msg = str(e.value)
    assert "nnodes=2" in msg and "HINT" in msg and "mpirun -x MASTER_ADDR" in msg


def test_a_blank_master_addr_is_as_unset_and_a_world_of_several_nodes_says_to_export_it():
    """`mpirun -x MASTER_ADDR=$UNSET`: the host '' failed later as "does not resolve", naming no variable."""
    with pytest.raises(ConfigError) as e:
        resolve(LaunchConfig(), ompi(6, 8, 2, 4, MASTER_ADDR=""), NODE)
    assert "nnodes=2" in str(e.value) and "mpirun -x MASTER_ADDR" in str(e.value)
    assert resolve(LaunchConfig(master_addr="n1"), ompi(6, 8, 2, 4, MASTER_ADDR=" "), NODE).master_addr == "n1"


def test_master_addr_flag_fills_what_mpi_does_not_say():
    spec = resolve(LaunchConfig(master_addr="n1"), ompi(6, 8, 2, 4), NODE)
    assert (spec.environment, spec.master_addr, spec.rank, spec.node_rank) == ("mpi", "n1", 6, 1)
    assert (spec.local_rank, spec.world_size, spec.rdzv_backend) == (2, 8, "static")


@pytest.mark.parametrize("addr", ["127.0.0.1", "localhost"])
def test_a_loopback_master_addr_in_a_world_of_several_nodes_is_refused_naming_it(addr):
    """Every node would host its own store and wait out the join timeout with no cause named."""
    with pytest.raises(ClusterError) as e:
        MpiEnvironment().read(ompi(1, 2, 0, 1, MASTER_ADDR=addr), NODE)
    msg = str(e.value)
    assert f"MASTER_ADDR={addr}" in msg and "loopback" in msg and "2 nodes" in msg and "mpirun -x" in msg
    assert MpiEnvironment().read(ompi(1, 2, 1, 2, MASTER_ADDR=addr), NODE)["master_addr"].value == addr  # one node


def test_uneven_layout_is_an_error_naming_the_counts():
    with pytest.raises(ClusterError) as e:
        MpiEnvironment().read(ompi(4, 6, 0, 4, MASTER_ADDR="n1"), NODE)
    msg = str(e.value)
    assert "OMPI_COMM_WORLD_SIZE=6" in msg and "OMPI_COMM_WORLD_LOCAL_SIZE=4" in msg and "HINT" in msg


def test_round_robin_placement_is_refused():
    # mpirun --map-by node: rank 1 is local rank 0 on the second node.
    with pytest.raises(ClusterError) as e:
        MpiEnvironment().read(ompi(1, 4, 0, 2, MASTER_ADDR="n1"), NODE)
    assert "--map-by slot" in str(e.value) and "HINT" in str(e.value)


def test_missing_local_size_is_an_error_naming_it():
    with pytest.raises(ClusterError) as e:
        MpiEnvironment().read({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0"}, NODE)
    assert "MPI_LOCALNRANKS=<unset>" in str(e.value) and "HINT" in str(e.value)
    assert "PMI_LOCAL_SIZE=<unset>" in str(e.value)  # PALS' pair is not there either


def test_garbage_rank_is_an_error():
    with pytest.raises(ClusterError, match="OMPI_COMM_WORLD_RANK='x'"):
        MpiEnvironment().read(ompi("x", 2, 0, 2), NODE)
