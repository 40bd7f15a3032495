"""When a run evaluates, saves and stops (textclf/loop/schedule.py)."""

from textclf.loop.schedule import due


def test_strategies_count_optimizer_steps_and_epochs():
    assert [step for step in range(1, 13) if due("steps", 4, step, steps_per_epoch=5)] == [4, 8, 12]
    assert [step for step in range(1, 13) if due("epoch", 4, step, steps_per_epoch=5)] == [5, 10]
    assert not any(due("no", 4, step, 5) for step in range(1, 13))
    assert not any(due("steps", None, step, 5) for step in range(1, 13))
