"""What the training loop keeps besides the model: its schedule in optimizer steps (when it evaluates, saves and
stops early), the best evaluation so far, the divergence watch, and where it reports (log.jsonl and the trackers
--report_to names, through accelerate's)."""

from .best_model import record_best_model, track_best
from .schedule import DivergenceWatch, Schedule, due, patience_ran_out, request_stop_on_signals
from .tracking import (
    JsonLinesTracker,
    Window,
    keep_log_until,
    log_with,
    tracker_config,
    use_trainer_names,
)

__all__ = [
    "DivergenceWatch", "due", "JsonLinesTracker", "keep_log_until", "log_with", "patience_ran_out", "record_best_model",
    "request_stop_on_signals", "Schedule", "track_best", "tracker_config", "use_trainer_names", "Window",
]
