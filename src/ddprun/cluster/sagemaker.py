"""Amazon SageMaker training jobs: one container per instance, ``ddprun run`` once in each.

Hosts come from SM_HOSTS (a JSON list), else the ``hosts`` of resourceconfig.json; this host from
SM_CURRENT_HOST, else its ``current_host``. A heterogeneous cluster (several instance groups:
SM_INSTANCE_GROUPS_DICT, else resourceconfig.json's ``instance_groups``) lists every group's instances
there, though only some train: the hosts are then those of the groups the estimator's ``distribution``
names (SM_DISTRIBUTION_INSTANCE_GROUPS; a host of another group is refused), else this host's group.
The file is /opt/ml/input/config/resourceconfig.json,
or the path in DDPRUN_SAGEMAKER_RESOURCECONFIG (tests); reading it is this module's only I/O, in
:func:`load_resourceconfig`, and only when the variables do not already say it.

Detected when SM_HOSTS or SM_CURRENT_HOST is present, or DDPRUN_SAGEMAKER_RESOURCECONFIG names a file
that exists. (The default file alone does not detect: the SM_* variables come with it on SageMaker.)

The hosts are sorted numerically (algo-1, algo-2, ..., algo-10), so every instance computes the same
list: node rank = this host's index, master = the first host, nodes = the count. nproc_per_node =
SM_NUM_GPUS when above 0 (every GPU of the instance); SM_NUM_CPUS is not read, as a CPU instance gets
ddprun's default of one process unless --nproc-per-node says otherwise. Port 29500 unless MASTER_PORT is set.
Rendezvous is static. SageMaker's own ``torch_distributed`` launcher already ran torchrun (RANK,
LOCAL_RANK, WORLD_SIZE are set), so the torchrun environment wins that case by priority.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import hostlist

from ddprun.cluster._values import DEFAULT_PORT, count, env_int, env_port, env_value
from ddprun.cluster.base import ClusterEnvironment, Fact, NodeFacts, Reading
from ddprun.errors import ClusterError

RESOURCECONFIG = "/opt/ml/input/config/resourceconfig.json"
OVERRIDE = "DDPRUN_SAGEMAKER_RESOURCECONFIG"


def resourceconfig_path(environ: Mapping[str, str]) -> str:
    return environ.get(OVERRIDE) or RESOURCECONFIG


def load_resourceconfig(path: str) -> dict[str, Any]:
    """The parsed resourceconfig.json; {} when it does not exist; ClusterError when it is not JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ClusterError("SageMaker's resourceconfig.json cannot be read.", seen=f"{path}: {e}",
                           hint="Check the file, or set SM_HOSTS and SM_CURRENT_HOST.") from None
    if not isinstance(data, dict):
        raise ClusterError("SageMaker's resourceconfig.json is not a JSON object.", seen=f"{path}: {data!r:.200}",
                           hint="Check the file, or set SM_HOSTS and SM_CURRENT_HOST.")
    return data


def _hosts(environ: Mapping[str, str], config: dict[str, Any], path: str) -> tuple[list[str], str]:
    if "SM_HOSTS" in environ:
        raw, source = environ["SM_HOSTS"], f"SM_HOSTS={environ['SM_HOSTS']}"
        try:
            hosts = json.loads(raw)
        except ValueError:
            hosts = None
    else:
        hosts, source = config.get("hosts"), f"{path} hosts"
    if not (isinstance(hosts, list) and hosts and all(isinstance(h, str) and h for h in hosts)):
        raise ClusterError("SageMaker's host list is not a non-empty JSON list of names.",
                           seen=source if "SM_HOSTS" in environ
                           else f"{source}: {hosts!r}" + ("" if config else " (no file)"),
                           hint='Expected e.g. SM_HOSTS=["algo-1","algo-2"]; do not set it by hand.')
    if len(set(hosts)) != len(hosts):
        raise ClusterError("SageMaker's host list names a host twice.", seen=source,
                           hint="Each instance must appear once; do not set SM_HOSTS by hand.")
    return hosts, source


def _instance_groups(environ: Mapping[str, str], config: dict[str, Any], path: str) -> tuple[dict[str, list], str]:
    """{group name: its hosts} of the job, and where from: SM_INSTANCE_GROUPS_DICT (the training toolkit's
    ``{name: {"hosts": [...], ...}}``), else resourceconfig.json's ``instance_groups`` (``[{"instance_group_name":
    ..., "hosts": [...]}]``); {} when neither says."""
    if "SM_INSTANCE_GROUPS_DICT" in environ:
        source = "SM_INSTANCE_GROUPS_DICT"
        try:
            raw = json.loads(environ[source])
            entries = list(raw.values()) if isinstance(raw, dict) else None
        except ValueError:
            entries = None
    else:
        source, entries = f"{path} instance_groups", config.get("instance_groups", [])
    groups = {}
    for entry in entries if isinstance(entries, list) else [None]:
        if not (isinstance(entry, dict) and isinstance(entry.get("instance_group_name"), str)
                and isinstance(entry.get("hosts"), list)):
            raise ClusterError("SageMaker's instance groups are not a list of groups with a name and hosts.",
                               seen=f"{source}: {environ.get(source) or entries!r:.300}",
                               hint="Do not set SM_INSTANCE_GROUPS_DICT by hand; check resourceconfig.json.")
        groups[entry["instance_group_name"]] = entry["hosts"]
    return groups, source


def _training_group(environ: Mapping[str, str], config: dict[str, Any], path: str,
                    current: Any) -> tuple[list[str], str] | None:
    """The hosts that train in a heterogeneous cluster (instance groups of several instance types: SM_HOSTS
    lists every group's), with their source; None in a cluster of one group. Those of the groups the
    estimator's ``distribution`` names (SM_DISTRIBUTION_INSTANCE_GROUPS), where this host must be; else
    this host's own group (the one whose hosts list it)."""
    groups, source = _instance_groups(environ, config, path)
    if len(groups) < 2:
        return None
    mine = next((name for name, hosts in groups.items() if current in hosts), None)
    try:
        named = json.loads(environ.get("SM_DISTRIBUTION_INSTANCE_GROUPS") or "[]")
    except ValueError:
        named = []
    chosen = [g for g in named if g in groups] if isinstance(named, list) else []
    if not chosen:
        if mine is None:
            raise ClusterError("This SageMaker host is in none of the job's instance groups.",
                               seen=f"current host {current!r}; {source}: {groups}",
                               hint="Do not set SM_CURRENT_HOST or the instance groups by hand.")
        return list(groups[mine]), f"instance group {mine!r} of this host ({source})"
    if mine not in chosen:
        raise ClusterError(
            f"This SageMaker host is in instance group {mine!r}, which the job's distribution does not train on.",
            seen=f"current host {current!r}; SM_DISTRIBUTION_INSTANCE_GROUPS={environ['SM_DISTRIBUTION_INSTANCE_GROUPS']}",
            hint=f"Run `ddprun run` only on the instances of {', '.join(chosen)}: branch on SM_CURRENT_INSTANCE_GROUP in "
                 "the entry point (the other groups' own work, e.g. data loading, runs there without ddprun).")
    hosts = [h for g in chosen for h in groups[g]]
    return hosts, f"the hosts of instance group(s) {', '.join(chosen)} (SM_DISTRIBUTION_INSTANCE_GROUPS, {source})"


class SageMakerEnvironment(ClusterEnvironment):
    name = "sagemaker"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        if "SM_HOSTS" in environ or "SM_CURRENT_HOST" in environ:
            return True
        return OVERRIDE in environ and os.path.isfile(environ[OVERRIDE])

    def read(self, environ: Mapping[str, str], node: NodeFacts, *, launcher: bool = False) -> Reading:
        path = resourceconfig_path(environ)
        need_file = not all(k in environ for k in ("SM_HOSTS", "SM_CURRENT_HOST", "SM_INSTANCE_GROUPS_DICT"))
        config = load_resourceconfig(path) if need_file else {}
        hosts, hosts_src = _hosts(environ, config, path)
        current: str | None
        if "SM_CURRENT_HOST" in environ:
            current, current_src = environ["SM_CURRENT_HOST"], f"SM_CURRENT_HOST={environ['SM_CURRENT_HOST']}"
        else:
            current, current_src = config.get("current_host"), f"{path} current_host"
        group = _training_group(environ, config, path, current)
        if group is not None:  # a heterogeneous cluster: only these instances train
            hosts, hosts_src = group
        ordered = hostlist.numerically_sorted(hosts)
        if current not in ordered:
            raise ClusterError(
                "This SageMaker host is not in the job's host list.",
                seen=f"{current_src} ({current!r}), {hosts_src}",
                hint="SM_CURRENT_HOST must be one of SM_HOSTS; do not set them by hand "
                     "(or unset both to use resourceconfig.json).",
            )
        nnodes = Fact(len(ordered), f"{hosts_src} ({count(len(ordered), 'host')})")
        reading: Reading = {
            "min_nodes": nnodes,
            "max_nodes": nnodes,
            "node_rank": Fact(ordered.index(current), f"{current_src} in sorted hosts {', '.join(ordered)}"),
            "master_addr": Fact(ordered[0], f"first of sorted {hosts_src}"),
            "rdzv_backend": Fact("static", "node ranks known from the sorted SageMaker hosts"),
        }
        if env_value(environ, "MASTER_PORT") is not None:
            reading["master_port"] = Fact(env_port(environ), f"MASTER_PORT={environ['MASTER_PORT']}")
        else:
            reading["master_port"] = Fact(DEFAULT_PORT, f"default ({DEFAULT_PORT}, as torchrun); MASTER_PORT unset")
        if "SM_NUM_GPUS" in environ:
            gpus = env_int(environ, "SM_NUM_GPUS")
            if gpus > 0:
                reading["nproc_per_node"] = Fact(gpus, f"SM_NUM_GPUS={gpus} (every GPU of the instance)")
        if "TRAINING_JOB_NAME" in environ:
            job = environ["TRAINING_JOB_NAME"]
            reading["run_id"] = Fact(f"sagemaker-{job}", f"TRAINING_JOB_NAME={job}")
        ifname = environ.get("SM_NETWORK_INTERFACE_NAME") or config.get("network_interface_name")
        if ifname:
            src = ("SM_NETWORK_INTERFACE_NAME" if environ.get("SM_NETWORK_INTERFACE_NAME")
                   else f"{path} network_interface_name")
            reading["ifname"] = Fact(ifname, f"{src}={ifname}")
        return reading
