"""The Accelerator's setup (train.make_accelerator): precision for a plain run and against the launch's, and
trackers that cannot start (textclf.launch.check_trackers) stopping the run before anything is written."""

import sys
import types

import accelerate.tracking
import pytest

import train
from conftest import TINY, assert_refused, run_train
from textclf.cli import parse_config
from textclf.errors import InputError
from textclf.launch.checks import check_trackers, resolve_precision


@pytest.fixture
def fresh_accelerator_state():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def test_mixed_precision_of_a_plain_run_reaches_the_accelerator(monkeypatch, fresh_accelerator_state):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    accelerator = train.make_accelerator(parse_config(["--mixed_precision", "bf16", "--report_to", "none"]))
    assert accelerator.mixed_precision == "bf16"


@pytest.mark.parametrize("launched, asked, runs", [
    (None, None, "no"), (None, "bf16", "bf16"), ("bf16", None, "bf16"), ("bf16", "bf16", "bf16"), ("no", "no", "no"),
])
def test_precision_is_the_flag_s_or_the_launch_s(monkeypatch, launched, asked, runs):
    if launched:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launched)
    else:
        monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert resolve_precision(asked) == runs


def test_precision_contradicting_the_launch_is_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # what `accelerate launch` sets from its yaml
    with pytest.raises(InputError, match="--mixed_precision bf16 contradicts the launch, which runs no"):
        resolve_precision("bf16")


def test_float16_weights_under_the_fp16_loss_scaler_are_refused_before_torch_loads(monkeypatch):
    """torch's loss scaler refuses to unscale float16 gradients at the first step; DeepSpeed and FSDP train float32
    copies of the weights, and bf16 needs no scaler."""
    from textclf.launch.checks import check_launch_early

    float16 = parse_config(["--torch_dtype", "float16", "--report_to", "none"])
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(InputError, match=r"^float16 weights under fp16 mixed precision: its loss scaler cannot "
                                         r"unscale float16 gradients .*; keep the weights in float32"):
        check_launch_early(float16)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(InputError, match="^mixed_precision fp16 needs a CUDA GPU"):  # this machine's, not this rule
        check_launch_early(float16)
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    check_launch_early(float16)


def test_a_float16_checkpoint_loaded_by_torch_dtype_auto_is_refused_under_fp16_before_the_data(tmp_path, monkeypatch):
    from transformers import BertConfig, BertForSequenceClassification

    from textclf.models.job import build_job

    folder = tmp_path / "fp16_model"
    BertForSequenceClassification(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=16)).half().save_pretrained(folder)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    cfg = parse_config(["--model", str(folder), "--torch_dtype", "auto", "--data", str(tmp_path / "unread.csv")])
    with pytest.raises(InputError, match=r"^float16 weights \(the checkpoint's, by --torch_dtype auto\) under fp16"):
        build_job(cfg)


def fake_wandb(logged_in: bool):
    """Stands in for wandb: `wandb.login(verify=False, prompt=False)` answers whether credentials exist
    (as wandb 0.31 does: False with no WANDB_API_KEY, netrc or settings, without asking or connecting)."""
    module = types.ModuleType("wandb")
    module.login = lambda verify=True, prompt=True: logged_in
    return module


@pytest.mark.parametrize("report_to, modules, message", [
    ("tensorboard", {"torch.utils.tensorboard": None}, "--report_to tensorboard, but tensorboard cannot be imported"),
    ("wandb", {"wandb": None}, "--report_to wandb, but wandb cannot be imported"),
    ("wandb", {"wandb": fake_wandb(False)}, "--report_to wandb, but wandb has no login here"),
    ("all", {"wandb": fake_wandb(False)}, "--report_to all, but wandb has no login here"),
])
def test_a_tracker_that_cannot_start_is_refused(monkeypatch, report_to, modules, message):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: ["tensorboard", "wandb"])
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    with pytest.raises(InputError, match=message.replace("(", r"\(")):
        check_trackers([report_to])


def test_trackers_that_can_start_pass(monkeypatch):
    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: ["tensorboard", "wandb"])
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(True))
    check_trackers(["wandb"])
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(False))
    monkeypatch.setenv("WANDB_MODE", "offline")  # an offline run needs no login
    check_trackers(["wandb", "tensorboard"])
    check_trackers(["tensorboard"])
    check_trackers(["none"])


@pytest.mark.parametrize("tracker, shadow", [
    ("tensorboard", "raise ImportError('tensorboard is not installed here')"),
    ("wandb", "def login(verify=True, prompt=True):\n    return False\n"),
])
def test_train_py_stops_before_writing_anything_when_a_tracker_cannot_start(tmp_path, tracker, shadow):
    """In a subprocess whose tensorboard is unimportable, or whose wandb has no login."""
    (tmp_path / "shadow" / tracker).mkdir(parents=True)
    (tmp_path / "shadow" / tracker / "__init__.py").write_text(shadow)
    out = tmp_path / "out"
    result = run_train([*TINY, "--report_to", tracker, "--output_dir", out], check=False,
                       env={"PYTHONPATH": str(tmp_path / "shadow"), "WANDB_MODE": "", "WANDB_API_KEY": ""})
    assert_refused(result, f"--report_to {tracker}, but {tracker} ")
    assert not out.exists()
