"""What users type and what their tools see: labels as people write them, trackers, the command line's
answers. In-process where the behaviour allows it (the functions are called, their InputError caught)."""

import json
import re
import warnings

import pytest
import torch

from textclf.data.examples import load_splits
from textclf.errors import InputError
from textclf.tasks.task import Task

SINGLE = Task.of("single_label", text_column="review", label_column="label")


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def splits(tmp_path, name, text, task=SINGLE, eval_text=None):
    eval_data = write(tmp_path / f"eval_{name}", eval_text) if eval_text else None
    return load_splits(write(tmp_path / name, text), eval_data, task, 0.25, 0)


# --- labels as people write them ---------------------------------------------------------------------------

def test_label_cells_are_trimmed_and_none_null_are_class_names(tmp_path):
    rows = "".join(f"{label},评论{i}\n" for i, label in enumerate([" 书籍", "书籍 ", "None", "null", "pos"] * 4))
    train, held_out, names = splits(tmp_path, "d.csv", "label,review\n" + rows)
    assert names == ["None", "null", "pos", "书籍"]
    assert len(train) + len(held_out) == 20


@pytest.mark.parametrize("task", ["single_label", "multi_label", "regression"])
@pytest.mark.parametrize("name, spelled", [("d.csv", ["nan", "NaN", "NA"]), ("d.tsv", ["NA"])])
def test_a_missing_number_spelled_in_a_label_cell_is_refused_not_a_class(tmp_path, task, name, spelled):
    labels = ["1", "0", *spelled, "0", "1", "0", "1"]
    sep = "\t" if name.endswith(".tsv") else ","
    rows = "".join(f"{label}{sep}评论{i}\n" for i, label in enumerate(labels))
    with pytest.raises(InputError) as refused:
        splits(tmp_path, name, f"label{sep}review\n" + rows, task=Task.of(task, "review", "label"))
    rows_named = "row 3 has" if len(spelled) == 1 else "3 rows (3, 4, 5) have"
    shown = ", ".join(map(repr, spelled))
    assert str(refused.value) == (f"{tmp_path / name}: {rows_named} a label spelled as a missing number ({shown}) in "
                                  "column 'label', which pandas and datasets read as NaN; fill them in or remove those "
                                  "rows")


def test_empty_label_cells_are_named_by_row_first_few_and_a_count(tmp_path):
    labels = ["1", "", "0", "", "1", "0", "", " ", "", "", "1", "", "0"]  # empty at rows 2, 4, 7, 8, 9, 10, 12
    rows = "".join(f"{label},评论{i}\n" for i, label in enumerate(labels))
    with pytest.raises(InputError, match=r"d.csv: 7 rows \(2, 4, 7, 8, 9 and 2 more\) have no value in label "
                                         r"column 'label'; fill them in"):
        splits(tmp_path, "d.csv", "label,review\n" + rows)


def test_row_numbers_count_the_rows_dropped_for_empty_text(tmp_path):
    with pytest.raises(InputError, match=r"d.csv: row 3 has no value in label column"):
        splits(tmp_path, "d.csv", "label,review\n1,\n0,好\n,差\n1,棒\n")


@pytest.mark.parametrize("line, where, advice", [
    ('{"review": "好", "label": 1.5}', "row 2: label 1.5 in column 'label' is not a class", "use --task regression"),
    ('{"review": "好", "label": NaN}', "row 2 has a label spelled as a missing number (nan) in column 'label'",
     "fill them in or remove those rows"),
])
def test_float_and_nan_classes_are_refused_with_regression_suggested(tmp_path, line, where, advice):
    with pytest.raises(InputError, match=advice) as refused:
        splits(tmp_path, "d.jsonl", '{"review": "差", "label": 0}\n' + line + "\n",
               eval_text='{"review": "棒", "label": 1}\n')
    assert where in str(refused.value)


def test_integral_floats_are_integer_classes(tmp_path):
    rows = "".join(f'{{"review": "评论{i}", "label": {i % 2}.0}}\n' for i in range(8))
    _, _, names = splits(tmp_path, "d.jsonl", rows)
    assert names == ["0", "1"]


MIXED = "; clean the column so that every label is a name or every label is an integer, or for a number per " \
        "example use --task regression"


@pytest.mark.parametrize("name, lines, message", [
    ("d.jsonl", ['{"review": "好", "label": 1}', '{"review": "差", "label": "bad"}'],
     "label column 'label' mixes numbers (row 1: 1) and names (row 2: 'bad')" + MIXED),
    ("d.csv", ["label,review", "0,好", "1,差", "bad,棒", "1,烂"],  # a CSV reader gives every cell as a string
     "label column 'label' mixes numbers (row 1: '0', and 2 more) and names (row 3: 'bad')" + MIXED),
    ("d.jsonl", ['{"review": "好", "label": {"a": 1}}', '{"review": "差", "label": {"a": 2}}'],
     "row 1: label {'a': 1} in column 'label' is a dict, not a class; a class is a name or an integer"),
])
def test_mixed_and_dict_labels_are_one_line(tmp_path, name, lines, message):
    with pytest.raises(InputError) as refused:
        splits(tmp_path, name, "\n".join(lines) + "\n")
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_integers_beside_numbers_written_as_text_are_refused_not_sorted_together():
    with pytest.raises(InputError, match=re.escape("mixes integers (row 1: 1) and numbers written as text (row 2: '2')"
                                                   + MIXED)):
        SINGLE.parse_labels([1, "2"], "d.jsonl")  # as a reader that keeps each cell's JSON type gives them


def test_a_class_too_small_to_split_is_named_with_eval_data_suggested(tmp_path):
    rows = "".join(f"{'好坏'[i % 2]},评论{i}\n" for i in range(20)) + "书籍,一本书\n"
    with pytest.raises(InputError, match=r"1 class \('书籍'\) with a single example, and a class needs at least 2.*"
                                         "--eval_data"):
        splits(tmp_path, "d.csv", "label,review\n" + rows)


def test_ten_thousand_classes_of_one_example_are_counted_and_ten_named(tmp_path):
    rows = "".join(f"c{i},评论{i}\n" for i in range(10_000))
    with pytest.raises(InputError) as refused:
        splits(tmp_path, "d.csv", "label,review\n" + rows)
    assert "10000 classes ('c0', 'c1', 'c10', 'c100', 'c1000', 'c1001', 'c1002', 'c1003', 'c1004', 'c1005' and 9990 " \
           "more) with a single example" in str(refused.value)
    assert len(str(refused.value)) < 400


def test_an_integer_column_with_empty_cells_reports_them_and_regression_reads_the_rest(tmp_path):
    rows = "label,review\n" + "".join(f"{i % 3},评论{i}\n" for i in range(12)) + ",空\n"
    with pytest.raises(InputError, match="row 13 has no value in label column"):
        splits(tmp_path, "d.csv", rows)
    with pytest.raises(InputError, match="row 13 has no value in label column"):
        splits(tmp_path, "r.csv", rows, task=Task.of("regression", "review", "label"))


def test_the_same_column_for_text_and_label_is_refused_by_the_config():
    from textclf.config import TrainConfig

    with pytest.raises(InputError, match="column 'review' is both the text and the label column"):
        TrainConfig(text_column="review", label_column="review")


# --- trackers, the Trainer's way ---------------------------------------------------------------------------

def test_report_to_takes_a_list_all_or_none_as_the_trainer_does():
    from textclf.cli import parse_config
    from textclf.config import TrainConfig

    assert parse_config([]).report_to == ["tensorboard"]
    assert parse_config(["--report_to", "wandb", "tensorboard"]).report_to == ["wandb", "tensorboard"]
    assert TrainConfig(report_to="none").report_to == ["none"]  # a checkpoint's config from before lists
    with pytest.raises(InputError, match="'none' and 'all' stand alone"):
        parse_config(["--report_to", "none", "tensorboard"])


def test_an_unknown_or_missing_tracker_is_one_line(monkeypatch):
    import accelerate.tracking

    from textclf.launch.checks import check_trackers

    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: ["tensorboard"])
    with pytest.raises(InputError, match="--report_to tensorbord: unknown tracker 'tensorbord'; accelerate knows "
                                         ".*mlflow"):
        check_trackers(["tensorbord"])
    with pytest.raises(InputError, match="--report_to tensorboard mlflow, but mlflow is not installed; "
                                         "pip install mlflow"):
        check_trackers(["tensorboard", "mlflow"])


@pytest.fixture
def fresh_accelerator_state():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def test_tensorboard_scalars_read_back_under_the_run_name_and_the_project_is_never_tensorboard(
        tmp_path, monkeypatch, fresh_accelerator_state):
    """And the trackers get the Trainer's names (transformers' integrations): train/loss, train/learning_rate,
    train/epoch (fractional), eval/<metric> in TensorBoard; loss, learning_rate, eval_<metric> in a tracker whose
    Trainer callback keeps them flat; log.jsonl keeps its own keys."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from textclf import loop
    from textclf.config import TrainConfig
    from textclf.loop.tracking import LOG

    class Recorder(GeneralTracker):
        """A tracker registered the way accelerate documents (register_tracker_class): records its project."""
        name, requires_logging_directory, projects, logged = "recorder", False, [], []

        def __init__(self, project_name, **kwargs):
            super().__init__()
            Recorder.projects.append(project_name)

        @property
        def tracker(self):
            return None

        def store_init_configuration(self, values):
            pass

        def log(self, values, step=None, **kwargs):
            Recorder.logged.append(values)

    monkeypatch.setitem(LOGGER_TYPE_TO_CLASS, "recorder", Recorder)
    for project in (None, "reviews"):
        out = tmp_path / str(project)
        cfg = TrainConfig(report_to=["tensorboard", "recorder"], run_name="first", project_name=project,
                          output_dir=str(out))
        accelerator = Accelerator(cpu=True, log_with=loop.log_with(cfg), project_dir=cfg.output_dir)
        accelerator.init_trackers(cfg.project_name, **loop.tracker_config(cfg))  # as train.py starts them
        loop.use_trainer_names(accelerator, cfg.report_to)
        for step in (1, 2):
            accelerator.log({"loss": 1.0 / step, "lr": 0.25, "epoch": step / 4}, step=step)
        accelerator.log({"eval_accuracy": 0.75}, step=2)
        accelerator.end_training()
        AcceleratorState._reset_state(True)
    assert Recorder.projects == [None, "reviews"]  # each tracker's own convention, or --project_name
    events = EventAccumulator(str(tmp_path / "None" / "tensorboard" / "first"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"train/loss", "train/learning_rate", "train/epoch", "eval/accuracy"}
    assert [(event.step, event.value) for event in events.Scalars("train/loss")] == [(1, 1.0), (2, 0.5)]
    assert [event.value for event in events.Scalars("train/epoch")] == [0.25, 0.5]
    assert Recorder.logged[:3] == [{"loss": 1.0, "learning_rate": 0.25, "epoch": 0.25},
                                   {"loss": 0.5, "learning_rate": 0.25, "epoch": 0.5}, {"eval_accuracy": 0.75}]
    # log.jsonl is one of the trackers: accelerator.log wrote it too, one line per call, in its own names
    logged = [json.loads(line) for line in (tmp_path / "None" / LOG).read_text().splitlines()]
    assert [(row["step"], row["loss"], row["lr"]) for row in logged[:2]] == [(1, 1.0, 0.25), (2, 0.5, 0.25)]


def test_report_to_all_names_the_trackers_it_chose_and_wandb_writes_under_the_output_folder(
        tmp_path, monkeypatch, capsys, fresh_accelerator_state):
    from accelerate import Accelerator

    from textclf import loop
    from textclf.config import TrainConfig
    from textclf.loop import tracking

    monkeypatch.setattr(tracking, "get_available_trackers", lambda: ["tensorboard"])
    monkeypatch.delenv("WANDB_DIR", raising=False)
    cfg = TrainConfig(report_to=["all"], output_dir=str(tmp_path / "out"))
    accelerator = Accelerator(cpu=True, log_with=loop.log_with(cfg), project_dir=cfg.output_dir)
    started = loop.tracker_config(cfg)["init_kwargs"]
    accelerator.init_trackers(cfg.project_name, **loop.tracker_config(cfg))  # as train.py starts them
    loop.use_trainer_names(accelerator, cfg.report_to)
    accelerator.end_training()
    assert "--report_to all: tensorboard, and log.jsonl" in capsys.readouterr().out
    assert started["wandb"] == {"dir": cfg.output_dir}  # not ./wandb, the repository's root under a launch


@pytest.mark.parametrize("project, variable, experiment", [
    (None, None, "Default"), ("reviews", None, "reviews"), (None, "from-env", "from-env"),
])
def test_mlflow_s_experiment_is_never_none(monkeypatch, tmp_path, project, variable, experiment):
    """mlflow is not installed here: the experiment is what accelerate's MLflowTracker will start under
    (--project_name, or MLFLOW_EXPERIMENT_NAME, else mlflow's Default experiment as under the Trainer)."""
    from accelerate.tracking import MLflowTracker

    from textclf.loop.tracking import named_trackers

    if variable:
        monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", variable)
    else:
        monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    [mlflow] = [t for t in named_trackers(["mlflow"], str(tmp_path), project, "first") if t.name == "mlflow"]
    assert isinstance(mlflow, MLflowTracker) and (mlflow.experiment_name, mlflow.run_name) == (experiment, "first")



# --- the other bad inputs: one line each ---------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--model", "./my_modle"], "model not found: ./my_modle is a path (a hub id is name or namespace/name) and "
                                "nothing is there"),
    (["--dataloader_num_workers", "-1"], "dataloader_num_workers must be 0 or more, got -1"),
    (["--warmup_steps", "-2"], "warmup_steps must be 0 or more, got -2"),
    (["--runname", "a"], "unknown config key(s) --runname (did you mean --run_name?)"),
    (["--do_train"], "(--do_train: train.py always trains; leave it out)"),
    (["--push_to_hub"], "(--push_to_hub: upload the exported model with `hf upload <repo_id> <output_dir>/model`)"),
    (["--text_column", "review", "--label_column", "review"],
     "column 'review' is both the text and the label column; name the texts with --text_column"),
])
def test_bad_command_lines_are_one_line_saying_what_to_do(argv, message):
    from textclf.cli import parse_config

    with pytest.raises(InputError) as refused:
        parse_config(argv)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("recipe, command_line, blamed", [
    ("max_steps: two\n", [], True),
    ("max_steps: -3\n", [], True),
    ("max_steps: two\n", ["--max_steps", "3"], True),  # argparse still reads the recipe's value, and quotes it
    ("max_steps: 3\n", ["--max_steps", "0"], False),  # the command line's value
])
def test_a_type_error_in_a_recipe_names_the_recipe(tmp_path, recipe, command_line, blamed):
    from textclf.cli import parse_config

    path = write(tmp_path / "recipe.yaml", recipe)
    with pytest.raises(InputError) as refused:
        parse_config(["--config", path, *command_line])
    assert str(refused.value).startswith(f"config recipe {path}: ") == blamed
    assert "max_steps" in str(refused.value)


def test_predict_says_when_no_label_is_above_the_threshold():
    import torch

    task = Task.of("multi_label", "review", "label", threshold=0.7)
    rows = task.prediction_rows(["一般"], None, torch.tensor([[0.0, -1.0]]), ["服务", "价格"])
    assert task.terminal_line(rows[0]) == "(no label above 0.7)\t一般"


# --- fewer processes than asked ----------------------------------------------------------------------------

def one_process_yaml(tmp_path):
    """What `accelerate config default` writes on a machine without GPUs: one process, distributed_type NO."""
    return write(tmp_path / "default.yaml", "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\n"
                                            "num_processes: 1\nmixed_precision: 'no'\nuse_cpu: true\n")


def test_a_launch_that_starts_fewer_processes_than_asked_is_said_by_the_checks_rule(tmp_path):
    from textclf.launch.checks import launch_shortfall

    yaml = one_process_yaml(tmp_path)
    line = launch_shortfall(1, ["--config_file", yaml, "--num_processes", "2", "train.py", "--max_steps", "3"])
    assert line == (f"{yaml}: distributed_type NO starts a single process, not the 2 asked for; for several use "
                    "MULTI_GPU, as accelerate_configs/cpu.yaml does on a CPU (train.py uses gloo there), or "
                    "--multi_gpu on the launch line")
    assert launch_shortfall(1, ["--config_file", yaml, "train.py"]) is None


def test_train_py_warns_once_when_accelerate_launch_starts_one_of_two_processes(tmp_path):
    from conftest import TINY, run_train

    unlabelled = tmp_path / "unlabelled.csv"  # an error met once the data is read, after the warning
    unlabelled.write_text("review\n好\n", encoding="utf-8")
    result = run_train([*TINY, "--data", unlabelled, "--output_dir", tmp_path / "out"],
                       config_file=one_process_yaml(tmp_path), extra_launch_args=["--num_processes", "2"], check=False)
    warnings = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "distributed_type NO starts a single process, not the 2 asked for" in warnings[0]
    # accelerate's simple launcher reports the exit status 2 as its own failure (exit status 1)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1 and f"{unlabelled} has no label column 'label'" in errors[0]


# --- answers in seconds ------------------------------------------------------------------------------------

RUN = {"world_size": 1, "zero_stage": None, "mixed_precision": "no"}  # the launch, as check_against takes it


@pytest.mark.parametrize("position, launch", [
    ({"world_size": 2, "zero_stage": None, "mixed_precision": "bf16"},
     "precision (mixed_precision) bf16 (this launch: no); resume it with accelerate launch --config_file "
     "accelerate_configs/cpu.yaml (ddp.yaml on GPUs) --num_processes 2 --mixed_precision bf16 train.py --resume ck"),
    ({"world_size": 2, "zero_stage": 3, "mixed_precision": "bf16"},
     "DeepSpeed ZeRO stage 3 (this launch: None), precision (mixed_precision) bf16 (this launch: no); resume it "
     "with accelerate launch --config_file accelerate_configs/zero3.yaml (or its _offload variant) "
     "--num_processes 2 --mixed_precision bf16 train.py"),
    ({"world_size": 2, "zero_stage": None, "mixed_precision": "no"},  # FSDP's shards: not resharded
     "FSDP on 2 processes (this launch: 1), whose sharded states this textclf does not reshard; resume it with "
     "accelerate launch --config_file accelerate_configs/cpu.yaml (ddp.yaml on GPUs) --num_processes 2"),
])
def test_a_resume_on_another_launch_is_refused_with_the_launch_to_use(position, launch):
    from textclf.checkpointing.resume_rules import check_against

    run = {**RUN, "distributed_type": "FSDP"} if launch.startswith("FSDP") else RUN
    with pytest.raises(InputError) as refused:
        check_against("ck", position, run)
    assert str(refused.value).startswith(f"cannot resume from ck: it was made by a launch with {launch}")
    assert check_against("ck", {"world_size": 1, "zero_stage": None, "mixed_precision": "no"}, RUN) is None


def test_a_resume_on_another_number_of_processes_keeps_the_global_batch_or_names_the_ones_that_can():
    from textclf.checkpointing.resplit import batch_split, on_this_launch
    from textclf.checkpointing.resume_rules import check_against

    made = {"world_size": 2, "gradient_accumulation_steps": 3, "per_device_train_batch_size": 8,
            "global_batch_size": 48, "zero_stage": None, "mixed_precision": "no"}

    def split(world_size, position=made):
        found = batch_split("ck", position, world_size)
        return found["per_device_train_batch_size"], found["gradient_accumulation_steps"]

    # Down and up: the accumulation changes while it can, then the micro-batch.
    assert [split(n) for n in (1, 3, 6, 12, 48)] == [(8, 6), (8, 2), (8, 1), (4, 1), (1, 1)]
    # The micro-batch a resume made smaller grows back to the one asked for (the checkpoint's config).
    assert split(1, {**made, "world_size": 12, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
                     "config": {"per_device_train_batch_size": 8}}) == (8, 6)
    # Said with it: the run is no longer the uninterrupted one bit for bit (the README's claim says so too).
    assert check_against("ck", made, {**RUN, "world_size": 3}) == (
        "resuming ck, made by 2 processes with micro-batch 8 and gradient accumulation 3, on 3 processes: "
        "micro-batch 8 and gradient accumulation 2 keep its global batch of 48; the order gradients are summed in "
        "differs, so from here it matches the uninterrupted run to rounding, not bit for bit")
    assert check_against("ck", made, {**RUN, "world_size": 12}).endswith(
        "on 12 processes: micro-batch 4 and gradient accumulation 1 keep its global batch of 48; its dropout masks "
        "(micro-batches split) and the order gradients are summed in differ, so from here it matches the "
        "uninterrupted run closely, not bit for bit")
    with pytest.raises(InputError) as refused:
        split(5)
    assert str(refused.value) == (
        "cannot resume from ck on 5 processes: its global batch of 48 (2 processes x micro-batch 8 x accumulation 3) "
        "does not split into equal micro-batches over 5 processes; resume it on 1, 2, 3, 4, 6, 8, 12, 16, 24, 48 "
        "processes (accelerate launch --num_processes N ... train.py --resume ck)")
    with pytest.raises(InputError, match="made by an older textclf, whose data order depended on the number of "
                                         "processes"):
        split(2, {**made, "global_batch_size": None})
    # the position as the new launch counts it: batches per process into the epoch, the loss window split evenly
    window = {"loss_sum": 3.0, "losses": 6, "samples": 48, "real_tokens": 301, "padded_tokens": 400}
    moved = on_this_launch({**made, "batch_in_epoch": 9, "loss_window": [window, window]}, 3, 2, 8)
    assert moved["batch_in_epoch"] == 6
    assert moved["loss_window"] == [{"loss_sum": 2.0, "losses": 4, "samples": 32, "real_tokens": 200 + extra,
                                     "padded_tokens": 266 + 2 * (extra > 0)} for extra in (2, 0, 0)]
    # in micro-batches half as big: twice the losses, of the same mean
    moved = on_this_launch({**made, "batch_in_epoch": 9, "loss_window": [window, window]}, 12, 1, 4)
    assert moved["batch_in_epoch"] == 3
    assert [(w["loss_sum"], w["losses"], w["samples"]) for w in moved["loss_window"]] == [(1.0, 2, 8)] * 12


@pytest.mark.parametrize("command, status, said", [
    *[(f"{command} --help", 0, "usage:") for command in ("train.py", "-m textclf.check", "-m textclf.predict",
                                                         "-m textclf.report", "-m textclf.export")],
    ("train.py --model ./my_modle", 2, "error: model not found: ./my_modle is a path"),
    ("-m textclf.check --learning_rat 1", 2, "error: unknown config key(s) --learning_rat"),
    ("-m textclf.predict --model nowhere --text 好", 2, "error: model not found: nowhere"),
    ("-m textclf.report --model nowhere --file a.csv --output_dir r", 2, "error: model not found: nowhere"),
    ("-m textclf.export nowhere exported", 2, "error: model not found: nowhere"),
    ("-m textclf.check --config_file nowhere.yaml", 2, "error: accelerate config not found: nowhere.yaml"),
    ("train.py --data nowhere.csv", 2, "error: data not found: nowhere.csv; check the path (expected CSV, TSV"),
    ("train.py --eval_data nowhere.jsonl", 2, "error: data not found: nowhere.jsonl"),
    ("train.py --model pyproject.toml", 2, "error: --model pyproject.toml is a file: give the folder"),
    ("-m textclf.predict --model . --file nowhere.csv", 2, "error: data not found: nowhere.csv"),
    ("-m textclf.report --model . --file nowhere.csv --output_dir r", 2, "error: data not found: nowhere.csv"),
])
def test_help_and_command_line_errors_answer_before_torch_is_imported(command, status, said):
    """-X importtime lists every module imported: the answer must come before torch, datasets and accelerate."""
    import subprocess
    import sys

    from conftest import REPO

    result = subprocess.run([sys.executable, "-X", "importtime", *command.split()], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == status and said in result.stdout + result.stderr, result.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}
    assert not {"torch", "transformers", "datasets", "accelerate"} & imported


@pytest.mark.parametrize("env, said", [
    ({"ACCELERATE_MIXED_PRECISION": "no"}, "error: --mixed_precision bf16 contradicts the launch, which runs no"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "nowhere.json"},
     "error: cannot read DeepSpeed config nowhere.json: No such file or directory"),
])
def test_a_launch_that_contradicts_itself_answers_before_torch_is_imported(env, said):
    import os
    import subprocess
    import sys

    from conftest import REPO

    result = subprocess.run([sys.executable, "-X", "importtime", "train.py", "--mixed_precision", "bf16"], cwd=REPO,
                            capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert result.returncode == 2 and said in result.stderr, result.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}
    assert not {"torch", "transformers", "datasets", "accelerate"} & imported


@pytest.mark.parametrize("args, said", [
    ("--report_to tensorbord", "error: --report_to tensorbord: unknown tracker 'tensorbord'; accelerate knows "),
    pytest.param("--mixed_precision fp16", "error: mixed_precision fp16 needs a CUDA GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs fp16")),
])
def test_what_the_machine_lacks_is_refused_before_transformers_or_the_data(tmp_path, args, said):
    """A tracker or a GPU needs torch and accelerate to be known (about a second), not the rest."""
    import subprocess
    import sys

    from conftest import REPO

    result = subprocess.run([sys.executable, "-X", "importtime", "train.py", *args.split(), "--output_dir",
                             str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=120)
    said_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(said_lines) == 1 and said_lines[0].startswith(said), result.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}
    assert not {"transformers", "datasets", "deepspeed"} & imported
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs FSDP")
def test_fsdp_on_a_machine_without_cuda_is_refused_by_the_check_s_rule_not_run_as_ddp(tmp_path):
    """accelerate would run an FSDP launch on a CPU as plain DDP without a word: train.py refuses it, by the rule
    the check calls a conflict (launch.cuda_only), before transformers or the data."""
    import os
    import subprocess
    import sys

    from conftest import REPO
    from textclf.launch.checks import cuda_only

    [(need, fix)] = cuda_only("FSDP", "no")
    result = subprocess.run([sys.executable, "-X", "importtime", "train.py", "--output_dir", str(tmp_path / "out")],
                            cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "ACCELERATE_USE_FSDP": "true"})  # what fsdp.yaml's launch sets
    said = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert said == [f"error: {need}, and this machine has none: {fix}"], result.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}
    assert not {"transformers", "datasets", "deepspeed"} & imported
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs FSDP")
def test_fsdp_yaml_launched_on_a_machine_without_cuda_is_one_line_not_a_silent_ddp_run(tmp_path, reviews_csv):
    from conftest import REPO, TINY, run_train

    out = tmp_path / "out"
    result = run_train([*TINY, "--data", reviews_csv, "--max_steps", 2, "--output_dir", out],
                       config_file=REPO / "accelerate_configs" / "fsdp.yaml",
                       extra_launch_args=["--num_processes", "2"], check=False)
    said = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(said) == 1 and "distributed_type FSDP needs CUDA GPUs" in said[0], \
        result.stderr[-3000:]
    assert "MULTI_CPU" not in result.stdout and not out.exists()


def test_a_deepspeed_json_hard_coding_the_accumulation_is_refused_before_torch_is_imported(tmp_path):
    """Accelerate would take the JSON's accumulation with a warning while train.py's schedule counts its own."""
    import json
    import os
    import subprocess
    import sys

    from conftest import REPO

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}))
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ds)}
    result = subprocess.run([sys.executable, "-X", "importtime", "train.py", "--output_dir", str(tmp_path / "out")],
                            cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert result.returncode == 2, result.stderr[-2000:]
    assert (f"error: gradient_accumulation_steps: {ds} hard-codes 4, the training config has 1 "
            '(--gradient_accumulation_steps); set it to "auto"') in result.stderr
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}
    assert not {"torch", "transformers", "datasets", "accelerate"} & imported


def test_a_resume_refused_for_its_launch_answers_before_torch_is_imported(tmp_path):
    import json
    import subprocess
    import sys

    from conftest import REPO
    from textclf.checkpointing.write import sealed

    checkpoint = tmp_path / "out" / "step_3"
    checkpoint.mkdir(parents=True)
    position = {"step": 3, "epoch": 0, "batch_in_epoch": 3, "world_size": 1, "zero_stage": 3, "mixed_precision": "no",
                "global_batch_size": 32, "per_device_train_batch_size": 32, "gradient_accumulation_steps": 1}
    (checkpoint / "position.json").write_text(json.dumps(sealed(position)))
    result = subprocess.run([sys.executable, "-X", "importtime", "train.py", "--resume", str(checkpoint)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    said = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(said) == 1, result.stderr[-2000:]
    assert said[0].startswith(f"error: cannot resume from {checkpoint}: it was made by a launch with DeepSpeed ZeRO "
                              "stage 3 (this launch: None)") and "accelerate_configs/zero3.yaml" in said[0]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}
    assert not {"torch", "transformers", "datasets", "accelerate"} & imported


@pytest.mark.parametrize("env, launch", [
    ({}, {"num_processes": 1, "zero_stage": None, "mixed_precision": "no"}),
    ({"WORLD_SIZE": "2", "ACCELERATE_MIXED_PRECISION": "bf16"},
     {"num_processes": 2, "zero_stage": None, "mixed_precision": "bf16"}),
    ({"WORLD_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_MIXED_PRECISION": "no",
      "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds_configs/zero3.json"},
     {"num_processes": 2, "zero_stage": 3, "mixed_precision": "no"}),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1"},
     {"num_processes": 1, "zero_stage": 1, "mixed_precision": "no"}),
])
def test_the_launch_read_before_the_imports_is_the_one_the_accelerator_describes(monkeypatch, env, launch):
    """What train.py checks a resume against before torch loads; the zoo's runs record the Accelerator's account
    of the same launch in run.json (test_zoo), which this reading must agree with."""
    from conftest import REPO
    from textclf.launch.checks import this_launch

    for name in ("WORLD_SIZE", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_DEEPSPEED",
                 "ACCELERATE_DEEPSPEED_CONFIG_FILE", "ACCELERATE_DEEPSPEED_ZERO_STAGE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(REPO)
    assert this_launch(None) == launch


def test_checkpoint_positions_are_read_without_torch_and_name_accelerate_s_fsdp_folder():
    import subprocess
    import sys

    from accelerate.utils.constants import FSDP_MODEL_NAME

    from conftest import REPO
    from textclf.checkpointing.folders import FSDP_SHARDED

    assert FSDP_SHARDED == f"{FSDP_MODEL_NAME}_0"  # written out in checkpointing/, which must not import accelerate
    result = subprocess.run([sys.executable, "-X", "importtime", "-c",
                             "import textclf.checkpointing, textclf.launch, textclf.cli"],
                            cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}
    assert not {"torch", "accelerate"} & imported


# --- quiet by default --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pretrained_backbone(tmp_path_factory):
    """A tiny BERT saved with its pretraining (masked-LM) head, as hub checkpoints are: no classification head."""
    from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast

    from textclf.models.tokenizer import train_tokenizer

    folder = tmp_path_factory.mktemp("backbone")
    train_tokenizer(["好吃 很好", "太差了 不好", "一般 还行"] * 30, str(folder / "tokenizer"))
    tokenizer = BertTokenizerFast.from_pretrained(folder / "tokenizer")
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64)
    BertForMaskedLM(config).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    return str(folder / "model"), tokenizer


@pytest.mark.parametrize("verbose", [False, True])
def test_a_new_classification_head_is_one_line_and_the_load_report_is_there_when_asked(
        pretrained_backbone, capfd, caplog, monkeypatch, verbose):
    from textclf.models.build import make_model, training_config
    from textclf.models.lora import apply_lora

    if verbose:
        monkeypatch.setenv("TEXTCLF_VERBOSE", "1")
    model, tokenizer = pretrained_backbone
    built = make_model(training_config(model, tokenizer, {"num_labels": 2}, 32), model, gradient_checkpointing=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_lora(built, 4, 8, 0.0)
    out, err = capfd.readouterr()
    notes = [line for line in (out + err).splitlines() if line.startswith("note:")]
    assert notes == [] if verbose else [
        f"note: {model}: new bert.pooler.dense, classifier, trained from random weights (the classification head); "
        "5 of its weights unused (its pretraining head); TEXTCLF_VERBOSE=1 shows transformers' load report"]
    assert ("LOAD REPORT" in out + err + caplog.text) == verbose  # a terminal, or pytest's log capture
    deprecated = [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
    assert bool(deprecated) == verbose


@pytest.mark.parametrize("verbose", [False, True])
def test_an_export_shows_no_bars_of_transformers_unless_verbose(pretrained_backbone, tmp_path, capfd, monkeypatch,
                                                                verbose):
    """train.py and the export command say "exported" in one line; transformers would add a bar for writing the
    weights and one for reading them back. Both export inside the run's scope (textclf/launch/process.py)."""
    from transformers.utils import logging as transformers_logging

    from textclf.launch.process import run_scope
    from textclf.models.build import make_model, training_config
    from textclf.models.folder import save_verified

    if verbose:
        monkeypatch.setenv("TEXTCLF_VERBOSE", "1")
    transformers_logging.enable_progress_bar()  # as in a fresh process
    model, tokenizer = pretrained_backbone
    built = make_model(training_config(model, tokenizer, {"num_labels": 2}, 32), model)
    capfd.readouterr()
    with run_scope():
        save_verified(built.eval(), tokenizer, str(tmp_path / "exported"))
    out, err = capfd.readouterr()
    assert ("Writing model shards" in out + err and "Loading weights" in out + err) == verbose, out + err
    assert (tmp_path / "exported" / "model.safetensors").is_file()


def test_deepspeeds_cpu_fallback_is_filtered_at_its_logger_unless_verbose(monkeypatch):
    import logging

    from textclf.launch.process import actionable, run_scope

    with run_scope():  # a run's, put back at its end
        assert actionable in logging.getLogger("DeepSpeed").filters
    assert actionable not in logging.getLogger("DeepSpeed").filters
    record = logging.LogRecord("DeepSpeed", logging.WARNING, "real_accelerator.py", 213, "Setting accelerator to "
                               "CPU. If you have GPU or other accelerator, we were unable to detect it.", None, None)
    assert not actionable(record)
    assert actionable(logging.LogRecord("DeepSpeed", logging.WARNING, "x.py", 1, "something else", None, None))
    monkeypatch.setenv("TEXTCLF_VERBOSE", "1")
    assert actionable(record)


def test_lines_about_the_data_come_from_rank_0_alone(tmp_path, capsys, monkeypatch):
    rows = "label,review\n" + "".join(f"{i % 2},评论{i}\n" for i in range(20)) + "1,\n"
    monkeypatch.setenv("RANK", "1")
    splits(tmp_path, "d.csv", rows)
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    splits(tmp_path, "d.csv", rows)
    lines = [re.sub(r"in \d+\.\d s$", "in <time>", line) for line in capsys.readouterr().out.splitlines()]
    assert lines == [f"warning: dropped 1 row(s) with empty text from {tmp_path / 'd.csv'}",
                     f"data: read {tmp_path / 'd.csv'}: 20 rows in <time>",
                     f"eval: 25% (5 examples) of {tmp_path / 'd.csv'} held out, stratified by label",
                     "data: labels and split: 15 train / 5 eval examples in <time>"]


def test_a_zero_checkpoint_on_another_number_of_processes_goes_through_the_universal_checkpoint():
    from textclf.checkpointing.resplit import needs_universal

    made = {"world_size": 2, "zero_stage": 3}
    assert needs_universal("ck", made, 1, False) and not needs_universal("ck", made, 2, True)
    assert not needs_universal("ck", {**made, "zero_stage": None}, 1, True)  # DDP: whole states
    with pytest.raises(InputError, match="cannot resume ck on 1 process with --load_best_model_at_end: its ZeRO "
                                         "states were saved by 2 processes"):
        needs_universal("ck", made, 1, True)


def test_the_suite_runs_beside_a_finished_run_in_the_repository_checkpoints(monkeypatch):
    """The quickstart leaves checkpoints/ holding a finished run, then the user runs the tests: every test runs
    beside one (conftest puts one there for the session if there is none), so a test that falls back on the default
    output folder fails here too, and the session fails if a test changed checkpoints/, data/ or wandb/."""
    from conftest import REPO
    from textclf.checkpointing.folders import find_checkpoint
    from textclf.config import TrainConfig
    from textclf.errors import InputError

    monkeypatch.chdir(REPO)
    with pytest.raises(InputError, match="checkpoints already holds checkpoints"):
        find_checkpoint(TrainConfig())


@pytest.mark.parametrize("name", ["cpu", "ddp", "ddp_bf16", "ddp_fp16", "fsdp", "zero2", "zero2_offload", "zero3",
                                  "zero3_offload"])
def test_a_single_machine_zoo_file_takes_a_free_port_beside_another_launch(name, monkeypatch):
    """A second launch on the same machine (while the first trains, or a test beside a run) does not collide at
    torchrun's default port 29500, nor warn that it is taken: the file asks accelerate for a free port (0)."""
    import socket
    import warnings

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    from conftest import REPO

    monkeypatch.chdir(REPO)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # accelerate's notes about the defaults it fills in
        args, defaults = _validate_launch_command(launch_command_parser().parse_args(
            ["--config_file", f"accelerate_configs/{name}.yaml", "train.py"]))[:2]
    assert args.main_process_port == 0
    # What accelerate's launch_command sets before its DeepSpeed launcher runs.
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
    with socket.socket() as first_launch, warnings.catch_warnings():
        first_launch.bind(("127.0.0.1", 29500))
        first_launch.listen()
        warnings.simplefilter("error")  # accelerate's "Port 29500 is already in use" is a warning
        (prepare_deepspeed_cmd_env if args.use_deepspeed else prepare_multi_gpu_env)(args)
    assert args.main_process_port not in (0, 29500)  # what torchrun is given


def library_state() -> dict:
    """What a run may change in this process: warning filters, DeepSpeed's logger filters, the libraries' bars, the
    stop signals' handlers."""
    import logging
    import signal
    import warnings

    import datasets
    from transformers.utils import logging as transformers_logging

    return {"warning filters": list(warnings.filters), "DeepSpeed": list(logging.getLogger("DeepSpeed").filters),
            "bars": (transformers_logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled()),
            "handlers": [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]}


@pytest.mark.parametrize("verbose", ["", "1"])
def test_a_run_s_quiet_libraries_are_put_back_when_it_ends(verbose, monkeypatch):
    """Inside the run's scope, library code's deprecation warnings are silenced by message and module (the same
    message from elsewhere still shows), the bars are off and train.py may set its handlers; after it, all is as
    before, an error ending it too. TEXTCLF_VERBOSE=1 silences nothing."""
    import signal
    import warnings

    from textclf.launch.process import run_scope

    monkeypatch.setenv("TEXTCLF_VERBOSE", verbose)
    deprecated = "`torch.distributed.reduce_scatter_tensor` is deprecated. Please use ..."

    def shown(module) -> bool:
        with warnings.catch_warnings(record=True) as caught:
            warnings.warn_explicit(deprecated, FutureWarning, "c10d_logger.py", 83, module=module)
        return bool(caught)

    before = library_state()
    with pytest.raises(KeyError), run_scope():
        signal.signal(signal.SIGTERM, lambda *_: None)
        assert shown("torch.distributed.c10d_logger") == bool(verbose)
        assert shown("my_code")  # not a library's call: the user's to see
        assert library_state()["bars"] == ((True, True) if verbose else (False, False))
        raise KeyError("the run failed")
    assert library_state() == before and shown("torch.distributed.c10d_logger")


def test_a_library_setting_a_run_changes_is_put_back_when_its_scope_ends():
    """speed_up's TF32 and dynamo's recompile limit (launch.set_for_the_run): the run's value inside, the process's
    after, nested scopes each putting back their own."""
    import torch

    from textclf.launch.process import run_scope, set_for_the_run

    limit, precision = torch._dynamo.config.recompile_limit, torch.backends.cuda.matmul.fp32_precision
    with pytest.raises(KeyError), run_scope():
        set_for_the_run(torch._dynamo.config, "recompile_limit", limit + 56)
        set_for_the_run(torch.backends.cuda.matmul, "fp32_precision", "tf32")
        with run_scope():
            set_for_the_run(torch._dynamo.config, "recompile_limit", limit + 100)
        assert torch._dynamo.config.recompile_limit == limit + 56
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        raise KeyError("the run failed")
    assert (torch._dynamo.config.recompile_limit, torch.backends.cuda.matmul.fp32_precision) == (limit, precision)


def test_a_compiled_run_takes_down_what_it_set_up_in_accelerate_and_torch_when_its_scope_ends(
        fresh_accelerator_state):
    """compile_model turns accelerate's compile of the whole model off (the blocks are compiled already) and starts
    the compile clock (dynamo's callbacks, an optimizer hook): for the run. After it, the launch's dynamo backend is
    back for the next run of the process, and no callback or hook of the clock is left."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DynamoBackend
    from transformers import BertConfig, BertForSequenceClassification

    from textclf.launch.process import run_scope
    from textclf.models.speed import CompileClock, compile_model

    accelerator = Accelerator(cpu=True, dynamo_backend="inductor")  # a launch's --dynamo_backend inductor
    model = BertForSequenceClassification(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=16))
    callbacks = torch._dynamo.callback_handler
    with run_scope():
        compile_model(model, {"backend": "inductor", "dynamic": False}, accelerator)  # compiles at the first call
        assert accelerator.state.dynamo_plugin.backend == DynamoBackend.NO
        assert CompileClock.on_start in callbacks.start_callbacks and CompileClock.said is not None
    assert accelerator.state.dynamo_plugin.backend == DynamoBackend.INDUCTOR
    assert CompileClock.on_start not in callbacks.start_callbacks and CompileClock.on_end not in callbacks.end_callbacks
    assert CompileClock.said is None


@pytest.mark.slow
def test_main_twice_in_one_process_starts_and_ends_with_the_same_library_state(tmp_path, reviews_csv, cache_dir):
    """A notebook that calls train.main twice: each run starts from the state the process had, and leaves it so."""
    import train
    from conftest import TINY
    from textclf.cli import parse_config

    before = library_state()
    for run in ("first", "second"):
        train.main(parse_config(list(map(str, [*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--max_steps",
                                               2, "--output_dir", tmp_path / run]))))
        assert library_state() == before, run
    assert (tmp_path / "first" / "model").is_dir() and (tmp_path / "second" / "model").is_dir()
