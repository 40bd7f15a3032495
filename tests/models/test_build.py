"""Every model built by make_model (textclf/models/build.py): weight decay groups, the dtype asked for, a pickle-only
weights file refused; a pretrained model: the four families trained, resumed and served, custom code only with
consent, a body that does not fit refused, a new head said in one line."""

import json
import os
import re
import shutil
import warnings
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

from conftest import (
    PROBE_TEXTS,
    REPO,
    TINY,
    assert_pipeline_predicts_like_the_trained_model,
    assert_refused,
    assert_same_run,
    code_shipping_folder,
    losses,
    moved_away,
    read_csv,
    read_log,
    run_module,
    run_train,
    to_train,
    train_forked,
)
from families import FAMILIES
from textclf import check
from textclf.checkpointing.write import complete
from textclf.errors import InputError
from textclf.models.build import make_model, model_config, parameter_groups, training_config
from textclf.models.folder import predict_logits
from textclf.models.lora import apply_lora
from textclf.models.tokenizer import get_tokenizer
from textclf.models.trained import load_trained


class RunsCode:
    """A pickle that runs code when loaded: it leaves a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


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


def test_weights_load_in_the_dtype_asked_for(family_model):
    llama_model = family_model("llama")
    tokenizer = get_tokenizer(str(llama_model), None, "unused", "unused", 32)
    for dtype, expected in (("bfloat16", torch.bfloat16), ("float32", torch.float32), ("auto", torch.float32)):
        model = to_train(str(llama_model), tokenizer, ["a", "b"], torch_dtype=dtype)
        assert {p.dtype for p in model.parameters()} == {expected}, dtype


def test_a_pickle_only_model_to_train_is_one_line_and_runs_nothing(tmp_path):
    folder = tmp_path / "model"
    BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=32).save_pretrained(folder)
    torch.save({"classifier.weight": torch.zeros(2, 16), "marker": RunsCode(tmp_path / "code-ran")},
               folder / "pytorch_model.bin")
    with pytest.raises(InputError, match="its weights are a pickle that holds more than tensors"):
        make_model(training_config(str(folder), SimpleNamespace(pad_token_id=0), {"num_labels": 2}, 32), str(folder))
    assert not (tmp_path / "code-ran").exists()


ZOO = REPO / "accelerate_configs"


STRATEGIES = {"single": None, "ddp": "cpu.yaml", "zero3": "zero3.yaml"}


STEPS = 4


# What each family's runs add: GPT-2 checkpoints its activations (under every strategy, so that its
# runs stay comparable), Qwen2 follows a cosine schedule.
EXTRA = {"gpt2": ["--gradient_checkpointing"], "qwen2": ["--lr_scheduler_type", "cosine"]}


def family_args(folder, reviews_csv, cache_dir, *extra):
    return ["--model", folder, "--max_length", 32, "--per_device_train_batch_size", 8, "--per_device_eval_batch_size",
            16, "--logging_steps", 1, "--report_to", "none", "--data", reviews_csv, "--cache_dir", cache_dir,
            "--max_steps", STEPS, "--save_steps", 2, *extra]


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


@pytest.fixture(scope="module")
def lora_offload_run(tmp_path_factory, family_model, reviews_csv, cache_dir):
    qwen2_model = family_model("qwen2")
    out = tmp_path_factory.mktemp("qwen2_lora_offload")
    train_forked([*family_args(qwen2_model, reviews_csv, cache_dir, "--lora", "--gradient_checkpointing"),
                  "--output_dir", out], config_file=ZOO / "zero3_offload.yaml")
    return out


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


def known_type_with_auto_map(tmp_path, where):
    """A BERT model folder (`model`) or step_<N> checkpoint (`checkpoint`) whose config or tokenizer config names
    custom code in an auto_map: transformers knows `bert`, and without the refusal loads its own class instead."""
    kind, file = where.split()
    folder = tmp_path / ("step_1" if kind == "checkpoint" else "model")
    BertForSequenceClassification(BertConfig(vocab_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32)).save_pretrained(folder)
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "好", "差", "书"]))
    tokenizer_folder = folder / "tokenizer" if kind == "checkpoint" else folder
    BertTokenizerFast(str(tmp_path / "vocab.txt")).save_pretrained(tokenizer_folder)
    edited = folder / "config.json" if file == "config" else tokenizer_folder / "tokenizer_config.json"
    settings = json.loads(edited.read_text())
    settings["auto_map"] = {"AutoConfig": "configuration_mine.MineConfig", "AutoTokenizer": ["tokenization_mine.Mine",
                                                                                              None]}
    edited.write_text(json.dumps(settings))
    if kind == "checkpoint":
        complete(str(folder), {"step": 1, "epoch": 0, "batch_in_epoch": 1})  # sealed, as a run seals it
    return folder


EMBEDDINGS = "bert.embeddings.word_embeddings.weight"


def halve(folder, key: str = EMBEDDINGS) -> None:
    """The folder's saved `key` cut to half its rows, its config left as it was."""
    weights = load_file(folder / "model.safetensors")
    weights[key] = weights[key][: weights[key].shape[0] // 2].clone()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture
def folder(tmp_path):
    """A BertForSequenceClassification folder of 2 labels whose config says vocab_size 64."""
    folder = tmp_path / "model"
    torch.manual_seed(0)
    BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32, num_labels=2)).save_pretrained(folder)
    return folder


def to_fine_tune(folder, num_labels: int = 2):
    """The model train.py builds from `folder` (make_model of its config with the task's head)."""
    return make_model(training_config(str(folder), SimpleNamespace(pad_token_id=0), {"num_labels": num_labels}, 32),
                      str(folder))


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


@pytest.mark.parametrize("position", [False, True], ids=["model folder", "checkpoint"])
def test_a_folder_code_runs_only_with_trust_remote_code(tmp_path, position):
    folder, marker = code_shipping_folder(tmp_path, position)
    with pytest.raises(InputError, match="needs custom code to load .* pass --trust_remote_code"):
        load_trained(str(folder))
    assert not marker.exists()
    if not position:
        # The flag reaches transformers: the folder's code runs (its model class is missing: a stub folder).
        with pytest.raises(AttributeError, match="has no attribute 'MineForSequenceClassification'"):
            load_trained(str(folder), trust_remote_code=True)
        assert marker.exists()


@pytest.mark.parametrize("where", ["model config", "model tokenizer", "checkpoint config", "checkpoint tokenizer"])
def test_custom_code_on_a_known_model_type_is_refused_not_swapped_for_the_stock_class(tmp_path, where, capsys):
    folder = known_type_with_auto_map(tmp_path, where)
    named = folder / "tokenizer" if where == "checkpoint tokenizer" else folder  # the folder that names the code
    line = f"'{named}' needs custom code to load (its config's auto_map names Python files it ships); pass " \
           "--trust_remote_code if you trust that code"
    with pytest.raises(InputError) as refused:  # export, predict and report
        load_trained(str(folder))
    assert str(refused.value) == line
    if where.startswith("model"):  # train.py (build_job reads the config first; a resume too) and the check
        with pytest.raises(InputError) as refused:
            model_config(str(folder), 32)
        assert str(refused.value) == line
        capsys.readouterr()
        assert check.main(["--model", str(folder), "--max_length", "32", "--target", "cpu"]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"error: {line}"]


@pytest.mark.parametrize("verbose", [False, True])
def test_a_new_classification_head_is_one_line_and_the_load_report_is_there_when_asked(
        pretrained_backbone, capfd, caplog, monkeypatch, verbose):
    from textclf.models.build import make_model, training_config

    if verbose:
        monkeypatch.setenv("TEXTCLF_VERBOSE", "1")
    model, tokenizer = pretrained_backbone
    built = make_model(training_config(model, tokenizer, {"num_labels": 2}, 32), model, gradient_checkpointing=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_lora(built, 4, 8, 0.0)
    out, err = capfd.readouterr()
    notes = [line for line in (out + err).splitlines() if line.startswith("note:")]
    assert notes == [] if verbose else [
        f"note: {model}: new bert.pooler.dense, classifier, trained from random weights (the classification head); "
        "5 of its weights unused (its pretraining head); TEXTCLF_VERBOSE=1 shows transformers' load report"]
    assert ("LOAD REPORT" in out + err + caplog.text) == verbose  # a terminal, or pytest's log capture
    deprecated = [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
    assert bool(deprecated) == verbose


@pytest.mark.parametrize("num_labels", [2, 3], ids=["same head", "new head"])
def test_body_weights_of_the_wrong_shape_are_refused_in_one_line_naming_them(folder, num_labels, capsys):
    halve(folder)
    with pytest.raises(InputError) as refused:
        to_fine_tune(folder, num_labels)
    assert str(refused.value) == (
        f"cannot fine-tune {folder}: its saved {EMBEDDINGS} is [32, 16] where its config makes it [64, 16]; only a "
        "new classification head is trained from random weights, never the model's body: save the config and the "
        "weights from one model (save_pretrained), or choose another --model")
    assert "trained from random weights" not in "".join(capsys.readouterr())


def test_several_misshapen_body_weights_are_counted(folder):
    halve(folder)
    halve(folder, "bert.embeddings.position_embeddings.weight")
    with pytest.raises(InputError, match=r"position_embeddings.weight is \[256, 16\] where its config makes it "
                                         r"\[512, 16\] \(and 1 more: bert.embeddings.word_embeddings.weight\); "):
        to_fine_tune(folder)


def test_a_head_of_another_shape_is_still_new_and_said_so(folder, capsys):
    model = to_fine_tune(folder, num_labels=3)
    assert model.classifier.weight.shape == (3, 16)
    assert f"note: {folder}: new classifier, trained from random weights (the classification head)" in \
        "".join(capsys.readouterr())


def test_predict_and_export_refuse_them_as_before(folder):
    from transformers import AutoConfig

    halve(folder)
    with pytest.raises(InputError) as refused:
        make_model(AutoConfig.from_pretrained(folder), str(folder), complete=True)
    assert str(refused.value) == f"{folder}: weights missing or of the wrong shape for its config: " \
                                 f"('{EMBEDDINGS}', torch.Size([32, 16]), torch.Size([64, 16]))"


@pytest.mark.slow
def test_train_py_refuses_a_model_folder_whose_body_does_not_fit_and_writes_nothing(tmp_path, tiny_model, reviews_csv,
                                                                                   cache_dir):
    folder = shutil.copytree(tiny_model, tmp_path / "model")
    halve(folder)
    out = tmp_path / "out"
    result = run_train([*TINY, "--model", folder, "--data", reviews_csv, "--cache_dir", cache_dir, "--max_steps", 1,
                        "--output_dir", out], check=False)
    assert_refused(result, f"cannot fine-tune {folder}: its saved {EMBEDDINGS} is ")
    assert not os.path.exists(out)
