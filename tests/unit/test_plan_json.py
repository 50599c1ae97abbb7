"""`ddprun plan` is a dry run: no endpoint needed, and `--json` carries what `--explain` says."""

import json
import pathlib
import re

import pytest

from ddprun.cli import main
from ddprun.cluster.base import NodeFacts
from ddprun.cluster.detect import explain, resolve
from ddprun.cluster.netaddr import NetProbe, plan_network
from ddprun.cluster.plan import make_plan
from ddprun.config import LaunchConfig
from ddprun.errors import ConfigError
from ddprun.plan_json import SCHEMA, plan_document

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "plan-json.md"
NODE = NodeFacts(hostname="gpu01", cpus=32, cuda_devices=4)
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[01-05]", "SLURM_JOB_NUM_NODES": "5",
         "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "1(x5)", "SLURM_GPUS_ON_NODE": "4", "SLURM_STEP_ID": "0"}


@pytest.fixture
def clean_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith(("SLURM_", "OMPI_", "PMI_", "SM_", "PET_", "LSB_", "SKYPILOT_")) or key in (
                "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
            monkeypatch.delenv(key)
    return monkeypatch


def run_json(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_without_an_endpoint_exits_0_and_shows_it_unresolved(clean_env, capsys):
    assert main(["plan", "--nnodes", "5", "--nproc-per-node", "4"]) == 0
    out = capsys.readouterr().out
    assert "5 node(s) x 4 = 20 processes" in out
    assert "rendezvous: unresolved" in out and "HINT: Give every node the same --rdzv-endpoint" in out


def test_plan_json_without_an_endpoint_says_why_and_what_run_would_say(clean_env, capsys):
    doc = run_json(capsys, "--nnodes", "5", "--nproc-per-node", "4")
    assert doc["schema"] == SCHEMA and doc["world_size"] == 20 and len(doc["ranks"]) == 20
    rdzv = doc["rendezvous"]
    assert (rdzv["endpoint"], rdzv["host"], rdzv["resolved"]) == (None, None, False)
    assert "--rdzv-endpoint" in rdzv["unresolved_reason"] and "HINT" in rdzv["unresolved_reason"]
    assert doc["values"]["master_addr"]["value"] is None
    assert doc["values"]["master_addr"]["source"].startswith("unresolved: ")
    assert doc["network"] == {"decided": False, "reason": "the rendezvous host is unresolved", "error": None}
    assert any(w.startswith("rendezvous endpoint unresolved") for w in doc["warnings"])


def test_run_still_refuses_a_multi_node_launch_without_an_endpoint():
    with pytest.raises(ConfigError, match="(?s)rendezvous host.*HINT: Give every node the same --rdzv-endpoint"):
        resolve(LaunchConfig(nnodes="5"), {}, NODE, launcher=True)


def test_plan_json_under_slurm_carries_every_value_with_its_source(clean_env, capsys):
    for key, value in SLURM.items():
        clean_env.setenv(key, value)
    # gpu01 resolves nowhere (as on a login node without the cluster's DNS), whatever this machine's resolver says
    from ddprun.cluster import netaddr

    clean_env.setattr(netaddr, "probe_network", lambda host: NetProbe({"lo": ("127.0.0.1",), "eth0": ("10.0.0.2",)}, ()))
    doc = run_json(capsys)
    assert (doc["environment"], doc["nnodes"], doc["nproc_per_node"], doc["world_size"]) == ("slurm", 5, 4, 20)
    assert (doc["node_rank"], doc["run_id"]) == (0, "slurm-4242")
    assert doc["rendezvous"]["endpoint"] == "gpu01:19242" and doc["rendezvous"]["backend"] == "static"
    assert doc["rendezvous"]["node_ranks"] == "fixed"
    values = doc["values"]
    assert values["master_addr"] == {"value": "gpu01", "source": "first host of SLURM_JOB_NODELIST=gpu[01-05]"}
    assert values["master_port"]["value"] == 19242 and "SLURM_JOB_ID=4242" in values["master_port"]["source"]
    assert values["nproc_per_node"] == {"value": 4, "source": "SLURM_GPUS_ON_NODE=4"}
    assert values["allocated_gpus"] == {"value": 4, "source": "SLURM_GPUS_ON_NODE=4"}
    assert doc["sources"] == {k: v["source"] for k, v in values.items()}
    assert doc["device"] in ("cpu", "cuda") and values["device"]["value"] == doc["device"]
    # the network check's failure is the warning `ddprun run` would stop with
    assert doc["network"]["error"] and "gpu01" in doc["network"]["error"], doc["network"]
    assert any(w.startswith("network: `ddprun run` on this node would fail") for w in doc["warnings"]), doc["warnings"]


def test_json_carries_every_line_explain_prints():
    spec = resolve(LaunchConfig(rdzv_backend="c10d"), {**SLURM, "SLURM_NODEID": "1"}, NODE, launcher=True)
    probe = NetProbe(interfaces={"lo": ("127.0.0.1",), "eth0": ("10.0.0.2",)}, master_addrs=("10.0.0.1",),
                     route_src="10.0.0.2")
    net = plan_network(spec, probe, {})
    doc = plan_document(spec, make_plan(spec.max_nodes, spec.nproc_per_node, spec.device), net)
    for line in explain(spec)[1:]:
        if line.startswith("note: "):
            assert line.removeprefix("note: ") in doc["notes"]
            continue
        key, _, source = line.partition("<- ")
        name = key.split(":")[0].strip()
        assert doc["values"][name]["source"] == source.strip()
    assert doc["node_rank"] is None and doc["rendezvous"]["node_ranks"] == "arrival order (c10d)"
    assert any("c10d" in n for n in doc["notes"])
    network = doc["network"]
    assert (network["decided"], network["is_host"], network["local_addr"], network["ifname"]) == (
        True, False, "10.0.0.2", "eth0")
    assert network["worker_env"] == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "=eth0"}
    assert set(network["sources"]) == {"is_host", "local_addr", "ifname"} and doc["warnings"] == []


def test_single_node_plan_json_says_why_the_network_is_left_to_torch(clean_env, capsys):
    doc = run_json(capsys, "--nproc-per-node", "2")
    assert doc["environment"] == "local" and doc["run_id"] is None and doc["rendezvous"]["port"] is None
    assert doc["network"]["decided"] is False and doc["network"]["reason"].startswith("one node")


def documented_keys() -> set[str]:
    return set(re.findall(r"^\| `([a-z_.]+)` \|", DOC.read_text(), re.M))


def test_every_key_of_the_document_is_documented_and_every_documented_key_exists():
    spec = resolve(LaunchConfig(), SLURM, NODE, launcher=True)
    probe = NetProbe(interfaces={"eth0": ("10.0.0.1",)}, master_addrs=("10.0.0.1",), route_src="10.0.0.1")
    doc = plan_document(spec, make_plan(5, 4, "cuda"), plan_network(spec, probe, {}))
    emitted = set(doc) | {f"rendezvous.{k}" for k in doc["rendezvous"]} | {f"network.{k}" for k in doc["network"]}
    assert emitted == documented_keys()



def test_values_come_in_the_order_environment_flags_defaults_and_a_flag_keeps_its_variables_place():
    """docs/plan-json.md, `values`: the order SLURM, then the flags, then the defaults first gave them;
    --master-port over SLURM's port keeps SLURM's place, with the flag as its source."""
    spec = resolve(LaunchConfig(nproc_per_node=2, master_port=29999), {**SLURM, "SLURM_GPUS_ON_NODE": "2"}, NODE,
                   launcher=True)
    probe = NetProbe(interfaces={"eth0": ("10.0.0.1",)}, master_addrs=("10.0.0.1",), route_src="10.0.0.1")
    values = plan_document(spec, make_plan(5, 2, "cuda"), plan_network(spec, probe, {}))["values"]
    assert list(values) == ["min_nodes", "max_nodes", "master_addr", "rdzv_backend", "run_id", "master_port",
                            "node_rank", "allocated_gpus", "nproc_per_node", "device"]
    assert values["master_port"] == {"value": 29999, "source": "--master-port 29999"}
    assert values["nproc_per_node"]["source"] == "--nproc-per-node 2"  # a flag only: after SLURM's values
    assert values["device"]["source"] == "4 CUDA devices visible"  # from this node's facts: last


def test_the_text_plan_of_one_node_says_a_free_port_where_the_json_has_none(capsys):
    import json

    from ddprun.cli import main

    assert main(["plan", "--standalone"]) == 0
    assert "rendezvous: 127.0.0.1, a free port (c10d)" in capsys.readouterr().out
    assert main(["plan", "--standalone", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rendezvous"]["port"] is None
