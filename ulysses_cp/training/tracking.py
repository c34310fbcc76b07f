"""Metrics: ``metrics.jsonl`` always, wandb when the DeepSpeed ``"wandb"`` block enables it.

We read the standard block (``enabled``, ``project``, ``group``, ``team``) and own the run
ourselves on global rank 0 instead of handing the block to DeepSpeed's monitor: one run
that holds the full JSON config and the topology, with our metrics at our step numbers.
wandb that is not installed or cannot start never stops training: one warning, then
offline, then off. ``WANDB_MODE=offline`` works with no network.

A resumed run continues the same wandb run: each checkpoint's ``meta.json`` keeps the run's
id (:meth:`Tracker.checkpoint_meta`), and ``run_id=`` opens that run again
(``resume="allow"``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..core.log import get_logger

__all__ = [
    "RUN_ID_KEY",
    "Tracker",
]

log = get_logger(__name__)
RUN_ID_KEY = "wandb_run_id"  # in a checkpoint's meta.json


class Tracker:
    def __init__(
        self,
        *,
        output_dir: str | Path,
        config: dict,
        topo_info: dict,
        is_main: bool,
        resume: bool,
        start_step: int = 0,
        run_id: str | None = None,
    ) -> None:
        """``run_id``: the wandb run to continue (a resumed checkpoint's, from its
        ``meta.json``); None starts a new one."""
        self.is_main = is_main
        self.run = None
        self.path = Path(output_dir) / "metrics.jsonl"
        if not is_main:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not resume and self.path.exists():
            self.path.unlink()
        if resume and self.path.exists():
            # rows logged after the checkpoint we resume from are logged again: drop them
            rows = [r for r in self.path.read_text().splitlines() if r.strip()]
            kept = [r for r in rows if json.loads(r)["step"] <= start_step]
            self.path.write_text("".join(r + "\n" for r in kept))
        block = config.get("wandb") or {}
        if block.get("enabled"):
            self.run = _start_wandb(
                block, {"config": config, "topology": topo_info}, Path(output_dir), run_id
            )

    def checkpoint_meta(self) -> dict:
        """What a checkpoint's ``meta.json`` keeps of the tracking: the wandb run's id."""
        run_id = getattr(self.run, "id", None)
        return {RUN_ID_KEY: run_id} if run_id else {}

    def log(self, step: int, metrics: dict) -> None:
        if not self.is_main:
            return
        row = {"step": step, **metrics}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.run is not None:
            try:
                self.run.log(metrics, step=step)
            except Exception as exc:  # a wandb failure mid-run must not stop training
                log.warning(f"wandb.log failed ({type(exc).__name__}: {exc}); tracking off")
                self.run = None

    def finish(self, summary: dict) -> None:
        if self.run is not None:
            try:
                self.run.summary.update(summary)
                self.run.finish()
            except Exception as exc:
                log.warning(f"wandb finish failed ({type(exc).__name__}: {exc})")


def _start_wandb(block: dict, run_config: dict, output_dir: Path, run_id: str | None):
    try:
        import wandb
    except ImportError:
        log.warning("wandb is enabled in the config but not installed; tracking off")
        return None
    kwargs: dict[str, Any] = dict(
        project=block.get("project", "ulysses_cp"),
        group=block.get("group"),
        entity=block.get("team"),
        config=run_config,
        dir=str(output_dir),
        id=run_id,
        resume="allow",
    )
    for mode in (None, "offline"):
        try:
            extra: dict[str, Any] = {"mode": mode} if mode else {}
            return wandb.init(**kwargs, **extra)
        except Exception as exc:  # network, auth, ... must not stop training
            log.warning(
                f"wandb could not start ({type(exc).__name__}: {exc}); "
                f"{'retrying offline' if mode is None else 'tracking off'}"
            )
    return None
