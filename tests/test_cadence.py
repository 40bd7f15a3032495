"""When train.py evaluates, saves and stops (textclf/loop/schedule.py): the Trainer's strategies, the best model,
early stopping."""

import json

import pytest

from conftest import TINY, read_log, run_train
from textclf.checkpointing.folders import find_best_checkpoint
from textclf.checkpointing.verify import verified_best_checkpoint
from textclf.loop.best_model import record_best_model, track_best
from textclf.loop.schedule import due, patience_ran_out


def test_strategies_count_optimizer_steps_and_epochs():
    assert [step for step in range(1, 13) if due("steps", 4, step, steps_per_epoch=5)] == [4, 8, 12]
    assert [step for step in range(1, 13) if due("epoch", 4, step, steps_per_epoch=5)] == [5, 10]
    assert not any(due("no", 4, step, 5) for step in range(1, 13))
    assert not any(due("steps", None, step, 5) for step in range(1, 13))


def test_patience_counts_evaluations_without_a_strict_improvement_and_ties_go_to_the_newer_checkpoint():
    best = None
    history = [(2, 0.5), (4, 0.7), (6, 0.6), (8, 0.7), (10, 0.65)]
    waited = []
    for step, f1 in history:
        best = track_best(best, step, {"eval_f1": f1, "eval_accuracy": 0.0}, "eval_f1", f"out/step_{step}")
        waited.append(best["evaluations_without_improvement"])
    assert waited == [0, 0, 1, 2, 3]
    assert (best["step"], best["value"], best["checkpoint"]) == (8, 0.7, "out/step_8")  # the tie at step 8
    assert patience_ran_out(best, 3) and not patience_ran_out(best, 4) and not patience_ran_out(best, None)


def test_the_best_checkpoint_s_weights_go_back_and_its_step_is_recorded(tmp_path):
    """train.py's end of a --load_best_model_at_end run: the best checkpoint verified, loaded, recorded."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from textclf.checkpointing.write import complete

    accelerator = Accelerator(cpu=True)
    try:
        model = accelerator.prepare(torch.nn.Linear(3, 2))
        (tmp_path / "run.json").write_text(json.dumps({"num_processes": 1}))
        accelerator.save_state(tmp_path / "step_2")
        at_step_2 = {name: p.detach().clone() for name, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        complete(str(tmp_path / "step_2"), {"step": 2})  # position.json with the files' sha256, as a save writes it
        best = {"step": 2, "value": 0.9, "metrics": {"eval_f1": 0.9, "eval_accuracy": 0.8},
                "checkpoint": "/where/it/was/saved/step_2", "evaluations_without_improvement": 2}
        with verified_best_checkpoint(accelerator, best, str(tmp_path), allow_pickle=False) as folder:
            accelerator.load_state(folder)
        assert record_best_model(accelerator, best, folder, str(tmp_path)) == best["metrics"]
        assert all(p.equal(at_step_2[name]) for name, p in model.named_parameters())
        run = json.loads((tmp_path / "run.json").read_text())
        assert run["best_model"] == {"step": 2, "checkpoint": str(tmp_path / "step_2"), "eval_f1": 0.9,
                                     "eval_accuracy": 0.8}
        assert run["num_processes"] == 1
    finally:
        AcceleratorState._reset_state(True)


def test_the_best_checkpoint_is_found_where_the_run_goes_on_else_where_it_was_saved(tmp_path):
    from textclf.errors import InputError

    saved, moved = tmp_path / "first" / "step_4", tmp_path / "moved" / "step_4"
    best = {"step": 4, "checkpoint": str(saved)}
    with pytest.raises(InputError, match=r"the best checkpoint so far \(step 4, saved as .*first/step_4\) is neither "
                                         r"there nor in .*moved: put it back"):
        find_best_checkpoint(best, str(moved.parent))
    for folder in (saved, moved):
        folder.mkdir(parents=True)
        (folder / "position.json").write_text("{}")
    assert find_best_checkpoint(best, str(tmp_path / "elsewhere")) == str(saved)  # resumed into another folder
    assert find_best_checkpoint(best, str(moved.parent)) == str(moved)  # the run's folder, moved


@pytest.mark.slow
def test_early_stopping_ends_the_run_after_patience_evaluations_without_improvement(tmp_path, reviews_csv, cache_dir):
    # A learning rate this small leaves every prediction as it was: no evaluation improves on the first.
    out = tmp_path / "out"
    result = run_train([*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--output_dir", out,
                        "--learning_rate", 1e-12, "--max_steps", 20, "--eval_steps", 2, "--save_steps", 2,
                        "--load_best_model_at_end", "--early_stopping_patience", 2])
    assert "early stopping at step 6: 2 evaluations without improvement of eval_f1" in result.stdout
    log = read_log(out)
    assert max(row["step"] for row in log) == 6
    assert [row["step"] for row in log if "eval_f1" in row] == [2, 4, 6]
    run = json.loads((out / "run.json").read_text())
    assert run["best_model"]["step"] == 6 and run["best_model"]["checkpoint"] is None  # a tie: the newest
    assert (out / "model" / "model.safetensors").exists()
