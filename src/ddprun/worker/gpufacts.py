"""GPU, NCCL and InfiniBand facts of one node for the preflight, and the checks across nodes.

Each node's local rank 0 adds :func:`collect`'s dict to its preflight facts (key ``gpu``); rank 0
runs :func:`check` over every node's facts. GPUs are read through NVML (``pynvml``, the
``ddprun[gpu]`` extra): NVML asks the driver, so no CUDA context is created. Without pynvml, or
without a driver, the facts say ``nvml: not available: <why>`` and the GPU checks are skipped.

The collectors take what they read as arguments (the NVML module, a filesystem root for
``/sys/class/infiniband``, ``/etc`` and the library directories, the environment mapping), so tests
pass a fake NVML module and a fake tree. Local rank i is the i-th entry of CUDA_VISIBLE_DEVICES
(indices in NVML's PCI bus order, or GPU-/MIG- UUIDs), as CUDA maps ``cuda:i``; with
CUDA_DEVICE_ORDER unset CUDA orders fastest first, which differs from PCI order only on nodes that
mix GPU models.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import threading
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence

from ddprun.cluster._values import visible_devices
from ddprun.cluster.netaddr import nccl_conf_files
from ddprun.protocol.env import device_kind

NVML_TIMEOUT_S = 20.0
"""Seconds the NVML queries may take before the node reports ``nvml: no answer`` (a GPU that fell off
the bus can stall NVML for minutes)."""

ENV_PREFIXES = ("NCCL_", "GLOO_")
ENV_NAMES = ("CUDA_VISIBLE_DEVICES",)
PER_NODE_ENV = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES")
"""Variables that may rightly differ between nodes (interface names, the scheduler's GPU choice):
recorded, but not compared."""

THROTTLE_BITS = {0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                 0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
                 0x100: "display_clocks"}
SLOWING = ("hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake")
"""Throttle reasons that slow a GPU at rest: each such GPU slows every step of the whole job."""

LIB_DIRS = ("/usr/lib", "/usr/lib64", "/usr/local/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu")
NVLINK_LINKS = 18  # NVLink 4 (H100) has 18 links; NVML answers NotSupported past the last one


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _under(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def _sha(path: str) -> str:
    if not os.path.isfile(path):
        return ""
    with open(path, "rb") as fp:
        return hashlib.sha256(fp.read()).hexdigest()[:16]


# -- NVML ----------------------------------------------------------------------------------------

class _Query:
    """Calls NVML, turning 'not supported' into None and other NVML errors into notes."""

    def __init__(self, nvml) -> None:
        self.nvml = nvml
        self.error = getattr(nvml, "NVMLError", Exception)
        self.quiet = {getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", 3), getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13)}
        self.notes: list[str] = []

    def __call__(self, field: str, name: str, *args):
        fn = getattr(self.nvml, name, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except self.error as e:
            if getattr(e, "value", None) not in self.quiet:
                self.notes.append(f"{field}: {e}")
            return None


def _visible(nvml, environ: Mapping[str, str], q: _Query) -> list:
    """NVML handles in CUDA's order for this process: CUDA_VISIBLE_DEVICES read as CUDA reads it
    (:func:`ddprun.cluster._values.visible_devices`), else every GPU. A ``GPU-`` entry may be a unique
    prefix of a UUID, as CUDA accepts it; the list ends at the first entry that names no one GPU."""
    count = q("gpu.count", "nvmlDeviceGetCount") or 0
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    entries = list(range(count)) if cvd is None else visible_devices(cvd)
    if entries and isinstance(entries[0], str) and entries[0].startswith("GPU-"):
        entries = _ordinals(q, count, [str(e) for e in entries])
    handles = []
    for entry in entries:
        if isinstance(entry, int):
            handle = q(f"gpu {entry}", "nvmlDeviceGetHandleByIndex", entry) if entry < count else None
        else:  # a MIG device: NVML finds it by its full UUID
            handle = q(f"gpu {entry}", "nvmlDeviceGetHandleByUUID", entry)
        if handle is None:
            break
        handles.append(handle)
    return handles


def _ordinals(q: _Query, count: int, prefixes: list[str]) -> list[int]:
    """GPU indices of UUID prefixes (torch.cuda._transform_uuid_to_ordinals): up to the first prefix
    that matches no GPU or several; a GPU named twice names none."""
    uuids = [_text(q(f"gpu {i}", "nvmlDeviceGetUUID", q(f"gpu {i}", "nvmlDeviceGetHandleByIndex", i)))
             for i in range(count)]
    found: list[int] = []
    for prefix in prefixes:
        matches = [i for i, uuid in enumerate(uuids) if uuid.startswith(prefix)]
        if len(matches) != 1:
            break
        if matches[0] in found:
            return []
        found.append(matches[0])
    return found


def _nvlinks(q: _Query, h) -> list[int]:
    """State (1 active, 0 not) of each NVLink; NVML errors past a GPU's last link, which ends the list."""
    states = []
    for link in range(NVLINK_LINKS):
        try:
            states.append(int(q.nvml.nvmlDeviceGetNvLinkState(h, link)))
        except (q.error, AttributeError):
            break
    return states


def _pcie_and_links(q: _Query, h) -> dict:
    links = _nvlinks(q, h)
    return {"pcie_gen": q("gpu.pcie", "nvmlDeviceGetCurrPcieLinkGeneration", h),
            "pcie_gen_max": q("gpu.pcie", "nvmlDeviceGetMaxPcieLinkGeneration", h),
            "pcie_width": q("gpu.pcie", "nvmlDeviceGetCurrPcieLinkWidth", h),
            "pcie_width_max": q("gpu.pcie", "nvmlDeviceGetMaxPcieLinkWidth", h),
            "nvlink_active": sum(1 for s in links if s), "nvlink_inactive": sum(1 for s in links if not s)}


def _gpu(q: _Query, h) -> dict:
    """One GPU's facts; a field NVML does not support is None. Memory in MiB."""
    nvml = q.nvml
    mem = q("gpu.memory", "nvmlDeviceGetMemoryInfo", h)
    cc = q("gpu.compute_capability", "nvmlDeviceGetCudaComputeCapability", h)
    mig = q("gpu.mig", "nvmlDeviceGetMigMode", h)
    ecc = q("gpu.ecc", "nvmlDeviceGetTotalEccErrors", h, getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
            getattr(nvml, "NVML_VOLATILE_ECC", 0))
    remap = q("gpu.remapped_rows", "nvmlDeviceGetRemappedRows", h)  # (corrected, uncorrected, pending, failed)
    reasons_fn = ("nvmlDeviceGetCurrentClocksEventReasons" if hasattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons")
                  else "nvmlDeviceGetCurrentClocksThrottleReasons")
    bits = q("gpu.throttle", reasons_fn, h) or 0
    name = q("gpu.name", "nvmlDeviceGetName", h)
    uuid = q("gpu.uuid", "nvmlDeviceGetUUID", h)
    return {"index": q("gpu.index", "nvmlDeviceGetIndex", h), "name": _text(name) if name else None,
            "uuid": _text(uuid) if uuid else None,
            "memory_mib": int(mem.total) // 2**20 if mem is not None else None,
            "compute_capability": f"{cc[0]}.{cc[1]}" if cc else None,
            "mig": bool(mig[0]) if mig else None,
            "ecc_uncorrected_volatile": ecc,
            "retired_pages_pending": bool(q("gpu.retired_pages", "nvmlDeviceGetRetiredPagesPendingStatus", h)),
            "remap_pending": bool(remap[2]) if remap else None, "remap_failed": bool(remap[3]) if remap else None,
            "throttle": [n for bit, n in THROTTLE_BITS.items() if bits & bit],
            **_pcie_and_links(q, h)}


def gpu_facts(nvml, environ: Mapping[str, str], nproc: int) -> dict:
    """NVML facts of this node: driver, CUDA driver version, and one entry per local rank < ``nproc``.

    ``nvml``: the pynvml module (or a fake with the same functions); initialised and shut down here.
    A local rank without a visible GPU is absent from ``ranks``; ``visible`` counts the GPUs CUDA
    would show this process."""
    try:
        nvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return {"nvml": f"not available: {_text(e) or type(e).__name__}"}
    try:
        q = _Query(nvml)
        cuda = q("cuda_driver", "nvmlSystemGetCudaDriverVersion")  # e.g. 12040 for 12.4
        handles = _visible(nvml, environ, q)
        ranks = [{"local_rank": i, **_gpu(q, h)} for i, h in enumerate(handles[:nproc])]
        driver = q("driver", "nvmlSystemGetDriverVersion")
        return {"nvml": "ok", "driver": _text(driver) if driver else None,
                "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else None,
                "visible": len(handles), "ranks": ranks, "notes": q.notes}
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down is best effort
            pass


def load_nvml():
    """The pynvml module, or a string saying why it is not available."""
    try:
        import pynvml
    except ImportError:
        return "not available: pynvml is not installed (pip install 'ddprun[gpu]')"
    return pynvml


def bounded_gpu_facts(nvml, environ: Mapping[str, str], nproc: int, timeout_s: float = NVML_TIMEOUT_S) -> dict:
    """:func:`gpu_facts` in a daemon thread, waiting at most ``timeout_s`` seconds for it."""
    if isinstance(nvml, str):
        return {"nvml": nvml}
    box: dict = {}

    def work() -> None:
        try:
            box["facts"] = gpu_facts(nvml, environ, nproc)
        except Exception as e:  # noqa: BLE001 - facts must never stop the job
            box["facts"] = {"nvml": f"not available: {type(e).__name__}: {e}"}

    t = threading.Thread(target=work, name="ddprun-nvml", daemon=True)
    t.start()
    t.join(timeout_s)
    return box.get("facts") or {"nvml": f"not available: no answer within {timeout_s:g} s"}


# -- NCCL settings, plugin, InfiniBand -----------------------------------------------------------

def comm_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Every NCCL_*, GLOO_* variable and CUDA_VISIBLE_DEVICES that is set."""
    return {k: environ[k] for k in sorted(environ) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def nccl_conf_hashes(environ: Mapping[str, str], root: str = "/") -> dict[str, str]:
    """SHA-256 prefixes of the NCCL config files NCCL reads ('' = absent): /etc/nccl.conf and
    NCCL_CONF_FILE, else ~/.nccl.conf."""
    files = nccl_conf_files(environ)
    return {"/etc/nccl.conf": _sha(_under(root, files["/etc/nccl.conf"])),
            "~/.nccl.conf": _sha(_under(root, files["~/.nccl.conf"]))}


def _lib_dirs(environ: Mapping[str, str], root: str) -> list[str]:
    dirs = [d for d in environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    for conf in sorted(glob.glob(_under(root, "/etc/ld.so.conf.d/*.conf"))):
        with open(conf, errors="replace") as fp:
            dirs += [ln.strip() for ln in fp if ln.strip().startswith("/")]
    return list(dict.fromkeys([*dirs, *LIB_DIRS]))


def net_plugins(environ: Mapping[str, str], root: str = "/") -> list[str]:
    """NCCL network plugins (libnccl-net*.so) in the directories the dynamic loader searches:
    LD_LIBRARY_PATH, /etc/ld.so.conf.d, the standard ones. Absolute paths as seen on the node."""
    found = []
    for d in _lib_dirs(environ, root):
        for path in sorted(glob.glob(os.path.join(_under(root, d), "libnccl-net*.so*"))):
            found.append(os.path.join(d, os.path.basename(path)))
    return found


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as fp:
            return fp.read().strip()
    except OSError:
        return ""


def infiniband(root: str = "/") -> dict[str, dict[str, dict[str, str]]]:
    """HCAs under /sys/class/infiniband: {hca: {port: {state, rate, link_layer}}}; state 'ACTIVE', ..."""
    base = _under(root, "/sys/class/infiniband")
    out: dict[str, dict[str, dict[str, str]]] = {}
    for hca in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        ports = os.path.join(base, hca, "ports")
        out[hca] = {}
        for port in sorted(os.listdir(ports)) if os.path.isdir(ports) else []:
            p = os.path.join(ports, port)
            state = _read(os.path.join(p, "state"))  # "4: ACTIVE"
            out[hca][port] = {"state": state.split(":", 1)[-1].strip(), "rate": _read(os.path.join(p, "rate")),
                              "link_layer": _read(os.path.join(p, "link_layer"))}
    return out


def collect(environ: Mapping[str, str], nproc: int, *, nvml=None, root: str = "/",
            timeout_s: float = NVML_TIMEOUT_S) -> dict:
    """This node's GPU/NCCL/IB facts (JSON-able). ``nvml``: None imports pynvml; ``root``: where
    /sys, /etc and the library directories are (tests: a fake tree)."""
    gpu = bounded_gpu_facts(load_nvml() if nvml is None else nvml, environ, nproc, timeout_s)
    return {**gpu, "device_kind": device_kind(environ) or "", "env": comm_env(environ),
            "nccl_conf": nccl_conf_hashes(environ, root), "net_plugin_wanted": environ.get("NCCL_NET_PLUGIN", ""),
            "net_plugins": net_plugins(environ, root), "ib": infiniband(root)}


# -- checks across nodes -------------------------------------------------------------------------

def _node(f: Mapping) -> str:
    return f"node {f.get('node_rank', '?')} ({f.get('host', '?')})"


def _gpu_of(f: Mapping) -> dict:
    return f.get("gpu") or {}


def _uses_gpus(f: Mapping) -> bool:
    """The node runs its ranks on GPUs and NVML answered: the per-GPU checks apply."""
    g = _gpu_of(f)
    return g.get("device_kind") == "cuda" and g.get("nvml") == "ok"


def _at(f: Mapping, r: Mapping) -> str:
    return f"{_node(f)} local rank {r['local_rank']} (GPU {r.get('index')}, {r.get('uuid')})"


def _duplicates(facts: Sequence[Mapping]) -> list[tuple[str, str]]:
    users: dict[str, list[str]] = defaultdict(list)
    for f in filter(_uses_gpus, facts):
        for r in _gpu_of(f).get("ranks", []):
            if r.get("uuid"):
                users[r["uuid"]].append(f"{_node(f)} local rank {r['local_rank']}")
    return [("error", f"GPU {uuid} is used by {len(who)} ranks: {', '.join(who)} (field gpu.uuid; NCCL would "
                      f"stop with 'Duplicate GPU detected'). HINT: two ddprun nodes on one machine use "
                      f"the same GPUs: give each its own with CUDA_VISIBLE_DEVICES.")
            for uuid, who in users.items() if len(who) > 1]


def _memory_faults(f: Mapping, r: Mapping) -> list[tuple[str, str]]:
    at, out = _at(f, r), []
    if r.get("ecc_uncorrected_volatile"):
        out.append(("error", f"{at}: gpu.ecc_uncorrected_volatile = {r['ecc_uncorrected_volatile']} (uncorrectable "
                             f"ECC errors since the driver loaded). HINT: drain this GPU (nvidia-smi -q -d ECC), "
                             f"or leave it out with CUDA_VISIBLE_DEVICES."))
    if r.get("remap_failed"):
        out.append(("error", f"{at}: gpu.remap_failed = true (row remapping failed: the GPU's memory is bad). "
                             f"HINT: drain this GPU and have it replaced."))
    for field in ("remap_pending", "retired_pages_pending"):
        if r.get(field):
            out.append(("error", f"{at}: gpu.{field} = true (retired memory takes effect only after a GPU reset). "
                                 f"HINT: reset the GPU (nvidia-smi -r) or reboot the node, then start again."))
    return out


def _slow_links(f: Mapping, r: Mapping) -> list[tuple[str, str]]:
    at, out = _at(f, r), []
    slowing = [t for t in r.get("throttle", []) if t in SLOWING]
    if slowing:
        out.append(("warning", f"{at}: gpu.throttle = {', '.join(slowing)}: this GPU is slowed, and with it every "
                               f"step of the job. HINT: check cooling and power (nvidia-smi -q -d PERFORMANCE)."))
    width, top = r.get("pcie_width"), r.get("pcie_width_max")
    if width and top and width < top:
        out.append(("warning", f"{at}: gpu.pcie_width = x{width} of x{top}: a degraded PCIe link. "
                               f"HINT: reseat the GPU or drain the node."))
    if r.get("nvlink_active") and r.get("nvlink_inactive"):
        total = r["nvlink_active"] + r["nvlink_inactive"]
        out.append(("warning", f"{at}: gpu.nvlink = {r['nvlink_active']} of {total} links active. "
                               f"HINT: nvidia-smi nvlink --status; drain the node if a link is down."))
    return out


def _per_node(f: Mapping) -> list[tuple[str, str]]:
    """Faults of one node's GPUs: missing GPUs, bad memory, slowed GPUs, NVML errors."""
    g, out = _gpu_of(f), []
    ranks, nproc = g.get("ranks", []), int(f.get("nproc", 0))
    torch_said = f.get("gpus") and f["gpus"] != nproc  # preflight.check names that case already
    if len(ranks) < nproc and not torch_said:
        cvd = g.get("env", {}).get("CUDA_VISIBLE_DEVICES", "<unset>")
        out.append(("error", f"{_node(f)}: gpu.visible = {g.get('visible')} GPU(s) for {nproc} local ranks "
                             f"(CUDA_VISIBLE_DEVICES={cvd!r}): local rank {len(ranks)} and up have none. HINT: run "
                             f"one process per GPU (leave --nproc-per-node out) or fix CUDA_VISIBLE_DEVICES."))
    for r in ranks:
        out += _memory_faults(f, r) + _slow_links(f, r)
    out += [("warning", f"{_node(f)}: NVML error reading {note}") for note in g.get("notes", [])]
    return out


def _odd(facts: Sequence[Mapping], value_of) -> str | None:
    """Who differs: "most have 'a', node 2 (h2) has 'b'", or every node's value when no value
    holds a majority (two nodes that disagree); None when all agree."""
    seen = [(f, value_of(f)) for f in facts]
    seen = [(f, v) for f, v in seen if v is not None]
    counts = Counter(v for _, v in seen)
    if len(counts) <= 1:
        return None
    majority, n = counts.most_common(1)[0]
    if 2 * n <= len(seen):
        return ", ".join(f"{_node(f)} has {v!r}" for f, v in seen)
    return f"most have {majority!r}, " + ", ".join(f"{_node(f)} has {v!r}" for f, v in seen if v != majority)


def _ranks_value(key: str, fmt):
    def value_of(f: Mapping):
        ranks = _gpu_of(f).get("ranks") if _gpu_of(f).get("nvml") == "ok" else None
        values = [r.get(key) for r in ranks or [] if r.get(key) is not None]
        return fmt(values) if values else None
    return value_of


def _active_hcas(f: Mapping) -> str:
    ib = _gpu_of(f).get("ib", {})
    return str(sum(1 for ports in ib.values() if any(p.get("state") == "ACTIVE" for p in ports.values())))


DRIFT = (
    ("GPU model", _ranks_value("name", lambda v: ", ".join(sorted(set(v)))), "the job runs at the slowest model's pace"),
    ("NVIDIA driver", lambda f: _gpu_of(f).get("driver"), "use one driver on every node"),
    ("CUDA driver version", lambda f: _gpu_of(f).get("cuda_driver"), "use one driver on every node"),
    ("narrowest PCIe link width", _ranks_value("pcie_width", lambda v: f"x{min(v)}"),
     "a narrow link slows every all-reduce"),
    ("NCCL network plugin", lambda f: ", ".join(os.path.basename(p) for p in _gpu_of(f).get("net_plugins", [])) or
     "none", "nodes on different NCCL transports can hang after init; install the same plugin everywhere"),
    ("NCCL config files (sha256)", lambda f: json.dumps(_gpu_of(f).get("nccl_conf"), sort_keys=True),
     "/etc/nccl.conf and ~/.nccl.conf set NCCL variables too; make them the same"),
    ("active InfiniBand HCA count", _active_hcas, "NCCL may pick another transport on that node (ibstat)"),
)


def _drift(facts: Sequence[Mapping]) -> list[tuple[str, str]]:
    with_gpu = [f for f in facts if f.get("gpu")]
    out = []
    for label, value_of, why in DRIFT:
        odd = _odd(with_gpu, value_of)
        if odd:
            out.append(("warning", f"{label} differs between nodes: {odd}. HINT: {why}."))
    return out


def _env_drift(facts: Sequence[Mapping]) -> list[tuple[str, str]]:
    with_gpu = [f for f in facts if f.get("gpu")]
    keys = sorted({k for f in with_gpu for k in _gpu_of(f).get("env", {})} - set(PER_NODE_ENV))
    parts = []
    for key in keys:
        odd = _odd(with_gpu, lambda f, k=key: _gpu_of(f).get("env", {}).get(k, "<unset>"))
        if odd:
            parts.append(f"{key}: {odd}")
    if not parts:
        return []
    return [("warning", "NCCL/GLOO settings differ between nodes: " + "; ".join(parts) + ". HINT: export the same "
                        "NCCL_*/GLOO_* variables on every node; nodes that disagree on transports can hang after init.")]


def _plugin_wanted(f: Mapping) -> list[tuple[str, str]]:
    g = _gpu_of(f)
    wanted = g.get("net_plugin_wanted")
    if not wanted or any(os.path.basename(p).startswith((f"libnccl-net-{wanted}", wanted)) or p == wanted
                         for p in g.get("net_plugins", [])):
        return []
    return [("warning", f"{_node(f)}: nccl.net_plugin: NCCL_NET_PLUGIN={wanted!r} but no libnccl-net-{wanted}.so "
                        f"was found in LD_LIBRARY_PATH, /etc/ld.so.conf.d or the standard directories (NCCL falls "
                        f"back to its own sockets/IB). HINT: install the plugin or fix LD_LIBRARY_PATH.")]


def check(facts: Sequence[Mapping]) -> list[tuple[str, str]]:
    """(level, message) for every GPU/NCCL/IB finding over the nodes' preflight facts.

    Errors (hard faults, only on nodes whose ranks use GPUs): two ranks on one GPU UUID, fewer GPUs
    than local ranks, uncorrectable ECC errors, failed or pending row remapping. Warnings: slowed
    GPUs, degraded links, and drift between nodes (GPU model, driver, NCCL settings and files,
    network plugin, PCIe width, active HCA count). Each message names the node and the field."""
    out = _duplicates(facts)
    cuda_nodes = [f for f in facts if _gpu_of(f).get("device_kind") == "cuda"]
    for f in cuda_nodes:
        if _uses_gpus(f):
            out += _per_node(f)
        else:
            out.append(("warning", f"{_node(f)}: nvml: {_gpu_of(f).get('nvml', 'not collected')}; its GPUs were "
                                   f"not checked. HINT: pip install 'ddprun[gpu]' (nvidia-ml-py)."))
        out += _plugin_wanted(f)
    return out + _drift(facts) + _env_drift(facts)


def summary(f: Mapping) -> str:
    """One line per node for the preflight table: GPUs, driver, links, plugin, HCAs."""
    g = _gpu_of(f)
    if not g:
        return f"{_node(f)}: no GPU facts"
    ranks = g.get("ranks", [])
    names = Counter(r.get("name") for r in ranks)
    gpus = ", ".join(f"{n}x {name}" for name, n in names.items()) or "no GPU"
    nvml = (f"driver {g.get('driver')}, CUDA {g.get('cuda_driver')}, {gpus}" if g.get("nvml") == "ok"
            else f"nvml: {g.get('nvml')}")
    plugins = ", ".join(os.path.basename(p) for p in g.get("net_plugins", [])) or "none"
    return (f"{_node(f)}: {nvml}; NCCL plugin {plugins}; {_active_hcas(f)} active IB HCA(s); "
            f"{len(g.get('env', {}))} NCCL_/GLOO_/CUDA_VISIBLE_DEVICES variable(s) set")
