"""netaddr: is_host, the reachable address and the gloo/NCCL interface, from probed facts (pure)."""

import dataclasses

import pytest

from ddprun.cluster.base import ClusterSpec, NodeFacts
from ddprun.cluster.detect import resolve
from ddprun.cluster.netaddr import NetProbe, interface_addresses, is_loopback, network_plan, plan_network, route_source
from ddprun.config import LaunchConfig
from ddprun.errors import ClusterError

IFS_A = {"lo": ("127.0.0.1", "::1"), "veth-a": ("10.231.7.1", "fe80::1")}
IFS_B = {"lo": ("127.0.0.1", "::1"), "veth-b": ("10.231.7.2",)}


def spec(master="algo-1", nnodes=2, backend="c10d", node_rank=None, ifname=None, sources=None):
    return ClusterSpec(environment="test", min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=2,
                       node_rank=node_rank, master_addr=master, master_port=29500, rdzv_backend=backend,
                       run_id="j", device="cpu", sources={"master_addr": "--rdzv-endpoint", **(sources or {})},
                       ifname=ifname)


def test_loopback_names_and_addresses():
    assert is_loopback("127.0.1.1") and is_loopback("::1") and is_loopback("localhost")
    assert is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("10.0.0.1") and not is_loopback("algo-1")


def test_single_node_and_loopback_rendezvous_change_nothing():
    for s in (spec(nnodes=1), spec(master="127.0.0.1")):
        net = network_plan(s, {}, probe=lambda host: pytest.fail("no probe when nothing to decide"))
        assert (net.is_host, net.local_addr, net.ifname, dict(net.worker_env), dict(net.rdzv_conf)) == \
               (None, None, None, {}, {})
        assert net.summary() == "" and net.explain()[0].startswith("network: ")


def test_host_whose_name_resolves_to_loopback_hosts_and_advertises_its_interface_address():
    # the measured failure: /etc/hosts says `127.0.0.1 algo-1` on algo-1
    net = plan_network(spec(), NetProbe(IFS_A, ("127.0.0.1",), route_src="127.0.0.1"), {})
    assert net.is_host is True and net.rdzv_conf == {"is_host": "1"}
    assert net.local_addr == "10.231.7.1" and net.ifname == "veth-a"
    assert net.worker_env == {"GLOO_SOCKET_IFNAME": "veth-a", "NCCL_SOCKET_IFNAME": "=veth-a"}
    assert "only interface" in net.sources["local_addr"]
    assert "127.0.0.1 is this node's (lo)" in net.sources["is_host"]


def test_host_whose_name_resolves_to_its_own_interface_address():
    net = plan_network(spec(), NetProbe(IFS_A, ("10.231.7.1",), route_src="10.231.7.1"), {})
    assert (net.is_host, net.local_addr, net.ifname) == (True, "10.231.7.1", "veth-a")
    assert "(veth-a)" in net.sources["is_host"]


def test_other_node_joins_from_the_source_address_of_its_route():
    net = plan_network(spec(), NetProbe(IFS_B, ("10.231.7.1",), route_src="10.231.7.2"), {})
    assert (net.is_host, net.local_addr, net.ifname) == (False, "10.231.7.2", "veth-b")
    assert net.rdzv_conf == {"is_host": "0"} and "none of this node's addresses" in net.sources["is_host"]
    assert net.summary() == "ddprun: this node joins the rendezvous; other nodes reach it at 10.231.7.2 via veth-b"


def test_user_variables_are_kept_and_name_the_interface():
    ifs = {**IFS_B, "eth9": ("192.168.5.5",)}
    net = plan_network(spec(), NetProbe(ifs, ("10.231.7.1",), route_src="10.231.7.2"), {"GLOO_SOCKET_IFNAME": "eth9"})
    assert (net.local_addr, net.ifname) == ("192.168.5.5", "eth9")
    assert net.worker_env == {"NCCL_SOCKET_IFNAME": "=eth9"}  # GLOO_SOCKET_IFNAME is the user's already
    # a list or an exclusion is left to the library: the route decides the address
    net = plan_network(spec(), NetProbe(ifs, ("10.231.7.1",), route_src="10.231.7.2"), {"NCCL_SOCKET_IFNAME": "^docker"})
    assert (net.local_addr, net.ifname, dict(net.worker_env)) == ("10.231.7.2", "veth-b", {"GLOO_SOCKET_IFNAME": "veth-b"})


def test_nccl_socket_ifname_is_matched_as_nccl_reads_it_by_prefix():
    ib = {**IFS_B, "ib0": ("192.168.9.2",)}
    net = plan_network(spec(), NetProbe(ib, ("10.231.7.1",), route_src="10.231.7.2"), {"NCCL_SOCKET_IFNAME": "ib"})
    assert (net.local_addr, net.ifname) == ("192.168.9.2", "ib0")
    assert net.worker_env == {"GLOO_SOCKET_IFNAME": "ib0"}  # gloo takes an exact name, NCCL keeps the user's prefix
    # of several matches, the one that routes to the rendezvous host
    two = {**ib, "ib1": ("192.168.8.2",)}
    net = plan_network(spec(), NetProbe(two, ("192.168.8.1",), route_src="192.168.8.2"), {"NCCL_SOCKET_IFNAME": "ib"})
    assert (net.local_addr, net.ifname, dict(net.worker_env)) == ("192.168.8.2", "ib1", {"GLOO_SOCKET_IFNAME": "ib1"})
    # none of them routes there: NCCL picks among them; gloo gets the route's interface, never a guessed ib
    net = plan_network(spec(), NetProbe(two, ("10.231.7.1",), route_src="10.231.7.2"), {"NCCL_SOCKET_IFNAME": "ib"})
    assert (net.local_addr, net.ifname, dict(net.worker_env)) == ("10.231.7.2", "veth-b", {"GLOO_SOCKET_IFNAME": "veth-b"})
    assert "matches ib0, ib1" in net.sources["ifname"]
    # '=' is an exact name; in a CUDA job nothing matching is an error naming the prefix and the
    # interfaces seen (NCCL would fail on it later)
    gpu = dataclasses.replace(spec(), device="cuda")
    with pytest.raises(ClusterError, match="exact names"):
        plan_network(gpu, NetProbe(ib, ("10.231.7.1",), route_src="10.231.7.2"), {"NCCL_SOCKET_IFNAME": "=ib"})
    with pytest.raises(ClusterError) as e:
        plan_network(gpu, NetProbe(IFS_B, ("10.231.7.1",), route_src="10.231.7.2"), {"NCCL_SOCKET_IFNAME": "hsn"})
    msg = str(e.value)
    assert "hsn (name prefixes" in msg and "veth-b: 10.231.7.2" in msg and "HINT" in msg
    # a CPU job's gloo does not read it: a site-wide NCCL setting on a node without those interfaces
    net = plan_network(spec(), NetProbe(IFS_B, ("10.231.7.1",), route_src="10.231.7.2"), {"NCCL_SOCKET_IFNAME": "hsn"})
    assert (net.local_addr, net.ifname) == ("10.231.7.2", "veth-b") and "not read (a CPU job" in net.sources["ifname"]


def test_sagemaker_interface_wins_over_the_route():
    ifs = {**IFS_B, "eth0": ("172.31.0.9",)}
    s = spec(ifname="eth0", sources={"ifname": "SM_NETWORK_INTERFACE_NAME=eth0"})
    net = plan_network(s, NetProbe(ifs, ("10.231.7.1",), route_src="10.231.7.2"), {})
    assert (net.local_addr, net.ifname) == ("172.31.0.9", "eth0")
    assert net.sources["ifname"] == "SM_NETWORK_INTERFACE_NAME=eth0"
    with pytest.raises(ClusterError, match="does not exist"):
        plan_network(s, NetProbe(IFS_B, ("10.231.7.1",), route_src="10.231.7.2"), {})


def test_local_addr_flag_and_is_host_conf_win():
    net = plan_network(spec(), NetProbe(IFS_B, ("10.231.7.1",), route_src="10.231.7.2"), {},
                       local_addr="10.231.7.2", rdzv_conf={"is_host": "1"})
    assert (net.is_host, net.local_addr, net.ifname) == (True, "10.231.7.2", "veth-b")
    assert net.sources["is_host"] == "--rdzv-conf is_host=1"


def test_static_rank_zero_must_be_the_rendezvous_host():
    s = spec(backend="static", node_rank=0, sources={"node_rank": "line 2 of hostfile: algo-2"})
    with pytest.raises(ClusterError) as e:
        plan_network(s, NetProbe(IFS_B, ("10.231.7.1",), route_src="10.231.7.2"), {})
    assert "node rank 0" in str(e.value) and "HINT" in str(e.value) and "10.231.7.1" in str(e.value)
    ok = plan_network(s, NetProbe(IFS_A, ("127.0.0.1",), route_src="127.0.0.1"), {})
    assert ok.is_host is True and ok.rdzv_conf == {}  # static: no c10d option
    other = plan_network(spec(backend="static", node_rank=1), NetProbe(IFS_B, ("10.231.7.1",), "10.231.7.2"), {})
    assert other.is_host is False


def test_unresolvable_host_no_route_and_ambiguous_host_are_errors_with_hints():
    with pytest.raises(ClusterError, match="does not resolve"):
        plan_network(spec(), NetProbe(IFS_B, ()), {})
    with pytest.raises(ClusterError, match="no route"):
        plan_network(spec(), NetProbe(IFS_B, ("10.9.9.9",), route_src=None), {})
    two = {**IFS_A, "eth1": ("192.168.1.4",)}
    with pytest.raises(ClusterError, match="several") as e:
        plan_network(spec(), NetProbe(two, ("127.0.0.1",), route_src="127.0.0.1"), {})
    assert "--local-addr" in str(e.value)
    net = plan_network(spec(), NetProbe(two, ("127.0.0.1",), route_src="127.0.0.1", default_ifname="eth1"), {})
    assert (net.local_addr, net.ifname) == ("192.168.1.4", "eth1") and "default route" in net.sources["local_addr"]


def test_nccl_is_given_the_exact_interface_unless_its_config_file_names_one(tmp_path):
    """``=eth1`` is NCCL's exact form (a plain eth1 matches eth10 too). NCCL lets the environment win
    over /etc/nccl.conf: an export would override the admin's setting, so there is none."""
    from ddprun.cluster.netaddr import nccl_conf

    ifs = {**IFS_B, "veth-b0": ("10.9.9.9",)}
    probe = NetProbe(ifs, ("10.231.7.1",), route_src="10.231.7.2")
    assert plan_network(spec(), probe, {}).worker_env == {"GLOO_SOCKET_IFNAME": "veth-b",
                                                          "NCCL_SOCKET_IFNAME": "=veth-b"}
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/nccl.conf").write_text("# site settings\nNCCL_SOCKET_IFNAME=ib\nNCCL_IB_HCA = mlx5 # HDR\n")
    (tmp_path / "home").mkdir()
    (tmp_path / "home/.nccl.conf").write_text("NCCL_IB_HCA=mlx5_0\n")
    conf = nccl_conf({"HOME": "/home"}, root=str(tmp_path))
    assert conf == {"NCCL_IB_HCA": "mlx5_0", "NCCL_SOCKET_IFNAME": "ib"}  # the user's file first, as NCCL reads
    net = plan_network(spec(), probe, {}, nccl_conf=conf)
    assert net.worker_env == {"GLOO_SOCKET_IFNAME": "veth-b"}
    assert net.sources["ifname"].endswith("; NCCL: NCCL_SOCKET_IFNAME=ib (its config file)")
    assert nccl_conf({"HOME": "/nonexistent"}, root=str(tmp_path / "none")) == {}


def test_probe_reads_this_machines_interfaces():
    ifs = interface_addresses()
    assert "127.0.0.1" in ifs.get("lo", ())
    assert route_source("127.0.0.1") == "127.0.0.1"


NODE = NodeFacts(hostname="n2", cpus=8)


def ompi(rank, size, local_rank, local_size, **extra):
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size), **extra}


def test_ddprun_run_once_per_node_under_mpirun_makes_the_mpi_rank_the_node_rank():
    spec_ = resolve(LaunchConfig(nproc_per_node="2"), ompi(1, 2, 0, 1, MASTER_ADDR="n1"), NODE, launcher=True)
    assert (spec_.max_nodes, spec_.node_rank, spec_.nproc_per_node) == (2, 1, 2)
    assert (spec_.rank, spec_.local_rank, spec_.world_size) == (None, None, None)
    assert spec_.rdzv_backend == "static" and "task rank is the node rank" in spec_.sources["node_rank"]
    # the script itself under mpirun (ddprun.init()) still sees one process per rank
    per_rank = resolve(LaunchConfig(), ompi(1, 2, 0, 1, MASTER_ADDR="n1"), NODE)
    assert (per_rank.rank, per_rank.world_size) == (1, 2)


def test_ddprun_run_several_times_per_node_is_refused_with_a_hint():
    with pytest.raises(ClusterError) as e:
        resolve(LaunchConfig(), ompi(1, 4, 1, 2, MASTER_ADDR="n1"), NODE, launcher=True)
    msg = str(e.value)
    assert "started 2 times on this node by mpirun" in msg and "ppr:1:node" in msg and "ddprun.init()" in msg
    slurm = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0",
             "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4",
             "SLURM_STEP_ID": "0"}
    with pytest.raises(ClusterError, match="ntasks-per-node=1"):
        resolve(LaunchConfig(), slurm, NODE, launcher=True)


def test_plan_explain_shows_the_network_choices(monkeypatch, capsys):
    from ddprun.cli import main
    from ddprun.cluster import netaddr

    monkeypatch.setattr(netaddr, "probe_network",
                        lambda host: NetProbe(IFS_B, ("10.231.7.1",), route_src="10.231.7.2"))
    assert main(["plan", "--nnodes", "2", "--rdzv-endpoint", "algo-1:29400", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "is_host: False  <- algo-1 resolves to 10.231.7.1, none of this node's addresses" in out
    assert "local_addr: '10.231.7.2'  <- source address of the route to algo-1 (10.231.7.1)" in out
    assert "ifname: 'veth-b'  <- owner of 10.231.7.2" in out and "worker env: GLOO_SOCKET_IFNAME=veth-b" in out
    monkeypatch.setattr(netaddr, "probe_network", lambda host: NetProbe(IFS_B, ()))
    assert main(["plan", "--nnodes", "2", "--rdzv-endpoint", "algo-1:29400", "--explain"]) == 0
    assert "network: `ddprun run` on this node would fail: The rendezvous host does not resolve" in capsys.readouterr().out
