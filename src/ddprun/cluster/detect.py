"""Which cluster environment this is, and the topology it implies once flags are laid over it.

Priority (docs/ARCHITECTURE.md): already inside a torchrun worker >
explicit flags > SLURM > MPI > LSF > SkyPilot > SageMaker > Kubernetes PyTorchJob > hostfile > local.
MPI comes before the schedulers that can host it (LSF): under mpirun its rank variables describe this
process; SkyPilot before SageMaker and Kubernetes, whose machines it may provision. The first environment whose ``detect`` is
true is read, except that ``--hostfile`` selects the hostfile environment over everything but
torchrun; then every topology flag the user gave overrides the matching value, and anything
still missing gets ddprun's default. Each value keeps its source for ``ddprun plan --explain``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ddprun.cluster.base import ClusterEnvironment, ClusterSpec, Fact, NodeFacts, Reading
from ddprun.cluster.hostfile import HostfileEnvironment
from ddprun.cluster.kubernetes import KubernetesEnvironment
from ddprun.cluster.local import LocalEnvironment
from ddprun.cluster.lsf import LsfEnvironment
from ddprun.cluster.mpi import MpiEnvironment
from ddprun.cluster.sagemaker import SageMakerEnvironment
from ddprun.cluster.skypilot import SkyPilotEnvironment
from ddprun.cluster.slurm import SlurmEnvironment
from ddprun.cluster.torchrun import TorchrunEnvironment
from ddprun.config import LaunchConfig, run_id_problem
from ddprun.errors import ClusterError, ConfigError

DEFAULT_MASTER_PORT = 29500
RDZV_BACKENDS = ("c10d", "static")
ETCD_BACKENDS = ("etcd", "etcd-v2")

PRIORITY: tuple[type[ClusterEnvironment], ...] = (
    TorchrunEnvironment, SlurmEnvironment, MpiEnvironment, LsfEnvironment, SkyPilotEnvironment,
    SageMakerEnvironment, KubernetesEnvironment, HostfileEnvironment, LocalEnvironment,
)
"""Environments in the order they are tried; local always detects, so it comes last. The hostfile
never detects from the environment: it is listed for its place in the order, and chosen by
:func:`choose` when --hostfile is given."""


def detect(environ: Mapping[str, str], order: Sequence[type[ClusterEnvironment]] = PRIORITY) -> ClusterEnvironment:
    """The first environment in ``order`` whose variables are present."""
    for env_cls in order:
        if env_cls.detect(environ):
            return env_cls()
    return LocalEnvironment()


def choose(cfg: LaunchConfig, environ: Mapping[str, str]) -> tuple[ClusterEnvironment, list[str]]:
    """The environment to read, and notes on what it overrode: torchrun > --standalone > --hostfile > detect()."""
    found = detect(environ)
    if cfg.standalone and found.name not in ("local", "torchrun"):  # one node on this machine, as torchrun's
        return LocalEnvironment(), [f"--standalone: one node on this machine; the {found.name} job around it is not read."]
    if not cfg.hostfile:
        return found, []
    if found.name == "torchrun":
        return found, [f"--hostfile {cfg.hostfile} is ignored inside a torchrun worker."]
    notes = [] if found.name == "local" else [f"--hostfile {cfg.hostfile} is used instead of the detected "
                                               f"{found.name} environment."]
    return HostfileEnvironment(cfg.hostfile), notes


def parse_nnodes(raw: str) -> tuple[int, int]:
    """``"4"`` -> (4, 4); ``"2:4"`` -> (2, 4), as torchrun reads --nnodes."""
    parts = raw.split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError(raw)
    except ValueError:
        raise ConfigError(
            "--nnodes is neither N nor MIN:MAX.", seen=f"--nnodes={raw!r}", hint="Use e.g. --nnodes 5 or --nnodes 2:5."
        ) from None
    if not 0 < lo <= hi:
        raise ConfigError(
            "--nnodes needs 0 < MIN <= MAX.", seen=f"--nnodes={raw!r} (min={lo}, max={hi})",
            hint="Give a positive node count, e.g. --nnodes 5 or --nnodes 2:5.",
        )
    return lo, hi


def parse_nproc(raw: str, node: NodeFacts) -> tuple[int, str]:
    """--nproc-per-node as torchrun reads it: an int, ``gpu``, ``cpu`` or ``auto``."""
    if raw == "gpu":
        if node.cuda_devices == 0:
            raise ConfigError(
                "--nproc-per-node gpu, but this node sees no CUDA device.", seen=f"host {node.hostname}: 0 GPUs",
                hint="Check CUDA_VISIBLE_DEVICES and the driver (nvidia-smi), or give a number.",
            )
        return node.cuda_devices, f"--nproc-per-node gpu ({node.cuda_devices} visible GPUs)"
    if raw == "cpu":
        return node.cpus, f"--nproc-per-node cpu ({node.cpus_text()})"
    if raw == "auto":
        if node.cuda_devices:
            return node.cuda_devices, f"--nproc-per-node auto ({node.cuda_devices} visible GPUs)"
        return node.cpus, f"--nproc-per-node auto (no GPU; {node.cpus_text()})"
    try:
        n = int(raw)
    except ValueError:
        raise ConfigError(
            "--nproc-per-node is not a number, gpu, cpu or auto.", seen=f"--nproc-per-node={raw!r}",
            hint="Leave it out to use every visible GPU, or give e.g. --nproc-per-node 4.",
        ) from None
    if n < 1:
        raise ConfigError("--nproc-per-node must be at least 1.", seen=f"--nproc-per-node={n}", hint="Give 1 or more.")
    return n, f"--nproc-per-node {n}"


ENDPOINT_HINT = "Use HOST:PORT, e.g. node1:29500, or [ADDR]:PORT for an IPv6 address, e.g. [fe80::1]:29500."
HOST_CHARS = re.compile(r"^[\w.:-]+$")
"""What torch's parse_rendezvous_endpoint accepts as a host (torch/distributed/elastic/rendezvous/utils.py)."""
ENDPOINT_CHARS = re.compile(r"^[\w.:\[\]-]*$")
"""Every character an endpoint may hold: a host's, brackets around an IPv6 address, the port's digits."""


def parse_endpoint(raw: str, default_port: int | None, what: str = "--rdzv-endpoint") -> tuple[str, int | None]:
    """``host:port``, ``[v6addr]:port``, ``host`` or ``[v6addr]`` (then ``default_port``), as torch's
    parse_rendezvous_endpoint reads them; what it would read otherwise than the user meant is refused:
    an IPv6 address without brackets (``fe80::1:1234``: torch takes 1234 as the port), an empty port
    (``host:``), text after the brackets that is not ``:PORT``. ``what``: where ``raw`` came from."""
    text = raw.strip()

    def bad(why: str) -> ConfigError:
        return ConfigError(f"The rendezvous endpoint {why}.", seen=f"{what} {raw!r}", hint=ENDPOINT_HINT)

    if not ENDPOINT_CHARS.match(text):
        raise bad("holds a character no host name, IP address or port has")
    port_s: str | None = None
    if text.startswith("["):
        host, closed, rest = text[1:].partition("]")
        if not closed:
            raise bad("has no ']' closing its IPv6 address")
        if rest and not rest.startswith(":"):
            raise bad(f"has {rest!r} after its IPv6 address where only :PORT may follow")
        port_s = rest[1:] if rest else None
    elif text.count(":") > 1:
        raise bad(f"is ambiguous: an IPv6 address without brackets, whose last group torch would read as "
                  f"the port ({text.rpartition(':')[2]!r})")
    else:
        host, colon, port_s = text.partition(":")
        port_s = port_s if colon else None
    if not host:
        raise bad("has no host")
    if not HOST_CHARS.match(host):
        raise bad(f"has a host, {host!r}, that is not a host name or an IP address")
    if port_s is None:
        return host, default_port
    if not (port_s.isascii() and port_s.isdecimal()):
        raise bad("has an empty port" if not port_s else "has a port that is not a number")
    return host, check_port(int(port_s), f"{what} {raw}")


def master_host(raw: str) -> str:
    """--master-addr: a host, or an IPv6 address with or without brackets (torchrun's help asks for
    ``[0:0:0:0:0:0:0:1]``); a port belongs in --master-port, not here."""
    text = raw.strip()
    host = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    if not host or not HOST_CHARS.match(host) or host.count(":") == 1:
        raise ConfigError("--master-addr takes the rendezvous host only: a host name or an IP address.",
                          seen=f"--master-addr {raw!r}",
                          hint="e.g. --master-addr node1 --master-port 29500, or --rdzv-endpoint [ADDR]:PORT for an "
                               "IPv6 address with its port.")
    return host


def check_port(port: int, seen: str) -> int:
    if not 0 <= port <= 65535:
        raise ConfigError("Port out of range 0-65535.", seen=seen, hint="Pick a free TCP port, e.g. 29500.")
    return port


def _overlay_flags(reading: Reading, cfg: LaunchConfig, node: NodeFacts) -> Reading:
    """Lay every topology flag the user gave over what the environment said."""
    out = dict(reading)
    if cfg.standalone:
        out["min_nodes"] = out["max_nodes"] = Fact(1, "--standalone")
        out["master_addr"] = Fact("127.0.0.1", "--standalone")
        out["master_port"] = Fact(0, "--standalone (a free port)")
        out["rdzv_backend"] = Fact("c10d", "--standalone")
    if cfg.nnodes is not None:
        lo, hi = parse_nnodes(cfg.nnodes)
        out["min_nodes"] = Fact(lo, f"--nnodes {cfg.nnodes}")
        out["max_nodes"] = Fact(hi, f"--nnodes {cfg.nnodes}")
    if cfg.nproc_per_node is not None:
        n, src = parse_nproc(cfg.nproc_per_node, node)
        out["nproc_per_node"] = Fact(n, src)
    if cfg.node_rank is not None:
        out["node_rank"] = Fact(cfg.node_rank, f"--node-rank {cfg.node_rank}")
    if cfg.master_addr is not None:
        out["master_addr"] = Fact(master_host(cfg.master_addr), f"--master-addr {cfg.master_addr}")
    if cfg.master_port is not None:
        flag = f"--master-port {cfg.master_port}"
        out["master_port"] = Fact(check_port(cfg.master_port, flag), flag)
    if cfg.rdzv_endpoint:
        default_port = out["master_port"].value if "master_port" in out else DEFAULT_MASTER_PORT
        host, port = parse_endpoint(cfg.rdzv_endpoint, default_port)
        out["master_addr"] = Fact(host, f"--rdzv-endpoint {cfg.rdzv_endpoint}")
        out["master_port"] = Fact(port, f"--rdzv-endpoint {cfg.rdzv_endpoint}")
    if cfg.rdzv_backend is not None:
        if cfg.rdzv_backend not in (*RDZV_BACKENDS, *ETCD_BACKENDS):  # etcd: its own error (_with_rendezvous)
            raise ConfigError(
                "Unknown --rdzv-backend.", seen=f"--rdzv-backend={cfg.rdzv_backend!r}",
                hint=f"Use one of {', '.join(RDZV_BACKENDS)} (c10d is the default).",
            )
        out["rdzv_backend"] = Fact(cfg.rdzv_backend, f"--rdzv-backend {cfg.rdzv_backend}")
    if cfg.rdzv_id is not None:
        out["run_id"] = Fact(cfg.rdzv_id, f"--rdzv-id {cfg.rdzv_id}")
    return out


def resolve(cfg: LaunchConfig, environ: Mapping[str, str], node: NodeFacts,
            env: ClusterEnvironment | None = None, *, launcher: bool = False, dry_run: bool = False) -> ClusterSpec:
    """Detect the environment, overlay the flags, fill defaults, validate. Pure.

    ``launcher``: True for ``ddprun run``/``plan`` (this process starts the node's workers), False for
    a process that is itself a rank (``ddprun.init()``, which then applies :func:`one_rank_per_node`)
    and for reading what the environment says. See :func:`one_agent_per_node`.
    ``dry_run``: True for ``ddprun plan``: a multi-node launch without a rendezvous host gets
    ``master_addr=None`` (its source says what is missing) instead of a ConfigError.
    """
    notes: list[str] = []
    if env is None:
        env, notes = choose(cfg, environ)
    reading = env.read(environ, node, launcher=launcher)
    if launcher:
        reading = one_agent_per_node(reading, env.name)
    facts = _overlay_flags(reading, cfg, node)
    notes = [*notes, *override_notes(reading, facts, env.name)]
    facts, node_notes = _with_node_defaults(facts, node)
    facts = _with_master(facts, env, dry_run)
    facts, rdzv_notes = _with_rendezvous(facts)
    _check_per_process(facts, env.name)
    if launcher:
        _check_run_id(facts)
    if "run_id" not in facts:
        facts["run_id"] = (
            Fact("", "a new one each launch, agreed by the nodes (--rdzv-id JOB names it)")
            if _multi_node(facts) else Fact("", "generated at launch")
        )
    return _spec(env.name, facts, (*notes, *node_notes, *rdzv_notes))


def _check_run_id(facts: Reading) -> None:
    """A run id a launcher names its run directory with (runs/<run id>) must be one directory name,
    wherever it came from: --rdzv-id (also checked by the CLI) or a variable of the environment
    (PET_RDZV_ID, SLURM_JOB_ID, TRAINING_JOB_NAME, SKYPILOT_TASK_ID, LSB_JOBID...). Empty: generated."""
    fact = facts.get("run_id")
    problem = run_id_problem(fact.value) if fact is not None and fact.value else None
    if fact is not None and problem:
        raise ConfigError(f"The run id names the run directory (runs/<run id>), but {problem}: the run's files would "
                          "go elsewhere.", seen=f"run id {fact.value!r} ({fact.source})",
                          hint="Give every node --rdzv-id NAME (a plain name; it replaces the environment's run id), "
                               "or set the variable to a plain name.")


def override_notes(reading: Reading, facts: Reading, env_name: str) -> list[str]:
    """A note for each node count or node rank a flag set to another value than the scheduler's own
    (the flag wins): a node count the job does not have is waited for until the join timeout."""
    notes = []
    for key, what in (("max_nodes", "the node count"), ("min_nodes", "the fewest nodes"), ("node_rank", "this node's rank")):
        said, now = reading.get(key), facts.get(key)
        if env_name == "local" or said is None or now is None or said.value == now.value:
            continue
        if key == "min_nodes" and reading.get("max_nodes") == said and facts.get("max_nodes") != reading["max_nodes"]:
            continue  # one --nnodes changed both: one note
        notes.append(f"{now.source} replaces {what} the {env_name} environment states ({said.source}: "
                     f"{said.value}); a node the job does not have is waited for until --join-timeout.")
    return notes


def _multi_node(facts: Reading) -> bool:
    return facts["max_nodes"].value > 1


def _with_node_defaults(facts: Reading, node: NodeFacts) -> tuple[Reading, list[str]]:
    """Node count, processes per node and device where nothing gave them; a note when the scheduler
    allocated GPUs torch does not see."""
    facts, notes = dict(facts), []
    if "min_nodes" not in facts:
        facts["min_nodes"] = facts["max_nodes"] = Fact(1, "default: one node")
    if "nproc_per_node" not in facts:
        if node.cuda_devices:
            facts["nproc_per_node"] = Fact(node.cuda_devices, f"every visible GPU ({node.cuda_devices} on {node.hostname})")
        else:
            facts["nproc_per_node"] = Fact(1, "default on a node without GPUs")
    device = "cuda" if node.cuda_devices else "cpu"
    facts.setdefault("device", Fact(device, f"{node.cuda_devices} CUDA devices visible"))
    allocated = facts.get("allocated_gpus")  # GPUs the scheduler gave this node (SLURM gres)
    if allocated is not None and not node.cuda_devices:
        notes.append(f"{allocated.source}, but torch sees no CUDA device on {node.hostname}: "
                     f"{facts['nproc_per_node'].value} process(es) per node run on cpu "
                     "(if this node has GPUs, check nvidia-smi and that torch is a CUDA build).")
    elif node.unused_gpus and facts["device"].value == "cpu":
        notes.append(f"{node.hostname}: {node.unused_gpus}")
    return facts, notes


def _with_master(facts: Reading, env: ClusterEnvironment, dry_run: bool = False) -> Reading:
    """The rendezvous address and port: required for several nodes (``dry_run``: left unresolved),
    loopback and a free port for one."""
    facts, multi_node = dict(facts), _multi_node(facts)
    if "master_addr" not in facts:
        facts["master_addr"] = _default_master(facts, env, multi_node, dry_run)
    if "master_port" not in facts:
        facts["master_port"] = (
            Fact(DEFAULT_MASTER_PORT, f"default ({DEFAULT_MASTER_PORT}, as torchrun)")
            if multi_node else Fact(0, "default: a free port (single node)")
        )
    return facts


def _etcd_refused(facts: Reading) -> ConfigError:
    """The refusal of torch's etcd rendezvous, with the fix for where the backend came from."""
    source = facts["rdzv_backend"].source
    if source.startswith("PET_"):
        hint = ("Set the PyTorchJob's elasticPolicy.rdzvBackend to c10d (torch's recommended backend), whose "
                "endpoint is the master pod's host:port, not an etcd server.")
    else:
        given = facts.get("master_addr")  # an endpoint given for etcd names the etcd server
        where = given.source if given is not None else ""
        hint = ("Use --rdzv-backend c10d (the default, torch's recommended backend; no etcd server needed)."
                + (f" The endpoint ({where}) must then be node 0's host:port, where c10d's store runs, "
                   "not the etcd server." if where.startswith(("--rdzv-endpoint", "--master-addr")) else ""))
    return ConfigError(
        "ddprun does not run on torch's etcd rendezvous: admission, failure records, the stall watchdog and "
        "preemption live in the rendezvous' TCPStore, which etcd rendezvous does not have.",
        seen=f"{facts['rdzv_backend'].value!r} ({source})", hint=hint)


def _with_rendezvous(facts: Reading) -> tuple[Reading, list[str]]:
    """The rendezvous backend, and the node rank it allows: c10d assigns node ranks (a given one is
    dropped with a note), static needs one on several nodes and a fixed node count."""
    facts, notes, multi_node = dict(facts), [], _multi_node(facts)
    if "rdzv_backend" not in facts:
        facts["rdzv_backend"] = Fact("c10d", "default (c10d: node ranks by arrival, no duplicates)")
    backend = facts["rdzv_backend"].value
    if backend in ETCD_BACKENDS:  # its store is etcd's, where ddprun's job store would be
        raise _etcd_refused(facts)
    if backend not in RDZV_BACKENDS:
        raise ConfigError("Unknown rendezvous backend.", seen=f"{backend!r} ({facts['rdzv_backend'].source})",
                          hint=f"Use one of {', '.join(RDZV_BACKENDS)} (c10d is the default).")
    node_rank = facts.get("node_rank")
    if node_rank is not None:
        if not 0 <= node_rank.value < facts["max_nodes"].value:
            raise ConfigError(
                "The node rank is outside the number of nodes.",
                seen=f"node rank {node_rank.value} ({node_rank.source}), nnodes={facts['max_nodes'].value}",
                hint="Node ranks run from 0 to nnodes-1.",
            )
        if backend == "c10d":
            notes.append(f"{node_rank.source} is ignored under c10d rendezvous: node ranks follow arrival order "
                         "(use --rdzv-backend static to fix them).")
            facts.pop("node_rank")
    elif backend == "static":
        if multi_node:
            raise ConfigError(
                "Static rendezvous needs this node's rank.",
                seen=f"--rdzv-backend static, nnodes={facts['max_nodes'].value}, no --node-rank",
                hint="Give --node-rank on every node (0 on the master), or drop --rdzv-backend to use c10d.",
            )
        facts["node_rank"] = Fact(0, "default: single node")
    if backend == "static" and facts["min_nodes"].value != facts["max_nodes"].value:
        raise ConfigError(
            "Static rendezvous cannot be elastic.",
            seen=f"nnodes {facts['min_nodes'].value}:{facts['max_nodes'].value} ({facts['max_nodes'].source}), "
                 f"backend static ({facts['rdzv_backend'].source})",
            hint="Use --rdzv-backend c10d for --nnodes MIN:MAX.",
        )
    return facts, notes


def _spec(environment: str, facts: Reading, notes: Sequence[str]) -> ClusterSpec:
    """The ClusterSpec of resolved ``facts``, every value with its source."""
    def get(k: str) -> Any:  # Fact.value is Any: each key's type is the field's
        return facts[k].value if k in facts else None
    return ClusterSpec(
        environment=environment,
        min_nodes=get("min_nodes"), max_nodes=get("max_nodes"),
        nproc_per_node=get("nproc_per_node"), node_rank=get("node_rank"),
        master_addr=get("master_addr"), master_port=get("master_port"),
        rdzv_backend=get("rdzv_backend"), run_id=get("run_id"), device=get("device"),
        sources={k: f.source for k, f in facts.items()},
        rank=get("rank"), local_rank=get("local_rank"), world_size=get("world_size"),
        notes=tuple(notes), ifname=get("ifname"),
        extra={k: f.value for k, f in facts.items() if k not in SPEC_FIELDS},
    )


SPEC_FIELDS = frozenset(f.name for f in dataclasses.fields(ClusterSpec))

UNRESOLVED = "unresolved: "
"""Prefix of ``sources["master_addr"]`` when a dry run found no rendezvous host."""


def _default_master(facts: Reading, env: ClusterEnvironment, multi_node: bool, dry_run: bool) -> Fact:
    """127.0.0.1 for one node; for several, the error ``ddprun run`` stops with (a dry run keeps it as the source)."""
    if not multi_node:
        return Fact("127.0.0.1", "default: single node")
    missing = ConfigError(
        "A multi-node launch needs the address of the rendezvous host.",
        seen=f"nnodes={facts['max_nodes'].value} ({facts['max_nodes'].source}), no --rdzv-endpoint or --master-addr",
        hint=env.master_hint or "Give every node the same --rdzv-endpoint HOST:PORT (HOST = one of the nodes), "
             "or launch under SLURM/mpirun/SageMaker where ddprun finds it.",
    )
    if not dry_run:
        raise missing
    return Fact(None, f"{UNRESOLVED}{missing.what} HINT: {missing.hint}")


PER_PROCESS_KEYS = ("rank", "local_rank", "world_size")

LAUNCHERS = {"mpi": "mpirun", "slurm": "srun"}

LSF_BLAUNCH = ("blaunch -z \"$(echo $LSB_MCPU_HOSTS | awk '{for (i = 1; i <= NF; i += 2) printf \"%s \", $i}')\" "
               "ddprun run train.py")
"""One ``ddprun run`` on every host of an LSF job, from its job script (space-separated hosts for -z)."""

AGENT_HINTS = {
    "mpi": "Start one `ddprun run` per node: mpirun -N 1 (or --map-by ppr:1:node) ddprun run train.py; "
           "or run the script itself under mpirun (mpirun -np N python train.py) with ddprun.init() in it.",
    "slurm": "Start one `ddprun run` per node: srun --ntasks-per-node=1 ddprun run train.py; "
             "or run the script itself under srun (srun python train.py) with ddprun.init() in it.",
    "lsf": "Start one `ddprun run` per host from the job script: " + LSF_BLAUNCH,
}


def one_agent_per_node(reading: Reading, env_name: str) -> Reading:
    """``ddprun run`` under a launcher that starts one process per rank (mpirun, srun tasks).

    One process on this node (local size 1): that process is this node's agent, so the task rank is
    the node rank (it already is: rank // 1), and the per-process values are dropped so that
    --nproc-per-node or ddprun's default (every GPU) says how many workers it starts. Several
    processes on this node: each would start a whole node's workers, so ClusterError.
    """
    if "rank" not in reading or env_name == "torchrun":
        return reading
    nproc = reading["nproc_per_node"]
    if nproc.value > 1:
        raise ClusterError(
            f"`ddprun run` was started {nproc.value} times on this node by {LAUNCHERS.get(env_name, env_name)}: "
            "each would start a whole node's workers.",
            seen=f"{nproc.source}; this process: {reading['rank'].source}, {reading['local_rank'].source}",
            hint=AGENT_HINTS.get(env_name, "Start one `ddprun run` per node, or run the script itself with "
                                           "ddprun.init() in it."),
        )
    out = {k: v for k, v in reading.items() if k not in (*PER_PROCESS_KEYS, "nproc_per_node")}
    if "node_rank" in out:
        rank = out["node_rank"]
        out["node_rank"] = Fact(rank.value, f"{rank.source} (one `ddprun run` per node: the task rank is the node rank)")
    return out


OWN_GROUP = ("A process that drives every GPU of its node itself (model parallel inside the node) creates its "
             "process group before ddprun.init(), which takes it as it is.")
RANK_HINTS = {  # the environments that state this process is one of the job's processes
    "slurm": "Start one process per GPU: srun --ntasks-per-node={n} python train.py; or one `ddprun run` per "
             "node: srun --ntasks-per-node=1 ddprun run train.py. " + OWN_GROUP,
    "kubernetes": "Make the pod's command `ddprun run train.py` (it starts one process per GPU), or "
                  "set nprocPerNode to 1. " + OWN_GROUP,
    "sagemaker": "Make the entry point `ddprun run train.py` (it starts one process per GPU), or use the "
                 "estimator's distribution={{'torch_distributed': {{'enabled': True}}}}. " + OWN_GROUP,
}
"""An srun step's task (SLURM_PROCID of SLURM_NTASKS), a PyTorchJob pod (the operator's RANK and
WORLD_SIZE, which torch's ``env://`` reads) and a SageMaker entry point (run on every instance, always)
are ranks. SkyPilot and LSF name hosts only and run what the user's script says where it says: a
script on the head node alone (an eval step) is as likely as one on every node, so such a process is
a job of one, said by :func:`alone_note`."""


def one_rank_per_node(spec: ClusterSpec, *, joining: bool) -> ClusterSpec:
    """``spec`` (resolve()'s, not a launcher's) for ``python train.py`` with ``ddprun.init()`` in it,
    started once per node by a multi-node job that states it is one of the job's processes but names
    no process rank: an srun step with one task per node, a PyTorchJob pod, SageMaker (RANK_HINTS).

    Torch's ``env://`` and Lightning take such a process as one rank of the job; reading it as a job
    of one would let every node train alone. One process per node planned: it is that node's rank
    (rank = node rank, world = nodes). ``joining`` (init()): a node planned for several processes (its
    GPUs: the "one GPU per node" failure) or node ranks by arrival (elastic, c10d) is a ClusterError
    naming the launcher. Not joining (rank_info(), a query): never an error; the node's rank where the
    node rank is known, else the spec as it is (a job of one).
    """
    env_name, src = spec.environment, spec.sources
    if spec.rank is not None or spec.max_nodes == 1 or env_name not in RANK_HINTS:
        return spec
    nodes, nproc, node_rank = spec.max_nodes, spec.nproc_per_node, spec.node_rank
    seen = (f"nodes {nodes} ({src['max_nodes']}), processes per node {nproc} ({src['nproc_per_node']}), "
            f"node rank {'by arrival' if node_rank is None else node_rank} "
            f"({src['rdzv_backend'] if node_rank is None else src['node_rank']})")
    if joining and nproc > 1:
        raise ClusterError(
            f"This process was started once on its node, but the {env_name} job plans {nproc} processes "
            "per node: as the node's only rank it would use one of them, and the job's world size would be wrong.",
            seen=seen, hint=RANK_HINTS[env_name].format(n=nproc))
    if node_rank is None or spec.elastic:
        if not joining:
            return spec
        raise ClusterError(
            f"This process was started once on its node of an elastic {env_name} job (or one whose node ranks "
            "come by arrival): only a launcher can give it a rank.", seen=seen,
            hint="Start it with `ddprun run train.py` on every node.")
    why = f"one process on each of {nodes} nodes ({src['max_nodes']}): the node rank"
    return dataclasses.replace(spec, rank=node_rank, local_rank=0, world_size=nodes, sources={
        **src, "rank": f"{src['node_rank']} ({why})", "local_rank": "the node's only process",
        "world_size": src["max_nodes"]})


ALONE_HINTS = {
    "skypilot": "make the task's run command `ddprun run train.py` (one process per GPU on every node).",
    "lsf": "start one `ddprun run` per host from the job script: " + LSF_BLAUNCH,
}


def alone_note(spec: ClusterSpec) -> str | None:
    """The line init() prints when a multi-node job's process runs as a job of one because nothing
    names it a rank (SkyPilot, LSF: see RANK_HINTS); None otherwise."""
    if (spec.rank is not None or spec.max_nodes == 1 or spec.environment in RANK_HINTS
            or spec.environment in ("torchrun", "local", "hostfile")):
        return None
    return (f"ddprun: note: a multi-node {spec.environment} job ({spec.max_nodes} nodes: "
            f"{spec.sources.get('max_nodes', '?')}), but nothing names this process one of its ranks: it runs as "
            "a job of one. To train on every node: " + ALONE_HINTS.get(
                spec.environment, "start `ddprun run train.py` once on every node."))


def _check_per_process(facts: Reading, env_name: str) -> None:
    """A cluster that started one process per rank must agree with the plan once flags are laid over it.

    torchrun's own variables are left alone: they describe a worker torch already placed.
    """
    if "world_size" not in facts or env_name == "torchrun":
        return
    nodes, nproc, world = facts["max_nodes"], facts["nproc_per_node"], facts["world_size"]
    if world.value != nodes.value * nproc.value:
        raise ConfigError(
            "The processes the cluster started do not match nodes x processes per node.",
            seen=f"world size {world.value} ({world.source}), nodes {nodes.value} ({nodes.source}), "
                 f"processes per node {nproc.value} ({nproc.source})",
            hint="Drop --nnodes/--nproc-per-node: the cluster already fixed them.",
        )
    node_rank = facts.get("node_rank")
    rank, local_rank = facts["rank"].value, facts["local_rank"].value
    if node_rank is None or rank != node_rank.value * nproc.value + local_rank:
        raise ConfigError(
            "This process's rank does not follow node rank x processes per node + local rank.",
            seen=f"rank {rank} ({facts['rank'].source}), local rank {local_rank}, node rank "
                 f"{node_rank.value if node_rank else None} ({node_rank.source if node_rank else 'none'})",
            hint="Drop --node-rank/--rdzv-backend: the cluster already fixed the ranks.",
        )


EXPLAINED = ("min_nodes", "max_nodes", "nproc_per_node", "node_rank", "device", "master_addr", "master_port",
             "rdzv_backend", "run_id", "rank", "local_rank", "world_size")


def explain(spec: ClusterSpec) -> list[str]:
    """One line per value: name, value, source; then extra facts of the environment (e.g. ifname)."""
    lines = [f"environment: {spec.environment}"]
    for key in EXPLAINED:
        if key in spec.sources:
            lines.append(f"{key}: {getattr(spec, key)!r}  <- {spec.sources[key]}")
    lines.extend(f"{key}  <- {src}" for key, src in spec.sources.items() if key not in EXPLAINED)
    lines.extend(f"note: {n}" for n in spec.notes)
    return lines
