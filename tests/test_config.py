"""The typed config: defaults < YAML recipe < command line, and every bad value is refused."""

import pytest

from textclf.config import parse_config
from textclf.errors import InputError


def test_command_line_overrides_recipe_which_overrides_defaults(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("learning_rate: 0.002\nmax_steps: 50\nlora_target_modules: [query, key]\n")
    cfg = parse_config(["--config", str(recipe), "--max_steps", "7"])
    assert cfg.learning_rate == 0.002  # from the recipe
    assert cfg.max_steps == 7  # the command line wins
    assert cfg.lora_target_modules == ["query", "key"]
    assert cfg.per_device_train_batch_size == 32  # the default


def test_booleans_parse_both_ways():
    assert parse_config(["--no_group_by_length"]).group_by_length is False
    assert parse_config(["--lora", "true"]).lora is True


@pytest.mark.parametrize("argv, message", [
    (["--learning_rat", "1e-3"], "unknown config key(s) --learning_rat"),
    (["--per_device_train_batch_size", "0"], "per_device_train_batch_size must be a positive integer, got 0"),
    (["--per_device_train_batch_size", "-4"], "per_device_train_batch_size must be a positive integer, got -4"),
    (["--max_steps", "ten"], "invalid int value: 'ten'"),
    (["--report_to", "mlflow"], "invalid choice: 'mlflow'"),
    (["--warmup_ratio", "1.5"], "warmup_ratio must be in [0, 1)"),
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
