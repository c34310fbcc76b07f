"""Two nodes simulated on one machine through DeepSpeed's own launcher: a hostfile with two
hosts of two slots, one ``deepspeed --no_ssh --node_rank i`` per node, hybrid Ulysses 2
(inside each node) x ring 2 (across the nodes). The process groups the ranks built are
checked against the nodes, and the losses against a single-node run of the same config."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support import helpers
from ulysses_cp.plan.nodes import describe, group_spans

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


def test_groups_that_cross_nodes_are_named():
    """The warning train.py logs when a ulysses group spans nodes (ulysses 4 on nodes of
    2), and none for the layout the multi-node test runs."""
    nodes = {"0": [0, 1], "1": [2, 3]}
    _, warning = describe({"nodes": nodes, "ulysses": [[0, 1, 2, 3]], "ring": [[0], [1]]})
    assert warning is not None and "[[0, 1, 2, 3]]" in warning and "(2)" in warning
    _, none = describe({"nodes": nodes, "ulysses": [[0, 1], [2, 3]], "ring": [[0, 2], [1, 3]]})
    assert none is None
    assert group_spans([[0, 1], [2, 3], [1, 2]], gpus_per_node=2) == [1, 1, 2]
