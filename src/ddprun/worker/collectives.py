"""Which collective each rank is in at a stall, from torch's Flight Recorder.

Every ``ddprun run`` worker records its collectives (TORCH_FR_BUFFER_SIZE, set by the agent unless
the user set it: protocol/env.py :func:`flight_recorder_env`); gloo and NCCL process groups both record. At a stall
each rank reads its own recorder (:func:`last_collectives`, from the monitor thread while the main
thread may be blocked in the collective), writes the whole trace beside its stacks, and publishes
the last collective of each process group with its place. The hang report then names, per group,
the rank that never entered the collective the others wait in, or the ranks that called different
collectives at the same sequence number (:func:`attribution`, pure).

A group is known by its name, torch's ``process_group[0]`` of an entry: the same on every rank, since
every rank calls ``new_group`` in one order (a hash of its ranks where only members call it). Its
description (``process_group[1]``, ``group_desc``) is "undefined" for every group made without
one, so it only labels a group in the report. Sequence numbers count per group, and only a group's
members have them: a rank is compared in a group when it has entries of that group, or is among the
members some rank knew (torch.distributed's own table, or the recorder's ``pg_config``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from ddprun._util import ranks_text


def _group_of(entry: dict) -> tuple[str, str]:
    """(name, description) of an entry's process group (module docstring)."""
    pg = entry.get("process_group")
    if isinstance(pg, (list, tuple)) and pg:
        return str(pg[0]), str(pg[1]) if len(pg) > 1 else ""
    return str(pg), ""


def _members(data: dict) -> dict[str, list[int]]:
    """name -> the global ranks of each group this process knows: the recorder's ``pg_config`` (NCCL
    fills it; gloo leaves it empty), then torch.distributed's table of the groups this process is in.
    Read from the monitor thread while the main thread may create groups: anything odd is left out."""
    out: dict[str, list[int]] = {}
    config = data.get("pg_config")
    for name, conf in (config.items() if isinstance(config, dict) else []):
        try:
            ranks = json.loads(conf["ranks"])
        except (TypeError, KeyError, ValueError):
            continue
        if isinstance(ranks, list) and ranks and all(isinstance(r, int) for r in ranks):
            out[str(name)] = ranks
    try:
        from torch.distributed import distributed_c10d as c10d

        world = c10d._world
        names, groups = dict(world.pg_names), dict(world.pg_group_ranks)
        for pg, name in names.items():
            ranks = sorted(groups.get(pg) or ())
            if ranks:
                out[str(name)] = ranks
    except Exception:  # noqa: BLE001 - private tables: a torch without them gives no membership
        pass
    return out


DUMPS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")
"""torch's Flight Recorder dumps (private): the recorder of every backend, and on CUDA builds that keep
NCCL's apart (seen: 2.11) NCCL's own. Read both; an entry in both counts once."""


def _trace() -> dict | None:
    """This process's recorded trace, every recorder's entries in one ``entries`` list and groups in
    one ``pg_config``; None if none."""
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
        data = data if data is not None else {**part, "entries": [], "pg_config": {}}
        if isinstance(part.get("pg_config"), dict):  # each recorder's groups (members: NCCL's)
            data["pg_config"].update(part["pg_config"])
        for e in part.get("entries") or []:
            key = json.dumps(e, sort_keys=True, default=str)
            if isinstance(e, dict) and key not in seen:
                seen.add(key)
                data["entries"].append(e)
    return data


def last_collectives(path: str | None = None) -> list[dict] | None:
    """This process's last recorded collective per process group: ``{"pg", "desc", "seq", "op",
    "state"}`` and ``"ranks"``, the group's global ranks, where known (:func:`_members`); the whole
    trace (JSON) into ``path`` if given. None when nothing is recorded or torch has no
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
        name, desc = _group_of(e)
        if seq > last.get(name, {}).get("seq", 0):
            last[name] = {"pg": name, "desc": desc, "seq": seq, "op": str(e.get("profiling_name", "?")),
                          "state": e.get("state")}
    members = _members(data) if last and data is not None else {}
    for name, c in last.items():
        if name in members:
            c["ranks"] = members[name]
    return list(last.values()) or None


def op_name(profiling_name: str) -> str:
    """``gloo:all_reduce`` / ``nccl:all_reduce`` -> ``ALLREDUCE``."""
    return profiling_name.split(":")[-1].replace("_", "").upper()


def _group(name: str, desc: str) -> str:
    if name == "0" or desc == "default_pg":
        return "the default group"
    return f"group {name}" + (f" ({desc})" if desc and desc != "undefined" else "")


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {ranks_text(ranks)}"


def attribution(places: Mapping[int, dict]) -> list[str]:
    """One line per process group whose ranks are not all in the same collective: the ranks that
    never entered the latest one, or those that called another collective at that number. Ranks
    whose place has no ``collectives`` (no recorder, or they did not answer) are left out; in a group,
    so are the ranks that have no entry of it and are not among its known members."""
    by_group: dict[str, dict[int, dict]] = {}
    members: dict[str, set[int]] = {}
    answered = [r for r, p in places.items() if isinstance(p.get("collectives"), list)]
    for rank in answered:
        for c in places[rank]["collectives"]:
            if isinstance(c, dict) and isinstance(c.get("seq"), int):
                by_group.setdefault(str(c.get("pg")), {})[rank] = c
                ranks = c.get("ranks")
                if isinstance(ranks, list) and all(isinstance(r, int) for r in ranks):
                    members.setdefault(str(c.get("pg")), set()).update(ranks)
    lines = []
    for name in sorted(by_group):
        seen = by_group[name]
        compared = set(seen) | (members.get(name, set()) & set(answered))
        line = _judge(name, seen, compared)
        if line:
            lines.append(line)
    return lines


def _judge(name: str, seen: dict[int, dict], compared: set[int]) -> str:
    """The line for one group (``""``: its ranks agree). ``seen``: its ranks' last entries of it;
    ``compared``: those ranks and the members that answered without an entry of it."""
    top = max(c["seq"] for c in seen.values())
    at_top = sorted(r for r, c in seen.items() if c["seq"] == top)
    behind = sorted(compared - set(at_top))
    ops = {op_name(seen[r]["op"]) for r in at_top}
    desc = next((str(c.get("desc")) for c in seen.values() if c.get("desc")), "")
    if len(ops) > 1:
        calls = "; ".join(f"{op} on {_ranks([r for r in at_top if op_name(seen[r]['op']) == op])}"
                          for op in sorted(ops))
        return f"ranks call different collectives as #{top} of {_group(name, desc)}: {calls}"
    if not behind:
        return ""
    where = "; ".join(f"rank {r} is at #{seen[r]['seq']}" if r in seen else f"rank {r} never used it"
                      for r in behind[:8])
    return (f"{_ranks(behind)} never entered {ops.pop()} #{top} of {_group(name, desc)}; {_ranks(at_top)} "
            f"{'wait' if len(at_top) > 1 else 'waits'} in it ({where})")
