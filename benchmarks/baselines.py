"""The benchmark's two baselines, written plainly: a hand-made PyTorch loop, and the HF Trainer.

    python -m benchmarks.baselines plain_pytorch      <train.py options>
    python -m benchmarks.baselines hf_trainer         <train.py options>   # settings equal to train.py's
    python -m benchmarks.baselines hf_trainer_default <train.py options>   # the Trainer's defaults
    python -m benchmarks.baselines hf_trainer_fast    <train.py options>   # train.py's settings, its speed flags

Each takes train.py's own options (parsed by textclf.cli), so data, split, tokenizer, model
weights, batch size, steps, seed and hyperparameters are the job's by construction. Each writes
`log.jsonl` in output_dir the way train.py does with `--logging_steps 1`: one line per optimizer
step with its wall-clock `time` and throughput, then one line with the eval accuracy. One process,
on the GPU when there is one; the plain loop uses no Accelerate at all.
"""

import collections
import math
import os
import sys

import torch
from transformers import (
    DataCollatorWithPadding,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    get_linear_schedule_with_warmup,
    set_seed,
)

from textclf.cli import parse_config
from textclf.config import TrainConfig
from textclf.data import make_loaders
from textclf.loop import JsonLinesTracker, Window
from textclf.models import build_job, parameter_groups
from textclf.tasks import Task
from train import evaluate

BASELINES = {  # name: what runs
    "plain_pytorch": "hand-written PyTorch loop, no Accelerate",
    "hf_trainer": "transformers.Trainer, train.py's settings",
    "hf_trainer_default": "transformers.Trainer at its defaults",
    "hf_trainer_fast": "transformers.Trainer, train.py's settings and speed flags (torch_compile, use_liger_kernel)",
}


def prepare(cfg: TrainConfig):
    """Data and model built as train.py builds them, in the same order, so the weights are the same."""
    set_seed(cfg.seed)
    job = build_job(cfg)
    return job.train_set, job.eval_set, job.tokenizer, job.model


def loaders(cfg: TrainConfig, train_set, eval_set, tokenizer):
    """train.py's batches: the same collation, length grouping and order for a given seed and epoch."""
    return make_loaders(train_set, eval_set, tokenizer, train_batch_size=cfg.per_device_train_batch_size,
                        eval_batch_size=cfg.per_device_eval_batch_size, num_processes=1,
                        group_by_length=cfg.group_by_length, seed=cfg.seed)


def plain_pytorch(cfg: TrainConfig) -> None:
    """The loop a PyTorch user writes by hand: train.py's job without Accelerate."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train_set, eval_set, tokenizer, model = prepare(cfg)
    train_loader, eval_loader = loaders(cfg, train_set, eval_set, tokenizer)
    model.to(device)
    optimizer = torch.optim.AdamW(parameter_groups(model, cfg.weight_decay), lr=cfg.learning_rate,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon, fused=True)
    total_steps = cfg.max_steps
    scheduler = get_linear_schedule_with_warmup(optimizer, round(cfg.warmup_ratio * total_steps), total_steps)

    # --mixed_precision bf16: computations in bf16 over fp32 weights, as accelerate's autocast does for train.py.
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.mixed_precision == "bf16")
    step, window, log = 0, Window(), JsonLinesTracker(cfg.output_dir)
    model.train()
    for epoch in range(math.ceil(total_steps / len(train_loader))):
        if cfg.group_by_length:
            train_loader.sampler.set_epoch(epoch)  # the epoch's order, drawn as train.py draws it
        for batch in train_loader:
            batch = {name: tensor.to(device) for name, tensor in batch.items()}
            with autocast:
                loss = model(**batch).loss
            loss.backward()
            if cfg.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            step += 1
            window.add(loss, batch)
            log.log(window.summary(), step)
            window = Window()
            if step == total_steps:
                break

    task = Task.from_config(cfg)
    model.eval()
    predictions, references = [], []
    with torch.no_grad(), autocast:
        for batch in eval_loader:
            batch = {name: tensor.to(device) for name, tensor in batch.items()}
            predictions += task.predictions(model(**batch).logits).tolist()
            references += task.targets(batch["labels"]).tolist()
    scores = task.compute_scores(predictions, references)
    log.log({**{f"eval_{key}": value for key, value in scores.items()}, "eval_samples": len(references)}, step)


def hf_trainer(cfg: TrainConfig, equal_settings: bool, speed_flags: bool = False) -> None:
    """transformers.Trainer on the same model and data: with train.py's settings, or at its defaults.

    Either way model, data, batch size, steps, seed and precision are the job's. At its defaults the Trainer
    uses lr 5e-5, no warmup, no weight decay, random batches, fused AdamW and logs every 500 steps. With
    `speed_flags`, what a Trainer user turns on for speed: torch_compile, and use_liger_kernel where liger-kernel
    is installed (the kernels train.py applies: its norms and MLPs).
    """
    train_set, eval_set, tokenizer, model = prepare(cfg)
    collate = DataCollatorWithPadding(tokenizer)  # what the Trainer picks by itself for a tokenizer
    pending = collections.deque()  # batches drawn but not yet trained on: accelerate's loader fetches one ahead
    log = JsonLinesTracker(cfg.output_dir)

    def counting_collate(features):
        pending.append(collate(features))
        return pending[-1]

    settings = dict(output_dir=cfg.output_dir, max_steps=cfg.max_steps, seed=cfg.seed,
                    per_device_train_batch_size=cfg.per_device_train_batch_size, bf16=cfg.mixed_precision == "bf16",
                    use_cpu=not torch.cuda.is_available(),  # what it does anyway, but bf16 on a CPU must be told so
                    report_to="none", save_strategy="no", disable_tqdm=True)
    if equal_settings:
        settings.update(
            learning_rate=cfg.learning_rate, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2, adam_epsilon=cfg.adam_epsilon, max_grad_norm=cfg.max_grad_norm,
            optim="adamw_torch_fused", lr_scheduler_type="linear", warmup_steps=round(cfg.warmup_ratio * cfg.max_steps),
            train_sampling_strategy="group_by_length" if cfg.group_by_length else "random",
            logging_steps=cfg.logging_steps)
    if speed_flags:
        from transformers.utils import is_liger_kernel_available

        from textclf.models.speed import (
            LIGER_KERNELS,  # the Trainer's defaults would give the classifier an LM's forward
        )

        # train.py's kernels: the Trainer would keep Liger's RoPE, a modeling module's swap that train.py puts back.
        settings.update(torch_compile=True, use_liger_kernel=is_liger_kernel_available(),
                        liger_kernel_config={**LIGER_KERNELS, "rope": False})

    class StepTimes(TrainerCallback):  # the Trainer's hooks take a callback object
        def on_train_begin(self, args, state, control, **kwargs):
            self.window = Window()

        def on_step_end(self, args, state, control, **kwargs):
            # Counted as train.py counts; the loss stays inside the Trainer, so the window's (a zero) is dropped.
            self.window.add(torch.zeros(()), pending.popleft())
            log.log({k: v for k, v in self.window.summary().items() if k != "loss"}, state.global_step)
            self.window = Window()

    trainer = Trainer(model=model, args=TrainingArguments(**settings), train_dataset=train_set,
                      data_collator=counting_collate, processing_class=tokenizer, callbacks=[StepTimes()])
    trainer.train()
    # The same evaluation as train.py's, on the Trainer's own Accelerator.
    eval_loader = trainer.accelerator.prepare(loaders(cfg, train_set, eval_set, tokenizer)[1])
    task = Task.from_config(cfg)
    log.log(evaluate(trainer.model, eval_loader, trainer.accelerator, task, task.scores_with([])),
            trainer.state.global_step)


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in BASELINES:
        sys.exit(f"usage: python -m benchmarks.baselines {{{','.join(BASELINES)}}} <train.py options>")
    cfg = parse_config(argv[1:])
    if not cfg.max_steps or cfg.gradient_accumulation_steps != 1 or cfg.lora or cfg.mixed_precision == "fp16":
        sys.exit("the baselines run a fixed number of steps (--max_steps), without accumulation or LoRA, in fp32 "
                 "or bf16")
    os.makedirs(cfg.output_dir, exist_ok=True)
    if argv[0] == "plain_pytorch":
        plain_pytorch(cfg)
    else:
        hf_trainer(cfg, equal_settings=argv[0] != "hf_trainer_default", speed_flags=argv[0] == "hf_trainer_fast")


if __name__ == "__main__":
    main(sys.argv[1:])
