"""The command line: train.py's flags, one per field of TrainConfig, typed as the field is (HfArgumentParser's work,
without importing transformers, so that `--help` and a mistyped flag answer before torch loads); a YAML recipe
(`--config`) read as flags, with an error about one of its values led by its name; the option a user meant by a key
train.py does not know; and the options the commands (export, predict, report) share.

Values come from the defaults, then a resumed checkpoint's config, then the recipe, then `--key value`: the command
line wins.
"""

import argparse
import dataclasses
import difflib
import re
import sys
import typing
from typing import Literal, Optional

import yaml

from textclf.checkpointing import Start, plan_start, read_resume
from textclf.config import (
    ADDS_UP,
    HELP_SECTIONS,
    TrainConfig,
    field_helps,
    field_marks,
    field_names,
    require_local_model,
)
from textclf.errors import InputError, say
from textclf.tasks import KINDS


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise InputError(message)


def to_bool(text: str) -> bool:
    """A flag's value, as TrainingArguments reads it (`--lora true`, `--lora no`)."""
    if text.lower() in ("yes", "true", "t", "y", "1"):
        return True
    if text.lower() in ("no", "false", "f", "n", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{text}'")


def to_bool_or_auto(text: str) -> Optional[bool]:
    """A tri-state flag's value: true, false, or 'auto' (None: decided by the hardware at hand)."""
    if text.lower() == "auto":
        return None
    try:
        return to_bool(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected true, false or auto, got '{text}'") from None


def add_field(group, f: dataclasses.Field, hint, help_text: str) -> None:
    """One option for one field, typed as the field is: HfArgumentParser's work, without importing transformers."""
    tri_state = hint == Optional[bool]  # true, false or auto (None)
    if typing.get_origin(hint) is typing.Union:  # Optional[X]
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    shown = " ".join(map(str, default)) if isinstance(default, list) else "auto" if tri_state else default
    help_text += "" if default is None and not tri_state else f" (default: {shown})"
    options = {"default": default, "help": help_text.replace("%", "%%")}
    if typing.get_origin(hint) is Literal:
        options.update(choices=typing.get_args(hint), type=str)
    elif typing.get_origin(hint) is list:
        options.update(nargs="+", type=typing.get_args(hint)[0], metavar="TEXT")
    elif hint is bool:  # `--lora` alone, or `--lora true/false`; a flag that defaults to true gets --no_<flag> too
        options.update(nargs="?", const=True, type=to_bool_or_auto if tri_state else to_bool,
                       metavar="{true,false,auto}" if tri_state else "BOOL")
    else:
        options.update(type=hint, metavar={int: "INT", float: "FLOAT"}.get(hint, "TEXT"))
    group.add_argument(f"--{f.name}", **options)
    if hint is bool and default is True:
        group.add_argument(f"--no_{f.name}", action="store_false", dest=f.name,
                           help=f"The same as --{f.name} false.")


def make_parser() -> _Parser:
    # No abbreviations: a mistyped key must fail, not silently set another one.
    parser = _Parser(prog="python train.py", allow_abbrev=False,
                     usage="python train.py [--config RECIPE.yaml] [--resume CHECKPOINT] [--key value ...]",
                     description="Fine-tune a text classifier with Accelerate. Every option is a field of "
                                 "TrainConfig (textclf/config.py); names follow transformers.TrainingArguments.")
    # Read by parse_config before this parser runs; declared here for --help.
    parser.add_argument("--config", metavar="RECIPE.yaml", default=argparse.SUPPRESS,
                        help="Read values from a YAML recipe (key: value); flags on the command line win over it.")
    hints, helps = typing.get_type_hints(TrainConfig), field_helps()
    group = parser
    for f in dataclasses.fields(TrainConfig):
        if f.name in HELP_SECTIONS:
            group = parser.add_argument_group(HELP_SECTIONS[f.name])
        add_field(group, f, hints[f.name], helps[f.name])
    return parser


# Options that pick what the run reads, where the last of two would silently win: given twice, they are refused.
GIVEN_ONCE = ("--config", "--resume")


def parse_config(argv: Optional[list[str]] = None, under: Optional[dict] = None) -> TrainConfig:
    """Defaults < `under` (a resumed checkpoint's config: this reads no checkpoint) < recipe < command line."""
    argv = sys.argv[1:] if argv is None else argv
    for flag in GIVEN_ONCE:
        given = [argv[i + 1] if arg == flag and i + 1 < len(argv) else arg.partition("=")[2]
                 for i, arg in enumerate(argv) if arg == flag or arg.startswith(f"{flag}=")]
        if len(given) > 1:
            raise InputError(f"{flag} is given {len(given)} times ({', '.join(given)}); give it once")
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    recipe, rest = pre.parse_known_args(argv)
    rest = joined_repeats(rest)
    from_recipe = []
    if recipe.config:
        from_recipe = recipe_args(recipe.config)
    args = from_recipe + rest
    parser = make_parser()
    if under:
        parser.set_defaults(**under)
    try:
        namespace, unknown = parser.parse_known_args(args)
        cfg = TrainConfig(**vars(namespace))
    except InputError as e:
        if from_recipe:
            e = InputError(blame_recipe(str(e), recipe.config, from_recipe, rest))
        raise e from None
    if unknown:
        flags = [arg for arg in unknown if arg.startswith("-")]
        raise InputError(unknown_keys(flags) if flags else f"unexpected argument(s) {' '.join(unknown)}; "
                         "options are given as --key value (see `python train.py --help`)")
    require_local_model(cfg.model)
    return cfg


def plan_run(cfg: TrainConfig, argv: Optional[list[str]] = None,
             refusals: Optional[list[str]] = None) -> tuple[TrainConfig, Start]:
    """The config this run trains with, and where it starts; before torch is imported. A resume's checkpoint is read
    first, and `argv` (the command line that made `cfg`) parsed again over the config it was made with: what the
    command line does not set comes from the checkpoint. Without `argv` (a config built in code) `cfg` is taken as
    it is, and must agree with the checkpoint.

    A resume's refusals are named together, one line each of one InputError, so that one launch says all that must
    change, not one a launch; with `refusals` (the check command, which calls them conflicts) they are added there
    instead, and the plan goes on as far as it can. One the plan cannot go on after (the output folder in use, a
    position.json that is not the one saved) ends it at once, after those found before it."""
    gathered = [] if refusals is None else refusals
    try:
        resumed = read_resume(cfg, gathered)
        if resumed is not None and resumed.made_with is not None and argv is not None:
            cfg = parse_config(argv, under=resumed.made_with)
        cfg, start = plan_start(cfg, resumed, gathered)
    except InputError as e:
        if refusals is None and gathered:
            raise InputError("\n".join([*gathered, str(e)])) from None
        raise
    if refusals is None:
        if gathered:
            raise InputError("\n".join(gathered))
        if start.resplit:
            say(start.resplit)
    return cfg, start


def joined_repeats(args: list[str]) -> list[str]:
    """An option that adds up (ADDS_UP) given again on the command line adds to its list (`--metric a --metric b` is
    `--metric a b`), where argparse would keep the last; the whole list still wins over a recipe's or a resumed
    checkpoint's."""
    lists = {f"--{name}" for name, marks in field_marks().items() if ADDS_UP in marks}
    segments = []  # each option with the values after it: [flag, values]
    for arg in args:
        if arg.startswith("--") or not segments:
            flag, equals, value = arg.partition("=")
            segments.append([flag if flag in lists else arg, [value] if equals and flag in lists else []])
        else:
            segments[-1][1].append(arg)
    joined = {}
    for flag, values in segments:
        if flag in lists and flag in joined:
            joined[flag] += values
        else:
            joined[flag if flag in lists else len(joined)] = [flag, *values]
    return [arg for values in joined.values() for arg in values]


class RecipeLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, but a key given twice is refused: PyYAML would keep the last without a word."""

    def construct_mapping(self, node, deep=False):
        first_line = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: its keys may be given again
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    problem=f"{key} is given twice (first on line {first_line[key]})", problem_mark=key_node.start_mark)
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def recipe_args(path: str) -> list[str]:
    """A YAML recipe as command-line arguments, so that it is type-checked like the command line."""
    try:
        with open(path, encoding="utf-8") as f:
            recipe = yaml.load(f, Loader=RecipeLoader) or {}
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


# Names that users of the Trainer, run_glue_no_trainer.py and other scripts type, and what they are here.
HABITS = {
    "lr": "learning_rate", "epochs": "num_train_epochs", "num_epochs": "num_train_epochs",
    "batch_size": "per_device_train_batch_size", "train_batch_size": "per_device_train_batch_size",
    "eval_batch_size": "per_device_eval_batch_size", "bf16": "mixed_precision bf16",
    "fp16": "mixed_precision fp16", "evaluation_strategy": "eval_strategy", "model_name_or_path": "model",
    "train_file": "data", "validation_file": "eval_data", "resume_from_checkpoint": "resume",
    "max_seq_length": "max_length", "max_train_steps": "max_steps", "num_warmup_steps": "warmup_steps",
    "checkpointing_steps": "save_steps", "with_tracking": "report_to tensorboard", "num_workers":
    "dataloader_num_workers", "patience": "early_stopping_patience", "grad_accum": "gradient_accumulation_steps",
    "sep": "delimiter", "lr_warmup_steps": "warmup_steps",
}

# The Trainer's options that have no counterpart here, and what to do instead.
FOREIGN = {
    "do_train": "train.py always trains; leave it out", "do_eval": "train.py always evaluates at the end; "
    "--eval_strategy sets how often before", "do_predict": "predict with `python -m textclf.predict`",
    "push_to_hub": "upload the exported model with `hf upload <repo_id> <output_dir>/model`",
    "hub_model_id": "upload the exported model with `hf upload <repo_id> <output_dir>/model`",
}


def suggest(key: str) -> str:
    """The known key closest to a mistyped or foreign one ('--lr' -> '--learning_rate'), or ''."""
    dashes = "--" if key.startswith("--") else ""
    name = key.lstrip("-").split("=")[0].replace("-", "_")
    known = field_names()
    habit = HABITS.get(name)
    if habit and habit.split()[0] in known:
        return dashes + habit
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return dashes + close[0] if close else ""


def unknown_keys(keys: list[str], where: str = "") -> str:
    names = [key.lstrip("-").split("=")[0].replace("-", "_") for key in keys]
    foreign = [f"{key}: {FOREIGN[name]}" for key, name in zip(keys, names) if name in FOREIGN]
    suggestions = [suggestion for key, name in zip(keys, names) if name not in FOREIGN and (suggestion := suggest(key))]
    hint = f" (did you mean {' / '.join(suggestions)}?)" if suggestions else ""
    hint += f" ({'; '.join(foreign)})" if foreign else ""
    return f"unknown config key(s) {', '.join(keys)}{where}{hint}; see `python train.py --help`"


def add_task_options(parser: argparse.ArgumentParser) -> None:
    """The task's options, for predict and report; by default those the model was trained with."""
    parser.add_argument("--task", choices=list(KINDS), help="the task (default: the one the model was trained for)")
    parser.add_argument("--text_column", help="the column that holds the text (default: the training run's)")
    parser.add_argument("--text_pair_column", help="the column that holds the second text of a pair "
                                                   "(default: the training run's)")
    parser.add_argument("--threshold", type=float, help="several labels: a label is predicted where its sigmoid "
                                                        "exceeds this (default: the training run's)")


def add_loading_options(parser: argparse.ArgumentParser) -> None:
    """What export, predict and report may load beyond plain safetensors and transformers' own classes."""
    parser.add_argument("--allow_pickle", action="store_true",
                        help="load a checkpoint from elsewhere (not signed with this user's secret) whose files need "
                        "full pickle (FSDP's sharded metadata), or whose DeepSpeed files hold more than DeepSpeed's "
                        "own classes (trusted files only)")
    parser.add_argument("--trust_remote_code", action="store_true",
                        help="run the Python code a model folder ships for its config, model or tokenizer (its "
                        "auto_map); without it such a folder is refused, never prompted (trusted folders only)")
