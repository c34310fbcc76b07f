"""What the fork server (tests/support/zygote.py) does once so that no rank does it again.

Imported last by the server. Three costs every forked rank used to pay, measured with
cProfile in a GRPO rank forked from the server before this module (2 cores, CPU):

- the modules behind lazy package names: ``import transformers``, ``trl`` and ``ulysses_cp``
  load almost nothing, so each rank imported the Trainer, TRL's trainers and this package's
  integrations itself (about 1.5 s);
- DeepSpeed's ZeRO optimizer check imports its Muon optimizer, whose ``torch.compile``
  decorators import torch's inductor (2.6 s of every ZeRO rank);
- transformers' weight-conversion table (about 1,000 regular expressions compiled at the
  first ``from_pretrained``, 0.5 s).

Then ``gc.freeze()``: the server's objects move out of the collector's reach, so a rank's
``gc.collect()`` (Accelerate calls one per Trainer) walks only its own objects (0.25 s) and
does not copy the server's pages by touching them.
"""

from __future__ import annotations

import contextlib
import gc
import importlib

MODULES = [
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "transformers.trainer",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.mixtral.modeling_mixtral",
    "trl.trainer.grpo_trainer",
    "trl.trainer.dpo_trainer",
    "trl.trainer.sft_trainer",
    "trl.trainer.rloo_trainer",
    "ulysses_cp.train",
    "ulysses_cp.training.trainer",
    "ulysses_cp.training.fsdp2_engine",
    "ulysses_cp.integrations.hf_trainer.trainer",
    "ulysses_cp.integrations.hf_trainer.sft",
    "ulysses_cp.integrations.hf_trainer.dpo",
    "ulysses_cp.integrations.hf_trainer.grpo",
    "ulysses_cp.integrations.hf_trainer.rloo",
    "ulysses_cp.integrations.hf_trainer.fsdp",
]

for name in MODULES:
    # only a speed-up: a module that a later release moved is left to the ranks
    with contextlib.suppress(ModuleNotFoundError):
        importlib.import_module(name)

from transformers.conversion_mapping import get_checkpoint_conversion_mapping  # noqa: E402

get_checkpoint_conversion_mapping("llama")  # builds and caches the whole table
gc.collect()
gc.freeze()
