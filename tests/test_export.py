"""python -m textclf.export (textclf/export.py): a checkpoint of any strategy exported as a verified model folder."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForSequenceClassification,
    BertConfig,
    BertForSequenceClassification,
    pipeline,
)

from conftest import (
    REPO,
    TINY,
    another_user,
    assert_refused,
    refusal,
    run_module,
    train_forked,
)
from textclf.checkpointing.write import complete
from textclf.errors import InputError
from textclf.export import export_checkpoint

CONFIGS = {"ddp": "cpu.yaml", "zero2": "zero2.yaml", "zero3": "zero3.yaml"}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, reviews_csv, cache_dir):
    """`trained_run(strategy)`: the output_dir of a 2-process run (forked: tests/journeys/test_zoo.py launches each zoo
    file for real), trained once per strategy and module."""
    runs = {}

    def get(strategy):
        if strategy not in runs:
            out = tmp_path_factory.mktemp(strategy)
            train_forked([*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--output_dir", out,
                          "--max_steps", 2, "--save_steps", 1],
                         config_file=REPO / "accelerate_configs" / CONFIGS[strategy])
            runs[strategy] = out
        return runs[strategy]

    return get


def export(source, target, *extra):
    result = run_module("textclf.export", [source, target, "--allow_pickle", *extra])
    assert "verified" in result.stdout
    return target


def assert_no_empty_tensor(weights: dict):
    assert all(tensor.numel() > 0 for tensor in weights.values())


def _save_fsdp_sharded(weights, checkpoint):
    """What accelerate's save_state writes under FSDP with SHARDED_STATE_DICT (torch.distributed.checkpoint)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": weights}, storage_writer=dcp.FileSystemWriter(checkpoint / "pytorch_model_fsdp_0"))


def _save_fsdp_full(weights, checkpoint):
    """What it writes with FULL_STATE_DICT."""
    torch.save(weights, checkpoint / "pytorch_model_fsdp.bin")


def _without(name):
    def make(model, tmp_path):
        folder = tmp_path / "model"
        shutil.copytree(model, folder)
        os.remove(folder / name)
        return folder
    return make


def _step_folder_without_position(model, tmp_path):
    (tmp_path / "step_3").mkdir()
    return tmp_path / "step_3"


def _checkpoint_without_weights(model, tmp_path):

    folder = tmp_path / "step_4"
    folder.mkdir()
    shutil.copy(model / "config.json", folder)
    complete(str(folder), {"step": 4})
    return folder


def _unrelated_folder(model, tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("not a model")
    return tmp_path / "notes"


BAD_SOURCES = {
    "a model folder without its weights": (_without("model.safetensors"),
                                           "is not a complete model folder: it has no weights"),
    "a model folder without its config": (_without("config.json"),
                                          "is not a complete model folder: it has no config.json"),
    "a step folder that is no checkpoint": (_step_folder_without_position,
                                            "is not a complete checkpoint: it has no position.json"),
    "a checkpoint without weights": (_checkpoint_without_weights,
                                     "is not a complete checkpoint: it holds no model weights"),
    "a folder that is neither": (_unrelated_folder, "is neither a model folder (config.json and weights, as export "
                                                    "writes) nor a step_<N> checkpoint"),
    "no folder at all": (lambda model, tmp_path: tmp_path / "missing", "model not found: "),
}


def core_modules() -> set[str]:
    """The modules of textclf that training imports: train.py's `textclf` imports, followed through each
    module's own (those inside functions too, and those named by a string, as tasks.KINDS names each kind's), read
    from the source without importing anything."""
    import ast

    def imported(path, package="textclf"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level:  # from .x import y, from . import x
                base = package if not node.module else f"{package}.{node.module}"
                yield from [base] if node.module else (f"{base}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("textclf"):
                yield node.module
                yield from (f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                yield from (alias.name for alias in node.names)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("textclf."):
                yield node.value  # importlib's: kept where it is a module

    def source(module):
        path = REPO.joinpath(*module.split("."))
        return next((p for p in (path.with_suffix(".py"), path / "__init__.py") if p.is_file()), None)

    seen, todo = set(), [name for name in imported(REPO / "train.py") if source(name)]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        package = module if source(module).name == "__init__.py" else module.rpartition(".")[0]
        todo += [name for name in imported(source(module), package) if name.startswith("textclf") and source(name)]
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("strategy", CONFIGS)
def test_checkpoint_export_equals_the_weights_the_run_held_at_that_step(strategy, trained_run, tmp_path):
    out = trained_run(strategy)
    run = json.loads((out / "run.json").read_text())
    assert run["num_processes"] == 2
    assert run["zero_stage"] == {"ddp": None, "zero2": 2, "zero3": 3}[strategy]
    # What the strategy wrote: accelerate's whole model, or one DeepSpeed shard per rank.
    checkpoint = out / "step_2"
    if strategy == "ddp":
        assert (checkpoint / "model.safetensors").is_file()
    else:
        assert not (checkpoint / "model.safetensors").exists()
        assert len(list((checkpoint / "pytorch_model").glob("zero_pp_rank_*_optim_states.pt"))) == 2

    exported = load_file(export(checkpoint, tmp_path / "from_checkpoint") / "model.safetensors")
    at_the_end = load_file(out / "model" / "model.safetensors")
    assert exported.keys() == at_the_end.keys()
    assert_no_empty_tensor(exported)
    for name, tensor in exported.items():
        assert tensor.shape == at_the_end[name].shape, name
        assert torch.allclose(tensor, at_the_end[name], rtol=0, atol=1e-6), name

    # The earlier checkpoint exports the earlier weights: the step is the one asked for.
    earlier = load_file(export(out / "step_1", tmp_path / "step_1") / "model.safetensors")
    assert any(not torch.equal(earlier[name], exported[name]) for name in exported)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", CONFIGS)
def test_checkpoint_export_is_a_complete_folder_that_loads_in_a_pipeline(strategy, trained_run, tmp_path):
    target = tmp_path / "exported"
    export(trained_run(strategy) / "step_1", target)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(target))
    model = AutoModelForSequenceClassification.from_pretrained(target)
    assert model.config.id2label == {0: "negative", 1: "positive"}
    classify = pipeline("text-classification", model=str(target))
    predictions = classify(["质量很好，非常满意", "太差了，不会再买"])
    assert [p["label"] in {"negative", "positive"} for p in predictions] == [True, True]
    assert not [name for name in os.listdir(tmp_path) if "incomplete" in name]


def test_a_deepspeed_checkpoint_exports_with_no_flag_its_pickles_read_weights_only(trained_run, tmp_path, capsys):
    """The fast tier's DeepSpeed run: ZeRO-2 on 2 processes writes a checkpoint whose pickles (each rank's
    partition) are read weights-only with DeepSpeed's own classes allowed: export needs no --allow_pickle, for the
    run's own checkpoint (signed) or one from elsewhere (another user's: a warning says nothing proves who wrote it),
    and exports the same weights either way."""
    from textclf.export import main

    main([str(trained_run("zero2") / "step_2"), str(tmp_path / "own")])
    assert "warning:" not in capsys.readouterr().err
    with another_user(tmp_path):
        main([str(trained_run("zero2") / "step_2"), str(tmp_path / "elsewhere")])
    assert "warning: nothing proves that this user's runs wrote" in capsys.readouterr().err
    own, elsewhere = (load_file(tmp_path / name / "model.safetensors") for name in ("own", "elsewhere"))
    assert own.keys() == elsewhere.keys() and all(torch.equal(own[name], elsewhere[name]) for name in own)


@pytest.mark.parametrize("save_weights", [_save_fsdp_sharded, _save_fsdp_full], ids=["sharded", "full"])
def test_fsdp_checkpoint_layouts_export_too(save_weights, tiny_model, tmp_path):
    """FSDP needs GPUs to train here, so the checkpoint is laid out by hand: train.py's files around the
    weights as accelerate's FSDP saving writes them."""
    from transformers import AutoTokenizer

    from textclf.errors import InputError
    from textclf.export import export_checkpoint

    checkpoint = tmp_path / "step_1"
    checkpoint.mkdir()
    shutil.copy(tiny_model / "config.json", checkpoint)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(checkpoint / "tokenizer")
    weights = load_file(tiny_model / "model.safetensors")
    save_weights(weights, checkpoint)
    complete(str(checkpoint), {"step": 1, "config": {"lora": False}})  # position.json, last, as train.py writes it

    # The sharded state's metadata is a full pickle (torch.distributed.checkpoint has no weights-only read): the
    # run's own checkpoint loads, signed; one from elsewhere (another user's) needs --allow_pickle.
    pickled = save_weights is _save_fsdp_sharded
    if pickled:
        with another_user(tmp_path), pytest.raises(InputError, match="written elsewhere .* pass --allow_pickle"):
            export_checkpoint(str(checkpoint), str(tmp_path / "refused"))
        with another_user(tmp_path):
            export_checkpoint(str(checkpoint), str(tmp_path / "elsewhere"), allow_pickle=True)
    export_checkpoint(str(checkpoint), str(tmp_path / "exported"))
    exported = load_file(tmp_path / "exported" / "model.safetensors")
    assert exported.keys() == weights.keys()
    assert all(torch.equal(exported[name], weights[name]) for name in weights)


def test_an_existing_target_is_refused_unless_overwrite(tiny_model, tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    assert_refused(run_module("textclf.export", [tiny_model, target], check=False),
                   f"{target} already exists; choose another target or pass --overwrite")
    assert os.listdir(target) == ["keep.txt"]

    from textclf.export import main

    main([str(tiny_model), str(target), "--overwrite"])
    assert "keep.txt" not in os.listdir(target)
    original, replaced = load_file(tiny_model / "model.safetensors"), load_file(target / "model.safetensors")
    assert all(torch.equal(original[name], replaced[name]) for name in original)


@pytest.mark.parametrize("case", BAD_SOURCES)
def test_a_source_that_is_not_a_model_is_one_clear_error(case, tiny_model, tmp_path):
    from textclf.export import main

    make_source, message = BAD_SOURCES[case]
    source = make_source(tiny_model, tmp_path)
    assert message in refusal(main, [source, tmp_path / "target"])
    assert not (tmp_path / "target").exists()


def test_training_imports_none_of_the_commands():
    """The core (train.py and what it imports) is what a fork reads; the commands are built on it, never in it."""
    core = core_modules()
    assert {"textclf.models.build", "textclf.models.folder", "textclf.data", "textclf.checkpointing",
            "textclf.tasks.multi_label"} <= core
    assert not core & {"textclf.export", "textclf.predict", "textclf.check", "textclf.report"}


@pytest.mark.parametrize("checkpoint", [False, True], ids=["model folder", "checkpoint"])
def test_export_from_a_truncated_weights_file_is_one_line(tmp_path, checkpoint):
    source = tmp_path / ("step_1" if checkpoint else "model")
    BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32)).save_pretrained(source)
    if checkpoint:
        (source / "position.json").write_text(json.dumps({"step": 1, "epoch": 0, "batch_in_epoch": 1}))
    weights = source / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    with pytest.raises(InputError) as refused:
        export_checkpoint(str(source), str(tmp_path / "exported"))
    assert str(source) in str(refused.value) and len(str(refused.value).splitlines()) == 1
    assert not (tmp_path / "exported").exists()
