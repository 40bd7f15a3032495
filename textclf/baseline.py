"""The baseline a report stands the model beside: a TF-IDF of character 1-3-grams (sublinear term
frequency) and the task's linear model (Task.baseline), fitted on the examples the model was trained
on. It takes seconds on a CPU (docs/after-training.md), so a user sees at once whether fine-tuning beat it.

Character n-grams need no word segmentation (Chinese has no spaces). For pairs, each text is a vector
of its own and their elementwise product adds the n-grams the two share.
"""

import time

import numpy as np
import scipy.sparse
from datasets import Dataset
from sklearn.feature_extraction.text import TfidfVectorizer

from .task import Task


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
