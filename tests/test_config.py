"""The one training config (textclf/config.py): every field documented, the rules its values follow."""

import dataclasses

import pytest

from textclf.cli import parse_config
from textclf.config import field_helps, field_names
from textclf.errors import InputError


def test_every_field_is_documented_by_the_docstring_under_it():
    from textclf.tasks.task import KINDS

    helps = field_helps()
    assert list(helps) == field_names()
    undocumented = [name for name, help_text in helps.items() if not help_text]
    assert not undocumented, f"TrainConfig field(s) {', '.join(undocumented)} have no docstring: write each one's " \
                             "help as a string on the line under it"
    assert all(f"{kind}: " in helps["task"] for kind in KINDS) and "{" not in "".join(helps.values())  # filled in
    assert helps["delimiter"].startswith("Field delimiter of a delimited text file (e.g. '\\t', ';', '|'); default")


def test_a_field_without_a_help_string_stops_no_run():
    """A fork adds a field and forgets its docstring: --help and every run still work (the test above names it)."""
    @dataclasses.dataclass
    class Fork:
        documented: int = 1
        """Its help."""
        undocumented: int = 2

    assert field_helps(Fork) == {"documented": "Its help.", "undocumented": ""}


def test_the_learning_rate_follows_the_model_kind_unless_given():
    assert parse_config([]).learning_rate == 1e-3
    assert parse_config(["--lora"]).learning_rate == 1e-3  # LoRA of a scratch model: still a scratch model
    assert parse_config(["--model", "bert-base-chinese"]).learning_rate == 2e-5
    assert parse_config(["--model", "Qwen/Qwen2.5-0.5B", "--lora"]).learning_rate == 2e-4
    assert parse_config(["--model", "bert-base-chinese", "--learning_rate", "3e-5"]).learning_rate == 3e-5


def test_the_sample_size_is_checked_and_recorded_in_the_config():
    with pytest.raises(InputError, match=r"tokenizer_sample must be 0 \(every example\) or more, got -1"):
        parse_config(["--tokenizer_sample", "-1"])
    assert parse_config([]).to_dict()["tokenizer_sample"] == 100_000


def test_the_best_checkpoints_metric_is_one_of_the_tasks_scores():
    from textclf.cli import parse_config
    from textclf.errors import InputError

    assert parse_config([]).metric_for_best_model == "eval_f1"
    assert parse_config(["--task", "regression"]).metric_for_best_model == "eval_mse"
    assert parse_config(["--task", "multi_label"]).metric_for_best_model == "eval_micro_f1"
    assert parse_config(["--metric_for_best_model", "accuracy"]).metric_for_best_model == "eval_accuracy"
    with pytest.raises(InputError, match="eval_f1 is not a score of task regression"):
        parse_config(["--task", "regression", "--metric_for_best_model", "eval_f1"])


def test_the_same_column_for_text_and_label_is_refused_by_the_config():
    from textclf.config import TrainConfig

    with pytest.raises(InputError, match="column 'review' is both the text and the label column"):
        TrainConfig(text_column="review", label_column="review")


def test_report_to_takes_a_list_all_or_none_as_the_trainer_does():
    from textclf.cli import parse_config
    from textclf.config import TrainConfig

    assert parse_config([]).report_to == ["tensorboard"]
    assert parse_config(["--report_to", "wandb", "tensorboard"]).report_to == ["wandb", "tensorboard"]
    assert TrainConfig(report_to="none").report_to == ["none"]  # a checkpoint's config from before lists
    with pytest.raises(InputError, match="'none' and 'all' stand alone"):
        parse_config(["--report_to", "none", "tensorboard"])
