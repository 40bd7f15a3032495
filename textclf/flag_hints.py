"""The option a user meant by a key train.py does not know ('--lr' -> '--learning_rate', the Trainer's --do_train):
imported only on such bad input."""

import difflib

from .config import field_names

# Names that users of the Trainer, run_glue_no_trainer.py and other scripts type, and what they are here.
HABITS = {
    "lr": "learning_rate", "epochs": "num_train_epochs", "num_epochs": "num_train_epochs",
    "batch_size": "per_device_train_batch_size", "train_batch_size": "per_device_train_batch_size",
    "eval_batch_size": "per_device_eval_batch_size", "bf16": "mixed_precision bf16",
    "fp16": "mixed_precision fp16", "evaluation_strategy": "eval_strategy", "model_name_or_path": "model",
    "train_file": "data", "validation_file": "eval_data", "resume_from_checkpoint": "resume",
    "max_seq_length": "max_length", "max_train_steps": "max_steps", "num_warmup_steps": "warmup_steps",
    "checkpointing_steps": "save_steps", "with_tracking": "report_to tensorboard", "num_workers":
    "dataloader_num_workers", "patience": "early_stopping_patience", "grad_accum": "gradient_accumulation_steps",
    "sep": "delimiter", "lr_warmup_steps": "warmup_steps",
}


# The Trainer's options that have no counterpart here, and what to do instead.
FOREIGN = {
    "do_train": "train.py always trains; leave it out", "do_eval": "train.py always evaluates at the end; "
    "--eval_strategy sets how often before", "do_predict": "predict with `python -m textclf.predict`",
    "push_to_hub": "upload the exported model with `hf upload <repo_id> <output_dir>/model`",
    "hub_model_id": "upload the exported model with `hf upload <repo_id> <output_dir>/model`",
}


def suggest(key: str) -> str:
    """The known key closest to a mistyped or foreign one ('--lr' -> '--learning_rate'), or ''."""
    dashes = "--" if key.startswith("--") else ""
    name = key.lstrip("-").split("=")[0].replace("-", "_")
    known = field_names()
    habit = HABITS.get(name)
    if habit and habit.split()[0] in known:
        return dashes + habit
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return dashes + close[0] if close else ""


def unknown_keys(keys: list[str], where: str = "") -> str:
    names = [key.lstrip("-").split("=")[0].replace("-", "_") for key in keys]
    foreign = [f"{key}: {FOREIGN[name]}" for key, name in zip(keys, names) if name in FOREIGN]
    suggestions = [suggestion for key, name in zip(keys, names) if name not in FOREIGN and (suggestion := suggest(key))]
    hint = f" (did you mean {' / '.join(suggestions)}?)" if suggestions else ""
    hint += f" ({'; '.join(foreign)})" if foreign else ""
    return f"unknown config key(s) {', '.join(keys)}{where}{hint}; see `python train.py --help`"
