"""LoRA's adapters (textclf/models/lora.py): only the adapters and the head train, under every strategy; the adapter and
its merge load everywhere."""

import json
import shutil

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from conftest import (
    PROBE_TEXTS,
    REPO,
    TINY,
    assert_peft_loaders_predict_like_the_trained_model,
    assert_pipeline_predicts_like_the_trained_model,
    losses,
    moved_away,
    run_module,
    to_train,
    train_forked,
)
from textclf.export import export_checkpoint
from textclf.models.build import parameter_groups
from textclf.models.lora import apply_lora
from textclf.models.tokenizer import get_tokenizer
from textclf.models.trained import checkpoint_weights

CONFIGS = {"ddp": "cpu.yaml", "zero2": "zero2.yaml", "zero3": "zero3.yaml"}


TEXTS = ["质量很好，非常满意", "太差了，不会再买", "一般般吧", "物流很快，包装也好，下次还来",
         "客服态度恶劣", "还行"]


@pytest.fixture(scope="module")
def lora_args(reviews_csv, cache_dir):
    return [*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--lora", "--max_steps", 2, "--save_steps", 1]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, lora_args):
    """`lora_run(strategy)`: the output_dir of a 2-process LoRA run, trained once per strategy and module."""
    runs = {}

    def get(strategy):
        if strategy not in runs:
            out = tmp_path_factory.mktemp(f"lora_{strategy}")
            train_forked([*lora_args, "--output_dir", out],
                         config_file=REPO / "accelerate_configs" / CONFIGS[strategy])
            runs[strategy] = out
        return runs[strategy]

    return get


def adapter_model(folder):
    """The exported folder as transformers loads it: the base model in it, and the adapter beside it on top."""
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    # The adapter's own weights are in the model (not merged away, not skipped): true on every peft version.
    assert any("lora_" in name for name, _ in model.named_parameters())
    return model


def logits(model, folder, texts=TEXTS):
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        return model(**tokenizer(texts, padding=True, return_tensors="pt")).logits


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_lora_of_a_decoder_gives_the_optimizer_no_empty_group(family, family_model):
    """LoRA of Llama trains no bias and no norm: no group without decay. DeepSpeed would drop an empty one
    and the scheduler's first step would fail (zip() of 2 learning rates with 1 group)."""
    folder = family_model(family)
    model = to_train(str(folder), get_tokenizer(str(folder), None, "unused", "unused", 32), ["a", "b"])
    model = apply_lora(model, 8, 16, 0.0)
    groups = parameter_groups(model, 0.1)
    assert all(group["params"] for group in groups)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(len(group["params"]) for group in groups) == len(trainable)
    # Llama's score head has no bias, GPT-2's neither: every trainable parameter decays.
    assert [group["weight_decay"] for group in groups] == [0.1]


def test_gradient_checkpointing_gives_lora_the_same_gradients(family_model):
    """Non-reentrant checkpointing: the adapters behind a frozen embedding still get gradients, the same ones."""
    llama_model = family_model("llama")
    from textclf.models.lora import apply_lora

    tokenizer = get_tokenizer(str(llama_model), None, "unused", "unused", 32)
    batch = tokenizer(PROBE_TEXTS, padding=True, return_tensors="pt")
    gradients = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = to_train(str(llama_model), tokenizer, ["a", "b"], gradient_checkpointing=checkpointing)
        model = apply_lora(model, 8, 16, 0.0).train()
        assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules()) == checkpointing
        with torch.no_grad():  # B starts at zero, which would give A no gradient
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_()
        model(**batch, labels=torch.tensor([0, 1] * 4)).loss.backward()
        gradients.append({name: p.grad for name, p in model.named_parameters() if p.requires_grad})
    assert gradients[0].keys() == gradients[1].keys()
    assert all(g is not None and g.abs().sum() > 0 for g in gradients[1].values())
    assert all(torch.allclose(gradients[0][name], gradients[1][name], atol=1e-6) for name in gradients[0])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", CONFIGS)
def test_only_adapters_and_head_change(strategy, lora_run):
    out = lora_run(strategy)
    assert json.loads((out / "run.json").read_text())["num_processes"] == 2
    before = checkpoint_weights(str(out / "step_1"), allow_pickle=False)
    after = checkpoint_weights(str(out / "step_2"), allow_pickle=False)
    assert before.keys() == after.keys()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    trainable = {name for name in before if ".lora_" in name or ".modules_to_save." in name}
    # query and value of both layers (A and B each), and the classifier head (weight and bias).
    assert len(trainable) == 2 * 2 * 2 + 2
    assert changed == trainable


@pytest.mark.slow
@pytest.mark.parametrize("strategy", CONFIGS)
def test_the_exported_adapter_reloads_with_peft(strategy, lora_run):
    folder = lora_run(strategy) / "model"
    model = adapter_model(folder)
    config = model.peft_config["default"]
    assert config.r == 8 and config.lora_alpha == 16 and set(config.target_modules) == {"query", "value"}
    assert "classifier" in config.modules_to_save
    assert model.config.id2label == {0: "negative", 1: "positive"}
    adapter = load_file(folder / "adapter_model.safetensors")
    assert adapter and all(tensor.numel() > 0 for tensor in adapter.values())  # not ZeRO-3's empty placeholders
    assert any(".lora_B." in name and tensor.abs().sum() > 0 for name, tensor in adapter.items())  # B starts at 0


@pytest.mark.slow
@pytest.mark.parametrize("strategy", CONFIGS)
def test_merged_export_of_a_checkpoint_is_a_plain_model_that_predicts_like_the_adapter(strategy, lora_run, tmp_path):
    out = lora_run(strategy)
    merged = tmp_path / "merged"
    run_module("textclf.export", [out / "step_2", merged, "--merge"])
    assert not (merged / "adapter_config.json").exists()
    plain = AutoModelForSequenceClassification.from_pretrained(merged).eval()
    assert not isinstance(plain, PeftModel)
    assert not [name for name in plain.state_dict() if "lora" in name or "modules_to_save" in name]
    expected = logits(adapter_model(out / "model"), out / "model")  # the run's own export, at the same step
    got = logits(plain, merged)
    assert got.argmax(dim=-1).tolist() == expected.argmax(dim=-1).tolist()
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_resume_continues_the_lora_run_exactly(strategy, lora_run, lora_args, tmp_path):
    out = lora_run(strategy)
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "step_1", resumed / "step_1")
    train_forked([*lora_args, "--output_dir", resumed, "--resume", resumed / "step_1"],
                 config_file=REPO / "accelerate_configs" / CONFIGS[strategy])
    assert losses(resumed)[2] == losses(out)[2]
    for name in ("adapter_model.safetensors", "model.safetensors"):
        uninterrupted, continued = load_file(out / "model" / name), load_file(resumed / "model" / name)
        assert uninterrupted.keys() == continued.keys()
        assert all(torch.equal(uninterrupted[key], continued[key]) for key in uninterrupted), name


@pytest.mark.slow
def test_the_adapter_folder_and_its_merge_load_in_a_pipeline_from_anywhere(lora_run, tmp_path):
    """An encoder's LoRA folder (a scratch base: nowhere else to load it from) in `pipeline`, from another
    directory after the folder has moved, and its merge: both predict what the trained model predicts."""
    with moved_away(lora_run("zero3") / "model", tmp_path / "moved") as moved:
        assert_pipeline_predicts_like_the_trained_model(moved)
        run_module("textclf.export", [moved, tmp_path / "merged", "--merge"])
    assert_pipeline_predicts_like_the_trained_model(tmp_path / "merged")


@pytest.mark.slow
def test_the_adapter_folders_load_in_peft_from_anywhere(lora_run, tmp_path):
    """The run's export and the export of a checkpoint, copied elsewhere: peft's own loaders give the trained
    model's predictions (the base adapter_config.json names is the folder, not the scratch base or step_N)."""
    out = lora_run("ddp")
    assert_peft_loaders_predict_like_the_trained_model(out / "model", tmp_path / "run")
    export_checkpoint(str(out / "step_2"), str(tmp_path / "exported"))
    assert_peft_loaders_predict_like_the_trained_model(tmp_path / "exported", tmp_path / "checkpoint")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_lora_of_a_decoder_trains_under_zero_and_its_exports_load_everywhere(strategy, family_model, reviews_csv,
                                                                             cache_dir, tmp_path):
    """LoRA of a Qwen2 trains no bias or norm (one parameter group, not an empty second one that DeepSpeed
    would drop under the scheduler's feet); both of its exports load in pipeline and in peft's loaders."""
    out = tmp_path / "out"
    train_forked([*TINY, "--model", family_model("qwen2"), "--data", reviews_csv, "--cache_dir", cache_dir, "--lora",
                  "--max_steps", 2, "--save_steps", 2, "--output_dir", out],
                 config_file=REPO / "accelerate_configs" / CONFIGS[strategy])
    assert sorted(losses(out)) == [1, 2]
    exported = tmp_path / "exported"
    export_checkpoint(str(out / "step_2"), str(exported))
    for folder in (out / "model", exported):
        assert_pipeline_predicts_like_the_trained_model(folder)
        assert_peft_loaders_predict_like_the_trained_model(folder, tmp_path / f"{folder.name}_elsewhere")
