"""Two nodes simulated on one machine through DeepSpeed's own launcher: a hostfile with two
hosts of two slots, one ``deepspeed --no_ssh --node_rank i`` per node, hybrid Ulysses 2
(inside each node) x ring 2 (across the nodes). The process groups the ranks built are
checked against the nodes, and the losses against a single-node run of the same config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import helpers
from ulysses_cp.config import RunConfig
from ulysses_cp.plan.cli import plan
from ulysses_cp.plan.nodes import describe, group_spans
from ulysses_cp.plan.search import Hardware

CONFIG = helpers.run_config(
    2,
    2,
    **helpers.LAUNCH,
    training={"max_steps": 3, "log_interval": 1, "portable_checkpoint": False},
)


def launch_two_nodes(cfg: Path, hostfile: Path, out: Path) -> list[str]:
    """Both nodes' launchers at once (they rendezvous at 127.0.0.1); their outputs."""
    port = str(helpers.free_port())
    procs = []
    for node in (0, 1):
        opts = (
            "--hostfile",
            str(hostfile),
            "--no_ssh",
            "--node_rank",
            str(node),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            port,
        )
        procs.append(
            helpers.start(
                helpers.deepspeed_cmd(cfg, out, launcher=opts), env={"WANDB_MODE": "disabled"}
            )
        )
    results = helpers.finish(procs)
    for code, text in results:
        assert code == 0, text[-4000:]
    return [text for _, text in results]


def groups_line(text: str) -> dict:
    line = next(x for x in text.splitlines() if "process groups: " in x)
    return json.loads(line.split("process groups: ", 1)[1])


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


def test_groups_that_cross_nodes_are_named():
    """The warning train.py logs when a ulysses group spans nodes (ulysses 4 on nodes of
    2), and none for the layout the multi-node test runs."""
    nodes = {"0": [0, 1], "1": [2, 3]}
    _, warning = describe({"nodes": nodes, "ulysses": [[0, 1, 2, 3]], "ring": [[0], [1]]})
    assert warning is not None and "[[0, 1, 2, 3]]" in warning and "(2)" in warning
    _, none = describe({"nodes": nodes, "ulysses": [[0, 1], [2, 3]], "ring": [[0, 2], [1, 3]]})
    assert none is None
    assert group_spans([[0, 1], [2, 3], [1, 2]], gpus_per_node=2) == [1, 1, 2]
