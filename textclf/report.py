"""Evaluate a trained model on a labelled file, beside a baseline fitted on the model's own training data.

    python -m textclf.report --model checkpoints/model --file test.csv --output_dir report/
    python -m textclf.report --model checkpoints/model --output_dir report/    # the examples the run evaluated
    accelerate launch --config_file accelerate_configs/cpu.yaml -m textclf.report --model ... --file ... ...

Prints the task's scores for the model and for a TF-IDF + linear baseline fitted on
the examples the model was trained on (baseline_predictions, below), then what the task adds (Task.figures: a
precision / recall / F1 / support table per class or per label, with their names). Writes it all to
<output_dir>/report.json, and draws the task's picture (Task.picture: the confusion matrix, or the
predicted against the true scores). The task, the columns and the training data are those of the run
that trained the model (its training.json, or a checkpoint's position.json) unless given here.
"""

import argparse
import os
import sys
from typing import Optional

from textclf import files
from textclf.cli import add_loading_options, add_task_options
from textclf.config import DEFAULT_DATA, HELD_OUT, TrainConfig, require_data, require_trained_model
from textclf.errors import InputError, checked_on_main_process, die_with_launcher, run_command, write_failed

REPORT = "report.json"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m textclf.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model folder that export wrote, or a step_<N> checkpoint")
    parser.add_argument("--file", help=f"labelled data, in any format --data takes (default: the examples the "
                        f"training run evaluated, {HELD_OUT} in the output folder that holds --model)")
    add_task_options(parser)
    parser.add_argument("--label_column", help="the column that holds the true label (default: the training run's)")
    parser.add_argument("--label_separator", help="several labels: what separates the names in a CSV label cell "
                                                  "(default: the training run's)")
    parser.add_argument("--delimiter", help="field delimiter of a delimited --file (default: by suffix)")
    parser.add_argument("--encoding", help="text encoding of --file (default: UTF-8, or GB18030 when not UTF-8)")
    parser.add_argument("--output_dir", required=True, help=f"where {REPORT} and the picture go")
    parser.add_argument("--train_data", help="the baseline's training data (default: the training run's `data`, "
                                             "split as the run split it)")
    parser.add_argument("--no_baseline", action="store_true", help="leave the TF-IDF + linear baseline out")
    parser.add_argument("--batch_size", type=int, default=64, help="texts per batch and process")
    parser.add_argument("--metric", nargs="+", action="extend", default=[],
                        help="more scores, each an evaluate module, as train.py's --metric takes them; the run's own "
                        "come with a checkpoint this user's run signed (a module is code: from a model folder or a "
                        "checkpoint from elsewhere it runs only when named here)")
    add_loading_options(parser)
    args = parser.parse_args(argv)
    require_trained_model(args.model)
    if args.file is None:
        args.file = held_out_file(args.model)
    require_data(args.file, args.train_data)
    return args


def held_out_file(model: str) -> str:
    """The examples the run that made `model` (its exported model/ or a step_<N>/ checkpoint) evaluated: the
    file it wrote beside it, in its output folder."""
    path = os.path.join(os.path.dirname(os.path.normpath(model)), HELD_OUT)
    if not os.path.isfile(path):
        raise InputError(f"no --file given, and {path}, the examples the run that made {model} evaluated, is not "
                         f"there (the model was moved, or made before runs wrote it); pass a labelled --file")
    return path


if __name__ == "__main__":
    die_with_launcher()  # under accelerate launch: end with the launcher, however it ends
    # The command line first: --help and a mistyped flag answer at once, not after the imports below.
    ARGS = run_command(parse_args)

import time

import numpy as np
import scipy.sparse
from datasets import Dataset
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.metrics import classification_report
from transformers.utils import logging as transformers_logging

from textclf.checkpointing import POSITION, authorship, read_verified_position
from textclf.data import fingerprint, load_splits, read_labelled
from textclf.files import write_json
from textclf.launch import scoped
from textclf.models import inference_accelerator, label_names, load_trained, predict_logits, read_training, run_config
from textclf.tasks import Task


def metrics_to_run(model_path: str, run_metrics: list[str], given: list[str]) -> tuple[list[str], list[str]]:
    """The evaluate modules the report scores with besides the task's: those given here, and the run's own where a
    checkpoint this user's run signed names them; and the run's own left out. A module is code, and a model folder's
    training.json or a checkpoint from elsewhere could name anyone's."""
    own = (os.path.isfile(os.path.join(model_path, POSITION))
           and authorship(model_path, read_verified_position(model_path)) is None)
    left_out = [] if own else [name for name in run_metrics if name not in given]
    return [*dict.fromkeys([*given, *(run_metrics if own else [])])], left_out


def training_examples(cfg: TrainConfig, task: Task, names: list[str], model_path: str) -> Dataset:
    """The examples the model was trained on, rebuilt as train.py builds them from the run's config (data,
    eval_data, eval_split, seed): all of `data` when the run had eval_data, else the same held-out split."""
    if cfg.data != DEFAULT_DATA and not os.path.exists(cfg.data):
        raise InputError(f"the baseline is fitted on the model's training data, {cfg.data}, which is not found "
                         "here; pass it with --train_data (or leave the baseline out with --no_baseline)")
    if cfg.eval_data:
        train, train_names = read_labelled(cfg.data, task, cfg.delimiter, cfg.encoding)
    else:
        train, _, train_names = load_splits(cfg.data, None, task, cfg.eval_split, cfg.seed, cfg.delimiter, cfg.encoding)
    if train_names != names:
        raise InputError(f"the training data {cfg.data} has labels {', '.join(train_names)}; the model has "
                         f"{', '.join(names)}: pass the data it was trained on with --train_data")
    trained_on = read_training(model_path).get("data_fingerprint")
    if trained_on and fingerprint(train) != trained_on:
        print(f"warning: the examples of {cfg.data} are not those {model_path} was trained on; the baseline is "
              "fitted on them all the same", file=sys.stderr)
    return train


def font_covering(texts: list[str]) -> Optional[str]:
    """An installed font with a glyph for every character of `texts` (the default font if it has them).

    The file system is searched afresh, not matplotlib's font cache: a CJK font installed after
    matplotlib first ran (apt-get install fonts-noto-cjk) is missing from the cache.
    """
    from matplotlib import font_manager, ft2font

    needed = {ord(char) for text in texts for char in text}
    default = font_manager.findfont(font_manager.FontProperties())
    for path in [default, *sorted(font_manager.findSystemFonts())]:
        try:
            if needed <= ft2font.FT2Font(path).get_charmap().keys():
                font_manager.fontManager.addfont(path)
                return font_manager.FontProperties(fname=path).get_name()
        except (OSError, RuntimeError):  # a font file FreeType cannot read
            continue
    return None


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise InputError("drawing the report's picture needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, path: str) -> None:
    """Write the picture through a temporary file and a rename (never through a symbolic link), then let the figure
    go."""
    figure.tight_layout()
    try:
        with files.replacing(path, "wb", suffix=".incomplete.png",
                             advice="free space (or choose another --output_dir), then run again") as f:
            figure.savefig(f, format="png", dpi=120)
    finally:
        pyplot().close(figure)


def draw_confusion_matrix(report: dict, title: str, path: str) -> None:
    import matplotlib
    from sklearn.metrics import ConfusionMatrixDisplay

    plt = pyplot()
    names = report["labels"]
    font = font_covering(names)
    if font is None:
        print("warning: no installed font has glyphs for the label names; the confusion matrix shows label ids "
              f"(names in {REPORT}). Install one, e.g. apt-get install fonts-noto-cjk", file=sys.stderr)
    tick_labels = names if font else [str(i) for i in range(len(names))]
    size = 3 + 0.6 * len(names)
    with matplotlib.rc_context({"font.family": [font] if font else matplotlib.rcParams["font.family"]}):
        figure, axes = plt.subplots(figsize=(size + 1, size))
        display = ConfusionMatrixDisplay(np.array(report["confusion_matrix"]), display_labels=tick_labels)
        display.plot(ax=axes, cmap="Blues", xticks_rotation=45, colorbar=True)
        axes.set_title(title)
        save_figure(figure, path)


def draw_predicted_vs_true(references: list[float], predictions: list[float], title: str, path: str) -> None:
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6, 6))
    axes.scatter(references, predictions, s=8, alpha=0.5)
    low, high = min(references + predictions), max(references + predictions)
    axes.plot([low, high], [low, high], color="gray", linewidth=1, label="predicted = true")
    axes.set(xlabel="true score", ylabel="predicted score", title=title, aspect="equal")
    axes.legend(loc="upper left")
    save_figure(figure, path)


# The pictures a task may name (Task.picture), and what draws each from the report and the predictions.
DRAWINGS = {
    "confusion_matrix.png": lambda report, references, predictions, *where: draw_confusion_matrix(report, *where),
    "predicted_vs_true.png": lambda report, *drawn: draw_predicted_vs_true(*drawn),
}


@scoped
def main(argv=None, args: Optional[argparse.Namespace] = None) -> None:
    args = args or parse_args(argv)
    transformers_logging.disable_progress_bar()

    accelerator = inference_accelerator()
    model, tokenizer = load_trained(args.model, args.allow_pickle, args.trust_remote_code)  # verified: then its config
    options = ("task", "text_column", "text_pair_column", "threshold", "label_column", "label_separator")
    cfg = run_config(args.model, {**{key: getattr(args, key) for key in options}, "data": args.train_data})
    task = Task.from_config(cfg)
    # The run's scores, by the same evaluate modules: the task's, and those its --metric named that may run here.
    metrics, left_out = metrics_to_run(args.model, cfg.metric, args.metric)
    if left_out and accelerator.is_main_process:
        names = " ".join(left_out)
        print(f"warning: the run that made {args.model} also scored --metric {names}; nothing proves that this "
              f"user's run wrote {args.model}, and a metric module is code, so it is not run: add --metric {names} "
              "to score it too", file=sys.stderr)
    scores = task.scores_with(checked_on_main_process(accelerator, lambda: Task.find_metrics(metrics)))
    names = label_names(model)
    table, _ = read_labelled(args.file, task, args.delimiter, args.encoding, names)  # an unknown label stops it here
    knows_training_data = bool(args.train_data or read_training(args.model))
    train = training_examples(cfg, task, names, args.model) if knows_training_data and not args.no_baseline else None
    pairs = table["text_pair"][:] if task.text_pair_column else None
    logits = predict_logits(model, tokenizer, table["text"][:], pairs, batch_size=args.batch_size,
                            accelerator=accelerator, progress=True)
    if accelerator.is_main_process:
        references, predictions = table["labels"][:], task.predictions(logits).tolist()
        scores.add_batch(predictions=predictions, references=references)
        report = {"model": args.model, "file": args.file, "task": task.kind,
                  "samples": len(references), **scores.compute(names=names),
                  **task.figures(references, predictions, names)}  # scores over every label the model has
        print(f"model:    {task.summary(report, prefix='', separator=' | ')} | {len(table)} examples of {args.file}")
        if train is not None:
            baseline, about = baseline_predictions(task, train, table)
            report["baseline"] = {**about, **task.compute_scores(baseline, references, names)}
            print(f"baseline: {task.summary(report['baseline'], prefix='', separator=' | ')} | {about['method']}, "
                  f"fitted in {about['fit_seconds']:.1f} s on the {about['train_examples']} examples the model "
                  "was trained on")
        elif not args.no_baseline:
            print(f"baseline: none ({args.model} does not say what it was trained on; pass --train_data)")
        if "labels" in report:  # a task with a table per label
            print(classification_report(references, predictions, labels=list(range(len(names))), target_names=names,
                                        digits=4, zero_division=0))
        try:
            made = files.make_folders(args.output_dir)
        except OSError as e:
            raise write_failed("create", args.output_dir, e, "choose another --output_dir, or make its parent "
                               "writable") from None
        try:
            write_json(os.path.join(args.output_dir, REPORT), report)
            picture = task.picture
            if picture:
                title = f"{task.summary(report, prefix='')}, {report['samples']} examples"
                DRAWINGS[picture](report, references, predictions, title, os.path.join(args.output_dir, picture))
        except BaseException:
            files.remove_empty(made)  # a failed report leaves no empty folder of its own making behind
            raise
        print(f"wrote {REPORT}{f' and {picture}' if picture else ''} to {args.output_dir}")
    accelerator.end_training()


# The baseline: a TF-IDF of character 1-3-grams (sublinear term frequency) and the task's linear model
# (Task.baseline), fitted on the examples the model was trained on, in seconds on a CPU. Character n-grams need no word
# segmentation (Chinese has no spaces); for pairs, each text is a vector of its own, and their elementwise product adds
# the n-grams the two share.

def features(vectorizer: TfidfVectorizer, table: Dataset, fit: bool = False):
    """One row per example: the text's n-grams, or for a pair both texts' and what they share. With `fit`,
    the vectorizer first learns its vocabulary and idf from every text (each is analysed once)."""
    texts = table["text"][:]
    pairs = table["text_pair"][:] if "text_pair" in table.column_names else []
    matrix = (vectorizer.fit_transform if fit else vectorizer.transform)(texts + pairs)
    if not pairs:
        return matrix
    text, pair = matrix[:len(texts)], matrix[len(texts):]
    return scipy.sparse.hstack([text, pair, text.multiply(pair)]).tocsr()


def baseline_predictions(task: Task, train: Dataset, test: Dataset) -> tuple[list, dict]:
    """(predictions on `test` in the form the task's scores take, what was fitted and how long it took).

    `train` and `test` have the columns load_splits gives (`text`, `text_pair` for pairs, `labels`).
    """
    start = time.perf_counter()
    vectorizer = TfidfVectorizer(analyzer="char", ngram_range=(1, 3), sublinear_tf=True)
    train_features = features(vectorizer, train, fit=True)
    model, method = task.baseline()
    model.fit(train_features, np.asarray(train["labels"][:]))
    seconds = time.perf_counter() - start
    predictions = model.predict(features(vectorizer, test))
    about = {"method": f"TF-IDF of character 1-3-grams + {method}", "train_examples": len(train),
             "fit_seconds": round(seconds, 2)}
    return predictions.tolist(), about


if __name__ == "__main__":
    run_command(lambda: main(args=ARGS))
