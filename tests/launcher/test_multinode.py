"""Two nodes simulated on one machine through DeepSpeed's own launcher: a hostfile with two
hosts of two slots, one ``deepspeed --no_ssh --node_rank i`` per node, hybrid Ulysses 2
(inside each node) x ring 2 (across the nodes). The process groups the ranks built are
checked against the nodes, and the losses against a single-node run of the same config.

The launcher-tier tests; the unit-tier ones and the shared helpers are in
tests/unit/test_multinode.py.
"""

from __future__ import annotations

import pytest

from tests.support import helpers
from tests.unit.test_multinode import CONFIG, groups_line, launch_two_nodes
from ulysses_cp.config import RunConfig
from ulysses_cp.plan.cli import plan
from ulysses_cp.plan.nodes import group_spans
from ulysses_cp.plan.search import Hardware


@pytest.mark.slow
@pytest.mark.launcher
def test_two_simulated_nodes_through_the_launcher(tmp_path):
    cfg = helpers.write_config(tmp_path, CONFIG)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\n")
    outputs = launch_two_nodes(cfg, hostfile, tmp_path / "two")
    # each launcher started its own node's two ranks out of a world of two nodes
    for i, text in enumerate(outputs):
        assert f"nnodes=2, num_local_procs=2, node_rank={i}" in text, text[-3000:]
    groups = groups_line(outputs[0])
    assert groups["nodes"] == {"0": [0, 1], "1": [2, 3]}
    node = {r: n for n, ranks in groups["nodes"].items() for r in ranks}
    assert groups["ulysses"] == [[0, 1], [2, 3]]
    assert group_spans(groups["ulysses"], node) == [1, 1]  # every all-to-all inside a node
    assert groups["ring"] == [[0, 2], [1, 3]]
    assert group_spans(groups["ring"], node) == [2, 2]  # every ring across the nodes
    two = helpers.metrics(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2, 3]

    helpers.launch(cfg, tmp_path / "one", num_gpus=4)  # the same config on one node of 4
    one = helpers.metrics(tmp_path / "one")
    assert [r["step"] for r in one] == [1, 2, 3]
    for a, b in zip(one, two):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-7), (a, b)
        assert a["comm_bytes_per_step"] == b["comm_bytes_per_step"]
    # the planner's attention bytes are the measured ones, the all-to-all inside the
    # nodes and the ring across them
    got = plan(RunConfig.load(cfg), world=4, hw=Hardware(gpus_per_node=2))["config"]
    assert all(
        r["attention_comm_bytes_per_step"] == got["attention_comm_bytes_per_step"] for r in two
    )
    assert all(r["comm_bytes_per_step"] == got["comm_bytes_per_step_per_rank"] for r in two)
    ring = got["attention_comm_bytes_per_step"] - got["intra_node_bytes"]
    assert 0 < ring < got["inter_node_bytes"]  # the ring, and ZeRO's collectives
