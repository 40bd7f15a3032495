"""Fine-tune a text classifier with Hugging Face Accelerate, from one CPU to many GPUs.

    python train.py                                    # the default job: one process, offline
    accelerate launch --config_file accelerate_configs/cpu.yaml train.py   # or any file of the zoo
    python train.py --resume latest                    # continue exactly where it stopped
    python train.py --help                             # every option (textclf/config.py)

Outputs in --output_dir: run.json, log.jsonl, step_<N>/ checkpoints, model/ (the exported model).
"""

import sys

from textclf.errors import die_with_launcher, run_command

if __name__ == "__main__":
    die_with_launcher()  # under torchrun, a rank ends with its launcher however that ends (textclf/errors.py)

from textclf.config import HELD_OUT, TrainConfig, parse_config
from textclf.launch import check_command_line, check_launch_early, launch_shortfall
from textclf.start import Start, plan_start

if __name__ == "__main__":
    # The command line first: --help and a mistyped flag answer at once, not after the heavy imports below;
    # so do a missing data file, a launch that contradicts itself and a resume that it cannot continue.
    cfg = run_command(parse_config)
    run_command(lambda: check_command_line(cfg))
    cfg, start = run_command(lambda: plan_start(cfg, sys.argv[1:]))
    run_command(lambda: check_launch_early(cfg))

import math
import os
import signal
from dataclasses import dataclass
from typing import Optional

import torch
from accelerate.utils import DistributedType, gather_object, set_seed
from tqdm.auto import tqdm
from transformers import get_scheduler

from textclf import cadence, checkpoint, errors, tracking
from textclf.data import make_loaders, seed_micro_batch, write_examples
from textclf.divergence import DivergenceWatch
from textclf.job import build_job
from textclf.metrics import evaluate_model
from textclf.model_folder import export_model
from textclf.modeling import parameter_counts, parameter_groups
from textclf.quiet import scoped
from textclf.runtime import describe, exit_finished_run, make_accelerator, padding_multiple, speed_up
from textclf.start import begin, record
from textclf.task import Task


@scoped  # what the run sets in the libraries (quiet warnings and bars, signal handlers) is put back at its end
def main(cfg: TrainConfig, start: Optional[Start] = None) -> None:
    if start is None:  # called from code (a notebook, a test): planned here, as the command line plans it
        cfg, start = plan_start(cfg)
    accelerator = make_accelerator(cfg, load_universal=start.universal)
    run = describe(accelerator, cfg)
    accelerator.print(f"config: {cfg.to_dict()}")
    accelerator.print(" | ".join(f"{k}: {run[k]}" for k in ("distributed_type", "num_processes", "mixed_precision",
                                                            "zero_stage", "device", "micro_batch_size",
                                                            "global_batch_size")))
    if accelerator.is_main_process and (shortfall := launch_shortfall(accelerator.num_processes)):
        print(f"warning: {shortfall}")  # the launch asked for more processes than it started: said, not refused
    set_seed(cfg.seed)

    # Data and model. Everything the user can get wrong is checked before anything is written.
    task = Task.from_config(cfg)  # what the labels are, how predictions are made and scored
    train_set, eval_set, label_names, tokenizer, model, data_fingerprint, eval_examples = build_job(
        cfg, accelerator.local_main_process_first)
    accelerator.print(f"data: {len(train_set)} train / {len(eval_set)} eval examples, labels {label_names}; "
                      f"model: {cfg.model}, {parameter_counts(model)['params'] / 1e6:.1f}M parameters")
    train_loader, eval_loader = make_loaders(
        train_set, eval_set, tokenizer, train_batch_size=cfg.per_device_train_batch_size,
        eval_batch_size=cfg.per_device_eval_batch_size, num_processes=accelerator.num_processes,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, group_by_length=cfg.group_by_length,
        seed=cfg.seed, num_workers=cfg.dataloader_num_workers,
        pad_to_multiple_of=padding_multiple(cfg, accelerator),  # tensor cores' multiple, or compiled lengths' buckets
        pin_memory=accelerator.device.type == "cuda")  # copied to the GPU without waiting for it (runtime.py)

    # Optimizer and schedule, counted in optimizer steps.
    schedule = Schedule.of(cfg, batches=len(train_loader) // accelerator.num_processes)  # per process, once sharded
    # Fused: one pass over each tensor instead of one per operation (the Trainer's default too); on a
    # CPU, BERT-base's optimizer step takes a third of the time. Not under fp16's loss scaler: a fused step skips an
    # overflow inside its kernel, unseen by accelerate's optimizer_step_was_skipped, which the divergence watch reads.
    optimizer = torch.optim.AdamW(parameter_groups(model, cfg.weight_decay), lr=cfg.learning_rate,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
                                  fused=accelerator.scaler is None)
    scheduler = get_scheduler(cfg.lr_scheduler_type, optimizer, cfg.num_warmup_steps(schedule.total_steps),
                              schedule.total_steps)
    run["speed"] = speed_up(model, cfg, accelerator)  # TF32, Liger's kernels, torch.compile: on a GPU, by default
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)

    # A resume checks the checkpoint against the run just built. Then the run takes output_dir, which it holds
    # until it ends (one run at a time), and writes to it from here on; a resume loads the checkpoint.
    made = record(cfg, run, data_fingerprint)
    position = begin(accelerator, optimizer, scheduler, start, cfg, made, **vars(schedule))
    if accelerator.is_main_process:
        checkpoint.write_json(os.path.join(cfg.output_dir, "run.json"), {"config": cfg.to_dict(), **run,
                                                                         "labels": label_names})
        tracking.keep_log_until(cfg.output_dir, position["step"])
        write_examples(eval_examples, task, label_names, os.path.join(cfg.output_dir, HELD_OUT))  # report's default
    tracking.start_trackers(accelerator, cfg.to_dict())

    def save(step, epoch, batch_in_epoch, metrics, window, best):
        state = {"step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch, **made, "metrics": metrics,
                 "best": best, "loss_window": gather_object([window.state()]),
                 "config": cfg.to_dict() | start.asked_split}

        def describe_model(folder):  # what export needs besides the weights: the config (id2label), the tokenizer
            accelerator.unwrap_model(model).config.save_pretrained(folder)
            tokenizer.save_pretrained(os.path.join(folder, "tokenizer"))

        path = checkpoint.save_checkpoint(accelerator, cfg.output_dir, state, describe_model)
        if accelerator.is_main_process and cfg.save_total_limit:
            from textclf.rotation import rotate

            rotate(cfg.output_dir, cfg.save_total_limit, cfg.metric_for_best_model, start.checkpoint,
                   task.greater_is_better(cfg.metric_for_best_model))
        return path

    step, metrics, best = fit(cfg, accelerator, model, optimizer, scheduler, train_loader, eval_loader, task,
                              schedule, position, save)
    if step is None:  # stopped by a signal, after its checkpoint
        return

    if not metrics:  # resumed from the last checkpoint: nothing left to train
        metrics = evaluate_model(model, eval_loader, accelerator, task)
    if cfg.load_best_model_at_end and best:
        from textclf.best_model import load_best

        metrics = load_best(accelerator, best, step, cfg.output_dir)
    accelerator.print(f"eval at step {step}: {task.summary(metrics)} on {metrics['eval_samples']} examples")
    model_dir = export_model(accelerator, model, tokenizer, os.path.join(cfg.output_dir, "model"),
                             training={"config": cfg.to_dict(), "data_fingerprint": data_fingerprint},
                             trust_remote_code=cfg.trust_remote_code)
    accelerator.print(f"model exported to {model_dir}")
    accelerator.end_training()


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


def fit(cfg, accelerator, model, optimizer, scheduler, train_loader, eval_loader, task, schedule: Schedule,
        position: dict, save):
    """The loop: one iteration per micro-batch; the work of an optimizer step happens where gradients sync.
    Returns (step, the last evaluation, the best so far), or step None when a signal stopped the run."""
    step, best, total_steps = position["step"], position.get("best"), schedule.total_steps
    start_epoch, skip = position["epoch"], position["batch_in_epoch"]
    if skip >= schedule.batches_per_epoch:  # the checkpoint closed its epoch
        start_epoch, skip = start_epoch + 1, 0
    progress = tqdm(total=total_steps, initial=step, desc="train",
                    disable=not accelerator.is_local_main_process or step >= total_steps)
    # The loss window is part of a checkpoint: the first line after a resume averages what it would have.
    window = tracking.Window(position["loss_window"][accelerator.process_index] if "loss_window" in position else None)
    stop_requested = request_stop_on_signals(accelerator, cfg.logging_steps)
    metrics = {}
    watch = DivergenceWatch(accelerator, cfg.learning_rate, clipping=bool(cfg.max_grad_norm), output_dir=cfg.output_dir)
    # DeepSpeed clips by itself (gradient_clipping, from max_grad_norm: runtime.py); under it accelerate's
    # clip_grad_norm_ would only read the norm back, which waits for the device at every step.
    clip = cfg.max_grad_norm and accelerator.distributed_type != DistributedType.DEEPSPEED
    model.train()
    for epoch in range(start_epoch, math.ceil(total_steps / schedule.steps_per_epoch)):
        if step >= total_steps:
            break
        train_loader.set_epoch(epoch)  # the same shuffle for this epoch as an uninterrupted run
        batches = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
        for batch_in_epoch, batch in enumerate(batches, start=skip + 1):
            # Dropout from the micro-batch's place in the run, not from the rank that runs it.
            micro_batch = (batch_in_epoch - 1) % cfg.gradient_accumulation_steps * accelerator.num_processes
            seed_micro_batch(cfg.seed, step, micro_batch + accelerator.process_index, accelerator.device)
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                grad_norm = None
                if accelerator.sync_gradients and clip:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            window.add(loss, batch)
            watch.add(step + 1, loss, grad_norm)  # kept on the device: read at log lines, evaluations and saves
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            step += 1
            progress.update()
            stopping = False
            if step % cfg.logging_steps == 0 or step == total_steps:
                # The epoch as a fraction, as the Trainer logs it.
                stopping = log(accelerator, window, step, step / schedule.steps_per_epoch, optimizer, progress,
                               stop_requested)
                watch.check(step)
                window = tracking.Window()
            metrics = {}
            if step == total_steps or cadence.due(cfg.eval_strategy, cfg.eval_steps, step, schedule.steps_per_epoch):
                watch.check(step, model)
                metrics, best, total_steps = evaluate(cfg, accelerator, model, eval_loader, task, step, best,
                                                      total_steps)
            # The last step is saved too, as the Trainer does: --resume latest or auto then finds the run finished.
            if cadence.due(cfg.save_strategy, cfg.save_steps, step, schedule.steps_per_epoch) or stopping or (
                    step == total_steps and cfg.save_strategy != "no"):
                watch.check(step, model)  # never a checkpoint of NaN weights: a diverged run stops here, in one line
                path = save(step, epoch, batch_in_epoch, metrics, window, best)
            if stopping:
                progress.close()  # the bar's line ends first: the --resume line is one of its own
                stopped_by = stop_requested[0] if stop_requested else "a signal to another rank"
                accelerator.print(f"stopped by {stopped_by} at step {step}; continue with: --resume {path}")
                accelerator.end_training()
                return None, metrics, best
            if step >= total_steps:
                break
        skip = 0
    progress.close()
    return step, metrics, best


def log(accelerator, window, step: int, epoch: float, optimizer, progress, stop_requested: list) -> bool:
    """Log the window's loss and throughput; returns whether the run stops here. All ranks agree on it: asking
    waits for the device, as logging does, so a step between two log lines never waits for it."""
    # The learning rate the next step applies, read from the optimizer that steps rather than from the schedule.
    values = {**window.summary(accelerator), "lr": optimizer.param_groups[0]["lr"], "epoch": epoch}
    tracking.log(accelerator, values, step)
    progress.set_postfix(loss=f"{values['loss']:.4f}", tok_s=f"{values['real_tokens_per_s']:.0f}")
    if stop_requested:
        accelerator.set_trigger()
    return accelerator.check_trigger()


def evaluate(cfg, accelerator, model, eval_loader, task, step: int, best: Optional[dict], total_steps: int):
    """Evaluate and log; track the best evaluation (load_best_model_at_end) and stop early when patience runs out.
    Returns (metrics, best, total_steps)."""
    metrics = evaluate_model(model, eval_loader, accelerator, task)
    tracking.log(accelerator, metrics, step)
    if cfg.load_best_model_at_end:
        from textclf.best_model import track_best

        best = track_best(best, step, metrics, cfg.metric_for_best_model,
                          checkpoint.checkpoint_folder(cfg.output_dir, step),
                          task.greater_is_better(cfg.metric_for_best_model))
    if cadence.patience_ran_out(best, cfg.early_stopping_patience) and step < total_steps:
        accelerator.print(f"early stopping at step {step}: {cfg.early_stopping_patience} evaluations "
                          f"without improvement of {cfg.metric_for_best_model}")
        total_steps = step
    return metrics, best, total_steps


def request_stop_on_signals(accelerator, logging_steps: int) -> list[str]:
    """SIGTERM (a scheduler) and SIGINT (Ctrl-C, which torchrun passes on to every rank) ask for a checkpoint at
    the next logging step, then a clean stop; a second Ctrl-C stops at once, without one. Returns the list the
    names of the signals received go into (ranks.wait_to_be_stopped reads it too)."""
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


if __name__ == "__main__":
    run_command(lambda: main(cfg, start))  # bad input: one `error:` line, exit code 2
    exit_finished_run()  # no interpreter teardown with gloo threads alive (textclf/runtime.py)
