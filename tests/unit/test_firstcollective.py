"""The bounded first collective of ddprun.init(): its timeout setting, the transport it names, and
its bounds over a real gloo group of one (the collective itself faked where it must hang or fail)."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from ddprun import firstcollective, runtime
from ddprun.errors import ClusterError, ConfigError
from tests.helpers import free_port
from tests.unit.test_runtime import clean_state, torchrun_env  # noqa: F401 - clean_state: autouse, as there


def test_probe_timeout_defaults_to_30_s_0_turns_it_off_and_bad_values_are_named():
    assert firstcollective.probe_timeout({}) == 30.0
    assert firstcollective.probe_timeout({"DDPRUN_FIRST_COLLECTIVE_TIMEOUT": "0"}) == 0.0
    with pytest.raises(ConfigError, match="DDPRUN_FIRST_COLLECTIVE_TIMEOUT='soon'.*\n.*HINT"):
        firstcollective.probe_timeout({"DDPRUN_FIRST_COLLECTIVE_TIMEOUT": "soon"})


@pytest.mark.parametrize("raw", ["nan", "inf", "1e20"])
def test_a_probe_timeout_timedelta_cannot_hold_is_the_same_named_error(raw):
    # nan passed the old `value < 0` check and was a ValueError from timedelta on every rank
    with pytest.raises(ConfigError, match=f"DDPRUN_FIRST_COLLECTIVE_TIMEOUT='{raw}'.*\n.*HINT"):
        firstcollective.probe_timeout({"DDPRUN_FIRST_COLLECTIVE_TIMEOUT": raw})


def test_transport_seen_names_backend_interfaces_master_and_this_host():
    env = {"NCCL_SOCKET_IFNAME": "ib0", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "13"}
    assert firstcollective.transport_seen("nccl", env, "gpu07", {"lo": ("127.0.0.1",), "ib0": ("10.1.0.7",)}) == (
        "backend nccl; GLOO_SOCKET_IFNAME unset (the library picks), NCCL_SOCKET_IFNAME='ib0'; "
        "MASTER_ADDR:MASTER_PORT=10.0.0.1:29500; this rank 13 on gpu07 (lo 127.0.0.1; ib0 10.1.0.7)")


def join_group_of_one(**env):
    os.environ.update(torchrun_env(port=free_port()), **env)


def gloo_timeout_s() -> float:
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return backend.options._timeout.total_seconds()


def test_init_runs_the_first_collective(monkeypatch):
    join_group_of_one(DDPRUN_FIRST_COLLECTIVE_TIMEOUT="4")
    seen = []
    real = firstcollective._all_reduce
    monkeypatch.setattr(firstcollective, "_all_reduce", lambda device: seen.append(gloo_timeout_s()) or real(device))
    runtime.init(timeout=30)
    assert dist.distributed_c10d._get_default_store().add(firstcollective.ARRIVAL_KEY, 0) == 1
    # gloo runs the probe under the probe's timeout (so its op ends by itself), then init's again
    assert seen == [4.0] and gloo_timeout_s() == 30.0


def test_a_first_collective_that_never_completes_is_an_error_within_its_timeout(monkeypatch):
    join_group_of_one(DDPRUN_FIRST_COLLECTIVE_TIMEOUT="0.5", GLOO_SOCKET_IFNAME="lo")
    monkeypatch.setattr(firstcollective, "_all_reduce", lambda device: time.sleep(30))
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=r"did not complete within 0.5 s, although all 1 ranks joined") as e:
        runtime.init(timeout=30)
    assert time.monotonic() - t0 < 5
    assert "backend gloo; GLOO_SOCKET_IFNAME='lo'" in str(e.value) and "HINT: " in str(e.value)
    assert not dist.is_initialized()  # init leaves no broken group behind


def test_a_first_collective_that_fails_is_one_error_naming_the_transport(monkeypatch):
    join_group_of_one()

    def refused(device):
        raise RuntimeError("Connection refused")

    monkeypatch.setattr(firstcollective, "_all_reduce", refused)
    with pytest.raises(ClusterError, match=r"\(gloo all_reduce of one element\) failed: RuntimeError: Connection "
                                           r"refused\nSeen: backend gloo; "):
        runtime.init(timeout=30)
    assert not dist.is_initialized()


def test_the_probe_can_be_turned_off(monkeypatch):
    join_group_of_one(DDPRUN_FIRST_COLLECTIVE_TIMEOUT="0")
    monkeypatch.setattr(firstcollective, "_all_reduce", lambda device: pytest.fail("probe ran"))
    assert runtime.init(timeout=30).distributed


def test_on_cuda_init_binds_the_rank_to_its_gpu_with_device_id(monkeypatch):
    os.environ.update(torchrun_env(rank=1, local_rank=1, world=2, local_world=2, port=free_port()))
    seen = {}

    def fake_init(**kwargs):
        seen.update(kwargs)
        raise KeyboardInterrupt  # stop before any collective: there is no GPU here

    monkeypatch.setattr(runtime, "_use_cuda", lambda environ: True)
    monkeypatch.setattr(runtime, "_device", lambda local_rank, use_cuda, bound=False: torch.device("cuda", local_rank))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    with pytest.raises(KeyboardInterrupt):
        runtime.init(timeout=30)
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 1)


def test_two_ranks_given_one_gpu_are_named_instead_of_nccls_invalid_usage(monkeypatch):
    """An mpirun wrapper that sets CUDA_VISIBLE_DEVICES=0 on every rank: each binds cuda:0 and NCCL's
    eager init stops with 'Duplicate GPU detected' inside an 'invalid usage' error."""
    os.environ.update(torchrun_env(rank=1, local_rank=1, world=2, local_world=2, port=free_port()),
                      CUDA_VISIBLE_DEVICES="0")
    nccl = ("NCCL error in: ProcessGroupNCCL.cpp:1234, invalid usage (run with NCCL_DEBUG=WARN for details), "
            "NCCL version 2.27.3\nncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
            "Last error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000")

    def fake_init(**kwargs):
        raise dist.DistBackendError(nccl)

    monkeypatch.setattr(runtime, "_use_cuda", lambda environ: True)
    monkeypatch.setattr(runtime, "_device", lambda local_rank, use_cuda, bound=False: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    with pytest.raises(ClusterError) as e:
        runtime.init(timeout=30)
    text = str(e.value)
    assert "Two ranks of this job were given the same GPU" in text
    assert "rank 1 (local rank 1)" in text and "uses cuda:0, CUDA_VISIBLE_DEVICES=0" in text
    assert "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000" in text
    assert isinstance(e.value.__cause__, dist.DistBackendError)
