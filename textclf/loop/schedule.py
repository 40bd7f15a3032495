"""The run's schedule in optimizer steps: its length, when it evaluates and saves (the Trainer's eval and save
strategies), and when it stops before its end: early stopping, or a signal that asks for a checkpoint and a stop."""

import math
import os
import signal
from dataclasses import dataclass
from typing import Optional

from textclf import errors
from textclf.config import TrainConfig


@dataclass(frozen=True)
class Schedule:
    """The run's length in optimizer steps, and how an epoch's batches count them."""

    batches_per_epoch: int
    steps_per_epoch: int
    total_steps: int

    @classmethod
    def of(cls, cfg: TrainConfig, batches: int) -> "Schedule":
        steps_per_epoch = math.ceil(batches / cfg.gradient_accumulation_steps)
        return cls(batches, steps_per_epoch, cfg.max_steps or math.ceil(cfg.num_train_epochs * steps_per_epoch))


def due(strategy: str, every: Optional[int], step: int, steps_per_epoch: int) -> bool:
    """Whether optimizer step `step` ends a period of `strategy`: accelerate syncs gradients at every epoch's end,
    so epoch e ends exactly at step (e + 1) x steps_per_epoch."""
    if strategy == "epoch":
        return step % steps_per_epoch == 0
    return strategy == "steps" and every is not None and step % every == 0


def patience_ran_out(best: Optional[dict], patience: Optional[int]) -> bool:
    """Whether early stopping ends the run: `patience` evaluations in a row did not improve on the best."""
    return patience is not None and best is not None and best["evaluations_without_improvement"] >= patience


def request_stop_on_signals(accelerator, logging_steps: int) -> list[str]:
    """SIGTERM (a scheduler) and SIGINT (Ctrl-C, which torchrun passes on to every rank) ask for a checkpoint at
    the next logging step, then a clean stop; a second Ctrl-C stops at once, without one. Returns the list the
    names of the signals received go into (the error path reads it too)."""
    stop_requested = errors.stop_signals = []

    def request_stop(signum, _frame):
        stop_requested.append(signal.Signals(signum).name)
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        if accelerator.is_local_main_process and len(stop_requested) == 1:
            again = "; Ctrl-C again stops at once, without it" if signum == signal.SIGINT else ""
            # os.write, not print: the signal may have interrupted a print, which must not be re-entered.
            os.write(2, f"\n{stop_requested[0]}: saving a checkpoint at the next logging step (--logging_steps "
                        f"{logging_steps}), then stopping{again}\n".encode())

    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop_signal, request_stop)
    return stop_requested
