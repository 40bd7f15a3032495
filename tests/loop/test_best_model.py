"""The best evaluation so far (textclf/loop/best_model.py): patience, the best checkpoint's weights back at the end, the
task's direction."""

import json

import pytest
import torch

from conftest import TINY, read_log, run_train
from textclf.checkpointing.verify import verified_best_checkpoint
from textclf.loop.best_model import record_best_model, track_best
from textclf.loop.schedule import patience_ran_out


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


def test_the_best_model_and_patience_follow_the_tasks_direction():
    from textclf.loop.best_model import track_best

    best = None
    for step, mse in [(1, 0.9), (2, 0.5), (3, 0.7), (4, 0.5)]:
        best = track_best(best, step, {"eval_mse": mse}, "eval_mse", f"out/step_{step}", greater_is_better=False)
    assert (best["step"], best["value"], best["evaluations_without_improvement"]) == (4, 0.5, 2)  # a tie: newer
    best = None
    for step, pearson in [(1, None), (2, 0.3), (3, None)]:  # undefined: constant predictions
        best = track_best(best, step, {"eval_pearson": pearson}, "eval_pearson", f"out/step_{step}")
        assert best is None if step == 1 else best["step"] == 2
    assert best["evaluations_without_improvement"] == 1
