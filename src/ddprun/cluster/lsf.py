"""IBM Spectrum LSF: ``ddprun run`` once on every host of the job, started with ``blaunch``.

LSF runs the job script on the first execution host only; it lists the job's hosts in
LSB_MCPU_HOSTS (``"hostA 4 hostB 4"``: each host once, with its slots) and LSB_HOSTS (each host once
per slot: ``"hostA hostA hostA hostA hostB ..."``). Start one ddprun per host from the script::

    blaunch -z "$(echo $LSB_MCPU_HOSTS | awk '{for (i = 1; i <= NF; i += 2) printf "%s ", $i}')" ddprun run train.py

Detected when LSB_JOBID and LSB_MCPU_HOSTS (or LSB_HOSTS) are present; an MPI launcher inside the
job wins by priority (its rank variables describe the process). nodes = the hosts in LSF's order,
node rank = the index of the host this node is (its hostname, short name or an address; as in
hostfile.py; DDPRUN_HOSTNAME overrides the name), rendezvous static at the first host on port
``15000 + LSB_JOBID % 17000`` (the same on every host, like SLURM's; an element of a job array adds
``1009 x LSB_JOBINDEX`` inside the modulo, since the elements share LSB_JOBID and may share a host),
MASTER_PORT wins; run id ``lsf-<job id>`` (``lsf-<job id>-<index>`` for an element of a job array).
Processes per node = the entries of CUDA_VISIBLE_DEVICES (LSF sets it for ``bsub -gpu``), else
ddprun's default: LSF's slots count CPUs as often as GPUs, so they are shown (``slots``) but not used.
CSM/jsrun allocations (a launch node listed first) are not covered.
"""

from __future__ import annotations

from collections.abc import Mapping

from ddprun.cluster._values import count, derived_port, env_int, env_port, env_value, visible_gpus
from ddprun.cluster.base import ClusterEnvironment, Fact, NodeFacts, Reading
from ddprun.cluster.hostfile import node_names
from ddprun.errors import ClusterError


def job_hosts(environ: Mapping[str, str]) -> tuple[list[tuple[str, int]], str]:
    """[(host, slots)] in LSF's order, and the variable they came from."""
    if "LSB_MCPU_HOSTS" in environ:
        raw = environ["LSB_MCPU_HOSTS"]
        words = raw.split()
        pairs = list(zip(words[0::2], words[1::2]))
        if not words or len(words) % 2 or not all(n.isdigit() and int(n) > 0 for _, n in pairs):
            raise ClusterError("LSB_MCPU_HOSTS is not a list of `host slots` pairs.", seen=f"LSB_MCPU_HOSTS={raw!r}",
                               hint='Expected e.g. "hostA 4 hostB 4"; run ddprun inside the LSF job, '
                                    'do not set it by hand.')
        hosts = [(h, int(n)) for h, n in pairs]
        if len({h for h, _ in hosts}) != len(hosts):
            raise ClusterError("LSB_MCPU_HOSTS names a host twice.", seen=f"LSB_MCPU_HOSTS={raw!r}",
                               hint="Run ddprun inside the LSF job; do not set LSB_MCPU_HOSTS by hand.")
        return hosts, f"LSB_MCPU_HOSTS={raw}"
    raw = environ["LSB_HOSTS"]
    slots: dict[str, int] = {}
    for host in raw.split():  # one entry per slot, a host's entries together
        slots[host] = slots.get(host, 0) + 1
    if not slots:
        raise ClusterError("LSB_HOSTS names no host.", seen=f"LSB_HOSTS={raw!r}",
                           hint="Run ddprun inside the LSF job (bsub), where LSF sets it.")
    return list(slots.items()), f"LSB_HOSTS={raw}"


def _index_of_this_node(hosts: list[tuple[str, int]], node: NodeFacts, hosts_src: str) -> int:
    names = node_names(node)
    mine = [i for i, (h, _) in enumerate(hosts) if h.lower() in names or h.lower().split(".")[0] in names]
    if len(mine) != 1:
        what = "This node is not one of the LSF job's hosts." if not mine else "Several LSF hosts match this node."
        raise ClusterError(
            what, seen=f"{hosts_src}; this node: {', '.join(sorted(names))}",
            hint="Start one `ddprun run` on every host of the job with blaunch (see `ddprun run --help`), "
                 "or set DDPRUN_HOSTNAME to the name LSF uses for this host.",
        )
    return mine[0]


class LsfEnvironment(ClusterEnvironment):
    name = "lsf"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return "LSB_JOBID" in environ and ("LSB_MCPU_HOSTS" in environ or "LSB_HOSTS" in environ)

    def read(self, environ: Mapping[str, str], node: NodeFacts, *, launcher: bool = False) -> Reading:
        job_id = env_int(environ, "LSB_JOBID")
        hosts, hosts_src = job_hosts(environ)
        rank = _index_of_this_node(hosts, node, hosts_src)
        nnodes = Fact(len(hosts), f"{hosts_src} ({count(len(hosts), 'host')})")
        index = env_int(environ, "LSB_JOBINDEX") if environ.get("LSB_JOBINDEX", "").strip() else 0
        in_array = index != 0  # LSF sets 0 outside job arrays
        run_id = f"lsf-{job_id}-{index}" if in_array else f"lsf-{job_id}"
        reading: Reading = {
            "min_nodes": nnodes,
            "max_nodes": nnodes,
            "node_rank": Fact(rank, f"{hosts[rank][0]} is host {rank} of {hosts_src}"),
            "master_addr": Fact(hosts[0][0], f"first host of {hosts_src}"),
            "rdzv_backend": Fact("static", f"node ranks known from the order of {hosts_src.split('=')[0]}"),
            "run_id": Fact(run_id, f"LSB_JOBID={job_id}" + (f", LSB_JOBINDEX={index}" if in_array else "")),
            "slots": Fact(hosts[rank][1], f"{hosts_src} (slots of {hosts[rank][0]}; not used as processes)"),
        }
        if env_value(environ, "MASTER_PORT") is not None:
            reading["master_port"] = Fact(env_port(environ), f"MASTER_PORT={environ['MASTER_PORT']}")
        else:
            reading["master_port"] = derived_port(job_id, "LSB_JOBID", index, "LSB_JOBINDEX")
        gpus = visible_gpus(environ)
        if gpus is not None:
            reading["nproc_per_node"] = gpus
        return reading
