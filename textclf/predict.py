"""Predict: what the model says of texts (or pairs) given on the command line or in a file.

    python -m textclf.predict --model checkpoints/model --text "味道很好" "送得太慢了"      # to the terminal
    python -m textclf.predict --model checkpoints/step_500 --file new.csv --text_column review --output out.csv
    accelerate launch --config_file accelerate_configs/cpu.yaml -m textclf.predict --model ... --file ... --output ...

Each row holds what the task predicts: label id, name and a probability per label;
the predicted label names and a sigmoid per label; or the score. The task, the columns and the
threshold are those the model was trained with (its training.json, or a checkpoint's position.json)
unless given here. One output row per input row, in input order, on any number of processes: batches
are sorted by length (little padding), each process predicts its share, and every row goes back to
its index.
"""

import argparse
import csv
import json
from typing import Optional

from textclf import files
from textclf.cli import add_loading_options, add_task_options
from textclf.config import require_data, require_trained_model
from textclf.errors import InputError, die_with_launcher, run_command

OUTPUT_FORMATS = (".csv", ".jsonl")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m textclf.predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model folder that export wrote, or a step_<N> checkpoint")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", nargs="+", help="one or more texts")
    source.add_argument("--file", help="a CSV, JSON Lines or JSON file, or a folder saved by `datasets`")
    parser.add_argument("--text_pair", nargs="+", help="with --text, for a pair model: the second text of each")
    add_task_options(parser)
    parser.add_argument("--delimiter", help="field delimiter of a delimited --file (default: by suffix)")
    parser.add_argument("--encoding", help="text encoding of --file (default: UTF-8, or GB18030 when not UTF-8)")
    parser.add_argument("--output", help="where to write: a .csv or .jsonl file; without it, one line per text "
                        "on the terminal: what the model predicts (label name and probability, names, or score), "
                        "then the text")
    parser.add_argument("--batch_size", type=int, default=64, help="texts per batch and process")
    add_loading_options(parser)
    args = parser.parse_args(argv)
    if args.output and not args.output.endswith(OUTPUT_FORMATS):
        raise InputError(f"--output {args.output}: expected a file ending in {' or '.join(OUTPUT_FORMATS)}")
    require_trained_model(args.model)
    require_data(args.file)
    return args


if __name__ == "__main__":
    die_with_launcher()  # under accelerate launch: end with the launcher, however it ends
    # The command line first: --help and a mistyped flag answer at once, not after the imports below.
    ARGS = run_command(parse_args)

from transformers.utils import logging as transformers_logging

from textclf.data import clean_text, load_table, require_text_column
from textclf.launch import scoped
from textclf.models import inference_accelerator, label_names, load_trained, predict_logits, run_config
from textclf.tasks import Task


def read_inputs(path: str, task: Task, delimiter: Optional[str] = None, encoding: Optional[str] = None):
    """(texts, pairs or None): every row's text(s), cleaned, in file order; empty texts kept, so that row i
    answers row i."""
    table = load_table(path, delimiter, encoding)
    for role, column in task.text_columns.items():
        require_text_column(table, path, role, column)
    texts = {role: [clean_text(text) for text in table[column]] for role, column in task.text_columns.items()}
    return texts["text"], texts.get("text_pair")


def write_rows(rows: list[dict], path: str) -> None:
    """CSV or JSON Lines by the file's suffix, through a temporary file and a rename (never through a symbolic
    link). In CSV a list (the predicted label names) is written as a JSON list, which training
    and report read back as one."""
    with files.replacing(path, suffix=".incomplete", encoding="utf-8", newline="",
                         advice="free space (or choose another --output), then predict again") as f:
        if path.endswith(".csv"):
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows({key: json.dumps(value, ensure_ascii=False) if isinstance(value, list) else value
                              for key, value in row.items()} for row in rows)
        else:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


@scoped
def main(argv=None, args: Optional[argparse.Namespace] = None) -> None:
    args = args or parse_args(argv)
    transformers_logging.disable_progress_bar()  # the prediction bar is the one that matters

    task = Task.from_config(run_config(args.model, {key: getattr(args, key) for key in (
        "task", "text_column", "text_pair_column", "threshold")}))
    accelerator = inference_accelerator()
    if args.text:
        texts, pairs = args.text, args.text_pair
        if (task.text_pair_column and pairs is None) or (pairs is not None and len(pairs) != len(texts)):
            raise InputError(f"give one --text_pair per --text ({len(texts)} texts, {len(pairs or [])} pairs)"
                             + (f": {args.model} was trained on pairs" if task.text_pair_column else ""))
    else:
        texts, pairs = read_inputs(args.file, task, args.delimiter, args.encoding)
    model, tokenizer = load_trained(args.model, args.allow_pickle, args.trust_remote_code)
    logits = predict_logits(model, tokenizer, texts, pairs, batch_size=args.batch_size, accelerator=accelerator,
                            progress=True)
    if accelerator.is_main_process:
        rows = task.prediction_rows(texts, pairs, logits, label_names(model))
        if args.output:
            write_rows(rows, args.output)
            accelerator.print(f"wrote {len(texts)} prediction{'s' * (len(texts) != 1)} to {args.output}")
        else:
            for row in rows:
                print(task.terminal_line(row))
    accelerator.end_training()  # a clean shutdown of the process group on every rank


if __name__ == "__main__":
    run_command(lambda: main(args=ARGS))
