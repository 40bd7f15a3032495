"""When a run evaluates, saves and stops (textclf/loop/schedule.py); a diverged run stops before it saves, in one line
naming the step, the likely cause and the last good checkpoint."""

import json
import math

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from conftest import REPO, TINY, assert_refused, read_csv, train_forked, write_csv
from textclf.checkpointing.write import complete
from textclf.errors import InputError
from textclf.loop.schedule import DivergenceWatch, diverged, due
from textclf.tasks.task import Task


def test_strategies_count_optimizer_steps_and_epochs():
    assert [step for step in range(1, 13) if due("steps", 4, step, steps_per_epoch=5)] == [4, 8, 12]
    assert [step for step in range(1, 13) if due("epoch", 4, step, steps_per_epoch=5)] == [5, 10]
    assert not any(due("no", 4, step, 5) for step in range(1, 13))
    assert not any(due("steps", None, step, 5) for step in range(1, 13))


NAN, INF = torch.tensor(math.nan), torch.tensor(math.inf)


NAN, INF = torch.tensor(math.nan), torch.tensor(math.inf)


@pytest.fixture
def accelerator():
    return Accelerator(cpu=True)


def checkpoint(output_dir, step, **metrics):
    folder = output_dir / f"step_{step}"
    folder.mkdir(parents=True)
    complete(str(folder), {"step": step, "epoch": 0, "batch_in_epoch": step, "metrics": metrics})
    return folder


def test_a_non_finite_loss_or_gradient_norm_stops_at_the_next_check_naming_the_step(accelerator, tmp_path):
    last_good = checkpoint(tmp_path, 2)
    watch = DivergenceWatch(accelerator, 1e30, clipping=True, output_dir=str(tmp_path))
    watch.add(3, torch.tensor(0.7), torch.tensor(2.0))
    watch.check(3)  # finite: nothing to say
    watch.add(4, torch.tensor(0.7), INF)
    watch.add(5, NAN, NAN)  # the first bad step is the one named, not the last
    with pytest.raises(InputError) as refused:
        watch.check(5)
    assert str(refused.value) == (
        "training diverged at step 4: its gradient norm is not finite (NaN or inf); the learning rate 1e+30 is likely "
        f"too high. Nothing of it was saved: the last good checkpoint is {last_good} (resumed, it repeats these "
        "steps); start a new run with a lower --learning_rate")


def test_a_step_the_fp16_loss_scaler_skipped_is_not_a_divergence(accelerator, tmp_path, monkeypatch):
    """An overflow under fp16 (accelerate's GradScaler, DeepSpeed's loss scaler) gives an inf gradient norm, and the
    optimizer skips the step: nothing reached the weights. fp16 does not run on a CPU, so the skip is accelerate's
    flag, set as an overflow sets it."""
    watch = DivergenceWatch(accelerator, 2e-5, clipping=False, output_dir=str(tmp_path))
    monkeypatch.setattr(Accelerator, "optimizer_step_was_skipped", property(lambda self: True))
    watch.add(1, INF, INF)
    watch.check(1)
    monkeypatch.setattr(Accelerator, "optimizer_step_was_skipped", property(lambda self: False))
    watch.add(2, torch.tensor(0.7), torch.tensor(3.0))
    watch.check(2)
    watch.add(3, NAN)
    with pytest.raises(InputError, match=r"^training diverged at step 3: its loss is not finite .* no checkpoint was "
                                         r"saved before it; start a new run with a lower --learning_rate \(or clip "
                                         r"gradients with --max_grad_norm 1.0\)$"):
        watch.check(3)


@pytest.mark.parametrize("fused", [True, False])
def test_only_an_unfused_optimizer_lets_accelerate_see_the_step_the_fp16_loss_scaler_skipped(accelerator, fused):
    """Why train.py's AdamW is not fused under fp16's loss scaler (accelerator.scaler): a fused step takes the
    overflow into its kernel and leaves the weights as they were, but accelerate's step_was_skipped, which the
    watch reads, then says the step was taken, and the inf gradient norm would stop the run as diverged. A CPU
    grad scaler acts as a GPU's here."""
    from accelerate.optimizer import AcceleratedOptimizer

    weight = torch.nn.Parameter(torch.ones(3))
    scaler = torch.amp.GradScaler("cpu")
    optimizer = AcceleratedOptimizer(torch.optim.AdamW([weight], lr=0.1, fused=fused), device_placement=False,
                                     scaler=scaler)
    scaler.scale((weight * math.inf).sum()).backward()
    optimizer.step()
    assert weight.tolist() == [1.0, 1.0, 1.0]  # skipped either way
    assert optimizer.step_was_skipped is not fused


def test_a_gradient_norm_fsdp2_returns_sharded_is_read_as_a_plain_one(tmp_path):
    """Under FSDP2 every parameter is a DTensor and accelerate's clip returns the norm as one, which a plain tensor
    cannot be combined with. A one-process mesh over gloo makes one here."""
    import types

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        norm = distribute_tensor(INF, init_device_mesh("cpu", (1,)), [Replicate()])
        process = types.SimpleNamespace(device=torch.device("cpu"), sync_gradients=True, distributed_type="FSDP",
                                        optimizer_step_was_skipped=False, gather=lambda tensor: tensor)
        watch = DivergenceWatch(process, 1e-3, clipping=True, output_dir=str(tmp_path))
        watch.add(1, torch.tensor(0.7), norm)
        with pytest.raises(InputError, match="^training diverged at step 1: its gradient norm is not finite"):
            watch.check(1)
    finally:
        dist.destroy_process_group()


def test_non_finite_weights_are_caught_before_a_save_even_where_the_loss_was_finite(accelerator, tmp_path):
    model = torch.nn.Linear(4, 2)
    watch = DivergenceWatch(accelerator, 1e30, clipping=True, output_dir=str(tmp_path))
    watch.add(1, torch.tensor(0.7), torch.tensor(1.0))
    watch.check(1, model)
    with torch.no_grad():
        model.weight[0, 0] = math.inf
    with pytest.raises(InputError, match="^training diverged at step 1: the weights it reached are not finite"):
        watch.check(1, model)


@pytest.mark.slow
@pytest.mark.parametrize("config_file", [None, REPO / "accelerate_configs" / "cpu.yaml"], ids=["1 process", "ddp"])
def test_a_diverged_run_stops_before_it_saves_and_keeps_the_last_good_checkpoint(tmp_path, reviews_csv, cache_dir,
                                                                                 config_file):
    """--learning_rate 1e30: step 1 moves the weights to about 1e30 (finite: saved), step 2's loss is NaN. It is
    logged only at step 3, and the save at step 2 must catch it first, on every process alike. step_1 is named for
    what it is: its weights were already runaway, not the last good ones."""
    out = tmp_path / "out"
    result = train_forked([*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--output_dir", out,
                           "--max_steps", 4, "--save_steps", 1, "--logging_steps", 3, "--save_total_limit", 1,
                           "--learning_rate", 1e30], config_file=config_file, check=False)
    assert_refused(result, "training diverged at step 2: its loss and gradient norm are not finite (NaN or inf); "
                           "the learning rate 1e+30 is likely too high. Nothing of it was saved: no good "
                           "checkpoint was saved before it; step_1 already holds weights of up to 1e+30 in "
                           "magnitude: the run was diverging there")
    assert sorted(path.name for path in out.iterdir() if "step_" in path.name) == ["step_1"]
    weights = load_file(out / "step_1" / "model.safetensors")
    assert all(torch.isfinite(tensor).all() for tensor in weights.values())
    assert json.loads((out / "step_1" / "position.json").read_text())["step"] == 1


def test_a_diverged_run_names_the_last_checkpoint_whose_weights_were_still_sane(tmp_path):
    """With --learning_rate 1e30 a checkpoint can hold finite weights of 1e30 before the loss turns NaN: the line
    names it for what it is, and the newest checkpoint before it as the last good one."""
    from textclf.loop.schedule import last_checkpoint

    for step, largest in ((1, 1.0), (2, 1e30), (3, 4e31)):
        complete_folder = tmp_path / f"step_{step}"
        complete_folder.mkdir()
        (complete_folder / "position.json").write_text(json.dumps({"step": step, "largest_weight": largest}))
    assert last_checkpoint(str(tmp_path)) == (f"the last good checkpoint is {tmp_path / 'step_1'} (resumed, it "
                                              "repeats these steps); step_2, step_3 already hold weights of up to "
                                              "4e+31 in magnitude: the run was diverging there")
    (tmp_path / "step_1" / "position.json").unlink()
    assert last_checkpoint(str(tmp_path)).startswith("no good checkpoint was saved before it; step_2, step_3")


def test_the_divergence_line_names_the_labels_scale_where_it_is_huge(tmp_path):
    message = str(diverged("step 1: its loss is not finite (NaN or inf)", str(tmp_path), 5e-5, True,
                           before_any_update=True, labels_scale=4.3e30))
    assert message == (
        "training diverged at step 1: its loss is not finite (NaN or inf); the labels' scale is the likely cause: they "
        "reach 4.3e+30 in magnitude, and the loss is their squared error from outputs that start near 0. Nothing of "
        "it was saved: no checkpoint was saved before it; scale the labels to around 1 (e.g. divide them by 1e+30, "
        "or standardize them), then start a new run")


def test_a_first_step_that_diverged_does_not_blame_the_learning_rate(tmp_path):
    message = str(diverged("step 1: its gradient norm is not finite (NaN or inf)", str(tmp_path), 5e-5, True,
                           before_any_update=True))
    assert message.startswith("training diverged at step 1: its gradient norm is not finite (NaN or inf), before "
                              "any update: the learning rate is not the cause, the data or the initial model is")
    assert "--learning_rate" not in message


@pytest.mark.parametrize("labels_scale", [None, 5.0])
def test_a_later_divergence_with_labels_of_a_usual_scale_still_blames_the_learning_rate(tmp_path, labels_scale):
    message = str(diverged("step 4: its loss is not finite (NaN or inf)", str(tmp_path), 1e30, True,
                           labels_scale=labels_scale))
    assert "the learning rate 1e+30 is likely too high" in message and "labels' scale" not in message


@pytest.mark.parametrize("task, labels, cause", [
    ("regression", [2e30, -4.3e30], "the labels' scale is the likely cause: they reach 4.3e+30 in magnitude"),
    ("regression", [1.5, 4.5], ", before any update: the learning rate is not the cause"),
    ("single_label", ["好", "差"], ", before any update: the learning rate is not the cause"),
])
def test_the_watch_names_the_scale_the_task_gives_the_training_labels(tmp_path, task, labels, cause):
    """train.py gives the watch `task.labels_scale` of the training labels."""

    scale = Task.of(task, "review", "rating").labels_scale({"labels": labels})
    watch = DivergenceWatch(Accelerator(cpu=True), 5e-5, clipping=True, output_dir=str(tmp_path), labels_scale=scale)
    watch.add(1, torch.tensor(math.inf), torch.tensor(math.inf))
    with pytest.raises(InputError, match="^training diverged at step 1: its loss and gradient norm are not finite") \
            as refusal:
        watch.check(1)
    assert cause in str(refusal.value)


@pytest.mark.slow
def test_a_regression_on_labels_of_a_huge_scale_diverges_naming_the_scale(tmp_path, rating_files, cache_dir):
    rows = [{**row, "rating": float(row["rating"]) * 1e30} for row in read_csv(rating_files["train"])]
    data = write_csv(tmp_path / "ratings.csv", rows)
    result = train_forked([*TINY, "--task", "regression", "--label_column", "rating", "--data", data, "--cache_dir",
                           cache_dir, "--output_dir", tmp_path / "out", "--max_steps", 2], config_file=None,
                          check=False)
    scale = max(row["rating"] for row in rows)
    assert_refused(result, "training diverged at step 1: its loss and gradient norm are not finite (NaN or inf); the "
                           f"labels' scale is the likely cause: they reach {scale:.3g} in magnitude")
