"""The scores are evaluate modules (textclf/tasks/scores.py): each built-in kind's own, equal to scikit-learn's and
SciPy's on fixed predictions; and any module --metric names, added to the logs as eval_<key> on one process and two,
kept by a resume, refused in one line before the data when it cannot be found offline (docs/tasks.md)."""

import json
import os
import textwrap

import pytest
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, mean_squared_error

from conftest import TINY, another_user, assert_refused, read_log, run_train, train_forked
from textclf.cli import parse_config, plan_run
from textclf.errors import InputError
from textclf.tasks.scores import FoundMetric, find_metric, load_metric
from textclf.tasks.task import Task

PREDICTED = [0, 2, 1, 1, 0, 2, 2, 1]


TRUE = [0, 1, 1, 1, 0, 2, 0, 1]


@pytest.fixture
def mean_prediction(tmp_path):
    """A metric of the user's own, as evaluate lays one out: a folder holding <folder name>.py."""
    folder = tmp_path / "mean_prediction"
    folder.mkdir()
    (folder / "mean_prediction.py").write_text(textwrap.dedent('''
        import datasets
        import evaluate


        class MeanPrediction(evaluate.Metric):
            """The share of examples predicted as label 1, and an accuracy of its own."""

            def _info(self):
                return evaluate.MetricInfo(
                    description=self.__doc__, citation="", inputs_description="label ids",
                    features=datasets.Features({"predictions": datasets.Value("int64"),
                                                "references": datasets.Value("int64")}))

            def _compute(self, predictions, references):
                return {"mean_prediction": sum(predictions) / len(predictions),
                        "accuracy": sum(p == r for p, r in zip(predictions, references)) / len(predictions)}
        '''), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def args(reviews_csv, cache_dir):
    # 216 training examples, 24 held out; an evaluation at steps 2 and 4.
    return [*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--max_steps", 4, "--eval_steps", 2,
            "--save_steps", 2]


def test_each_kind_s_scores_are_its_evaluate_module_s_and_equal_scikit_learn_s():
    single = Task.of("single_label", "t", "l")
    assert single.compute_scores(PREDICTED, TRUE) == {
        "accuracy": accuracy_score(TRUE, PREDICTED), "f1": f1_score(TRUE, PREDICTED, average="macro")}
    # Over every label the model has (the report): a label never seen counts as an F1 of 0.
    assert single.compute_scores(PREDICTED, TRUE, ["a", "b", "c", "d"])["f1"] == f1_score(
        TRUE, PREDICTED, average="macro", labels=[0, 1, 2, 3], zero_division=0)
    rows_true, rows_predicted = [[1, 0, 1], [0, 1, 0], [1, 1, 0]], [[1, 0, 0], [0, 1, 0], [1, 1, 1]]
    assert Task.of("multi_label", "t", "l").compute_scores(rows_predicted, rows_true) == {
        "micro_f1": f1_score(rows_true, rows_predicted, average="micro"),
        "macro_f1": f1_score(rows_true, rows_predicted, average="macro"),
        "subset_accuracy": accuracy_score(rows_true, rows_predicted)}
    scores_true, scores_predicted = [1.0, 3.0, 5.0, 2.5], [1.5, 2.0, 4.0, 2.5]
    assert Task.of("regression", "t", "l").compute_scores(scores_predicted, scores_true) == {
        "mse": mean_squared_error(scores_true, scores_predicted),
        "pearson": pearsonr(scores_predicted, scores_true)[0], "spearman": spearmanr(scores_predicted, scores_true)[0]}
    assert type(single.evaluation_module()).__name__ == "SingleLabelScores"
    assert single.evaluation_module().keep_in_memory  # no Arrow file, no file lock


def test_an_added_module_s_keys_join_the_task_s_whose_own_stay_as_they_are(mean_prediction):
    """A key the task has already (accuracy) is the added module's under its name; the task's keeps its own, where
    evaluate.combine would rename both."""
    found = find_metric(str(mean_prediction))
    assert found == FoundMetric(str(mean_prediction), str(mean_prediction / "mean_prediction.py"))
    assert find_metric(str(mean_prediction / "mean_prediction.py")).path == found.path  # the file itself too
    scores = Task.of("single_label", "t", "l").scores_with([found])
    for start in (0, 4):  # two batches, computed once
        scores.add_batch(predictions=PREDICTED[start:start + 4], references=TRUE[start:start + 4])
    assert scores.compute() == {"accuracy": accuracy_score(TRUE, PREDICTED),
                                "f1": f1_score(TRUE, PREDICTED, average="macro"),
                                "mean_prediction": sum(PREDICTED) / 8,
                                "mean_prediction_accuracy": accuracy_score(TRUE, PREDICTED)}
    scores.add_batch(predictions=[1, 1], references=[1, 0])  # the next evaluation starts empty
    assert scores.compute()["mean_prediction"] == 1.0


def test_a_module_that_cannot_be_found_or_read_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    with pytest.raises(InputError, match=r"--metric matthews_correlation: not in evaluate's cache, and this run is "
                                         r"offline .* save its script .* into a folder "
                                         r"matthews_correlation/matthews_correlation.py"):
        find_metric("matthews_correlation")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="holds no evaluate module .* empty.py in it"):
        find_metric(str(tmp_path / "empty"))
    (tmp_path / "broken.py").write_text("import a_package_that_is_not_here\n")
    with pytest.raises(InputError, match="broken.py does not import .ModuleNotFoundError"):
        load_metric(find_metric(str(tmp_path / "broken.py")))
    (tmp_path / "plain.py").write_text("x = 1\n")
    with pytest.raises(InputError, match="defines no evaluate module"):
        load_metric(find_metric(str(tmp_path / "plain.py")))


def test_metric_adds_up_when_given_again_and_picks_the_best_checkpoint():
    cfg = parse_config(["--metric", "a", "--report_to", "none", "--metric=b", "c", "--report_to", "tensorboard"])
    assert cfg.metric == ["a", "b", "c"] and cfg.report_to == ["tensorboard"]  # others keep the last
    assert parse_config(["--metric", "m", "--metric_for_best_model", "mean_prediction"]).metric_for_best_model == \
        "eval_mean_prediction"  # an added module's key: checked at the first evaluation
    with pytest.raises(InputError, match="not a score of task single_label .* comes with --metric"):
        parse_config(["--metric_for_best_model", "mean_prediction"])
    task = Task.of("single_label", "t", "l")
    assert task.greater_is_better("eval_matthews_correlation") and not task.greater_is_better("eval_mean_loss")
    assert not task.greater_is_better("eval_wer") and task.greater_is_better("eval_f1")


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2], ids=["one process", "cpu.yaml"])
def test_a_local_module_adds_its_keys_to_every_evaluation_and_a_resume_keeps_it(tmp_path, args, mean_prediction,
                                                                               processes):
    """`--metric <folder>`: eval_mean_prediction beside the task's own at each evaluation, over the whole eval set
    (eval_samples 24 under 2 processes too); resumed by path alone, the run keeps it (the checkpoint's config)."""
    launch = {"config_file": None} if processes == 1 else {}
    train_forked([*args, "--metric", mean_prediction, "--output_dir", tmp_path / "run"], **launch)
    evaluations = [row for row in read_log(tmp_path / "run") if "eval_samples" in row]
    assert [row["step"] for row in evaluations] == [2, 4], evaluations
    assert all(row["eval_samples"] == 24 and {"eval_accuracy", "eval_f1", "eval_mean_prediction",
                                              "eval_mean_prediction_accuracy"} <= row.keys() for row in evaluations)
    recorded = json.loads((tmp_path / "run" / "step_2" / "position.json").read_text())["config"]["metric"]
    assert recorded == [str(mean_prediction)]
    train_forked(["--resume", tmp_path / "run" / "step_2", "--output_dir", tmp_path / "resumed"], **launch)
    [resumed] = [row for row in read_log(tmp_path / "resumed") if "eval_samples" in row]
    assert resumed["eval_mean_prediction"] == evaluations[-1]["eval_mean_prediction"]


@pytest.mark.slow
def test_a_metric_named_by_a_run_nothing_proves_is_this_user_s_runs_only_when_named_again(tmp_path, args,
                                                                                        mean_prediction, capsys):
    """A metric module is code. report scores with the run's own where this user's run signed the checkpoint; from
    an exported folder (whose training.json anyone could write) or a checkpoint from elsewhere it is named in one
    line and not run, unless given here. A resume from elsewhere whose config names one is refused until the command
    line names it too."""
    from textclf import report

    run = tmp_path / "run"
    train_forked([*args, "--max_steps", 2, "--metric", mean_prediction, "--output_dir", run], config_file=None)

    def scored(model, *more):
        out = tmp_path / f"report_{len(list(tmp_path.glob('report_*')))}"
        report.main(list(map(str, ["--model", model, "--output_dir", out, "--no_baseline", *more])))
        return json.loads((out / "report.json").read_text())

    assert "mean_prediction" in scored(run / "step_2")  # signed by this user's run
    capsys.readouterr()
    assert "mean_prediction" not in scored(run / "model")
    assert (f"warning: the run that made {run / 'model'} also scored --metric {mean_prediction}; nothing proves"
            in capsys.readouterr().err)
    assert "mean_prediction" in scored(run / "model", "--metric", mean_prediction)

    with another_user(tmp_path):
        argv = ["--resume", str(run / "step_2"), "--output_dir", str(tmp_path / "resumed")]
        with pytest.raises(InputError) as refused:
            plan_run(parse_config(argv), argv)
        assert str(refused.value) == (
            f"{run / 'step_2'} was written elsewhere (it was signed with another secret than this user's "
            f"({os.environ['TEXTCLF_SECRET_FILE']}): another user or machine wrote it), and its config names --metric "
            f"{mean_prediction}, a module whose code the run would run; if you trust it, name it here too: --metric "
            f"{mean_prediction} (or give the --metric modules to run instead)")
        argv += ["--metric", str(mean_prediction)]
        cfg, start = plan_run(parse_config(argv), argv)
        assert cfg.metric == [str(mean_prediction)] and start.checkpoint == str(run / "step_2")


@pytest.mark.slow
def test_a_hub_metric_not_cached_offline_is_one_line_before_any_step(tmp_path, args):
    result = run_train([*args, "--metric", "matthews_correlation", "--output_dir", tmp_path / "out"], check=False,
                       env={"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_EVALUATE_OFFLINE": "1"})
    assert_refused(result, "--metric matthews_correlation: not in evaluate's cache, and this run is offline")
    assert "data:" not in result.stdout and not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_evaluation_benchmark_prints_both_ways_with_the_same_scores(tmp_path, reviews_csv, capsys):
    from benchmarks.evaluation import main

    main(["--rows", "300", "--repeats", "1", "--data", str(reviews_csv), "--output_dir", str(tmp_path)])
    table = capsys.readouterr().out
    assert "| evaluate modules (add_batch, compute) |" in table and "| lists and scikit-learn | " in table
    assert {row["way"] for row in json.loads((tmp_path / "evaluation.json").read_text())} == {
        "evaluate modules (add_batch, compute)", "lists and scikit-learn"}
