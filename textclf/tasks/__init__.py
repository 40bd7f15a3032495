"""What a task is: one class per kind (--task), which owns its labels, its head, its predictions and its scores.
KINDS registers each kind by what the command line needs before any data is read; a kind's class is imported when a
run asks for it."""

from .task import KINDS, Task, format_score

__all__ = [
    "KINDS", "format_score", "Task",
]
