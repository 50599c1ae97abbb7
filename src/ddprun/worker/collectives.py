"""Which collective each rank is in at a stall, from torch's Flight Recorder.

Every ``ddprun run`` worker records its collectives (TORCH_FR_BUFFER_SIZE, set by the agent unless
the user set it: protocol/env.py :func:`flight_recorder_env`); gloo and NCCL process groups both record. At a stall
each rank reads its own recorder (:func:`last_collectives`, from the monitor thread while the main
thread may be blocked in the collective), writes the whole trace beside its stacks, and publishes
the last collective of each process group with its place. The hang report then names, per group,
the rank that never entered the collective the others wait in, or the ranks that called different
collectives at the same sequence number (:func:`attribution`, pure).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from ddprun._util import ranks_text


def _group_name(entry: dict) -> str:
    pg = entry.get("process_group")
    if isinstance(pg, (list, tuple)) and len(pg) > 1:
        return str(pg[1])
    return str(pg)


DUMPS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")
"""torch's Flight Recorder dumps (private): the recorder of every backend, and on CUDA builds that keep
NCCL's apart (seen: 2.11) NCCL's own. Read both; an entry in both counts once."""


def _trace() -> dict | None:
    """This process's recorded trace, every recorder's entries in one ``entries`` list; None if none."""
    try:
        import torch._C._distributed_c10d as c10d
    except Exception:  # noqa: BLE001 - a torch without distributed
        return None
    data: dict | None = None
    seen: set[str] = set()
    for name in DUMPS:
        dump = getattr(c10d, name, None)  # absent: no such recorder in this build
        try:
            part = json.loads(dump(True, False)) if dump is not None else None
        except Exception:  # noqa: BLE001 - this recorder is off
            continue
        if not isinstance(part, dict):
            continue
        data = data if data is not None else {**part, "entries": []}
        for e in part.get("entries") or []:
            key = json.dumps(e, sort_keys=True, default=str)
            if isinstance(e, dict) and key not in seen:
                seen.add(key)
                data["entries"].append(e)
    return data


def last_collectives(path: str | None = None) -> list[dict] | None:
    """This process's last recorded collective per process group: ``{"pg", "seq", "op", "state"}``;
    the whole trace (JSON) into ``path`` if given. None when nothing is recorded or torch has no
    recorder. Never raises: it runs in the middle of a hang report."""
    data = _trace()
    entries = data["entries"] if data is not None else []
    if not entries:
        return None
    if path:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as fp:
                json.dump(data, fp)
        except OSError:
            pass
    last: dict[str, dict] = {}
    for e in entries:
        seq = e.get("collective_seq_id")
        if not isinstance(seq, int) or seq <= 0:  # point-to-point operations have no collective number
            continue
        name = _group_name(e)
        if seq > last.get(name, {}).get("seq", 0):
            last[name] = {"pg": name, "seq": seq, "op": str(e.get("profiling_name", "?")), "state": e.get("state")}
    return list(last.values()) or None


def op_name(profiling_name: str) -> str:
    """``gloo:all_reduce`` / ``nccl:all_reduce`` -> ``ALLREDUCE``."""
    return profiling_name.split(":")[-1].replace("_", "").upper()


def _group(name: str) -> str:
    return "the default group" if name in ("default_pg", "0") else f"group {name}"


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {ranks_text(ranks)}"


def attribution(places: Mapping[int, dict]) -> list[str]:
    """One line per process group whose ranks are not all in the same collective: the ranks that
    never entered the latest one, or those that called another collective at that number. Ranks
    whose place has no ``collectives`` (no recorder, or they did not answer) are left out."""
    by_group: dict[str, dict[int, dict]] = {}
    answered = [r for r, p in places.items() if isinstance(p.get("collectives"), list)]
    for rank in answered:
        for c in places[rank]["collectives"]:
            if isinstance(c, dict) and isinstance(c.get("seq"), int):
                by_group.setdefault(str(c.get("pg")), {})[rank] = c
    lines = []
    for name in sorted(by_group):
        seen = by_group[name]
        top = max(c["seq"] for c in seen.values())
        at_top = sorted(r for r, c in seen.items() if c["seq"] == top)
        behind = sorted(set(answered) - set(at_top))
        ops = {op_name(seen[r]["op"]) for r in at_top}
        if len(ops) > 1:
            calls = "; ".join(f"{op} on {_ranks([r for r in at_top if op_name(seen[r]['op']) == op])}"
                              for op in sorted(ops))
            lines.append(f"ranks call different collectives as #{top} of {_group(name)}: {calls}")
        elif behind:
            op = ops.pop()
            where = "; ".join(f"rank {r} is at #{seen[r]['seq']}" if r in seen else f"rank {r} never used it"
                              for r in behind[:8])
            lines.append(f"{_ranks(behind)} never entered {op} #{top} of {_group(name)}; {_ranks(at_top)} "
                         f"{'wait' if len(at_top) > 1 else 'waits'} in it ({where})")
    return lines
