"""How far one run's path travels through the code: a tiny default run of train.py (as `python train.py ...` runs it,
its command line included) traced in this process, every first call of a function of textclf/ or train.py recorded
in order (lambdas and comprehensions too; not the code modules and class bodies run on import). Prints the files it
touches, how often consecutive first calls switch file, the functions it calls and the lines of their bodies
(docs/development.md quotes them).

    python scripts/trace_run.py                 # 2 optimizer steps of the default job's model on 240 reviews
    python scripts/trace_run.py --order         # and the first calls themselves, in order

Offline, in a temporary folder; nothing of the repository is written.
"""

import argparse
import ast
import csv
import inspect
import os
import random
import runpy
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def sample_reviews(corpus: str, path: str, per_label: int = 120) -> None:
    """A small data file from the default corpus: `per_label` reviews of each label, texts cut to 60 characters."""
    with open(corpus, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    random.Random(0).shuffle(rows)
    picked = [row for label in sorted({row["label"] for row in rows})
              for row in [r for r in rows if r["label"] == label][:per_label]]
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["label", "review"])
        writer.writeheader()
        writer.writerows({"label": row["label"], "review": row["review"][:60]} for row in picked)


def body_lines(filename: str, first_line: int) -> int:
    """The lines of the function defined at `first_line` of `filename`, its signature and decorators excluded."""
    for node in ast.walk(ast.parse(Path(filename).read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and first_line in (
                node.lineno, *(decorator.lineno for decorator in node.decorator_list)):
            return node.end_lineno - node.body[0].lineno + 1
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--order", action="store_true", help="print every first call, in order")
    args = parser.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    from textclf.data.reading import build_default_corpus

    ours = (str(REPO / "textclf") + os.sep, str(REPO / "train.py"))
    first_calls: dict[tuple[str, int], str] = {}

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            # A function's code has its own locals; a module's or a class body's (run on import) has not.
            if code.co_filename.startswith(ours) and code.co_flags & inspect.CO_NEWLOCALS:
                first_calls.setdefault((code.co_filename, code.co_firstlineno), code.co_qualname)

    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.csv")
        build_default_corpus(corpus)
        data = os.path.join(tmp, "reviews.csv")
        sample_reviews(corpus, data)
        argv = ["--model", "scratch-tiny", "--max_length", "32", "--per_device_train_batch_size", "8",
                "--max_steps", "2", "--logging_steps", "1", "--report_to", "none", "--data", data,
                "--cache_dir", os.path.join(tmp, "cache"), "--output_dir", os.path.join(tmp, "out")]
        os.environ["TEXTCLF_SECRET_FILE"] = os.path.join(tmp, "secret")
        sys.argv = [str(REPO / "train.py"), *argv]
        sys.setprofile(profile)
        try:
            runpy.run_path(str(REPO / "train.py"), run_name="__main__")
        except SystemExit as e:  # exit_finished_run's
            if e.code:
                raise
        finally:
            sys.setprofile(None)
    files = [os.path.relpath(filename, REPO) for filename, _ in first_calls]
    switches = sum(1 for a, b in zip(files, files[1:]) if a != b)
    lines = sum(body_lines(filename, line) for filename, line in first_calls)
    if args.order:
        for (filename, line), name in first_calls.items():
            print(f"{os.path.relpath(filename, REPO)}:{line} {name}")
    print(f"{len(first_calls)} functions in {len(set(files))} files, {switches} file switches in first-call order, "
          f"{lines:,} lines of function bodies")


if __name__ == "__main__":
    main()
