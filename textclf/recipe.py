"""A YAML recipe (`--config recipe.yaml`): read as command-line arguments, and an error about one of its values led by
its name. Imported only with --config."""

import re
from typing import Optional

import yaml

from .config import field_names
from .errors import InputError


def recipe_args(path: str) -> list[str]:
    """A YAML recipe as command-line arguments, so that it is type-checked like the command line."""
    try:
        with open(path, encoding="utf-8") as f:
            recipe = yaml.safe_load(f) or {}
    except OSError as e:
        raise InputError(f"cannot read config recipe {path}: {e.strerror}") from None
    except yaml.YAMLError as e:  # a syntax error, or a tag such as !!python/object, which safe_load refuses
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise InputError(f"cannot read config recipe {path}: {getattr(e, 'problem', None) or e}{where}; "
                         "a recipe is plain YAML of key: value") from None
    if not isinstance(recipe, dict):
        raise InputError(f"config recipe {path} must be a mapping of key: value")
    unknown = sorted(set(recipe) - set(field_names()))
    if unknown:
        from .flag_hints import unknown_keys

        raise InputError(unknown_keys(unknown, f" in {path}"))
    args = []
    for key, value in recipe.items():
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        args += [f"--{key}", *map(str, values)]
    return args


def blame_recipe(message: str, path: Optional[str], from_recipe: list[str], command_line: list[str]) -> str:
    """`message` about a value, led by the recipe's name when the value came from the recipe."""
    given = {arg.split("=")[0] for arg in command_line if arg.startswith("--")}
    keys = [i for i, arg in enumerate(from_recipe) if arg.startswith("--")]
    for i, end in zip(keys, keys[1:] + [len(from_recipe)]):
        key, values = from_recipe[i], from_recipe[i + 1:end]
        named = re.search(rf"(?:^|[\s(]|--){re.escape(key[2:])}\b", message)
        # argparse quotes the value it refuses: the recipe's, even where the command line sets the key too
        if named and (key not in given or any(f"'{value}'" in message for value in values)):
            return f"config recipe {path}: {message}"
    return message
