"""The combination matrix (tests/matrix.py, docs/matrix.md): every cell of family, launch, LoRA, checkpointing and
task."""

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import pipeline

from conftest import PROBE_TEXTS, REPO, TINY, assert_peft_loaders_predict_like_the_trained_model, losses, train_forked
from matrix import CELLS, DIMENSIONS, LAUNCHES, cell_id, table
from textclf.models.folder import predict_logits, weight_files
from textclf.models.trained import load_trained

TASKS = {  # name: (the fixture with its files, its options)
    "single_label": ("reviews_csv", []),
    "multi_label": ("multi_label_files", ["--task", "multi_label", "--label_column", "aspects",
                                          "--label_separator", "|"]),
    "regression": ("rating_files", ["--task", "regression", "--label_column", "rating"]),
    "pairs": ("pair_files", ["--text_column", "first", "--text_pair_column", "second"]),
}


PAIRS = ["还行吧", "太差了", "Great value", "不错", "一般", "质量很好", "物流快", "ok"]


MATRIX_PAGE = REPO / "docs" / "matrix.md"


@pytest.fixture(scope="module")
def outcomes():
    """What each cell showed; written to docs/matrix.md once every cell has an outcome (a whole run)."""
    shown = {}
    yield shown
    if len(shown) == len(CELLS):
        MATRIX_PAGE.write_text(table(shown, ran_with()), encoding="utf-8")


def ran_with() -> str:
    import datetime
    from importlib.metadata import version

    packages = ", ".join(f"{name} {version(name)}" for name in ("torch", "transformers", "accelerate", "deepspeed",
                                                                "peft"))
    return f"Last run {datetime.date.today().isoformat()} on CPU ({os.cpu_count()} cores): {packages}."


def launch(args, launch_name):
    if LAUNCHES[launch_name] is None:
        return train_forked(args, config_file=None)
    config, launch_args = LAUNCHES[launch_name]
    return train_forked(args, config_file=REPO / "accelerate_configs" / config, launch_args=launch_args)


def cell_args(cell, request, family_model, cache_dir):
    fixture, options = TASKS[cell["task"]]
    files = request.getfixturevalue(fixture)
    data = ["--data", files] if isinstance(files, Path) else ["--data", files["train"], "--eval_data", files["eval"]]
    return [*TINY, "--model", family_model(cell["family"]), *data, "--cache_dir", cache_dir, *options,
            "--max_steps", 2, "--save_steps", 1,
            *(["--lora"] if cell["tuning"] == "lora" else []),
            *(["--gradient_checkpointing"] if cell["checkpointing"] == "on" else [])]


def exported_weights(output_dir) -> dict:
    return {f"{Path(path).name}:{name}": tensor for path in weight_files(str(Path(output_dir) / "model"))
            for name, tensor in load_file(path).items()}


def assert_resumed_bitwise(uninterrupted, resumed):
    assert losses(resumed)[2] == losses(uninterrupted)[2], (losses(resumed), losses(uninterrupted))
    expected, got = exported_weights(uninterrupted), exported_weights(resumed)
    assert expected.keys() == got.keys()
    different = [name for name in expected if not torch.equal(expected[name], got[name])]
    assert not different, f"final weights differ after resume: {different[:3]}"


def assert_pipeline_scores_are_the_trained_model_logits(folder, pairs: bool):
    """`pipeline` on the folder, asked for every label's raw score, gives the logits of the trained model (as
    predict and report load it) for every task: one label, several, a score, pairs."""
    model, tokenizer = load_trained(str(folder))
    expected = predict_logits(model, tokenizer, PROBE_TEXTS, PAIRS if pairs else None)
    inputs = [{"text": text, "text_pair": pair} for text, pair in zip(PROBE_TEXTS, PAIRS)] if pairs else PROBE_TEXTS
    classify = pipeline("text-classification", model=str(folder), function_to_apply="none", top_k=None)
    label_ids = model.config.label2id
    got = torch.zeros_like(expected)
    for row, scores in enumerate(classify(inputs)):
        for score in scores:
            got[row, label_ids[score["label"]]] = score["score"]
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5), (got - expected).abs().max()


@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.xdist_group("matrix")
@pytest.mark.parametrize("cell", CELLS, ids=cell_id)
def test_cell(cell, request, family_model, cache_dir, tmp_path, outcomes):
    loaders = "pipeline" + (", both peft loaders" if cell["tuning"] == "lora" else "")
    outcomes[cell_id(cell)] = ("failed", "", "")
    args = cell_args(cell, request, family_model, cache_dir)
    out, resumed = tmp_path / "run", tmp_path / "resumed"
    launch([*args, "--output_dir", out], cell["launch"])
    assert sorted(losses(out)) == [1, 2]
    shutil.copytree(out / "step_1", resumed / "step_1")
    launch([*args, "--output_dir", resumed, "--resume", resumed / "step_1"], cell["launch"])
    assert_resumed_bitwise(out, resumed)
    assert_pipeline_scores_are_the_trained_model_logits(out / "model", pairs=cell["task"] == "pairs")
    if cell["tuning"] == "lora":
        assert_peft_loaders_predict_like_the_trained_model(out / "model", tmp_path / "elsewhere")
    outcomes[cell_id(cell)] = ("passed", "bitwise", loaders)


def test_every_pair_of_values_is_in_a_cell():
    from itertools import combinations

    for a, b in combinations(DIMENSIONS, 2):
        met = {(cell[a], cell[b]) for cell in CELLS}
        assert met == {(x, y) for x in DIMENSIONS[a] for y in DIMENSIONS[b]}, (a, b)


def test_the_docs_table_has_a_row_for_each_generated_cell_and_no_other():
    """docs/matrix.md is written by a run of the whole matrix: it lists the cells the generator makes now, in
    order (a changed generator needs that run again before the table may speak for it)."""
    def cells_in(page):
        return [line.split("|")[1:6] for line in page.splitlines() if line.startswith("| ") and "---" not in line]

    assert cells_in(MATRIX_PAGE.read_text(encoding="utf-8")) == cells_in(table({}))
