"""What a run turns on for speed (textclf/models/speed.py): TF32, Liger's kernels, torch.compile and its length
buckets."""

import json
import subprocess
import sys
import types

import pytest
import torch
from accelerate.utils import DistributedType, TorchDynamoPlugin
from safetensors.torch import load_file

from conftest import (
    REPO,
    TINY,
    assert_no_sync_between_log_lines,
    losses,
    read_csv,
    run_sync_probe,
    train_forked,
    write_csv,
)
from textclf.cli import parse_config
from textclf.config import TrainConfig
from textclf.errors import InputError
from textclf.models.speed import resolve_speed


def speed(cuda=True, distributed_type=DistributedType.NO, backend="no", model_type="bert", **flags) -> dict:
    return resolve_speed(TrainConfig(**flags), cuda, distributed_type, TorchDynamoPlugin(backend=backend), model_type)


@pytest.fixture(scope="module")
def long_reviews(reviews_csv, tmp_path_factory):
    """The 240 reviews, each joined with the next ones until 200 characters long: every text fills max_length."""
    rows = read_csv(reviews_csv)
    texts = [" ".join(row["review"] for row in (rows[i:] + rows)[:8])[:200] for i in range(len(rows))]
    return write_csv(tmp_path_factory.mktemp("long") / "long.csv",
                     [{"label": row["label"], "review": text} for row, text in zip(rows, texts)])


def test_the_speed_flags_are_the_trainers_and_take_true_false_or_auto():
    assert parse_config(["--torch_compile"]).torch_compile is True
    assert parse_config(["--torch_compile", "false", "--use_liger_kernel", "no", "--tf32", "auto"]).tf32 is None
    cfg = parse_config([])
    assert (cfg.torch_compile, cfg.use_liger_kernel, cfg.tf32) == (None, None, None)  # auto
    with pytest.raises(InputError, match="argument --torch_compile: expected true, false or auto, got 'sometimes'"):
        parse_config(["--torch_compile", "sometimes"])


def test_auto_compiles_and_uses_tf32_on_a_gpu_and_leaves_a_cpu_eager():
    assert speed(cuda=False) == {"tf32": False, "use_liger_kernel": False, "torch_compile": None}
    on_gpu = speed(cuda=True)
    assert on_gpu["tf32"] and on_gpu["torch_compile"] == {"backend": "inductor", "dynamic": False,
                                                          "options": {"deterministic": True}}
    assert speed(cuda=True, distributed_type=DistributedType.MULTI_GPU)["torch_compile"]
    for sharded in (DistributedType.DEEPSPEED, DistributedType.FSDP):  # asked for, not by default
        assert speed(cuda=True, distributed_type=sharded)["torch_compile"] is None
        assert speed(cuda=True, distributed_type=sharded, torch_compile=True)["torch_compile"]
    assert speed(cuda=False, torch_compile=True)["torch_compile"]  # a CPU compiles when asked
    assert speed(cuda=True, torch_compile=False, tf32=False) == {"tf32": False, "use_liger_kernel": False,
                                                                 "torch_compile": None}
    assert not speed(cuda=False, tf32=True)["tf32"]  # TF32 is a GPU's: a CPU is unaffected


def test_a_launchs_dynamo_settings_are_taken_and_a_flag_against_them_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "max-autotune")
    compiled = speed(cuda=False, backend="inductor")["torch_compile"]
    # max-autotune as its options, beside inductor's deterministic mode: torch.compile takes one or the other.
    assert compiled["backend"] == "inductor" and "mode" not in compiled
    assert compiled["options"]["max_autotune"] and compiled["options"]["deterministic"]
    torch.compile(torch.nn.Linear(2, 2), **compiled)  # accepted as given (compiling happens at the first call)
    with pytest.raises(InputError, match="--torch_compile false, but the launch asks for dynamo_backend inductor"):
        speed(cuda=False, backend="inductor", torch_compile=False)


def test_liger_kernels_apply_on_cuda_to_the_families_liger_covers(monkeypatch):
    for module in ("liger_kernel", "liger_kernel.transformers", "liger_kernel.transformers.monkey_patch"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(InputError, match="--use_liger_kernel needs a CUDA GPU"):
        speed(cuda=False, use_liger_kernel=True, model_type="qwen2")
    installed = "liger_kernel" in {m.name for m in __import__("pkgutil").iter_modules()}
    if not installed:  # this machine's case: auto stays off, asking for it says what to install
        assert not speed(cuda=True, model_type="qwen2")["use_liger_kernel"]
        with pytest.raises(InputError, match=r"needs liger-kernel: pip install -e '.\[liger\]'"):
            speed(cuda=True, use_liger_kernel=True, model_type="qwen2")
    # liger-kernel's own table of the model types it patches decides, whatever is installed.
    fake = types.ModuleType("liger_kernel.transformers.monkey_patch")
    fake.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": None, "qwen2": None}
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", types.ModuleType("liger_kernel.transformers"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", fake)
    assert speed(cuda=True, model_type="qwen2")["use_liger_kernel"]
    assert not speed(cuda=True, model_type="bert")["use_liger_kernel"]
    assert not speed(cuda=False, model_type="qwen2")["use_liger_kernel"]
    with pytest.raises(InputError, match="liger-kernel has no kernels for model type bert"):
        speed(cuda=True, use_liger_kernel=True, model_type="bert")


def test_liger_patches_the_trained_model_alone_and_keeps_its_classifier_forward(monkeypatch):
    """What liger-kernel's apply function for a family does (apply_liger_kernel_to_llama, cut down): swap classes
    and RoPE in transformers' modeling module, patch the instance's norms, and with its fused linear cross-entropy
    on (its default) give the model a causal LM's forward. apply_liger, through the Trainer's call, keeps the
    instance's patches and the classifier's forward, and puts the module back."""
    from transformers import LlamaConfig, LlamaForSequenceClassification
    from transformers.models.llama import modeling_llama

    from textclf.models.speed import apply_liger

    asked = []

    def apply_to_instance(model, rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True):
        asked.append({"cross_entropy": cross_entropy, "fused_linear_cross_entropy": fused_linear_cross_entropy})
        modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm = "Liger's RoPE", "LigerRMSNorm"
        modeling_llama.liger_added = True
        if fused_linear_cross_entropy:
            model.forward = "a causal LM's forward, which reads model.lm_head"
        model.model.norm.forward = "LigerRMSNorm.forward"
        # Another family's module, imported to be patched (paligemma's apply patches gemma's).
        sys.modules["transformers.models.other.modeling_other"] = types.ModuleType("modeling_other")

    liger = types.ModuleType("liger_kernel.transformers")
    liger._apply_liger_kernel_to_instance = apply_to_instance
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", liger)
    monkeypatch.setattr("transformers.integrations.liger.is_liger_kernel_available", lambda: True)
    model = LlamaForSequenceClassification(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                       num_hidden_layers=1, num_attention_heads=2,
                                                       num_key_value_heads=2, pad_token_id=0))
    module_before = dict(vars(modeling_llama))
    apply_liger(model)
    assert asked == [{"cross_entropy": False, "fused_linear_cross_entropy": False}]
    assert "forward" not in vars(model) and model.model.norm.forward == "LigerRMSNorm.forward"
    assert vars(modeling_llama) == module_before  # the export's copy and later models are built as before
    assert "transformers.models.other.modeling_other" not in sys.modules  # imported anew, unpatched, when needed


@pytest.mark.parametrize("flag, precision", [("auto", "tf32"), ("false", "ieee")])
def test_tf32_is_set_on_a_gpu_for_the_run_on_or_off_whatever_a_dynamo_launch_set(flag, precision):
    """--tf32 false wins over the TF32 accelerate turns on for a launch with a dynamo backend and no mixed precision
    (torch's legacy allow_tf32); either way the process's setting is back when the run's scope ends."""
    from transformers import BertConfig, BertForSequenceClassification

    from textclf.launch.process import run_scope
    from textclf.models.speed import speed_up

    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    before = (matmul.fp32_precision, conv.fp32_precision)
    matmul.allow_tf32 = True  # as accelerate's state sets it for such a launch
    gpu = types.SimpleNamespace(device=torch.device("cuda"), distributed_type=DistributedType.NO, mixed_precision="no",
                                state=types.SimpleNamespace(dynamo_plugin=TorchDynamoPlugin(backend="no")))
    model = BertForSequenceClassification(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=16))
    try:
        with run_scope():
            settings = speed_up(model, parse_config(["--tf32", flag, "--torch_compile", "false"]), gpu)
            assert settings["tf32"] is (flag == "auto")
            assert (matmul.fp32_precision, conv.fp32_precision) == (precision, precision)
        assert (matmul.fp32_precision, conv.fp32_precision) == ("tf32", before[1])  # the launch's, put back
    finally:
        matmul.fp32_precision = before[0]


def test_a_compiled_run_pads_lengths_into_at_most_eight_buckets():
    from accelerate import Accelerator

    from textclf.models.speed import padding_multiple

    accelerator = Accelerator(cpu=True)
    assert padding_multiple(TrainConfig(), accelerator) is None  # eager fp32: no padding beyond the longest
    for max_length, multiple in ((32, 8), (128, 16), (256, 32), (512, 64), (100, 16)):
        assert padding_multiple(TrainConfig(torch_compile=True, max_length=max_length), accelerator) == multiple
        assert -(-max_length // multiple) <= 8


@pytest.mark.slow
def test_full_batches_wait_for_the_device_at_log_lines_only(tmp_path, long_reviews, cache_dir):
    """Without an attention mask transformers has nothing to check on the device: no step between two log lines
    waits for it, transformers' mask check included (conftest.LIBRARY_SYNCS)."""
    args = [*TINY, "--data", long_reviews, "--cache_dir", cache_dir, "--output_dir", tmp_path / "out",
            "--max_steps", 12, "--logging_steps", 4]
    _, [report] = run_sync_probe(args, tmp_path / "syncs.json")
    assert assert_no_sync_between_log_lines(report, ()) == []


@pytest.mark.slow
def test_a_compiled_run_on_a_cpu_resumes_bitwise_and_exports_the_eager_keys(tmp_path, reviews_csv, cache_dir):
    run = [*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--max_steps", 4, "--save_steps", 2,
           "--torch_compile", "true"]
    # One process each, forked after the imports (conftest.train_forked): what is tested is the compiled run, not
    # the interpreter's start.
    full = train_forked([*run, "--output_dir", tmp_path / "full"], config_file=None)
    assert full.stdout.count("torch.compile: the model's blocks compiled in") == 1, full.stdout[-2000:]
    ran = json.loads((tmp_path / "full" / "run.json").read_text(encoding="utf-8"))["speed"]
    assert ran["torch_compile"] == {"backend": "inductor", "dynamic": False, "options": {"deterministic": True}}
    assert ran["padding_multiple"] == 8
    train_forked(["--resume", tmp_path / "full" / "step_2", "--output_dir", tmp_path / "resumed"], config_file=None)
    expected, got = losses(tmp_path / "full"), losses(tmp_path / "resumed")
    assert [got[step] for step in (3, 4)] == [expected[step] for step in (3, 4)]
    reference, final = (load_file(tmp_path / name / "model" / "model.safetensors") for name in ("full", "resumed"))
    assert reference.keys() == final.keys() and all(reference[key].equal(final[key]) for key in reference)
    # The checkpoint and the export name the weights as an eager run does: no _orig_mod anywhere.
    eager = train_forked([*run[:-2], "--max_steps", 1, "--output_dir", tmp_path / "eager"], config_file=None)
    assert "torch.compile" not in eager.stdout
    assert load_file(tmp_path / "eager" / "model" / "model.safetensors").keys() == reference.keys()
    assert load_file(tmp_path / "full" / "step_2" / "model.safetensors").keys() == reference.keys()
    # And the export loads and predicts (the command reads the folder without compiling).
    predicted = subprocess.run([sys.executable, "-m", "textclf.predict", "--model", tmp_path / "full" / "model",
                                "--file", reviews_csv, "--output", tmp_path / "predictions.csv"], cwd=REPO,
                               capture_output=True, text=True)
    assert predicted.returncode == 0, predicted.stderr[-2000:]
