"""Fine-tune a text classifier with Hugging Face Accelerate, from one CPU to many GPUs.

    python train.py                                    # the default job: one process, offline
    accelerate launch --config_file accelerate_configs/cpu.yaml train.py   # or any file of the zoo
    python train.py --resume latest                    # continue exactly where it stopped
    python train.py --help                             # every option (textclf/config.py)

Outputs in --output_dir: run.json, log.jsonl, step_<N>/ checkpoints, model/ (the exported model). The run reads top
to bottom on the Accelerate calls it is built on; the template's guarantees (one-line errors, checkpoints complete
or absent and verified before they load, an exact resume) wrap those calls rather than hide them.
"""

import sys

from textclf.errors import die_with_launcher, run_command

if __name__ == "__main__":
    die_with_launcher()  # under torchrun, a rank ends with its launcher however that ends

from textclf.checkpointing import Start
from textclf.cli import parse_config, plan_run
from textclf.config import HELD_OUT, TrainConfig
from textclf.launch import check_command_line, check_launch_early, launch_shortfall

if __name__ == "__main__":
    # The command line first: --help and a mistyped flag answer at once, not after the heavy imports below;
    # so do a missing data file, a launch that contradicts itself and a resume that it cannot continue.
    cfg = run_command(parse_config)
    run_command(lambda: check_command_line(cfg))
    cfg, start = run_command(lambda: plan_run(cfg, sys.argv[1:]))
    run_command(lambda: check_launch_early(cfg))

import contextlib
import io
import math
import os
from typing import NamedTuple, Optional

import torch
from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs
from accelerate.utils import DistributedType, gather_object, set_seed
from tqdm.auto import tqdm
from transformers import get_scheduler

from textclf import checkpointing, errors, loop
from textclf.data import make_loaders, seed_micro_batch, write_examples
from textclf.files import write_json
from textclf.launch import (
    before_the_accelerator,
    complete_the_plugin,
    describe_run,
    exit_finished_run,
    launch_environment,
    scoped,
)
from textclf.models import (
    build_job,
    export_model,
    in_units,
    padding_multiple,
    parameter_counts,
    parameter_groups,
    speed_up,
)
from textclf.tasks import Task


def make_accelerator(cfg: TrainConfig, load_universal: bool = False) -> Accelerator:
    """One Accelerator for every zoo file, on GPUs and CPUs alike. `load_universal`: ZeRO's states come from
    DeepSpeed's universal checkpoint (a resume on another number of processes). Without CUDA, DDP needs `cpu=True`
    to form a gloo group (else each rank runs alone), DeepSpeed `cpu=False` and gloo (`cpu=True` would run DDP)."""
    has_cuda, launch = torch.cuda.is_available(), launch_environment()
    if launch.deepspeed:
        before_the_accelerator(has_cuda)  # its JSON checked, and on a CPU the op deepspeed.comm loads
    with contextlib.redirect_stdout(io.StringIO()) as said:  # DeepSpeed prints "... built successfully" per rank
        accelerator = Accelerator(
            cpu=not has_cuda and not launch.deepspeed,
            mixed_precision=cfg.mixed_precision,  # None: the launch's (ACCELERATE_MIXED_PRECISION), or "no"
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            # The schedule is defined in optimizer steps and stepped once per optimizer step (fit).
            step_scheduler_with_optimizer=False,
            log_with=loop.log_with(cfg),  # log.jsonl, and the trackers --report_to names
            project_dir=cfg.output_dir,
            # Shuffles of (seed, epoch) alone: a resume replays the data order. On a GPU, pinned batches are copied
            # without the host waiting for the previous step to finish.
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed,
                                                      non_blocking=has_cuda),
            kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if launch.world_size > 1 and not has_cuda else [],
        )
    print("".join(line for line in said.getvalue().splitlines(keepends=True)
                  if errors.verbose() or not line.endswith("built successfully\n")), end="")
    if accelerator.state.deepspeed_plugin is not None:
        complete_the_plugin(accelerator.state.deepspeed_plugin, cfg.max_grad_norm, load_universal)
    return accelerator


class Prepared(NamedTuple):
    """What `accelerator.prepare` returns, which the loop trains and evaluates with."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    train_loader: object
    eval_loader: object


class Outcome(NamedTuple):
    """How fit ended: at `step`, with the last evaluation and the best so far; `stopped` by a signal."""

    step: int
    metrics: dict
    best: Optional[dict]
    stopped: bool = False


@scoped  # what the run sets in the libraries (quiet warnings and bars, signal handlers) is put back at its end
def main(cfg: TrainConfig, start: Optional[Start] = None) -> None:
    if start is None:  # called from code (a notebook, a test): planned here, as the command line plans it
        cfg, start = plan_run(cfg)
    accelerator = make_accelerator(cfg, load_universal=start.universal)
    run = describe_run(accelerator, cfg)
    accelerator.print(f"config: {cfg.to_dict()}")
    accelerator.print(" | ".join(f"{k}: {run[k]}" for k in ("distributed_type", "num_processes", "mixed_precision",
                                                            "zero_stage", "device", "micro_batch_size",
                                                            "global_batch_size")))
    if accelerator.is_main_process and (shortfall := launch_shortfall(accelerator.num_processes)):
        print(f"warning: {shortfall}")  # the launch asked for more processes than it started: said, not refused
    set_seed(cfg.seed)

    # Data and model. Everything the user can get wrong is checked before anything is written.
    task = Task.from_config(cfg)  # what the labels are, how predictions are made and scored
    # The scores are evaluate modules: the task's own, and each --metric's, found by the main process (it alone may
    # fetch one, under evaluate's file lock) before the data is read; every process reads their files itself.
    scores = task.scores_with(errors.checked_on_main_process(accelerator, lambda: Task.find_metrics(cfg.metric)))
    job = build_job(cfg, accelerator.local_main_process_first, start)  # a resume keeps the tokenizer it trained with
    accelerator.print(f"data: {len(job.train_set)} train / {len(job.eval_set)} eval examples, labels "
                      f"{job.label_names}; model: {cfg.model}, {in_units(parameter_counts(job.model)['params'])} "
                      "parameters")
    train_loader, eval_loader = make_loaders(
        job.train_set, job.eval_set, job.tokenizer, train_batch_size=cfg.per_device_train_batch_size,
        eval_batch_size=cfg.per_device_eval_batch_size, num_processes=accelerator.num_processes,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, group_by_length=cfg.group_by_length,
        seed=cfg.seed, num_workers=cfg.dataloader_num_workers,
        pad_to_multiple_of=padding_multiple(cfg, accelerator),  # tensor cores' multiple, or compiled lengths' buckets
        pin_memory=accelerator.device.type == "cuda")  # copied to the GPU without waiting for it

    # Optimizer and schedule, counted in optimizer steps.
    schedule = loop.Schedule.of(cfg, batches=len(train_loader) // accelerator.num_processes)  # per process, sharded
    # Fused: one pass over each tensor instead of one per operation (the Trainer's default too); on a
    # CPU, BERT-base's optimizer step takes a third of the time. Not under fp16's loss scaler: a fused step skips an
    # overflow inside its kernel, unseen by accelerate's optimizer_step_was_skipped, which the divergence watch reads.
    optimizer = torch.optim.AdamW(parameter_groups(job.model, cfg.weight_decay), lr=cfg.learning_rate,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
                                  fused=accelerator.scaler is None)
    scheduler = get_scheduler(cfg.lr_scheduler_type, optimizer, cfg.num_warmup_steps(schedule.total_steps),
                              schedule.total_steps)
    run["speed"] = speed_up(job.model, cfg, accelerator)  # TF32, Liger's kernels, torch.compile: on a GPU, by default
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        job.model, optimizer, train_loader, eval_loader, scheduler)

    # What this run is made of: every checkpoint records it, and a resume must match it (RESUME_TABLE, per key).
    made_of = {"world_size": run["num_processes"], "zero_stage": run["zero_stage"],
               "mixed_precision": run["mixed_precision"],
               "per_device_train_batch_size": cfg.per_device_train_batch_size,
               "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
               "global_batch_size": run["global_batch_size"], "model": cfg.model, "lora": cfg.lora,
               "data_fingerprint": job.data_fingerprint}
    # The run holds output_dir until it ends (one run at a time), and writes to it from then on. A resume first checks
    # its checkpoint against the run just built, so that a refusal leaves nothing behind, then loads it.
    if start.checkpoint is None:
        checkpointing.claim_output_dir(accelerator, cfg.output_dir, cfg.resume, cfg.overwrite_output_dir, None)
    else:
        checkpointing.check_resume(accelerator, start, cfg, made_of, **vars(schedule))
        checkpointing.claim_output_dir(accelerator, cfg.output_dir, cfg.resume, cfg.overwrite_output_dir,
                                       start.checkpoint)
        with checkpointing.resuming(accelerator, optimizer, scheduler, start, cfg) as folder:
            accelerator.load_state(folder)  # weights, optimizer, schedule, RNG states, the data loaders' place
    position = start.position
    if accelerator.is_main_process:
        write_json(os.path.join(cfg.output_dir, "run.json"), {"config": cfg.to_dict(), **run,
                                                              "labels": job.label_names})
        loop.keep_log_until(cfg.output_dir, position["step"])
        write_examples(job.eval_examples, task, job.label_names, os.path.join(cfg.output_dir, HELD_OUT))
    accelerator.init_trackers(cfg.project_name, **loop.tracker_config(cfg))
    loop.use_trainer_names(accelerator, cfg.report_to)

    # A diverged run's line names the labels' scale where it is the likely cause (a regression's huge labels).
    watch = loop.DivergenceWatch(accelerator, cfg.learning_rate, clipping=bool(cfg.max_grad_norm),
                                 output_dir=cfg.output_dir, labels_scale=task.labels_scale(job.train_set))

    def save(step: int, epoch: int, batch_in_epoch: int, metrics: dict, window: loop.Window, best) -> str:
        """A checkpoint: what `accelerator.save_state` writes, sealed by position.json, which records this."""
        recorded = {"step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch,  # where the loop is
                    **made_of,
                    "metrics": metrics, "best": best,  # the last evaluation, and the best so far
                    "loss_window": gather_object([window.state()]),  # each rank's, since the last log line
                    "config": cfg.to_dict() | start.asked_split,  # what a resume trains with
                    "started_in": start.started_in,  # where the config's relative paths start from
                    "largest_weight": watch.largest_weight}  # checked before every save: a diverging run's is huge
        with checkpointing.sealed_checkpoint(accelerator, cfg.output_dir, recorded) as folder:
            accelerator.save_state(folder)
            if accelerator.is_main_process:  # what export needs besides the weights: the config (id2label), tokenizer
                accelerator.unwrap_model(model).config.save_pretrained(folder)
                job.tokenizer.save_pretrained(os.path.join(folder, "tokenizer"))
        if accelerator.is_main_process and cfg.save_total_limit:
            checkpointing.rotate(cfg.output_dir, cfg.save_total_limit, cfg.metric_for_best_model, start.checkpoint,
                                 task.greater_is_better(cfg.metric_for_best_model))
        return checkpointing.checkpoint_folder(cfg.output_dir, step)

    outcome = fit(cfg, accelerator, Prepared(model, optimizer, scheduler, train_loader, eval_loader), task, scores,
                  schedule, position, save, watch)
    if outcome.stopped:  # by a signal, after its checkpoint
        return
    step, metrics, best = outcome.step, outcome.metrics, outcome.best
    if not metrics:  # resumed from the last checkpoint: nothing left to train
        metrics = evaluate(model, eval_loader, accelerator, task, scores)
    if cfg.load_best_model_at_end and best:  # the best checkpoint's weights, unless they are the last step's
        folder = None
        if best["step"] != step:
            with checkpointing.verified_best_checkpoint(accelerator, best, cfg.output_dir, cfg.allow_pickle) as folder:
                accelerator.load_state(folder)
        metrics = loop.record_best_model(accelerator, best, folder, cfg.output_dir)
    accelerator.print(f"eval at step {step}: {task.summary(metrics)} on {metrics['eval_samples']} examples")
    model_dir = export_model(accelerator, model, job.tokenizer, os.path.join(cfg.output_dir, "model"),
                             training={"config": cfg.to_dict(), "data_fingerprint": job.data_fingerprint},
                             trust_remote_code=cfg.trust_remote_code)
    accelerator.print(f"model exported to {model_dir}")
    accelerator.end_training()


def fit(cfg: TrainConfig, accelerator: Accelerator, prepared: Prepared, task: Task, scores, schedule: loop.Schedule,
        position: dict, save, watch: loop.DivergenceWatch) -> Outcome:
    """The loop: one iteration per micro-batch; the work of an optimizer step happens where gradients sync."""
    model, optimizer, scheduler, train_loader, eval_loader = prepared
    step, best, total_steps = position["step"], position.get("best"), schedule.total_steps
    start_epoch, skip = position["epoch"], position["batch_in_epoch"]
    if skip >= schedule.batches_per_epoch:  # the checkpoint closed its epoch
        start_epoch, skip = start_epoch + 1, 0
    progress = tqdm(total=total_steps, initial=step, desc="train",
                    disable=not accelerator.is_local_main_process or step >= total_steps)
    # The loss window is part of a checkpoint: the first line after a resume averages what it would have.
    window = loop.Window(position["loss_window"][accelerator.process_index] if "loss_window" in position else None)
    stop_requested = loop.request_stop_on_signals(accelerator, cfg.logging_steps)
    metrics = {}
    # DeepSpeed clips by itself (gradient_clipping, from max_grad_norm); under it accelerate's clip_grad_norm_
    # would only read the norm back, which waits for the device at every step.
    clip = cfg.max_grad_norm and accelerator.distributed_type != DistributedType.DEEPSPEED
    model.train()
    for epoch in range(start_epoch, math.ceil(total_steps / schedule.steps_per_epoch)):
        if step >= total_steps:
            break
        train_loader.set_epoch(epoch)  # the same shuffle for this epoch as an uninterrupted run
        batches = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader  # a resume's place
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
                window = loop.Window()
            metrics = {}
            if step == total_steps or loop.due(cfg.eval_strategy, cfg.eval_steps, step, schedule.steps_per_epoch):
                watch.check(step, model)
                metrics, best, stop_early = evaluate_and_track(cfg, accelerator, model, eval_loader, task, scores, step,
                                                               best, total_steps)
                total_steps = step if stop_early else total_steps
            # The last step is saved too, as the Trainer does: --resume latest or auto then finds the run finished.
            if loop.due(cfg.save_strategy, cfg.save_steps, step, schedule.steps_per_epoch) or stopping or (
                    step == total_steps and cfg.save_strategy != "no"):
                watch.check(step, model)  # never a checkpoint of NaN weights: a diverged run stops here, in one line
                path = save(step, epoch, batch_in_epoch, metrics, window, best)
            if stopping:
                progress.close()  # the bar's line ends first: the --resume line is one of its own
                stopped_by = stop_requested[0] if stop_requested else "a signal to another rank"
                accelerator.print(f"stopped by {stopped_by} at step {step}; continue with: --resume {path}")
                accelerator.end_training()
                return Outcome(step, metrics, best, stopped=True)
            if step >= total_steps:
                break
        skip = 0
    progress.close()
    return Outcome(step, metrics, best)


def evaluate_and_track(cfg: TrainConfig, accelerator: Accelerator, model, eval_loader, task: Task, scores, step: int,
                       best: Optional[dict], total_steps: int) -> tuple[dict, Optional[dict], bool]:
    """Evaluate and log; track the best evaluation (load_best_model_at_end). Returns the metrics, the best so far, and
    whether the run stops early here (its patience ran out before its last step)."""
    metrics = evaluate(model, eval_loader, accelerator, task, scores)
    accelerator.log(metrics, step=step)
    if cfg.load_best_model_at_end:
        best = loop.track_best(best, step, metrics, cfg.metric_for_best_model,
                               checkpointing.checkpoint_folder(cfg.output_dir, step),
                               task.greater_is_better(cfg.metric_for_best_model))
    stop_early = loop.patience_ran_out(best, cfg.early_stopping_patience) and step < total_steps
    if stop_early:
        accelerator.print(f"early stopping at step {step}: {cfg.early_stopping_patience} evaluations "
                          f"without improvement of {cfg.metric_for_best_model}")
    return metrics, best, stop_early


def evaluate(model, eval_loader, accelerator: Accelerator, task: Task, scores) -> dict:
    """The scores over the whole eval set as eval_<key>, every process evaluating its shard, and eval_samples: the
    eval set's size (`gather_for_metrics` drops the samples that the last batch repeats to even out the shards). Every
    process feeds the gathered batches to the evaluate modules (`scores`) and computes them alike."""
    samples = 0
    was_training = model.training
    model.eval()
    with torch.no_grad():  # not inference_mode: ZeRO-3 gathers parameters during the forward pass
        # A bar like training's, below it while it runs, gone after: an evaluation takes a while on a large eval set.
        for batch in tqdm(eval_loader, desc="eval", unit="batch", leave=False,
                          disable=not accelerator.is_local_main_process):
            predictions = task.predictions(model(**batch).logits)
            predictions, references = accelerator.gather_for_metrics((predictions, task.targets(batch["labels"])))
            scores.add_batch(predictions=predictions.tolist(), references=references.tolist())
            samples += len(references)
    model.train(was_training)
    return {**{f"eval_{key}": value for key, value in scores.compute().items()}, "eval_samples": samples}


def log(accelerator: Accelerator, window: loop.Window, step: int, epoch: float, optimizer, progress,
        stop_requested: list) -> bool:
    """Log the window's loss and throughput; returns whether the run stops here. All ranks agree on it: asking
    waits for the device, as logging does, so a step between two log lines never waits for it."""
    # The learning rate the next step applies, read from the optimizer that steps rather than from the schedule.
    values = {**window.summary(accelerator), "lr": optimizer.param_groups[0]["lr"], "epoch": epoch}
    accelerator.log(values, step=step)  # log.jsonl as it is; the other trackers under the Trainer's names
    progress.set_postfix(loss=f"{values['loss']:.4f}", tok_s=f"{values['real_tokens_per_s']:.0f}")
    if stop_requested:
        accelerator.set_trigger()
    return accelerator.check_trigger()


if __name__ == "__main__":
    run_command(lambda: main(cfg, start))  # bad input: one `error:` line, exit code 2
    exit_finished_run()  # no interpreter teardown with gloo threads alive
