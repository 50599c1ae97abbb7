"""Already inside a torchrun (or ddprun) worker: the launcher has set RANK, LOCAL_RANK, ..."""

from __future__ import annotations

from collections.abc import Mapping

from ddprun.cluster._values import env_value
from ddprun.cluster.base import ClusterEnvironment, Fact, NodeFacts, Reading
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
