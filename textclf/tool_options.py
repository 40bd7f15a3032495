"""The options that export, predict and report share. Light (no torch), so that their --help and a
mistyped flag answer at once."""

import argparse
import os

from .errors import InputError
from .task import KINDS


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
                        help="allow a DeepSpeed checkpoint, whose files load only as full pickles (trusted files only)")
    parser.add_argument("--trust_remote_code", action="store_true",
                        help="run the Python code a model folder ships for its config, model or tokenizer (its "
                        "auto_map); without it such a folder is refused, never prompted (trusted folders only)")


def require_trained_model(path: str) -> None:
    """What predict, report and export read must be a folder: said before the heavy imports."""
    if not os.path.isdir(path):
        raise InputError(f"model not found: {path} (expected a model folder or a step_<N> checkpoint)")
