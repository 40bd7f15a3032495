"""Where a run reports: log.jsonl (the output contract), the trackers, and the console."""

import json
import os
import time
from typing import Optional

import torch
from accelerate import Accelerator

LOG = "log.jsonl"


def flat_config(config: dict) -> dict:
    """Trackers accept only plain scalars: None and lists become strings."""
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in config.items()}


def keep_log_until(output_dir: str, step: int) -> None:
    """On resume, forget what a killed run logged after its checkpoint, so the log reads as one run."""
    path = os.path.join(output_dir, LOG)
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(f"{path}.tmp", "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(f"{path}.tmp", path)


def append_log(output_dir: str, step: int, values: dict) -> None:
    """One line of log.jsonl: the step, its wall-clock `time` (Unix seconds), the values.

    The benchmark times steps from `time`, evaluation and checkpoints included or left out as it chooses.
    """
    with open(os.path.join(output_dir, LOG), "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "time": time.time(), **values}) + "\n")


def log(accelerator: Accelerator, output_dir: str, step: int, values: dict) -> None:
    """One line in log.jsonl, one point per value in the trackers (main process only)."""
    accelerator.log(values, step=step)
    if accelerator.is_main_process:
        append_log(output_dir, step, values)


class Window:
    """Loss and throughput over the micro-batches since the last log line."""

    def __init__(self):
        self.start = time.perf_counter()
        self.loss_sum, self.losses = 0.0, 0
        self.samples = self.real_tokens = self.padded_tokens = 0

    def add(self, loss: Optional[torch.Tensor], batch: dict) -> None:
        """Count one micro-batch; `loss` None where the caller does not see it (the Trainer baseline)."""
        if loss is not None:
            self.loss_sum += loss.detach().float()
            self.losses += 1
        mask = batch["attention_mask"]
        self.samples += mask.shape[0]
        self.real_tokens += mask.sum()
        self.padded_tokens += mask.numel()

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
