"""Evaluate a trained model on a labelled file: accuracy, macro-F1, a per-class table, a confusion matrix.

    python -m textclf.report --model checkpoints/model --file test.csv --label_column cat --output_dir report/
    accelerate launch --config_file accelerate_configs/cpu.yaml -m textclf.report --model ... --file ... ...

Prints the scores and the per-class precision / recall / F1 / support table with the label names,
and writes them to <output_dir>/report.json, with the confusion matrix drawn in confusion_matrix.png.
"""

import argparse
import os
import sys
from typing import Optional

import numpy as np
from sklearn.metrics import classification_report, confusion_matrix
from transformers.utils import logging as transformers_logging

from .checkpoint import write_json
from .errors import InputError, run_command
from .data import encode_labels, load_table, select_columns
from .metrics import classification_scores
from .loading import load_trained
from .runtime import die_with_launcher
from .predict import inference_accelerator, label_names, predict_logits

REPORT = "report.json"
CONFUSION_MATRIX = "confusion_matrix.png"


def scores(references: list[int], predictions: list[int], names: list[str]) -> dict:
    """The same accuracy and macro-F1 as training's evaluation, plus the per-class table and matrix."""
    labels = list(range(len(names)))
    overall = classification_scores(predictions, references, labels=labels)
    per_class = classification_report(references, predictions, labels=labels, target_names=names,
                                      output_dict=True, zero_division=0)
    return {
        "samples": len(references),
        "accuracy": overall["accuracy"],
        "macro_f1": overall["f1"],
        "per_class": {name: {"precision": per_class[name]["precision"], "recall": per_class[name]["recall"],
                             "f1": per_class[name]["f1-score"], "support": int(per_class[name]["support"])}
                      for name in names},
        "labels": names,
        # rows: true label, columns: predicted label
        "confusion_matrix": confusion_matrix(references, predictions, labels=labels).tolist(),
    }


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


def draw_confusion_matrix(report: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise InputError("drawing the confusion matrix needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from sklearn.metrics import ConfusionMatrixDisplay

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
        axes.set_title(f"accuracy {report['accuracy']:.4f}, macro-F1 {report['macro_f1']:.4f}, "
                       f"{report['samples']} examples")
        figure.tight_layout()
        tmp = f"{path}.incomplete.png"
        figure.savefig(tmp, dpi=120)
        plt.close(figure)
    os.replace(tmp, path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m textclf.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model folder that export wrote, or a step_<N> checkpoint")
    parser.add_argument("--file", required=True, help="labelled data: CSV, JSON Lines, JSON or a `datasets` folder")
    parser.add_argument("--text_column", default="review", help="the column that holds the text")
    parser.add_argument("--label_column", default="label", help="the column that holds the true label")
    parser.add_argument("--output_dir", required=True, help=f"where {REPORT} and {CONFUSION_MATRIX} go")
    parser.add_argument("--batch_size", type=int, default=64, help="texts per batch and process")
    parser.add_argument("--allow_pickle", action="store_true",
                        help="allow a DeepSpeed checkpoint, whose files load only as full pickles (trusted files only)")
    args = parser.parse_args(argv)
    transformers_logging.disable_progress_bar()

    accelerator = inference_accelerator()
    model, tokenizer = load_trained(args.model, args.allow_pickle)
    names = label_names(model)
    table = select_columns(load_table(args.file), args.file, args.text_column, args.label_column)
    table = encode_labels(table, names, args.file)  # a label the model does not know stops here
    logits = predict_logits(model, tokenizer, table["text"], batch_size=args.batch_size, accelerator=accelerator,
                            progress=True)
    if accelerator.is_main_process:
        references, predictions = table["labels"], logits.argmax(dim=-1).tolist()
        report = scores(references, predictions, names)
        print(f"accuracy {report['accuracy']:.4f} | macro-F1 {report['macro_f1']:.4f} | "
              f"{report['samples']} examples of {args.file}")
        print(classification_report(references, predictions, labels=list(range(len(names))), target_names=names,
                                    digits=4, zero_division=0))
        os.makedirs(args.output_dir, exist_ok=True)
        write_json(os.path.join(args.output_dir, REPORT), {"model": args.model, "file": args.file, **report})
        draw_confusion_matrix(report, os.path.join(args.output_dir, CONFUSION_MATRIX))
        print(f"wrote {REPORT} and {CONFUSION_MATRIX} to {args.output_dir}")
    accelerator.end_training()


if __name__ == "__main__":
    die_with_launcher()  # under accelerate launch: end with the launcher, however it ends
    run_command(main)
