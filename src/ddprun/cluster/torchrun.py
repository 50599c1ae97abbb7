"""Already inside a torchrun (or ddprun) worker: the launcher has set RANK, LOCAL_RANK, ...

Or something else set them: :func:`check_slurm_task` refuses values an srun task inherited from its
batch script instead of getting its own.
"""

from __future__ import annotations

from collections.abc import Mapping

from ddprun.cluster._values import env_value
from ddprun.cluster.base import ClusterEnvironment, Fact, NodeFacts, Reading
from ddprun.cluster.mpi import started_by_mpi_launcher
from ddprun.errors import ClusterError

REQUIRED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _int(environ: Mapping[str, str], key: str) -> int:
    raw = environ[key]
    try:
        return int(raw)
    except ValueError:
        raise ClusterError(
            f"{key} is not an integer.", seen=f"{key}={raw!r}", hint="Unset it or give a whole number."
        ) from None


def _nodes_without_group_world(world: int, local_world: int | None, node_rank: Fact | None) -> Fact | None:
    """The node count where GROUP_WORLD_SIZE is unset (Ray Train sets LOCAL_WORLD_SIZE and NODE_RANK
    only): at least this node's rank + 1 and ceil(WORLD_SIZE / LOCAL_WORLD_SIZE); None if neither is known.

    Without it the count would default to one node and refuse every node rank above 0.
    """
    parts, seen = [], []
    if local_world is not None and local_world > 0:
        parts.append(-(-world // local_world))
        seen.append(f"ceil(WORLD_SIZE={world} / LOCAL_WORLD_SIZE={local_world})")
    if node_rank is not None:
        parts.append(node_rank.value + 1)
        seen.append(f"{node_rank.source} + 1")
    if not parts:
        return None
    return Fact(max(parts), f"GROUP_WORLD_SIZE unset: the larger of {' and '.join(seen)}")


def _slurm_task_world(environ: Mapping[str, str]) -> tuple[str, int] | None:
    """The srun step's task count (variable, value) when this process is one of its tasks and nothing
    but srun placed it: no torch agent (TORCHELASTIC_RUN_ID; under ``srun ddprun run`` its workers'
    ranks are the job's, not the task's) and no mpirun (whose ranks are not the SLURM task of its
    daemon). None otherwise, or where a value is not a number (the readers name that)."""
    in_step = "SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ
    if "TORCHELASTIC_RUN_ID" in environ or not in_step or started_by_mpi_launcher(environ):
        return None
    key = next((k for k in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") if k in environ), None)
    if key is None or not environ[key].strip().isdigit():
        return None
    return key, int(environ[key])


def check_slurm_task(environ: Mapping[str, str]) -> None:
    """ClusterError when RANK or LOCAL_RANK contradict this srun task's SLURM_PROCID or SLURM_LOCALID.

    ``export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS`` in a batch script
    is evaluated once, in the batch step: every task of a later ``srun python train.py`` gets RANK=0,
    read first (torchrun's variables win), so each would host the store ("address already in use") and
    wait out the init timeout. Checked only where WORLD_SIZE is the step's task count: a task that
    starts ranks of its own (mp.spawn under one task per node) sets a larger world and other ranks.
    Values that agree, or any outside such a task, pass as before. Pure.
    """
    world = _slurm_task_world(environ)
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_PROCID")
    if world is None or not all(environ.get(k, "").strip().isdigit() for k in keys):
        return
    if int(environ["WORLD_SIZE"]) != world[1]:
        return
    pairs = [("RANK", "SLURM_PROCID"), ("LOCAL_RANK", "SLURM_LOCALID")]
    wrong = [(k, s) for k, s in pairs if environ.get(s, "").strip().isdigit() and int(environ[k]) != int(environ[s])]
    if not wrong:
        return
    raise ClusterError(
        "RANK/LOCAL_RANK are not this srun task's own, so every task would take the same rank: exported in the "
        "batch script, they are the batch step's values, the same for every task.",
        seen=", ".join(f"{k}={environ[k]} but {s}={environ[s]}" for k, s in wrong)
             + f"; WORLD_SIZE={environ['WORLD_SIZE']}, {world[0]}={world[1]}",
        hint="Do not export RANK/LOCAL_RANK/WORLD_SIZE in the batch script: `srun python train.py` is enough, "
             "ddprun reads SLURM's own variables. Or set them in each task: srun bash -c 'RANK=$SLURM_PROCID "
             "LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS python train.py'.",
    )


class TorchrunEnvironment(ClusterEnvironment):
    name = "torchrun"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return "TORCHELASTIC_RUN_ID" in environ or all(k in environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))

    def read(self, environ: Mapping[str, str], node: NodeFacts, *, launcher: bool = False) -> Reading:
        missing = [k for k in REQUIRED if env_value(environ, k) is None]  # blank: as unset, said with quotes
        if missing:
            raise ClusterError(
                "This looks like a torchrun worker, but part of its environment is missing.",
                seen=", ".join(f"{k}={environ[k]!r}" if k in missing and k in environ else f"{k}={environ.get(k, '<unset>')}"
                               for k in REQUIRED),
                hint="Start the script with `ddprun run` or torchrun, or unset RANK/LOCAL_RANK/WORLD_SIZE.",
            )
        rank, local_rank, world = _int(environ, "RANK"), _int(environ, "LOCAL_RANK"), _int(environ, "WORLD_SIZE")
        if not 0 <= rank < world:
            raise ClusterError(
                "RANK is outside the world size.",
                seen=f"RANK={rank}, WORLD_SIZE={world}",
                hint="Ranks run from 0 to WORLD_SIZE-1; check the launcher that set them.",
            )
        local_world = _int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else None
        group_world = _int(environ, "GROUP_WORLD_SIZE") if "GROUP_WORLD_SIZE" in environ else None
        reading: Reading = {
            "rank": Fact(rank, f"RANK={rank}"),
            "local_rank": Fact(local_rank, f"LOCAL_RANK={local_rank}"),
            "world_size": Fact(world, f"WORLD_SIZE={world}"),
            "master_addr": Fact(environ["MASTER_ADDR"].strip(), f"MASTER_ADDR={environ['MASTER_ADDR']}"),
            "master_port": Fact(_int(environ, "MASTER_PORT"), f"MASTER_PORT={environ['MASTER_PORT']}"),
        }
        if local_world is not None:
            reading["nproc_per_node"] = Fact(local_world, f"LOCAL_WORLD_SIZE={local_world}")
        for key in ("GROUP_RANK", "NODE_RANK"):
            if key in environ:
                reading["node_rank"] = Fact(_int(environ, key), f"{key}={environ[key]}")
                break
        nodes = (Fact(group_world, f"GROUP_WORLD_SIZE={group_world}") if group_world is not None
                 else _nodes_without_group_world(world, local_world, reading.get("node_rank")))
        if nodes is not None:
            reading["min_nodes"] = reading["max_nodes"] = nodes
        if "TORCHELASTIC_RUN_ID" in environ:
            reading["run_id"] = Fact(environ["TORCHELASTIC_RUN_ID"], "TORCHELASTIC_RUN_ID")
        return reading
