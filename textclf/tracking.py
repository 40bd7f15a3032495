"""Where a run reports, through `accelerator`'s trackers: log.jsonl (the output contract), and the trackers --report_to
names (textclf/trackers.py); the loss and throughput of each log line."""

import json
import os
import time
from typing import Optional

import torch
from accelerate import Accelerator
from accelerate.tracking import GeneralTracker

from . import files
from .checkpoint import continue_advice
from .errors import write_failed

LOG = "log.jsonl"


class JsonLinesTracker(GeneralTracker):
    """log.jsonl as one of accelerate's trackers: a line per `accelerator.log` (main process), with the step, its
    wall-clock `time` (the benchmark times steps from it) and the values."""

    name, requires_logging_directory, main_process_only = "log.jsonl", True, True

    def __init__(self, output_dir: str):
        super().__init__()
        self.output_dir = output_dir

    @property
    def tracker(self) -> str:
        return os.path.join(self.output_dir, LOG)

    def store_init_configuration(self, values: dict) -> None:
        pass  # run.json holds the config

    def log(self, values: dict, step: Optional[int] = None, **kwargs) -> None:
        try:
            with files.open_append(self.tracker, encoding="utf-8") as f:  # never through a link in its place
                f.write(json.dumps({"step": step, "time": time.time(), **values}) + "\n")
        except OSError as e:
            raise write_failed("append to", self.tracker, e, continue_advice(self.output_dir)) from None


def trackers(report_to: list[str], output_dir: str, project_name: Optional[str] = None,
             run_name: Optional[str] = None) -> list:
    """`log_with` for the Accelerator: log.jsonl, and the trackers named (textclf/trackers.py)."""
    if report_to == ["none"]:
        return [JsonLinesTracker(output_dir)]
    from .trackers import named_trackers

    return [JsonLinesTracker(output_dir), *named_trackers(report_to, output_dir, project_name, run_name)]


def start_trackers(accelerator: Accelerator, config: dict) -> None:
    """Start the trackers; log.jsonl alone takes nothing (run.json holds the config)."""
    if config.get("report_to") == ["none"]:
        accelerator.init_trackers(config.get("project_name"))
        return
    from .trackers import start_named

    start_named(accelerator, config)


def log(accelerator: Accelerator, values: dict, step: int) -> None:
    """`accelerator.log`: `values` as they are to log.jsonl, under the Trainer's names to the others."""
    if accelerator.is_main_process:  # accelerate keeps the trackers there
        for tracker in accelerator.trackers:
            if isinstance(tracker, JsonLinesTracker):
                tracker.log(values, step=step)
            else:
                from .trackers import trainer_names

                tracker.log(trainer_names(values, tracker.name), step=step)


def keep_log_until(output_dir: str, step: int) -> None:
    """On resume, forget what a killed run logged after its checkpoint (leftovers.cut_log): a fresh run has no log."""
    if os.path.lexists(os.path.join(output_dir, LOG)):
        from .leftovers import cut_log

        cut_log(os.path.join(output_dir, LOG), step)


class Window:
    """Loss and throughput over the micro-batches since the last log line. Its counts go in a checkpoint: a run
    resumed between two log lines logs the same loss at the next as the run never stopped (its clock restarts)."""

    def __init__(self, state: Optional[dict] = None):
        self.start = time.perf_counter()
        self.loss_sum, self.losses = 0.0, 0
        self.samples = self.real_tokens = self.padded_tokens = 0
        if state:
            # A float32 sum read back as a Python float: the next addition rounds exactly as it would have.
            self.loss_sum, self.losses = state["loss_sum"], state["losses"]
            self.samples, self.real_tokens, self.padded_tokens = (
                state["samples"], state["real_tokens"], state["padded_tokens"])

    def state(self) -> dict:
        return {"loss_sum": float(self.loss_sum), "losses": self.losses, "samples": self.samples,
                "real_tokens": int(self.real_tokens), "padded_tokens": self.padded_tokens}

    def add(self, loss: torch.Tensor, batch: dict) -> None:
        """Count one micro-batch and its loss."""
        self.loss_sum += loss.detach().float()
        self.losses += 1
        ids, mask = batch["input_ids"], batch.get("attention_mask")  # no mask: no padding (data.Collator)
        self.samples += ids.shape[0]
        self.real_tokens += ids.numel() if mask is None else mask.sum()
        self.padded_tokens += ids.numel()

    def summary(self, accelerator: Optional[Accelerator] = None) -> dict:
        """Averaged (loss) or summed (counts) over all processes of `accelerator`, or this one alone."""
        local = torch.tensor([float(self.loss_sum) / max(self.losses, 1), self.samples, float(self.real_tokens),
                              self.padded_tokens], dtype=torch.float64,
                             device=accelerator.device if accelerator else "cpu")
        processes = accelerator.num_processes if accelerator else 1
        loss, samples, real, padded = (accelerator.reduce(local, reduction="sum") if accelerator else local).tolist()
        seconds = time.perf_counter() - self.start
        return {**({"loss": loss / processes} if self.losses else {}),
                "samples_per_s": samples / seconds, "real_tokens_per_s": real / seconds,
                "real_token_fraction": real / padded}
