"""LSF: LSB_MCPU_HOSTS ("hostA 4 hostB 4") or LSB_HOSTS (one entry per slot), this host's index, LSB_JOBID."""

import pytest

from ddprun.cluster.base import NodeFacts
from ddprun.cluster.detect import detect, explain, resolve
from ddprun.cluster.lsf import LsfEnvironment, job_hosts
from ddprun.config import LaunchConfig
from ddprun.errors import ClusterError

NODE_B = NodeFacts(hostname="gpu-b07.cluster.example.org", cpus=64, cuda_devices=4, addresses=("10.1.0.7",))


def lsf(**extra):
    """What LSF exports to a task of `bsub -n 8 -R "span[ptile=4]" -gpu "num=4"` on its second host."""
    env = {"LSB_JOBID": "123456", "LSB_JOBINDEX": "0", "LSB_JOBNAME": "train", "LSB_QUEUE": "gpu",
           "LSB_MCPU_HOSTS": "gpu-a03 4 gpu-b07 4",
           "LSB_HOSTS": "gpu-a03 gpu-a03 gpu-a03 gpu-a03 gpu-b07 gpu-b07 gpu-b07 gpu-b07",
           "LSB_DJOB_NUMPROC": "8", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def test_detects_on_job_id_and_hosts_and_steps_aside_for_mpirun():
    assert LsfEnvironment.detect(lsf())
    assert LsfEnvironment.detect(lsf(LSB_MCPU_HOSTS=None))
    assert not LsfEnvironment.detect(lsf(LSB_JOBID=None))
    assert detect(lsf()).name == "lsf"
    assert detect({**lsf(), "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "8"}).name == "mpi"


def test_hosts_come_from_mcpu_hosts_else_from_lsb_hosts():
    assert job_hosts(lsf())[0] == [("gpu-a03", 4), ("gpu-b07", 4)]
    assert job_hosts(lsf(LSB_MCPU_HOSTS=None))[0] == [("gpu-a03", 4), ("gpu-b07", 4)]


def test_this_host_by_its_short_name_is_node_rank_1_and_the_first_host_is_the_master():
    spec = resolve(LaunchConfig(), lsf(), NODE_B, launcher=True)
    assert (spec.environment, spec.max_nodes, spec.node_rank, spec.nproc_per_node) == ("lsf", 2, 1, 4)
    assert (spec.master_addr, spec.master_port, spec.rdzv_backend) == ("gpu-a03", 15000 + 123456 % 17000, "static")
    assert spec.run_id == "lsf-123456"
    assert spec.sources["nproc_per_node"] == "CUDA_VISIBLE_DEVICES=0,1,2,3 (4 GPUs)"
    assert spec.extra["slots"] == 4


def test_explain_names_lsf_and_where_each_number_came_from():
    lines = explain(resolve(LaunchConfig(), lsf(), NODE_B, launcher=True))
    assert lines[0] == "environment: lsf"
    assert "node_rank: 1  <- gpu-b07 is host 1 of LSB_MCPU_HOSTS=gpu-a03 4 gpu-b07 4" in lines
    assert "master_port: 19456  <- 15000 + LSB_JOBID % 17000 (LSB_JOBID=123456)" in lines


@pytest.mark.parametrize("job_id", ["12768", "19999", "999999"])
def test_the_derived_port_stays_below_the_ephemeral_range_as_under_slurm(job_id):
    spec = resolve(LaunchConfig(), lsf(LSB_JOBID=job_id), NODE_B, launcher=True)
    assert 15000 <= spec.master_port < 32768


@pytest.mark.parametrize("hidden", ["-1", "NoDevFiles"])
def test_cuda_visible_devices_that_hide_every_gpu_give_ddpruns_default(hidden):
    cpu_node = NodeFacts(hostname="gpu-b07", cpus=8)
    spec = resolve(LaunchConfig(), lsf(CUDA_VISIBLE_DEVICES=hidden), cpu_node, launcher=True)
    assert (spec.nproc_per_node, spec.device) == (1, "cpu")
    assert "CUDA_VISIBLE_DEVICES" not in spec.sources["nproc_per_node"]


def test_a_host_listed_by_address_a_job_array_element_and_master_port():
    by_addr = NodeFacts(hostname="whatever", cpus=8, addresses=("10.1.0.7",))
    spec = resolve(LaunchConfig(), lsf(LSB_MCPU_HOSTS="10.1.0.3 4 10.1.0.7 4", LSB_JOBINDEX="3",
                                       MASTER_PORT="29400", CUDA_VISIBLE_DEVICES=None), by_addr, launcher=True)
    assert (spec.node_rank, spec.master_addr, spec.master_port) == (1, "10.1.0.3", 29400)
    assert spec.run_id == "lsf-123456-3" and spec.nproc_per_node == 1  # no GPUs given: ddprun's default


def test_elements_of_one_job_array_on_one_host_get_ports_and_run_ids_of_their_own():
    """They share LSB_JOBID: one port for all made the second element's admission refuse it as another job's."""
    first, second = (resolve(LaunchConfig(), lsf(LSB_JOBID="4711", LSB_JOBINDEX=i), NODE_B, launcher=True)
                     for i in ("1", "2"))
    assert first.master_port != second.master_port and first.run_id != second.run_id
    assert (first.run_id, second.run_id) == ("lsf-4711-1", "lsf-4711-2")
    assert all(15000 <= s.master_port < 32768 for s in (first, second))
    assert first.sources["master_port"] == "15000 + (LSB_JOBID + 1009 x LSB_JOBINDEX) % 17000 " \
                                           "(LSB_JOBID=4711, LSB_JOBINDEX=1)"
    plain = resolve(LaunchConfig(), lsf(LSB_JOBID="4711"), NODE_B, launcher=True)  # LSB_JOBINDEX=0: no array
    assert plain.master_port == 15000 + 4711 and plain.run_id == "lsf-4711"


@pytest.mark.parametrize("bad, message", [
    ({"LSB_MCPU_HOSTS": "gpu-a03 4 gpu-b07"}, "pairs"),
    ({"LSB_MCPU_HOSTS": "gpu-a03 four"}, "pairs"),
    ({"LSB_MCPU_HOSTS": "gpu-b07 4 gpu-b07 4"}, "twice"),
    ({"LSB_MCPU_HOSTS": "gpu-a03 4 gpu-a04 4"}, "not one of the LSF job's hosts"),
    ({"LSB_JOBID": "abc"}, "not a whole number"),
    ({"LSB_JOBINDEX": "x1"}, "not a whole number"),
])
def test_bad_values_are_one_message_with_the_values_and_a_hint(bad, message):
    with pytest.raises(ClusterError) as e:
        resolve(LaunchConfig(), lsf(**bad), NODE_B, launcher=True)
    text = str(e.value)
    assert message in text and "Seen: " in text and "HINT: " in text and next(iter(bad.values())) in text


def test_plan_names_lsf(monkeypatch, capsys):
    from ddprun.cli import main

    for key, value in lsf().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("DDPRUN_HOSTNAME", "gpu-b07")
    assert main(["plan", "--nproc-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "(lsf)" in out and "rendezvous: gpu-a03:19456 (static), run id lsf-123456" in out
