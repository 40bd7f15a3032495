"""Every model built by make_model (textclf/models/build.py): weight decay groups, the dtype asked for, a pickle-only
weights file refused."""

from types import SimpleNamespace

import pytest
import torch
from transformers import BertConfig

from families import FAMILIES
from textclf.errors import InputError
from textclf.models.build import make_model, parameter_groups, training_config
from textclf.models.tokenizer import get_tokenizer
from textclf.tasks.task import Task


def to_train(model: str, tokenizer, label_names: list[str], **options):
    """The model train.py builds to fine-tune `model` (job.py's two calls), at max_length 32."""
    head = Task.of("single_label", "text", "label").head_config(label_names)
    return make_model(training_config(model, tokenizer, head, 32), model, **options)


class RunsCode:
    """A pickle that runs code when loaded: it leaves a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("family", FAMILIES)
def test_weight_decay_skips_biases_and_every_normalisation_layer(family, family_model):
    from transformers.pytorch_utils import ALL_LAYERNORM_LAYERS

    folder = family_model(family)
    model = to_train(str(folder), get_tokenizer(str(folder), None, "unused", "unused", 32), ["a", "b"])
    decayed, not_decayed = (group["params"] for group in parameter_groups(model, 0.1))
    norms = {id(p) for m in model.modules() if "Norm" in type(m).__name__ or isinstance(m, tuple(ALL_LAYERNORM_LAYERS))
             for p in m.parameters(recurse=False)}
    biases = {id(p) for name, p in model.named_parameters() if name.endswith(".bias")}
    assert norms, "every family normalises"
    assert {id(p) for p in not_decayed} == norms | biases
    assert len(decayed) + len(not_decayed) == len(list(model.parameters()))
    if family in ("llama", "qwen2"):  # RMSNorm, which a rule by type (nn.LayerNorm) alone would miss
        rms = [name for name, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]
        assert len(rms) == 2 * 2 + 1  # two per layer and the final one


def test_weights_load_in_the_dtype_asked_for(family_model):
    llama_model = family_model("llama")
    tokenizer = get_tokenizer(str(llama_model), None, "unused", "unused", 32)
    for dtype, expected in (("bfloat16", torch.bfloat16), ("float32", torch.float32), ("auto", torch.float32)):
        model = to_train(str(llama_model), tokenizer, ["a", "b"], torch_dtype=dtype)
        assert {p.dtype for p in model.parameters()} == {expected}, dtype


def test_a_pickle_only_model_to_train_is_one_line_and_runs_nothing(tmp_path):
    folder = tmp_path / "model"
    BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=32).save_pretrained(folder)
    torch.save({"classifier.weight": torch.zeros(2, 16), "marker": RunsCode(tmp_path / "code-ran")},
               folder / "pytorch_model.bin")
    with pytest.raises(InputError, match="its weights are a pickle that holds more than tensors"):
        make_model(training_config(str(folder), SimpleNamespace(pad_token_id=0), {"num_labels": 2}, 32), str(folder))
    assert not (tmp_path / "code-ran").exists()
