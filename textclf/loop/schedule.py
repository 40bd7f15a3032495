"""The run's schedule in optimizer steps: its length, when it evaluates and saves (the Trainer's eval and save
strategies), and when it stops before its end: early stopping, a signal that asks for a checkpoint and a stop, or a
diverged run.

A diverged run stops before it saves: a loss, gradient norm or weight that is not finite ends the run with one
line naming the step, the likely cause and the last good checkpoint; no checkpoint of NaN weights is written. The
cause named is the labels' scale where the task says they are numbers of a huge magnitude, the data or the model
where the first step's loss or gradient came out of the initial weights not finite, else the learning rate.

No step waits for the device: losses and gradient norms fold into a number kept there, read at the log lines
(which wait for the loss anyway) and before every evaluation and save, where the weights are checked too. A step
the fp16 loss scaler skipped (an overflow) is no divergence: nothing of it reached the weights.
"""

import math
import os
import signal
from dataclasses import dataclass
from typing import Optional

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from textclf import errors
from textclf.checkpointing import complete_checkpoints, read_position
from textclf.config import TrainConfig
from textclf.errors import InputError


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


LOSS, GRAD_NORM = 1, 2  # what was not finite, as bits of the code kept per step: code = step * 4 + bits


class DivergenceWatch:
    """Non-finite losses and gradient norms of the steps the optimizer took, kept on the device until `check`."""

    def __init__(self, accelerator: Accelerator, learning_rate: float, clipping: bool, output_dir: str,
                 labels_scale: Optional[float] = None):
        """`labels_scale`: the largest magnitude of the training labels where the task says it bears (a regression's:
        Task.labels_scale), which a diverged run's line names as the likely cause when it is huge."""
        self.accelerator, self.learning_rate, self.clipping = accelerator, learning_rate, clipping
        self.output_dir, self.labels_scale = output_dir, labels_scale
        self.first = torch.zeros((), dtype=torch.long, device=accelerator.device)  # the first bad step's code; 0: none
        self.step_bits = torch.zeros((), dtype=torch.long, device=accelerator.device)  # the running step's
        self.largest_weight: Optional[float] = None
        """The largest weight in magnitude at the last check of the weights: a checkpoint records it, and a diverged
        run's line judges that checkpoint by it."""

    def add(self, step: int, loss: torch.Tensor, grad_norm: Optional[torch.Tensor] = None) -> None:
        """Fold one micro-batch's loss into optimizer step `step` and, where gradients sync, the step's gradient
        norm (the clip's, or DeepSpeed's own), unless the loss scaler skipped the step."""
        self.step_bits |= (~torch.isfinite(loss.detach())).long() * LOSS
        if not self.accelerator.sync_gradients:
            return
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            grad_norm = self.accelerator.deepspeed_engine_wrapped.engine.get_global_grad_norm()  # None: not computed
        if grad_norm is not None:
            if hasattr(grad_norm, "full_tensor"):  # FSDP2's clip returns a DTensor, which plain tensors cannot mix with
                grad_norm = grad_norm.full_tensor()
            norm = torch.as_tensor(grad_norm, device=self.first.device)
            self.step_bits |= (~torch.isfinite(norm)).long() * GRAD_NORM
        if not self.accelerator.optimizer_step_was_skipped:
            self.first = torch.where((self.first == 0) & (self.step_bits > 0), step * 4 + self.step_bits, self.first)
        self.step_bits = torch.zeros_like(self.step_bits)

    def check(self, step: int, model=None) -> None:
        """Stop the run (an InputError) if any step until `step` diverged on any process, or the `model`'s weights are
        not finite: every process calls it at the same steps and stops alike."""
        largest = torch.zeros((), dtype=torch.float64, device=self.first.device)
        if model is not None:
            largest = largest_weight(model, self.first.device)
        # float64 holds every code exactly (a step below 2**51), and NaN and inf as they are.
        gathered = self.accelerator.gather(torch.stack([self.first.double(), largest]).view(1, 2))
        codes, magnitudes = gathered.view(-1, 2).T.tolist()
        codes = [int(code) for code in codes if code]
        bad = [not math.isfinite(magnitude) for magnitude in magnitudes]
        if model is not None and not any(bad):
            self.largest_weight = max(magnitudes)
        if codes:
            first, bits = divmod(min(codes), 4)
            what = [name for bit, name in ((LOSS, "loss"), (GRAD_NORM, "gradient norm")) if bits & bit]
            # Step 1's loss and gradients come from the initial weights: no learning rate has acted on them yet.
            raise self.diverged(f"step {first}: its {' and '.join(what)} {'are' if len(what) > 1 else 'is'} not finite "
                                "(NaN or inf)", before_any_update=first == 1)
        if any(bad):
            raise self.diverged(f"step {step}: the weights it reached are not finite (NaN or inf)")

    def diverged(self, where: str, before_any_update: bool = False) -> Exception:
        return diverged(where, self.output_dir, self.learning_rate, self.clipping, before_any_update,
                        self.labels_scale)


def largest_weight(model, device) -> torch.Tensor:
    """The largest magnitude among the weights this process holds (its ZeRO-3 `ds_tensor` or FSDP shard, else the
    whole weight), NaN or inf where one is not finite; a float64 tensor on `device`, not read back."""
    largest = []
    for parameter in model.parameters():
        local = getattr(parameter, "ds_tensor", None)
        if local is None:
            local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        if local.numel():
            # One reduction, no temporary of the weight's size (abs() would make one).
            largest.append(torch.linalg.vector_norm(local.detach(), ord=math.inf).to(device, torch.float64))
    return torch.stack(largest).max() if largest else torch.zeros((), dtype=torch.float64, device=device)


def diverged(where: str, output_dir: str, learning_rate: float, clipping: bool, before_any_update: bool = False,
             labels_scale: Optional[float] = None) -> InputError:
    """DivergenceWatch's error: a resume repeats the same steps (and refuses another --learning_rate), so
    the remedy is a new run. `labels_scale`: the largest magnitude of the labels, where the task says it bears
    (a regression's); `before_any_update`: what diverged came from the initial weights (step 1's loss or gradient)."""
    last_good = last_checkpoint(output_dir)
    if labels_scale is not None and labels_scale >= LARGE_LABELS:
        power = 10.0 ** math.floor(math.log10(labels_scale))
        return InputError(f"training diverged at {where}; the labels' scale is the likely cause: they reach "
                          f"{labels_scale:.3g} in magnitude, and the loss is their squared error from outputs that "
                          f"start near 0. Nothing of it was saved: {last_good}; scale the labels to around 1 (e.g. "
                          f"divide them by {power:.0e}, or standardize them), then start a new run")
    if before_any_update:
        return InputError(f"training diverged at {where}, before any update: the learning rate is not the cause, the "
                          "data or the initial model is (its loss on the first examples is not finite). Nothing of it "
                          f"was saved: {last_good}; look at the labels (their scale, for --task regression) and the "
                          "model's weights, then start a new run")
    clip = "" if clipping else " (or clip gradients with --max_grad_norm 1.0)"
    return InputError(f"training diverged at {where}; the learning rate {learning_rate:g} is likely too high. "
                      f"Nothing of it was saved: {last_good}; start a new run with a lower --learning_rate{clip}")


def last_checkpoint(output_dir: str) -> str:
    """What the diverged run's line says of its checkpoints: the newest good one, passing over those whose weights
    (as recorded) were already out of any trained model's range, where the run was diverging before it stopped."""
    diverging = []
    for _, checkpoint in reversed(complete_checkpoints(output_dir)):
        try:
            largest = read_position(checkpoint).get("largest_weight")
        except InputError:
            largest = None
        if not (isinstance(largest, (int, float)) and largest >= LARGE_WEIGHTS):
            break
        diverging.append((os.path.basename(checkpoint), largest))
    else:
        checkpoint = None
    bad = (f"; {', '.join(name for name, _ in reversed(diverging))} already hold{'s' * (len(diverging) == 1)} "
           f"weights of up to {max(largest for _, largest in diverging):.3g} in magnitude: the run was diverging "
           "there") if diverging else ""
    if checkpoint is None:
        return f"no {'good ' * bool(diverging)}checkpoint was saved before it{bad}"
    return f"the last good checkpoint is {checkpoint} (resumed, it repeats these steps){bad}"


# Weights of this magnitude or more are no trained model's: a run whose checkpoint holds them was diverging already.
LARGE_WEIGHTS = 1e4

# Labels of this magnitude or more make a diverged run's labels, not its learning rate, the likely cause: a model's
# outputs start near 0, and the loss and its gradients grow with the labels.
LARGE_LABELS = 1e6
