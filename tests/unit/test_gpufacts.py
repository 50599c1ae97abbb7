"""GPU/NCCL/IB preflight facts from a fake NVML module and a fake filesystem tree, and the checks
over them: hard faults are errors naming node and field, drift between nodes is a warning."""

import importlib.util
import sys
import time
from pathlib import Path

import pytest

from ddprun.worker import gpufacts
from ddprun.worker.preflight import check as preflight_check
from ddprun.worker.preflight import render_facts

FAKE = Path(__file__).resolve().parents[1] / "fakes" / "nvml" / "pynvml.py"


@pytest.fixture
def nvml():
    spec = importlib.util.spec_from_file_location("fake_pynvml", FAKE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def h100(i, **kw):
    gpu = {"name": "NVIDIA H100 80GB HBM3", "uuid": f"GPU-{i:04d}", "memory": 80 * 2**30, "cc": [9, 0], "mig": 0,
           "ecc": 0, "retired_pending": 0, "remap": [0, 0, 0, 0], "throttle": 0, "pcie": [5, 5, 16, 16],
           "nvlink": [1] * 18}
    gpu.update(kw)
    return gpu


def spec(gpus, driver="550.54.15", cuda=12040):
    return {"driver": driver, "cuda": cuda, "gpus": gpus}


def ib(root, **hcas):
    for hca, state in hcas.items():
        port = root / "sys/class/infiniband" / hca / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text(state + "\n")
        (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
        (port / "link_layer").write_text("InfiniBand\n")


def node(rank, nvml, tmp_path, gpus, nproc=2, env=None, kind="cuda", host=None, driver="550.54.15"):
    """One node's preflight facts, its "gpu" part collected from the fake NVML and a fake tree."""
    nvml.install(spec(gpus, driver=driver))
    root = tmp_path / f"root{rank}"
    root.mkdir(exist_ok=True)
    environ = {"DDPRUN_DEVICE_KIND": kind, **(env or {})}
    return {"node_rank": rank, "host": host or f"h{rank}", "nproc": nproc, "gpus": 0,
            "gpu": gpufacts.collect(environ, nproc, nvml=nvml, root=str(root))}


def messages(found, level):
    return [m for lvl, m in found if lvl == level]


# -- facts ----------------------------------------------------------------------------------------

def test_every_field_is_read_per_local_rank_and_nvml_is_shut_down(nvml):
    nvml.install(spec([h100(0), h100(1, pcie=[4, 5, 8, 16], throttle=0x40 | 0x1, nvlink=[1, 1, 0])]))
    g = gpufacts.gpu_facts(nvml, {}, nproc=2)
    assert (g["nvml"], g["driver"], g["cuda_driver"], g["visible"]) == ("ok", "550.54.15", "12.4", 2)
    r0, r1 = g["ranks"]
    assert r0 == {"local_rank": 0, "index": 0, "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-0000",
                  "memory_mib": 81920, "compute_capability": "9.0", "mig": False, "ecc_uncorrected_volatile": 0,
                  "retired_pages_pending": False, "remap_pending": False, "remap_failed": False, "throttle": [],
                  "pcie_gen": 5, "pcie_gen_max": 5, "pcie_width": 16, "pcie_width_max": 16,
                  "nvlink_active": 18, "nvlink_inactive": 0}
    assert (r1["pcie_gen"], r1["pcie_width"], r1["throttle"]) == (4, 8, ["gpu_idle", "hw_thermal"])
    assert (r1["nvlink_active"], r1["nvlink_inactive"]) == (2, 1)
    assert g["notes"] == []
    assert nvml.CALLS == ["nvmlInit", "nvmlShutdown"]


def test_cuda_visible_devices_maps_local_ranks_by_index_or_uuid_and_stops_at_a_bad_entry(nvml):
    nvml.install(spec([h100(i) for i in range(4)]))
    g = gpufacts.gpu_facts(nvml, {"CUDA_VISIBLE_DEVICES": "GPU-0002,GPU-0000"}, nproc=2)
    assert [(r["local_rank"], r["index"]) for r in g["ranks"]] == [(0, 2), (1, 0)]
    g = gpufacts.gpu_facts(nvml, {"CUDA_VISIBLE_DEVICES": "1,x,3"}, nproc=3)
    assert g["visible"] == 1 and [r["index"] for r in g["ranks"]] == [1]
    # as torch and CUDA read it: ordinals stop at the first entry that is no number, a UUID included
    assert gpufacts.gpu_facts(nvml, {"CUDA_VISIBLE_DEVICES": "2,GPU-0000"}, nproc=2)["visible"] == 1
    assert gpufacts.gpu_facts(nvml, {"CUDA_VISIBLE_DEVICES": "3,9,1"}, nproc=2)["visible"] == 1


def test_shortened_gpu_uuids_name_their_gpus_as_cuda_reads_them(nvml):
    """CUDA takes a unique prefix of a GPU's UUID; NVML's lookup by UUID does not, so preflight failed
    a healthy job started with them ("local rank 0 and up have none")."""
    uuids = ["GPU-1a2b3c4d-0000", "GPU-5e6f7a8b-0000", "GPU-1a9f0000-0000"]
    nvml.install(spec([h100(i, uuid=u) for i, u in enumerate(uuids)]))
    g = gpufacts.gpu_facts(nvml, {"CUDA_VISIBLE_DEVICES": "GPU-5e6f,GPU-1a2b"}, nproc=2)
    assert [(r["local_rank"], r["index"], r["uuid"]) for r in g["ranks"]] == [(0, 1, uuids[1]), (1, 0, uuids[0])]
    assert g["notes"] == []
    # an ambiguous prefix ("GPU-1a" fits two) ends the list; a GPU named twice names none
    assert gpufacts.gpu_facts(nvml, {"CUDA_VISIBLE_DEVICES": "GPU-5e,GPU-1a,GPU-1a2b"}, nproc=1)["visible"] == 1
    assert gpufacts.gpu_facts(nvml, {"CUDA_VISIBLE_DEVICES": "GPU-5e,GPU-5e6f"}, nproc=1)["visible"] == 0
    assert gpufacts.gpu_facts(nvml, {"CUDA_VISIBLE_DEVICES": "0,0"}, nproc=1)["visible"] == 0


def test_fields_a_gpu_does_not_support_are_none_without_notes(nvml):
    nvml.install(spec([h100(0, remap=None, ecc=None, nvlink=None, mig=None)]))
    (r,) = gpufacts.gpu_facts(nvml, {}, nproc=1)["ranks"]
    assert (r["remap_pending"], r["ecc_uncorrected_volatile"], r["mig"], r["nvlink_active"]) == (None, None, None, 0)


def test_without_pynvml_or_a_driver_the_facts_say_not_available(nvml, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert gpufacts.collect({}, 1)["nvml"] == "not available: pynvml is not installed (pip install 'ddprun[gpu]')"
    nvml.install({"init_error": True})
    assert gpufacts.collect({}, 1, nvml=nvml)["nvml"] == "not available: NVML Shared Library Not Found"


def test_an_nvml_that_does_not_answer_is_given_up_on_in_bounded_time():
    class Stuck:
        @staticmethod
        def nvmlInit():
            time.sleep(3)

    t0 = time.monotonic()
    assert gpufacts.bounded_gpu_facts(Stuck, {}, 1, timeout_s=0.2) == {"nvml": "not available: no answer within 0.2 s"}
    assert time.monotonic() - t0 < 2


def test_nccl_conf_file_replaces_the_home_config_in_the_hashes(tmp_path):
    """NCCL reads NCCL_CONF_FILE instead of ~/.nccl.conf: that file is the one hashed in its place."""
    import hashlib

    (tmp_path / "home/u").mkdir(parents=True)
    (tmp_path / "home/u/.nccl.conf").write_text("NCCL_IB_DISABLE=0\n")
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared/nccl.conf").write_text("NCCL_IB_DISABLE=1\n")
    home = gpufacts.nccl_conf_hashes({"HOME": "/home/u"}, root=str(tmp_path))
    chosen = gpufacts.nccl_conf_hashes({"HOME": "/home/u", "NCCL_CONF_FILE": "/shared/nccl.conf"}, root=str(tmp_path))
    assert home == {"/etc/nccl.conf": "", "~/.nccl.conf": hashlib.sha256(b"NCCL_IB_DISABLE=0\n").hexdigest()[:16]}
    assert chosen == {"/etc/nccl.conf": "", "~/.nccl.conf": hashlib.sha256(b"NCCL_IB_DISABLE=1\n").hexdigest()[:16]}


def test_nccl_settings_config_files_plugins_and_hcas_come_from_the_given_root(tmp_path, nvml):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/nccl.conf").write_text("NCCL_IB_DISABLE=0\n")
    (tmp_path / "etc/ld.so.conf.d").mkdir()
    (tmp_path / "etc/ld.so.conf.d/ofi.conf").write_text("# aws\n/opt/amazon/ofi-nccl/lib\n")
    for d in ("opt/amazon/ofi-nccl/lib", "usr/lib/x86_64-linux-gnu"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so").write_text("")
    (tmp_path / "usr/lib/x86_64-linux-gnu/libnccl-net.so").write_text("")
    ib(tmp_path, mlx5_0="4: ACTIVE", mlx5_1="1: DOWN")
    env = {"NCCL_IB_HCA": "mlx5_0", "GLOO_SOCKET_IFNAME": "eth0", "CUDA_VISIBLE_DEVICES": "0", "PATH": "/bin",
           "HOME": "/home/u"}
    nvml.install(spec([h100(0)]))
    g = gpufacts.collect(env, 1, nvml=nvml, root=str(tmp_path))
    assert g["env"] == {"CUDA_VISIBLE_DEVICES": "0", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "mlx5_0"}
    assert len(g["nccl_conf"]["/etc/nccl.conf"]) == 16 and g["nccl_conf"]["~/.nccl.conf"] == ""
    assert g["net_plugins"] == ["/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so", "/usr/lib/x86_64-linux-gnu/libnccl-net.so"]
    assert g["ib"]["mlx5_0"]["1"] == {"state": "ACTIVE", "rate": "400 Gb/sec (4X NDR)", "link_layer": "InfiniBand"}
    assert g["ib"]["mlx5_1"]["1"]["state"] == "DOWN"


# -- hard faults: errors naming node and field ----------------------------------------------------

def test_healthy_identical_nodes_give_no_finding(nvml, tmp_path):
    facts = [node(r, nvml, tmp_path, [h100(2 * r), h100(2 * r + 1)]) for r in (0, 1)]
    assert gpufacts.check(facts) == []


def two_nodes_on_one_machine(nvml, tmp_path):
    """Two ddprun nodes started on one machine, each with its one rank on the same GPU."""
    return [node(r, nvml, tmp_path, [h100(0), h100(1)], nproc=1, host="h0") for r in (0, 1)]


def test_two_ranks_on_one_gpu_uuid_is_an_error_naming_both(nvml, tmp_path):
    (msg,) = messages(gpufacts.check(two_nodes_on_one_machine(nvml, tmp_path)), "error")
    assert msg.startswith("GPU GPU-0000 is used by 2 ranks: node 0 (h0) local rank 0, node 1 (h0) local rank 0 "
                          "(field gpu.uuid; NCCL would stop with 'Duplicate GPU detected'). HINT:")


def test_a_gpu_listed_twice_in_cuda_visible_devices_hides_every_gpu_as_cuda_does(nvml, tmp_path):
    facts = [node(0, nvml, tmp_path, [h100(0), h100(1)], env={"CUDA_VISIBLE_DEVICES": "0,0"})]
    (msg,) = messages(gpufacts.check(facts), "error")
    assert msg.startswith("node 0 (h0): gpu.visible = 0 GPU(s) for 2 local ranks (CUDA_VISIBLE_DEVICES='0,0'): ")


def test_memory_faults_are_errors_naming_node_rank_gpu_and_field(nvml, tmp_path):
    bad = [h100(0, ecc=2), h100(1, remap=[0, 1, 1, 1])]
    found = gpufacts.check([node(0, nvml, tmp_path, [h100(8), h100(9)]), node(1, nvml, tmp_path, bad)])
    errs = messages(found, "error")
    assert any(m.startswith("node 1 (h1) local rank 0 (GPU 0, GPU-0000): gpu.ecc_uncorrected_volatile = 2 ") for m in errs)
    assert any(m.startswith("node 1 (h1) local rank 1 (GPU 1, GPU-0001): gpu.remap_failed = true") for m in errs)
    assert any("local rank 1 (GPU 1, GPU-0001): gpu.remap_pending = true" in m for m in errs)
    assert all("HINT:" in m for m in errs) and len(errs) == 3


def test_fewer_gpus_than_local_ranks_is_an_error(nvml, tmp_path):
    f = node(0, nvml, tmp_path, [h100(0), h100(1)], nproc=2, env={"CUDA_VISIBLE_DEVICES": "1"})
    (msg,) = messages(gpufacts.check([f]), "error")
    assert msg.startswith("node 0 (h0): gpu.visible = 1 GPU(s) for 2 local ranks (CUDA_VISIBLE_DEVICES='1'): "
                          "local rank 1 and up have none.")


def test_gpu_faults_on_a_cpu_job_are_not_errors(nvml, tmp_path):
    f = node(0, nvml, tmp_path, [h100(0, ecc=5), h100(0)], kind="cpu")
    assert messages(gpufacts.check([f]), "error") == []


def test_a_gpu_node_without_nvml_is_a_warning(nvml, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    f = {"node_rank": 0, "host": "h0", "nproc": 1, "gpus": 1,
         "gpu": gpufacts.collect({"DDPRUN_DEVICE_KIND": "cuda"}, 1, root=str(tmp_path))}
    assert gpufacts.check([f]) == [("warning", "node 0 (h0): nvml: not available: pynvml is not installed (pip "
                                    "install 'ddprun[gpu]'); its GPUs were not checked. HINT: pip install "
                                    "'ddprun[gpu]' (nvidia-ml-py).")]


# -- warnings: slowed GPUs, links, drift -------------------------------------------------------------

def test_slowed_gpus_and_degraded_links_are_warnings(nvml, tmp_path):
    gpus = [h100(0, throttle=0x40 | 0x8), h100(1, pcie=[5, 5, 8, 16], nvlink=[1] * 16 + [0, 0])]
    found = gpufacts.check([node(0, nvml, tmp_path, gpus)])
    assert messages(found, "error") == []
    warns = messages(found, "warning")
    assert any(m.startswith("node 0 (h0) local rank 0 (GPU 0, GPU-0000): gpu.throttle = hw_slowdown, hw_thermal")
               for m in warns)
    assert any("local rank 1 (GPU 1, GPU-0001): gpu.pcie_width = x8 of x16" in m for m in warns)
    assert any("local rank 1 (GPU 1, GPU-0001): gpu.nvlink = 16 of 18 links active" in m for m in warns)


def test_drift_between_nodes_names_the_odd_node_and_its_value(nvml, tmp_path):
    ib(tmp_path / "root0", mlx5_0="4: ACTIVE", mlx5_1="4: ACTIVE")
    ib(tmp_path / "root1", mlx5_0="4: ACTIVE", mlx5_1="4: ACTIVE")
    ib(tmp_path / "root2", mlx5_0="4: ACTIVE", mlx5_1="1: DOWN")
    env = {"NCCL_IB_HCA": "mlx5", "NCCL_SOCKET_IFNAME": "eth0"}
    facts = [node(0, nvml, tmp_path, [h100(0), h100(1)], env=env),
             node(1, nvml, tmp_path, [h100(2), h100(3)], env=env),
             node(2, nvml, tmp_path, [h100(4, name="NVIDIA A100-SXM4-80GB"), h100(5, pcie=[4, 4, 8, 8])],
                  env={"NCCL_SOCKET_IFNAME": "ens5", "NCCL_DEBUG": "INFO"}, driver="535.129.03")]
    found = gpufacts.check(facts)
    assert messages(found, "error") == []
    warns = messages(found, "warning")
    expected = [
        "GPU model differs between nodes: most have 'NVIDIA H100 80GB HBM3', node 2 (h2) has "
        "'NVIDIA A100-SXM4-80GB, NVIDIA H100 80GB HBM3'.",
        "NVIDIA driver differs between nodes: most have '550.54.15', node 2 (h2) has '535.129.03'.",
        "narrowest PCIe link width differs between nodes: most have 'x16', node 2 (h2) has 'x8'.",
        "active InfiniBand HCA count differs between nodes: most have '2', node 2 (h2) has '1'.",
        "NCCL/GLOO settings differ between nodes: NCCL_DEBUG: most have '<unset>', node 2 (h2) has 'INFO'; "
        "NCCL_IB_HCA: most have 'mlx5', node 2 (h2) has '<unset>'.",
    ]
    for text in expected:
        assert any(m.startswith(text) and "HINT:" in m for m in warns), (text, warns)
    assert not any("NCCL_SOCKET_IFNAME" in m for m in warns)  # interface names may differ per node
    assert len(warns) == len(expected)


def test_a_named_network_plugin_that_is_not_found_is_a_warning(nvml, tmp_path):
    f = node(0, nvml, tmp_path, [h100(0)], nproc=1, env={"NCCL_NET_PLUGIN": "aws-ofi"})
    (msg,) = messages(gpufacts.check([f]), "warning")
    assert msg.startswith("node 0 (h0): nccl.net_plugin: NCCL_NET_PLUGIN='aws-ofi' but no libnccl-net-aws-ofi.so")


# -- through the preflight --------------------------------------------------------------------------

def test_the_preflight_check_and_table_include_the_gpu_findings(nvml, tmp_path):
    facts = two_nodes_on_one_machine(nvml, tmp_path)
    for f in facts:
        f.update(nnodes="1", torch="2.13.0", cuda="12.4", nccl="2.27", python="3.11", script_sha="a", free_disk_gb=9)
    findings = preflight_check(facts, 2)
    assert [f.level for f in findings] == ["error"] and "gpu.uuid" in findings[0].message
    text = render_facts(facts, findings)
    assert "node 0 (h0): driver 550.54.15, CUDA 12.4, 1x NVIDIA H100 80GB HBM3; NCCL plugin none" in text
    assert "preflight error: GPU GPU-0000 is used by 2 ranks" in text


def test_node_facts_count_gpus_without_initialising_cuda_before_the_script(monkeypatch):
    """torch.cuda.is_available() runs cuInit (and marks fork unsafe) in the rank before the user's
    script: its own CUDA_VISIBLE_DEVICES would then be ignored on that rank only."""
    import torch

    from ddprun.worker.preflight import node_facts

    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("CUDA initialised by preflight"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    facts = node_facts({"LOCAL_WORLD_SIZE": "2"}, None)
    assert (facts["gpus"], facts["nccl"]) == (2, "2.27.3")
    # NVML also counts GPUs torch's CUDA cannot use (a CPU build, an old driver), where the launch put
    # the job on cpu: none counted, or preflight refused it ("has 2 GPUs but runs 1 processes")
    facts = node_facts({"LOCAL_WORLD_SIZE": "1", "DDPRUN_DEVICE_KIND": "cpu"}, None)
    assert (facts["gpus"], facts["nccl"]) == (0, "")


def test_node_facts_carry_the_gpu_facts_of_this_machine():
    from ddprun.worker.preflight import node_facts

    g = node_facts({"LOCAL_WORLD_SIZE": "1"}, None)["gpu"]
    assert g["nvml"] == "ok" or g["nvml"].startswith("not available: ")
    assert isinstance(g["env"], dict) and isinstance(g["ib"], dict)


def test_two_nodes_that_disagree_are_both_named_without_a_majority(nvml, tmp_path):
    facts = [node(0, nvml, tmp_path, [h100(0)], nproc=1), node(1, nvml, tmp_path, [h100(1)], nproc=1, driver="535.1")]
    (msg,) = messages(gpufacts.check(facts), "warning")
    assert msg.startswith("NVIDIA driver differs between nodes: node 0 (h0) has '550.54.15', node 1 (h1) has '535.1'.")


def test_pending_page_retirement_is_an_error_and_nvml_is_given_20_s_by_default(nvml, tmp_path):
    import inspect

    found = gpufacts.check([node(0, nvml, tmp_path, [h100(0), h100(1, retired_pending=1)])])
    (msg,) = messages(found, "error")
    assert msg.startswith("node 0 (h0) local rank 1 (GPU 1, GPU-0001): gpu.retired_pages_pending = true") and "HINT:" in msg
    assert gpufacts.NVML_TIMEOUT_S == 20.0  # README: an NVML "that does not answer within 20 s is given up on"
    assert inspect.signature(gpufacts.bounded_gpu_facts).parameters["timeout_s"].default == gpufacts.NVML_TIMEOUT_S


def test_a_node_with_another_nccl_config_file_or_network_plugin_is_named(nvml, tmp_path):
    for rank in range(3):
        conf = tmp_path / f"root{rank}" / "etc"
        conf.mkdir(parents=True)
        (conf / "nccl.conf").write_text("NCCL_IB_DISABLE=1\n" if rank == 1 else "NCCL_IB_DISABLE=0\n")
    plugins = tmp_path / "root2" / "usr/lib/x86_64-linux-gnu"
    plugins.mkdir(parents=True)
    (plugins / "libnccl-net-ofi.so").write_text("")
    facts = [node(r, nvml, tmp_path, [h100(2 * r), h100(2 * r + 1)]) for r in range(3)]
    warns = messages(gpufacts.check(facts), "warning")
    assert any(m.startswith("NCCL config files (sha256) differs between nodes: most have ") and "node 1 (h1) has" in m
               and "HINT: /etc/nccl.conf and ~/.nccl.conf set NCCL variables too" in m for m in warns), warns
    assert ("NCCL network plugin differs between nodes: most have 'none', node 2 (h2) has 'libnccl-net-ofi.so'. "
            "HINT: nodes on different NCCL transports can hang after init; install the same plugin everywhere.") in warns
    assert len(warns) == 2
