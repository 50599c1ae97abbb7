"""--allow-uneven-nodes: the flag reaches the workers; the rank table, plan.json, the report and
RankInfo show nodes with different process counts as torch's agent placed them."""

import json

from ddprun.cli import build_parser, config_from_args
from ddprun.ranktable import processes_per_node, uneven_note, write_plan_json


def rows(counts):
    out, rank = [], 0
    for node, n in enumerate(counts):
        for local in range(n):
            out.append({"rank": rank, "local_rank": local, "node_rank": node, "host": f"h{node}", "pid": 1, "device": "cpu"})
            rank += 1
    return out


def test_flag_parses_for_run_doctor_and_plan_and_defaults_off():
    for command in (["run", "--allow-uneven-nodes", "t.py"], ["doctor", "--allow_uneven_nodes"],
                    ["plan", "--allow-uneven-nodes"]):
        assert config_from_args(build_parser().parse_args(command)).allow_uneven_nodes is True
    assert config_from_args(build_parser().parse_args(["run", "t.py"])).allow_uneven_nodes is False


def test_rank_table_title_and_plan_json_show_the_counts(tmp_path):
    assert processes_per_node(rows((2, 1))) == {0: 2, 1: 1}
    assert uneven_note(rows((2, 1))) == " (uneven: node 0 runs 2, node 1 runs 1)"
    assert uneven_note(rows((2, 2))) == ""
    write_plan_json(str(tmp_path), rows((2, 1)), 3)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert (plan["nnodes"], plan["world_size"], plan["uneven"], plan["nproc_per_node"]) == (2, 3, True, {"0": 2, "1": 1})


def test_report_card_shows_the_uneven_world(tmp_path):
    from ddprun.report import write_report

    write_plan_json(str(tmp_path), rows((2, 1)), 3)
    html = open(write_report(str(tmp_path))).read()
    assert "<dt>world</dt><dd>3 ranks on 2 node(s) (2 + 1)</dd>" in html


def test_rank_info_takes_the_node_rank_from_torchs_agent(monkeypatch):
    from ddprun import runtime

    env = {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "1",
           "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "u",
           "DDPRUN_DEVICE_KIND": "cpu"}
    _, info = runtime._from_environ(env)
    assert (info.rank, info.node_rank, info.local_world_size, info.world_size) == (2, 1, 1, 3)  # not 2 // 1
