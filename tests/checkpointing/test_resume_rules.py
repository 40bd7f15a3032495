"""What a resume keeps and what it refuses (textclf/checkpointing/resume_rules.py): RESUME_TABLE against what every
checkpoint records, and the launch a refused resume names."""

import pytest

from conftest import REPO
from textclf.errors import InputError

RUN = {"world_size": 1, "zero_stage": None, "mixed_precision": "no"}  # the launch, as check_against takes it


def test_a_checkpoint_records_every_key_the_resume_table_rules_on():
    """train.py's `made_of` (what every checkpoint records of the run) and RESUME_TABLE (what a resume does with
    each key) name the same keys: a key recorded but not ruled on would never be checked, one ruled on but not
    recorded never matches."""
    import ast

    from textclf.checkpointing.resume_rules import RESUME_TABLE

    made_of = next(node.value for node in ast.walk(ast.parse((REPO / "train.py").read_text()))
                   if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "made_of")
    assert {key.value for key in made_of.keys} == set(RESUME_TABLE) - {"config"}


@pytest.mark.parametrize("position, launch", [
    ({"world_size": 2, "zero_stage": None, "mixed_precision": "bf16"},
     "precision (mixed_precision) bf16 (this launch: no); resume it with accelerate launch --config_file "
     "accelerate_configs/cpu.yaml (ddp.yaml on GPUs) --num_processes 2 --mixed_precision bf16 train.py --resume ck"),
    ({"world_size": 2, "zero_stage": 3, "mixed_precision": "bf16"},
     "DeepSpeed ZeRO stage 3 (this launch: None), precision (mixed_precision) bf16 (this launch: no); resume it "
     "with accelerate launch --config_file accelerate_configs/zero3.yaml (or its _offload variant) "
     "--num_processes 2 --mixed_precision bf16 train.py"),
    ({"world_size": 2, "zero_stage": None, "mixed_precision": "no"},  # FSDP's shards: not resharded
     "FSDP on 2 processes (this launch: 1), whose sharded states this textclf does not reshard; resume it with "
     "accelerate launch --config_file accelerate_configs/cpu.yaml (ddp.yaml on GPUs) --num_processes 2"),
])
def test_a_resume_on_another_launch_is_refused_with_the_launch_to_use(position, launch):
    from textclf.checkpointing.resume_rules import check_against

    run = {**RUN, "distributed_type": "FSDP"} if launch.startswith("FSDP") else RUN
    with pytest.raises(InputError) as refused:
        check_against("ck", position, run)
    assert str(refused.value).startswith(f"cannot resume from ck: it was made by a launch with {launch}")
    assert check_against("ck", {"world_size": 1, "zero_stage": None, "mixed_precision": "no"}, RUN) is None
