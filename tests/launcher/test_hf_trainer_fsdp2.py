"""The Trainer subclasses under FSDP2 (``TrainingArguments(fsdp="full_shard",
fsdp_config={"version": 2})``, the sequence_parallel block given as
``sequence_parallel_config=``) against one-process runs of their parents: 2 CPU ranks
(gloo) at Ulysses 2, so both ranks are in FSDP2's shard group and its mean divides by 2.
Trainer (tiny Llama, the saved folder too), SFTTrainer (packed, tiny Qwen3) and DPOTrainer:
3 steps with gradient accumulation 2, SGD at a large rate so that a wrong gradient scale
shows, training and eval losses within 1e-5 relative. Seen failing: the same Trainer run
with its gradient scale doubled."""

from __future__ import annotations

import pytest

from tests.launcher import test_dpo
from tests.launcher.test_hf_trainer import (
    U2,
    assert_plain_folders,
    assert_same_losses,
    ref_and_sp,
    side_by_side,
    trainer_assets,
)

pytestmark = pytest.mark.launcher
pytest.importorskip("trl")
pytest.importorskip("peft")

FSDP = dict(fsdp=True, sp=U2)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
    return trainer_assets(tmp_path_factory.mktemp("fsdp2_assets"))


def test_trainer_fsdp2_u2_equals_one_process(assets, tmp_path):
    """Trainer, tiny Llama: losses, eval loss and the saved folder (gathered from the
    shards) equal the one-process Trainer's; the SFT and DPO subclasses' losses too."""
    ref, sp = ref_and_sp("trainer", "llama", assets, tmp_path / "trainer", FSDP, save=True)
    ref_result, sp_result = side_by_side(tmp_path / "trainer", ref, sp, nproc=2)
    assert_same_losses(ref_result, sp_result)
    assert sp_result["fsdp2_ranks"] == 2 and ref_result["fsdp2_ranks"] == 0
    assert_plain_folders(tmp_path / "trainer" / "ref_model", tmp_path / "trainer" / "sp_model")

    only = dict(FSDP, model_block={"lean_norms": False})
    ref, sp = ref_and_sp("sft", "qwen3", assets, tmp_path / "sft", only)
    assert_same_losses(*side_by_side(tmp_path / "sft", ref, sp, nproc=2))

    ref = test_dpo.spec(assets, tmp_path / "dpo" / "ref")
    sp = test_dpo.spec(assets, tmp_path / "dpo" / "sp", **FSDP)
    test_dpo.assert_same_logs(*test_dpo.side_by_side(tmp_path / "dpo", ref, sp, nproc=2))


def test_trainer_fsdp2_seen_failing_with_a_doubled_gradient_scale(assets, tmp_path):
    """The Trainer comparison above fails when the FSDP2 run's gradient scale is doubled
    (the one rule's factor applied twice)."""
    ref, sp = ref_and_sp("trainer", "llama", assets, tmp_path, dict(FSDP, scale=2.0))
    ref_result, sp_result = side_by_side(tmp_path, ref, sp, nproc=2)
    with pytest.raises(AssertionError):
        assert_same_losses(ref_result, sp_result)
