"""SequenceParallelGRPOTrainer's checks, without a run: the generation batch counts the
replicas; batches that split prompt groups and generation backends not run are refused.

The unit-tier tests; the launcher-tier ones and the shared helpers are in
tests/launcher/test_grpo.py.
"""

from __future__ import annotations

import pytest

from tests.launcher.test_grpo import grpo_args
from tests.launcher.test_hf_trainer import U2


def test_generation_batch_counts_the_replicas():
    """4 processes, Ulysses 2: 2 replicas, so 2 x 2 x 2 = 8 completions a generation (not
    GRPOConfig's 16, which counted every process)."""
    from ulysses_cp.integrations.hf_trainer.rollouts import _replica_batches

    args = grpo_args()
    _replica_batches(args, U2)
    assert args.generation_batch_size == 8
    args = grpo_args(world_size=2, per_device_eval_batch_size=4)
    _replica_batches(args, U2)  # one replica: 2 x 1 x 2 = 4
    assert args.generation_batch_size == 4


def test_batches_that_split_prompt_groups_are_refused():
    from ulysses_cp.integrations.hf_trainer.rollouts import _replica_batches

    with pytest.raises(ValueError, match=r"= 6 completions.*num_generations=4"):
        _replica_batches(grpo_args(world_size=2, steps_per_generation=3), U2)
    with pytest.raises(ValueError, match=r"\(2\) x dp replicas \(1\) = 2 completions"):
        _replica_batches(grpo_args(world_size=2, steps_per_generation=4), U2)


@pytest.mark.parametrize("option", ["use_vllm", "use_transformers_continuous_batching"])
def test_generation_backends_not_run_are_refused(option):
    from ulysses_cp.integrations.hf_trainer.rollouts import _check_options

    with pytest.raises(ValueError, match=f"{option}=True"):
        _check_options(grpo_args(**{option: True}))
