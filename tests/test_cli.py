"""The command line (textclf/cli.py): flags over the config's fields, recipes, did-you-mean hints, one error line for
each mistake."""

import re

import pytest

from textclf.cli import parse_config
from textclf.config import field_names
from textclf.errors import InputError


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_command_line_overrides_recipe_which_overrides_defaults(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("learning_rate: 0.002\nmax_steps: 50\nlora_target_modules: [query, key]\n")
    cfg = parse_config(["--config", str(recipe), "--max_steps", "7"])
    assert cfg.learning_rate == 0.002  # from the recipe
    assert cfg.max_steps == 7  # the command line wins
    assert cfg.lora_target_modules == ["query", "key"]
    assert cfg.per_device_train_batch_size == 32  # the default


def test_a_key_given_twice_in_a_recipe_is_refused_not_the_last_taken(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("learning_rate: 0.002\nmax_steps: 50\nlearning_rate: 0.5\n")
    with pytest.raises(InputError) as refused:
        parse_config(["--config", str(recipe)])
    assert str(refused.value) == (f"cannot read config recipe {recipe}: learning_rate is given twice (first on line 1) "
                                  "(line 3, column 1); a recipe is plain YAML of key: value")


def test_booleans_parse_both_ways():
    assert parse_config(["--no_group_by_length"]).group_by_length is False
    assert parse_config(["--lora", "true"]).lora is True


@pytest.mark.parametrize("argv, message", [
    (["--learning_rat", "1e-3"], "unknown config key(s) --learning_rat"),
    (["--per_device_train_batch_size", "0"], "per_device_train_batch_size must be a positive integer, got 0"),
    (["--per_device_train_batch_size", "-4"], "per_device_train_batch_size must be a positive integer, got -4"),
    (["--max_steps", "ten"], "invalid int value: 'ten'"),
    (["--warmup_ratio", "1.5"], "warmup_ratio must be in [0, 1)"),
    # AdamW's settings, refused when parsed rather than in a traceback after the data stage or as NaN weights
    (["--learning_rate", "inf"], "learning_rate must be a positive number, got inf"),
    (["--learning_rate", "nan"], "learning_rate must be a positive number, got nan"),
    (["--learning_rate", "0"], "learning_rate must be a positive number, got 0.0"),
    (["--num_train_epochs", "inf"], "num_train_epochs must be a positive number, got inf"),
    (["--adam_beta1", "1.5"], "adam_beta1 must be in [0, 1), got 1.5"),
    (["--adam_beta2", "1"], "adam_beta2 must be in [0, 1), got 1.0"),
    (["--adam_epsilon", "0"], "adam_epsilon must be a positive number, got 0.0"),
    (["--weight_decay", "nan"], "weight_decay must be 0 or more, got nan"),
    (["--max_grad_norm", "inf"], "max_grad_norm must be 0 (no clipping) or more, got inf"),
    # the Trainer's options that cannot work together
    (["--load_best_model_at_end", "--eval_steps", "10", "--save_steps", "20"],
     "load_best_model_at_end needs a checkpoint at every evaluation: set --save_strategy and --save_steps as "
     "--eval_strategy and --eval_steps (now evaluating every 10 steps, saving every 20 steps)"),
    (["--load_best_model_at_end", "--eval_strategy", "epoch"], "(now evaluating every epoch, saving every 500 steps)"),
    (["--load_best_model_at_end"], "(now evaluating never, saving every 500 steps)"),
    (["--early_stopping_patience", "3", "--eval_steps", "10"],
     "early_stopping_patience needs --load_best_model_at_end"),
    (["--eval_strategy", "sometimes"], "invalid choice: 'sometimes'"),
    (["--mixed_precision", "fp8"], "invalid choice: 'fp8'"),
    (["--warmup_steps", "-1"], "warmup_steps must be 0 or more, got -1"),
    (["--delimiter", "ab"], "delimiter must be one character, got 'ab'"),
])
def test_bad_values_are_refused_with_the_reason(argv, message):
    with pytest.raises(InputError) as error:
        parse_config(argv)
    assert message in str(error.value)


def test_unknown_key_in_recipe_names_the_key_and_file(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("learning_rate: 0.001\nbatch_size: 8\n")
    with pytest.raises(InputError, match=r"unknown config key\(s\) batch_size in .*recipe.yaml"):
        parse_config(["--config", str(recipe)])


def test_wrong_type_in_recipe_is_refused(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("max_steps: many\n")
    with pytest.raises(InputError, match="invalid int value: 'many'"):
        parse_config(["--config", str(recipe)])


def test_trainer_names_parse_with_the_trainer_s_defaults():
    cfg = parse_config(["--warmup_steps", "5", "--eval_steps", "10", "--dataloader_num_workers", "2",
                        "--mixed_precision", "bf16"])
    assert (cfg.warmup_steps, cfg.dataloader_num_workers, cfg.mixed_precision) == (5, 2, "bf16")
    assert cfg.eval_strategy == "steps"  # eval_steps alone asks for evaluation every eval_steps
    assert parse_config([]).eval_strategy == "no" and parse_config([]).save_strategy == "steps"
    # eval_strategy steps without eval_steps falls back to logging_steps, as in TrainingArguments
    assert parse_config(["--eval_strategy", "steps", "--logging_steps", "7"]).eval_steps == 7
    best = parse_config(["--eval_strategy", "epoch", "--save_strategy", "epoch", "--load_best_model_at_end",
                         "--early_stopping_patience", "2"])
    assert best.load_best_model_at_end and best.early_stopping_patience == 2


def test_a_tab_delimiter_may_be_typed_as_backslash_t():
    assert parse_config(["--delimiter", "\\t"]).delimiter == "\t"
    assert parse_config(["--delimiter", "，"]).delimiter == "，"


@pytest.mark.parametrize("argv, suggestion", [
    (["--lr", "3e-5"], "--lr (did you mean --learning_rate?)"),
    (["--epochs", "2"], "--epochs (did you mean --num_train_epochs?)"),
    (["--batch_size", "8"], "--batch_size (did you mean --per_device_train_batch_size?)"),
    (["--bf16"], "--bf16 (did you mean --mixed_precision bf16?)"),
    (["--evaluation_strategy", "steps"], "did you mean --eval_strategy?"),
    (["--model_name_or_path", "x"], "did you mean --model?"),
    (["--learning-rat", "1"], "did you mean --learning_rate?"),
    (["--gradient_acumulation_steps", "2"], "did you mean --gradient_accumulation_steps?"),
])
def test_unknown_flags_suggest_the_closest_known_name(argv, suggestion):
    with pytest.raises(InputError) as error:
        parse_config(argv)
    assert str(error.value).startswith("unknown config key(s) ") and suggestion in str(error.value)


def test_an_unknown_recipe_key_gets_a_suggestion_too(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("lr: 0.001\n")
    with pytest.raises(InputError,
                       match=r"unknown config key\(s\) lr in .*recipe.yaml \(did you mean learning_rate\?\)"):
        parse_config(["--config", str(recipe)])


def test_help_groups_the_options_and_lists_the_recipe(help_text):
    sections = [line[:-1] for line in help_text.splitlines()
                if line and not line.startswith(" ") and line.endswith(":")]
    assert sections == ["options", "model", "data", "task", "optimisation", "LoRA", "evaluation and checkpoints",
                        "logging"]
    assert "--config RECIPE.yaml" in help_text
    assert "  -h, --help            show this help message and exit" in help_text.splitlines()
    assert "  --no_group_by_length  The same as --group_by_length false." in help_text.splitlines()
    section_of = {}
    for line in help_text.splitlines():
        if line and not line.startswith(" "):
            current = line[:-1]
        elif line.startswith("  --"):
            section_of[line.split()[0]] = current
    assert section_of["--encoding"] == "data" and section_of["--warmup_steps"] == "optimisation"
    assert section_of["--lora_r"] == "LoRA" and section_of["--early_stopping_patience"] == "evaluation and checkpoints"
    assert section_of["--report_to"] == "logging"
    assert set(section_of) >= {f"--{name}" for name in field_names()}


def test_resume_given_twice_is_one_line_not_the_last_one_silently():
    with pytest.raises(InputError, match=r"^--resume is given 2 times \(out/step_2, latest\); give it once$"):
        parse_config(["--resume", "out/step_2", "--max_steps", "9", "--resume=latest"])
    assert parse_config(["--resume", "latest"]).resume == "latest"


@pytest.mark.parametrize("recipe, message", [
    ("learning_rate: [1\nseed: 3\n", "expected ',' or ']', but got ':' (line 2, column 5)"),
    ("seed: !!python/object/apply:os.system ['touch {marker}']\n", "could not determine a constructor for the tag"),
], ids=["syntax error", "python tag"])
def test_a_recipe_that_is_not_plain_yaml_is_one_line(tmp_path, recipe, message):
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe.format(marker=tmp_path / "code-ran"))
    with pytest.raises(InputError) as refused:
        parse_config(["--config", str(path)])
    assert message in str(refused.value) and len(str(refused.value).splitlines()) == 1
    assert not (tmp_path / "code-ran").exists()


@pytest.mark.parametrize("seed", ["-1", str(2 ** 40)])
def test_a_seed_numpy_cannot_take_is_refused(seed):
    with pytest.raises(InputError, match=re.escape(f"seed must be in [0, 2**32 - 1], got {seed}")):
        parse_config(["--seed", seed])


@pytest.mark.parametrize("argv, message", [
    (["--model", "./my_modle"], "model not found: ./my_modle is a path (a hub id is name or namespace/name) and "
                                "nothing is there"),
    (["--dataloader_num_workers", "-1"], "dataloader_num_workers must be 0 or more, got -1"),
    (["--warmup_steps", "-2"], "warmup_steps must be 0 or more, got -2"),
    (["--runname", "a"], "unknown config key(s) --runname (did you mean --run_name?)"),
    (["--do_train"], "(--do_train: train.py always trains; leave it out)"),
    (["--push_to_hub"], "(--push_to_hub: upload the exported model with `hf upload <repo_id> <output_dir>/model`)"),
    (["--text_column", "review", "--label_column", "review"],
     "column 'review' is both the text and the label column; name the texts with --text_column"),
])
def test_bad_command_lines_are_one_line_saying_what_to_do(argv, message):
    from textclf.cli import parse_config

    with pytest.raises(InputError) as refused:
        parse_config(argv)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("recipe, command_line, blamed", [
    ("max_steps: two\n", [], True),
    ("max_steps: -3\n", [], True),
    ("max_steps: two\n", ["--max_steps", "3"], True),  # argparse still reads the recipe's value, and quotes it
    ("max_steps: 3\n", ["--max_steps", "0"], False),  # the command line's value
])
def test_a_type_error_in_a_recipe_names_the_recipe(tmp_path, recipe, command_line, blamed):
    from textclf.cli import parse_config

    path = write(tmp_path / "recipe.yaml", recipe)
    with pytest.raises(InputError) as refused:
        parse_config(["--config", path, *command_line])
    assert str(refused.value).startswith(f"config recipe {path}: ") == blamed
    assert "max_steps" in str(refused.value)
