"""What a checkpoint's pickles may run (textclf/checkpointing/pickles.py): DeepSpeed's files read weights-only with its
own classes, FSDP's metadata only with consent from elsewhere, nothing that would run code."""

import os
import pickle

import pytest
import torch

from conftest import RunsCode
from textclf.checkpointing.pickles import FORCE_WEIGHTS_ONLY, weights_only_loads
from textclf.errors import InputError


def test_an_fsdp_sharded_checkpoint_from_elsewhere_needs_allow_pickle(tmp_path, capsys):
    """FSDP needs GPUs to train, so the checkpoint is laid out by hand: torch.distributed.checkpoint reads the
    metadata of FSDP's sharded state with full pickle, which no weights-only read replaces. The run's own checkpoint
    (its signature verified: nothing unproven) loads; one from elsewhere needs the user's say-so, said either way."""
    from textclf.checkpointing.folders import FSDP_SHARDED
    from textclf.checkpointing.pickles import refuse_pickle_unless_allowed
    from textclf.errors import InputError

    (tmp_path / FSDP_SHARDED).mkdir()
    refuse_pickle_unless_allowed(str(tmp_path), None, allow_pickle=False)
    assert capsys.readouterr().err == ""
    elsewhere = "it was signed with another secret than this user's"
    with pytest.raises(InputError, match=f"written elsewhere \\({elsewhere}\\), and FSDP's files load only with full "
                                         "pickle, .* pass --allow_pickle if you trust this checkpoint"):
        refuse_pickle_unless_allowed(str(tmp_path), elsewhere, allow_pickle=False)
    refuse_pickle_unless_allowed(str(tmp_path), elsewhere, allow_pickle=True)
    assert f"warning: nothing proves that this user's runs wrote {tmp_path}: {elsewhere}" in capsys.readouterr().err


@pytest.mark.parametrize("pickled_by", ["torch.save", "pickle.dump"])
def test_a_pickle_that_would_run_code_is_one_line_and_never_runs(tmp_path, pickled_by):
    """DeepSpeed's own torch.load(..., weights_only=False) is read weights-only under weights_only_loads, which puts
    torch's switch back as it was."""
    marker, path = tmp_path / "code-ran", tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    if pickled_by == "torch.save":
        torch.save({"optimizer_state_dict": RunsCode(str(marker))}, path)
    else:
        path.write_bytes(pickle.dumps({"optimizer_state_dict": RunsCode(str(marker))}))
    assert FORCE_WEIGHTS_ONLY not in os.environ
    with pytest.raises(InputError) as refused:
        with weights_only_loads("step_6", deepspeed=True):
            torch.load(path, weights_only=False)
    assert str(refused.value).startswith("cannot load checkpoint step_6: a file of it holds more than tensors and "
                                         "the classes its writer pickles (Unsupported ")
    assert "pass --allow_pickle if you trust whoever wrote it" in str(refused.value)
    assert not marker.exists() and FORCE_WEIGHTS_ONLY not in os.environ


def test_deepspeed_s_own_classes_read_weights_only():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    state = {"loss_scaler": LossScaler(1.0), "dynamic": DynamicLossScaler(2 ** 16, 1000, 1, False, False),
             "zero_stage": ZeroStageEnum.gradients, "param_slice_mappings": [{"w": fragment_address(4, 0)}],
             "tensor": torch.ones(2)}
    path = "/dev/shm/textclf-deepspeed-classes.pt" if os.path.isdir("/dev/shm") else "deepspeed-classes.pt"
    torch.save(state, path)
    try:
        with weights_only_loads("step_6", deepspeed=True):
            loaded = torch.load(path, weights_only=False)
    finally:
        os.remove(path)
    assert loaded["zero_stage"] is ZeroStageEnum.gradients and loaded["dynamic"].cur_scale == 2 ** 16
    assert loaded["param_slice_mappings"][0]["w"] == fragment_address(4, 0)
