"""Your own model: pretrained BERT, Llama, Qwen2 and GPT-2 folders (tiny, built from config; the decoders'
tokenizers without a pad token) train under `python train.py`, cpu.yaml and zero3.yaml; LoRA with gradient
checkpointing under zero3_offload.yaml; exact resume of a decoder under ZeRO-3; the exports load in
`pipeline` from anywhere and predict what the trained model predicts; bad models are refused.

One launch per family and strategy serves every assertion about it (`family_run`).
"""

import json
import random
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file
from test_resume import assert_same_run

from conftest import (
    PROBE_TEXTS,
    REPO,
    assert_pipeline_predicts_like_the_trained_model,
    assert_refused,
    losses,
    moved_away,
    read_csv,
    read_log,
    run_module,
    run_train,
    train_forked,
)
from families import FAMILIES
from textclf import check
from textclf.cli import parse_config
from textclf.errors import InputError
from textclf.models.build import make_model, model_config, parameter_groups, training_config
from textclf.models.folder import predict_logits
from textclf.models.lora import apply_lora
from textclf.models.tokenizer import get_tokenizer
from textclf.models.trained import load_trained
from textclf.tasks.task import Task

ZOO = REPO / "accelerate_configs"
STRATEGIES = {"single": None, "ddp": "cpu.yaml", "zero3": "zero3.yaml"}
DECODERS = [family for family in FAMILIES if family != "bert"]
STEPS = 4
# What each family's runs add: GPT-2 checkpoints its activations (under every strategy, so that its
# runs stay comparable), Qwen2 follows a cosine schedule.
EXTRA = {"gpt2": ["--gradient_checkpointing"], "qwen2": ["--lr_scheduler_type", "cosine"]}


def family_args(folder, reviews_csv, cache_dir, *extra):
    return ["--model", folder, "--max_length", 32, "--per_device_train_batch_size", 8, "--per_device_eval_batch_size",
            16, "--logging_steps", 1, "--report_to", "none", "--data", reviews_csv, "--cache_dir", cache_dir,
            "--max_steps", STEPS, "--save_steps", 2, *extra]



def to_train(model: str, tokenizer, label_names: list[str], **options):
    """The model train.py builds to fine-tune `model` (job.py's two calls), at max_length 32."""
    head = Task.of("single_label", "text", "label").head_config(label_names)
    return make_model(training_config(model, tokenizer, head, 32), model, **options)

@pytest.fixture(scope="module")
def family_run(tmp_path_factory, family_model, reviews_csv, cache_dir):
    """`family_run(family, strategy)`: the output_dir of a 4-step run (checkpoints at steps 2 and 4), made once."""
    runs = {}

    def get(family, strategy):
        if (family, strategy) not in runs:
            out = tmp_path_factory.mktemp(f"{family}_{strategy}")
            config = STRATEGIES[strategy] and ZOO / STRATEGIES[strategy]
            train_forked([*family_args(family_model(family), reviews_csv, cache_dir, *EXTRA.get(family, [])),
                          "--output_dir", out], config_file=config)
            runs[family, strategy] = out
        return runs[family, strategy]

    return get


def exported_weights(output_dir) -> dict:
    return load_file(output_dir / "model" / "model.safetensors")


# --- The tokenizer and the head: pad token, padding side, weight decay (no launch) --------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_each_text_gets_the_logits_it_gets_alone_in_a_padded_batch(family, family_model):
    """The decoders' tokenizers ship no pad token: it becomes their eos token, on the tokenizer and in the
    model's config, and padding goes right, so the head reads each text's own last token at the position
    it has alone (the left padding that Llama's tokenizer class defaults to shifts GPT-2's positions)."""
    from transformers import AutoTokenizer

    folder = family_model(family)
    assert (AutoTokenizer.from_pretrained(folder).pad_token is None) == (family != "bert")  # as shipped
    tokenizer = get_tokenizer(str(folder), None, "unused", "unused", 32)
    torch.manual_seed(0)
    model = to_train(str(folder), tokenizer, ["a", "b", "c"]).eval()
    if family != "bert":
        assert tokenizer.pad_token == tokenizer.eos_token
    assert tokenizer.padding_side == "right"
    assert model.config.pad_token_id == tokenizer.pad_token_id is not None
    rng = random.Random(0)
    texts = ["好" * rng.randint(1, 25) + "吃" * rng.randint(0, 5) + " ok" * rng.randint(0, 2) for _ in range(21)]
    batched = predict_logits(model, tokenizer, texts, batch_size=8)
    one_by_one = torch.cat([predict_logits(model, tokenizer, [text], batch_size=1) for text in texts])
    assert torch.allclose(batched, one_by_one, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_weight_decay_skips_biases_and_every_normalisation_layer(family, family_model):
    from transformers.pytorch_utils import ALL_LAYERNORM_LAYERS

    folder = family_model(family)
    model = to_train(str(folder), get_tokenizer(str(folder), None, "unused", "unused", 32), ["a", "b"])
    decayed, not_decayed = (group["params"] for group in parameter_groups(model, 0.1))
    norms = {id(p) for m in model.modules() if "Norm" in type(m).__name__ or isinstance(m, tuple(ALL_LAYERNORM_LAYERS))
             for p in m.parameters(recurse=False)}
    biases = {id(p) for name, p in model.named_parameters() if name.endswith(".bias")}
    assert norms, "every family normalises"
    assert {id(p) for p in not_decayed} == norms | biases
    assert len(decayed) + len(not_decayed) == len(list(model.parameters()))
    if family in ("llama", "qwen2"):  # RMSNorm, which a rule by type (nn.LayerNorm) alone would miss
        rms = [name for name, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]
        assert len(rms) == 2 * 2 + 1  # two per layer and the final one


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


def test_the_learning_rate_follows_the_model_kind_unless_given():
    assert parse_config([]).learning_rate == 1e-3
    assert parse_config(["--lora"]).learning_rate == 1e-3  # LoRA of a scratch model: still a scratch model
    assert parse_config(["--model", "bert-base-chinese"]).learning_rate == 2e-5
    assert parse_config(["--model", "Qwen/Qwen2.5-0.5B", "--lora"]).learning_rate == 2e-4
    assert parse_config(["--model", "bert-base-chinese", "--learning_rate", "3e-5"]).learning_rate == 3e-5


def test_weights_load_in_the_dtype_asked_for(family_model):
    llama_model = family_model("llama")
    tokenizer = get_tokenizer(str(llama_model), None, "unused", "unused", 32)
    for dtype, expected in (("bfloat16", torch.bfloat16), ("float32", torch.float32), ("auto", torch.float32)):
        model = to_train(str(llama_model), tokenizer, ["a", "b"], torch_dtype=dtype)
        assert {p.dtype for p in model.parameters()} == {expected}, dtype


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


# --- Every family under every strategy -------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_pretrained_family_trains_alone_and_its_export_predicts_the_same_in_a_pipeline(family, family_run, tmp_path):
    out = family_run(family, "single")
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["learning_rate"] == 2e-5  # a pretrained model's default, resolved and recorded
    assert all(loss == loss for loss in losses(out).values()) and len(losses(out)) == STEPS
    exported = json.loads((out / "model" / "config.json").read_text())
    tokenizer = json.loads((out / "model" / "tokenizer_config.json").read_text())
    assert tokenizer.get("padding_side", "right") == "right"
    if family != "bert":
        assert tokenizer["pad_token"] == tokenizer["eos_token"]
        assert exported["pad_token_id"] == exported["eos_token_id"]
    with moved_away(out / "model", tmp_path / "moved"):  # from another directory, after the folder has moved
        assert_pipeline_predicts_like_the_trained_model(tmp_path / "moved")


@pytest.mark.slow
def test_the_schedule_named_is_the_schedule_followed(family_run):
    from transformers import get_scheduler

    logged = [row["lr"] for row in read_log(family_run("qwen2", "single")) if "lr" in row]
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=2e-5)
    scheduler = get_scheduler("cosine", optimizer, round(0.1 * STEPS), STEPS)
    expected = []
    for _ in range(STEPS):
        optimizer.step()
        scheduler.step()
        expected.append(scheduler.get_last_lr()[0])
    assert logged == pytest.approx(expected, rel=1e-9) and expected[-1] == 0 and expected[1] != expected[0] / 2


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_pretrained_family_trains_the_same_under_ddp_and_zero3(family, family_run):
    ddp, zero3 = family_run(family, "ddp"), family_run(family, "zero3")
    for out, stage in ((ddp, None), (zero3, 3)):
        run = json.loads((out / "run.json").read_text())
        assert (run["num_processes"], run["zero_stage"]) == (2, stage)
    reference, sharded = exported_weights(ddp), exported_weights(zero3)
    assert reference.keys() == sharded.keys()
    assert all(tensor.numel() > 0 for tensor in sharded.values())
    assert max((reference[name] - sharded[name]).abs().max().item() for name in reference) < 1e-4


@pytest.mark.slow
def test_a_decoder_resumes_exactly_under_zero3(family_run, family_model, reviews_csv, cache_dir, tmp_path):
    full = family_run("llama", "zero3")
    resumed = tmp_path / "resumed"
    train_forked([*family_args(family_model("llama"), reviews_csv, cache_dir), "--output_dir", resumed,
                  "--resume", full / "step_2"], config_file=ZOO / "zero3.yaml")
    assert_same_run(full, resumed, 2)


@pytest.mark.slow
def test_predict_and_report_read_a_decoder_export(family_run, reviews_csv, tmp_path):
    model = family_run("llama", "single") / "model"
    run_module("textclf.predict", ["--model", model, "--file", reviews_csv, "--output", tmp_path / "out.csv"])
    rows = read_csv(tmp_path / "out.csv")
    trained, tokenizer = load_trained(str(model))
    labels = predict_logits(trained, tokenizer, [row["text"] for row in rows]).argmax(dim=-1).tolist()
    assert len(rows) == 240 and [int(row["label"]) for row in rows] == labels
    run_module("textclf.report", ["--model", model, "--file", reviews_csv, "--output_dir", tmp_path / "report"])
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["samples"] == 240 and report["labels"] == ["negative", "positive"]
    truth = [["negative", "positive"].index(row["label"]) for row in read_csv(reviews_csv)]
    assert report["accuracy"] == pytest.approx(sum(map(int.__eq__, labels, truth)) / 240)


# --- LoRA of a decoder, with gradient checkpointing, under ZeRO-3 offload ---------------------------------

@pytest.fixture(scope="module")
def lora_offload_run(tmp_path_factory, family_model, reviews_csv, cache_dir):
    qwen2_model = family_model("qwen2")
    out = tmp_path_factory.mktemp("qwen2_lora_offload")
    train_forked([*family_args(qwen2_model, reviews_csv, cache_dir, "--lora", "--gradient_checkpointing"),
                  "--output_dir", out], config_file=ZOO / "zero3_offload.yaml")
    return out


@pytest.mark.slow
def test_lora_with_checkpointing_under_zero3_offload_trains_the_adapters_and_the_head(lora_offload_run, family_model):
    qwen2_model = family_model("qwen2")
    run = json.loads((lora_offload_run / "run.json").read_text())
    assert run["config"]["learning_rate"] == 2e-4 and run["zero_offload"] == {"optimizer": "cpu", "param": "cpu"}
    folder = lora_offload_run / "model"
    adapter = load_file(folder / "adapter_model.safetensors")
    lora_b = [tensor for name, tensor in adapter.items() if ".lora_B." in name]
    assert lora_b and all(tensor.abs().sum() > 0 for tensor in lora_b)  # B starts at zero: gradients got through
    assert any(".score." in name for name in adapter)  # the head, trained, saved with the adapter
    # The base beside the adapter is the pretrained body, untouched (plus the trained head).
    pretrained, base = load_file(qwen2_model / "model.safetensors"), load_file(folder / "model.safetensors")
    assert set(base) == {name for name in pretrained if not name.startswith("lm_head")} | {"score.weight"}
    assert all(torch.equal(base[name], pretrained[name]) for name in base if name != "score.weight")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert "score" in config["modules_to_save"]


@pytest.mark.slow
def test_the_lora_folder_and_its_merge_load_in_a_pipeline_anywhere_and_predict_the_same(lora_offload_run, tmp_path,
                                                                                          reviews_csv, family_model):
    qwen2_model = family_model("qwen2")
    moved = tmp_path / "moved"
    with moved_away(lora_offload_run / "model", moved), moved_away(qwen2_model, tmp_path / "pretrained"):
        # Neither where it was written nor the pretrained folder its adapter_config.json names is there.
        assert_pipeline_predicts_like_the_trained_model(moved)
        shutil.copytree(moved, tmp_path / "copy")
    moved, merged = tmp_path / "copy", tmp_path / "merged"
    run_module("textclf.export", [moved, merged, "--merge"])
    assert not (merged / "adapter_config.json").exists()
    assert_pipeline_predicts_like_the_trained_model(merged)
    adapter_model, tokenizer = load_trained(str(moved))
    merged_model, _ = load_trained(str(merged))
    assert torch.allclose(predict_logits(adapter_model, tokenizer, PROBE_TEXTS),
                          predict_logits(merged_model, tokenizer, PROBE_TEXTS), atol=1e-5)
    run_module("textclf.report", ["--model", merged, "--file", reviews_csv, "--output_dir", tmp_path / "report"])
    assert json.loads((tmp_path / "report" / "report.json").read_text())["samples"] == 240


# --- Models it cannot train: one error line, nothing written ---------------------------------------------

def _no_classification_class(tmp_path, family_model):
    from transformers import CodeGenConfig

    CodeGenConfig(n_embd=32, n_layer=1, n_head=2).save_pretrained(tmp_path / "codegen")
    return tmp_path / "codegen", [], "is a codegen model, and transformers has no sequence-classification class"


def _custom_code(tmp_path, family_model):
    folder = tmp_path / "custom"
    folder.mkdir()
    marker = tmp_path / "code-ran"
    (folder / "configuration_mine.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nfrom transformers import PretrainedConfig\n"
        "class MineConfig(PretrainedConfig):\n    model_type = 'mine'\n")
    (folder / "config.json").write_text(json.dumps({"model_type": "mine", "auto_map": {
        "AutoConfig": "configuration_mine.MineConfig",
        "AutoModelForSequenceClassification": "modeling_mine.MineForSequenceClassification"}}))
    return folder, [], "needs custom code to load"


def _too_long(tmp_path, family_model):
    return family_model("llama"), ["--max_length", "128"], "--max_length 128 is beyond the 64 positions of"


BAD_MODELS = {"no sequence-classification class": _no_classification_class, "custom code": _custom_code,
              "max_length beyond the positions": _too_long}


@pytest.mark.slow
@pytest.mark.parametrize("case", BAD_MODELS)
def test_a_model_it_cannot_train_is_one_clear_error_and_writes_nothing(case, tmp_path, family_model, reviews_csv,
                                                                        cache_dir, capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # where launches start: zoo paths are relative to it
    folder, extra, message = BAD_MODELS[case](tmp_path, family_model)
    out = tmp_path / "out"
    args = [*family_args(folder, reviews_csv, cache_dir), *extra, "--output_dir", out]
    assert_refused(run_train(args, check=False), message)
    assert not out.exists()
    assert not (tmp_path / "code-ran").exists()  # no prompt, no custom code run without --trust_remote_code
    # The pre-launch check reads the same config the same way.
    assert check.main(["--config_file", str(ZOO / "cpu.yaml"), *map(str, args)]) == 2
    assert message in capsys.readouterr().err
    with pytest.raises(InputError, match=re.escape(message)):
        model_config(str(folder), 128 if extra else 32)
    assert not (tmp_path / "code-ran").exists()
