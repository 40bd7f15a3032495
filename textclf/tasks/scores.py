"""The scores, as Hugging Face `evaluate` modules: each built-in kind's own, shipped here (they load with no network),
and any module --metric names, a Hub name (found in evaluate's cache, or fetched once online) or a local file or
folder. A run's evaluation feeds them the predictions `gather_for_metrics` gave every process, a batch at a time
(add_batch), and computes them once: kept in memory, each on its own process, so no Arrow file is written and no file
lock is shared by ranks. Imported where scores are computed, not with the kinds, which the command line reads before
anything heavy.
"""

import hashlib
import importlib.util
import inspect
import math
import os
import sys
from dataclasses import dataclass
from typing import Optional

import datasets
import evaluate

from textclf.errors import InputError

_CITATION = ""  # the scores are scikit-learn's and SciPy's, as evaluate's own metric scripts compute them


class SingleLabelScores(evaluate.Metric):
    """Accuracy and macro-F1 of one label per example. `names` (compute): every label the model has, which macro-F1
    averages over (the report), else the labels that occur."""

    def _info(self):
        return evaluate.MetricInfo(
            description=self.__doc__, citation=_CITATION, inputs_description="predictions, references: label ids",
            features=datasets.Features({"predictions": datasets.Value("int64"),
                                        "references": datasets.Value("int64")}))

    def _compute(self, predictions, references, names: Optional[list[str]] = None):
        from sklearn.metrics import accuracy_score, f1_score

        labels = list(range(len(names))) if names else None
        return {"accuracy": float(accuracy_score(references, predictions)),
                "f1": float(f1_score(references, predictions, average="macro", labels=labels, zero_division=0))}


class MultiLabelScores(evaluate.Metric):
    """Micro-F1, macro-F1 and subset accuracy (every label of the example right) of 0/1 rows, one column per label."""

    def _info(self):
        return evaluate.MetricInfo(
            description=self.__doc__, citation=_CITATION, inputs_description="predictions, references: 0/1 rows",
            features=datasets.Features({"predictions": datasets.Sequence(datasets.Value("int64")),
                                        "references": datasets.Sequence(datasets.Value("int64"))}))

    def _compute(self, predictions, references, names: Optional[list[str]] = None):
        from sklearn.metrics import accuracy_score, f1_score

        # On 0/1 indicator rows scikit-learn's accuracy is subset accuracy.
        return {"micro_f1": float(f1_score(references, predictions, average="micro", zero_division=0)),
                "macro_f1": float(f1_score(references, predictions, average="macro", zero_division=0)),
                "subset_accuracy": float(accuracy_score(references, predictions))}


class RegressionScores(evaluate.Metric):
    """Mean squared error, Pearson's and Spearman's correlations of one score per example (a correlation is None
    where it is undefined: fewer than two examples, or a constant side)."""

    def _info(self):
        return evaluate.MetricInfo(
            description=self.__doc__, citation=_CITATION, inputs_description="predictions, references: scores",
            features=datasets.Features({"predictions": datasets.Value("float64"),
                                        "references": datasets.Value("float64")}))

    def _compute(self, predictions, references, names: Optional[list[str]] = None):
        from scipy.stats import pearsonr, spearmanr
        from sklearn.metrics import mean_squared_error

        return {"mse": float(mean_squared_error(references, predictions)),
                "pearson": correlation(pearsonr, predictions, references),
                "spearman": correlation(spearmanr, predictions, references)}


def correlation(function, predictions, references) -> Optional[float]:
    """None where a correlation is undefined (fewer than two examples, or a constant side), not SciPy's nan."""
    if min(len(set(predictions)), len(set(references))) < 2:
        return None
    value = float(function(predictions, references)[0])
    return None if math.isnan(value) else value


def kept_in_memory(module_class: type, config_name: Optional[str] = None) -> evaluate.EvaluationModule:
    """An instance that keeps what add_batch gives it in memory: no cache file, no lock (evaluate's default writes an
    Arrow file per process under a file lock)."""
    return module_class(config_name=config_name, keep_in_memory=True)


@dataclass(frozen=True)
class FoundMetric:
    """A --metric, found: the name as given, the module's file, and its config (`glue:mrpc`'s mrpc)."""

    name: str
    path: str
    config: Optional[str] = None


def find_metric(given: str) -> FoundMetric:
    """The module file of --metric `given` (NAME or NAME:CONFIG): a local .py file, or a folder holding NAME.py as
    evaluate lays them out; else a Hub name, found by evaluate's own loader in its cache (or fetched once, online).
    Said in one line where it cannot be found. Run by one process: fetching one takes a file lock."""
    name, _, config = given.partition(":") if not os.path.exists(given) else (given, "", "")
    if os.path.exists(name):
        path = name if os.path.isfile(name) else os.path.join(name, os.path.basename(os.path.normpath(name)) + ".py")
        if not (path.endswith(".py") and os.path.isfile(path)):
            raise InputError(f"--metric {given}: {name} holds no evaluate module (expected a .py file, or a folder "
                             f"with {os.path.basename(path)} in it, as evaluate lays them out)")
        return FoundMetric(given, os.path.abspath(path), config or None)
    from evaluate.loading import evaluation_module_factory

    try:
        module = evaluation_module_factory(name, module_type="metric")
    except Exception as e:  # evaluate's words for "not cached and not on the Hub": FileNotFoundError, ConnectionError
        offline = evaluate.config.HF_EVALUATE_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        why = ("not in evaluate's cache, and this run is offline (HF_EVALUATE_OFFLINE or HF_HUB_OFFLINE)" if offline
               else f"not in evaluate's cache, nor found on the Hub ({str(e).splitlines()[0] if str(e) else e!r})")
        raise InputError(f"--metric {given}: {why}; to use it offline, run once online (it is then cached in "
                         f"{evaluate.config.HF_MODULES_CACHE}), or save its script (on the Hub: "
                         f"https://huggingface.co/spaces/evaluate-metric/{name}) into a folder {name}/{name}.py and "
                         f"pass --metric <that folder>") from None
    return FoundMetric(given, importlib.import_module(module.module_path).__file__, config or None)


def load_metric(found: FoundMetric) -> evaluate.EvaluationModule:
    """The module a FoundMetric names, read from its file by this process itself (evaluate's loader would copy it
    into its modules cache under a file lock, which ranks would share and which a killed run leaves held), kept in
    memory."""
    key = "textclf_metric_" + hashlib.sha256(found.path.encode()).hexdigest()[:16]
    module = sys.modules.get(key)
    if module is None:
        spec = importlib.util.spec_from_file_location(key, found.path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[key]
            raise InputError(f"--metric {found.name}: {found.path} does not import ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}); fix or remove it") from None
    classes = [value for value in vars(module).values() if isinstance(value, type)
               and issubclass(value, evaluate.EvaluationModule) and value.__module__ == key
               and not inspect.isabstract(value)]
    if not classes:
        raise InputError(f"--metric {found.name}: {found.path} defines no evaluate module (a class derived from "
                         "evaluate.Metric)")
    try:
        return kept_in_memory(classes[0], found.config)
    except (KeyError, ValueError) as e:  # a config the module does not have (glue's names its own)
        raise InputError(f"--metric {found.name}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


class Scores:
    """The scores of one evaluation: the task's own module, whose keys stay as they are, and those --metric added,
    fed every batch (add_batch) and computed once per evaluation (compute). evaluate.combine would do the feeding,
    but on a key two modules share it renames both, the task's own too; here only the added module's key is
    prefixed with its name.

    The batches are kept here and given to each module in one add_batch when the evaluation computes: evaluate's
    Arrow buffer reads back slower the more batches it holds (10,000 rows in batches of 128 took ten times as long
    to compute as in one batch), which would add a tenth to an evaluation of a small model."""

    def __init__(self, task_module: evaluate.EvaluationModule, added: list[tuple[str, evaluate.EvaluationModule]]):
        self.modules = [("", task_module), *added]
        self.predictions, self.references = [], []

    def add_batch(self, predictions: list, references: list) -> None:
        self.predictions += predictions
        self.references += references

    def compute(self, **task_options) -> dict:
        """Every module's scores by key, each module then empty, ready for the next evaluation; `task_options` go to
        the task's own module alone (its `names`)."""
        batch, self.predictions, self.references = (self.predictions, self.references), [], []
        scores = {}
        for name, module in self.modules:
            module.add_batch(predictions=batch[0], references=batch[1])
            computed = module.compute(**(task_options if module is self.modules[0][1] else {}))
            if not isinstance(computed, dict):
                raise InputError(f"--metric {name} computed {computed!r}, not a dict of scores by name")
            for key, value in computed.items():
                if not (value is None or isinstance(value, (int, float))):
                    raise InputError(f"--metric {name} computed {key} = {str(value)[:80]}, not a number: the logs and "
                                     "trackers take one number per score; ask the module for an average")
                scores[f"{key}" if key not in scores else f"{metric_key(name)}_{key}"] = value
        return scores


def metric_key(name: str) -> str:
    """A --metric as it prefixes a key: the module's name, without its path or config."""
    return os.path.splitext(os.path.basename(os.path.normpath(name.partition(":")[0])))[0]
