"""Models: every model built by make_model (to train, to read back, the check's, the export's copy) from the offline
default (a small BERT from a config, a tokenizer learnt from the texts), a pretrained model, or LoRA adapters on
either; the speed options a run turns on; the exported model folder, written, verified and read back; the training
job (data, tokenizer and model built one way for train.py, the benchmark and its baselines)."""

from .build import (
    SCRATCH_VOCAB_SIZE,
    embedding_holders,
    in_units,
    layer_classes,
    lora_settings,
    make_model,
    model_config,
    parameter_counts,
    parameter_groups,
    scratch_config,
    scratch_size,
)
from .folder import export_model, predict_logits, refuse_existing, save_verified
from .job import build_job, load_data
from .speed import padding_multiple, speed_up
from .tokenizer import sample_key, scratch_tokenizer_folder
from .trained import inference_accelerator, label_names, load_trained, read_training, run_config

__all__ = [
    "SCRATCH_VOCAB_SIZE", "build_job", "embedding_holders", "export_model", "in_units", "inference_accelerator",
    "label_names", "layer_classes", "load_data", "load_trained", "lora_settings", "make_model", "model_config",
    "padding_multiple", "parameter_counts", "parameter_groups", "predict_logits", "read_training", "refuse_existing",
    "run_config", "sample_key", "save_verified", "scratch_config", "scratch_size", "scratch_tokenizer_folder",
    "speed_up",
]
