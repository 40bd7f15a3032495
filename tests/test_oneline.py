"""Bad input and failures that used to end in a traceback, or in a prompt: each is one `error:` line, said once.

docs/faults.md ("One line, not a traceback") lists them with these tests.
"""

import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from safetensors.torch import save_file
from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

from conftest import OFFLINE, REPO, TINY, assert_refused, free_port, run_train
from textclf import check
from textclf.checkpointing.folders import checkpoint_folder
from textclf.checkpointing.write import complete, sealed_checkpoint
from textclf.cli import parse_config
from textclf.config import TrainConfig
from textclf.data.examples import read_labelled
from textclf.errors import PEER_ENDED, InputError, peer_ended, run_command
from textclf.export import export_checkpoint
from textclf.launch.deepspeed_config import check_deepspeed_config
from textclf.models.build import make_model, model_config, training_config
from textclf.models.trained import load_trained
from textclf.predict import read_inputs
from textclf.tasks.task import Task
from train import make_accelerator


def save_checkpoint(accelerator, output_dir: str, position: dict) -> str:
    """A checkpoint saved as train.py saves one: accelerate's save_state into the folder sealed_checkpoint yields."""
    with sealed_checkpoint(accelerator, output_dir, position) as folder:
        accelerator.save_state(folder)
    return checkpoint_folder(output_dir, position["step"])


def code_shipping_folder(tmp_path, position=False):
    """A model folder whose config names its own Python code (auto_map); importing that code leaves a marker."""
    folder = tmp_path / ("step_1" if position else "custom")
    folder.mkdir()
    marker = tmp_path / "code-ran"
    leave_marker = f"open({str(marker)!r}, 'w').close()\n"
    (folder / "configuration_mine.py").write_text(
        f"{leave_marker}from transformers import PretrainedConfig\n"
        "class MineConfig(PretrainedConfig):\n    model_type = 'mine'\n")
    (folder / "modeling_mine.py").write_text(leave_marker)
    (folder / "config.json").write_text(json.dumps({"model_type": "mine", "auto_map": {
        "AutoConfig": "configuration_mine.MineConfig",
        "AutoModelForSequenceClassification": "modeling_mine.MineForSequenceClassification"}}))
    save_file({"weight": torch.zeros(2)}, str(folder / "model.safetensors"))
    if position:
        complete(str(folder), {"step": 1, "epoch": 0, "batch_in_epoch": 1})  # sealed, as a run seals it
    return folder, marker


@pytest.mark.parametrize("position", [False, True], ids=["model folder", "checkpoint"])
def test_a_folder_code_runs_only_with_trust_remote_code(tmp_path, position):
    folder, marker = code_shipping_folder(tmp_path, position)
    with pytest.raises(InputError, match="needs custom code to load .* pass --trust_remote_code"):
        load_trained(str(folder))
    assert not marker.exists()
    if not position:
        # The flag reaches transformers: the folder's code runs (its model class is missing: a stub folder).
        with pytest.raises(AttributeError, match="has no attribute 'MineForSequenceClassification'"):
            load_trained(str(folder), trust_remote_code=True)
        assert marker.exists()


def test_predict_never_prompts_to_run_a_folder_code(tmp_path):
    """transformers asks "Do you wish to run the custom code? [y/N]" when trust_remote_code is None, and reads
    the answer from stdin: a "y" there must not run it."""
    folder, marker = code_shipping_folder(tmp_path)
    result = subprocess.run([sys.executable, "-m", "textclf.predict", "--model", str(folder), "--text", "好"],
                            cwd=REPO, input="y\ny\n", capture_output=True, text=True, timeout=300,
                            env={**os.environ, **OFFLINE})
    assert_refused(result, "needs custom code to load")
    assert "--trust_remote_code" in result.stderr
    assert not marker.exists()


def known_type_with_auto_map(tmp_path, where):
    """A BERT model folder (`model`) or step_<N> checkpoint (`checkpoint`) whose config or tokenizer config names
    custom code in an auto_map: transformers knows `bert`, and without the refusal loads its own class instead."""
    kind, file = where.split()
    folder = tmp_path / ("step_1" if kind == "checkpoint" else "model")
    BertForSequenceClassification(BertConfig(vocab_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32)).save_pretrained(folder)
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "好", "差", "书"]))
    tokenizer_folder = folder / "tokenizer" if kind == "checkpoint" else folder
    BertTokenizerFast(str(tmp_path / "vocab.txt")).save_pretrained(tokenizer_folder)
    edited = folder / "config.json" if file == "config" else tokenizer_folder / "tokenizer_config.json"
    settings = json.loads(edited.read_text())
    settings["auto_map"] = {"AutoConfig": "configuration_mine.MineConfig", "AutoTokenizer": ["tokenization_mine.Mine",
                                                                                              None]}
    edited.write_text(json.dumps(settings))
    if kind == "checkpoint":
        complete(str(folder), {"step": 1, "epoch": 0, "batch_in_epoch": 1})  # sealed, as a run seals it
    return folder


@pytest.mark.parametrize("where", ["model config", "model tokenizer", "checkpoint config", "checkpoint tokenizer"])
def test_custom_code_on_a_known_model_type_is_refused_not_swapped_for_the_stock_class(tmp_path, where, capsys):
    folder = known_type_with_auto_map(tmp_path, where)
    named = folder / "tokenizer" if where == "checkpoint tokenizer" else folder  # the folder that names the code
    line = f"'{named}' needs custom code to load (its config's auto_map names Python files it ships); pass " \
           "--trust_remote_code if you trust that code"
    with pytest.raises(InputError) as refused:  # export, predict and report
        load_trained(str(folder))
    assert str(refused.value) == line
    if where.startswith("model"):  # train.py (build_job reads the config first; a resume too) and the check
        with pytest.raises(InputError) as refused:
            model_config(str(folder), 32)
        assert str(refused.value) == line
        capsys.readouterr()
        assert check.main(["--model", str(folder), "--max_length", "32", "--target", "cpu"]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"error: {line}"]


@pytest.mark.parametrize("recipe, message", [
    ("learning_rate: [1\nseed: 3\n", "expected ',' or ']', but got ':' (line 2, column 5)"),
    ("seed: !!python/object/apply:os.system ['touch {marker}']\n", "could not determine a constructor for the tag"),
], ids=["syntax error", "python tag"])
def test_a_recipe_that_is_not_plain_yaml_is_one_line(tmp_path, recipe, message):
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe.format(marker=tmp_path / "code-ran"))
    with pytest.raises(InputError) as refused:
        parse_config(["--config", str(path)])
    assert message in str(refused.value) and len(str(refused.value).splitlines()) == 1
    assert not (tmp_path / "code-ran").exists()


@pytest.mark.parametrize("seed", ["-1", str(2 ** 40)])
def test_a_seed_numpy_cannot_take_is_refused(seed):
    with pytest.raises(InputError, match=re.escape(f"seed must be in [0, 2**32 - 1], got {seed}")):
        parse_config(["--seed", seed])


@pytest.mark.parametrize("suffix, rows", [
    (".csv", "label,review\npos,23\nneg,45\n"),
    (".jsonl", '{"review": 12, "label": "pos"}\n{"review": "x", "label": "neg"}\n'),
], ids=["numbers", "mixed"])
def test_a_text_column_of_numbers_is_refused(tmp_path, suffix, rows):
    path = tmp_path / f"data{suffix}"
    path.write_text(rows)
    task = Task.from_config(TrainConfig())
    for read in (read_labelled, read_inputs):  # training and report, predict
        with pytest.raises(InputError, match="the text column 'review' holds .* values, not text; choose"):
            read(str(path), task)


class RunsCode:
    """A pickle that runs code when loaded: it leaves a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_only_model_to_train_is_one_line_and_runs_nothing(tmp_path):
    folder = tmp_path / "model"
    BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=32).save_pretrained(folder)
    torch.save({"classifier.weight": torch.zeros(2, 16), "marker": RunsCode(tmp_path / "code-ran")},
               folder / "pytorch_model.bin")
    with pytest.raises(InputError, match="its weights are a pickle that holds more than tensors"):
        make_model(training_config(str(folder), SimpleNamespace(pad_token_id=0), {"num_labels": 2}, 32), str(folder))
    assert not (tmp_path / "code-ran").exists()


@pytest.mark.parametrize("checkpoint", [False, True], ids=["model folder", "checkpoint"])
def test_export_from_a_truncated_weights_file_is_one_line(tmp_path, checkpoint):
    source = tmp_path / ("step_1" if checkpoint else "model")
    BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32)).save_pretrained(source)
    if checkpoint:
        (source / "position.json").write_text(json.dumps({"step": 1, "epoch": 0, "batch_in_epoch": 1}))
    weights = source / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    with pytest.raises(InputError) as refused:
        export_checkpoint(str(source), str(tmp_path / "exported"))
    assert str(source) in str(refused.value) and len(str(refused.value).splitlines()) == 1
    assert not (tmp_path / "exported").exists()


def deepspeed_json(tmp_path, edit=None, text=None) -> Path:
    """A copy of ds_configs/zero2.json changed by `edit(config)`, or the file `text`."""
    config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    if edit:
        edit(config)
    path = tmp_path / "ds.json"
    path.write_text(text if text is not None else json.dumps(config))
    return path


DEEPSPEED_MISTAKES = {
    "syntax error": (dict(text='{"zero_optimization": {"stage": 2,}}'), "cannot read DeepSpeed config"),
    "stage 4": (dict(edit=lambda ds: ds["zero_optimization"].update(stage=4)),
                "DeepSpeed refuses it: DeepSpeedZeroConfig stage: Input should be 0, 1, 2, 3"),
    "stagee": (dict(edit=lambda ds: ds["zero_optimization"].update(stagee=2)),
               "DeepSpeed refuses it: DeepSpeedZeroConfig stagee: Extra inputs are not permitted"),
    "offload to gpu": (dict(edit=lambda ds: ds["zero_optimization"].update(offload_optimizer={"device": "gpu"})),
                       "offload_optimizer.device: Input should be 'none', 'cpu' or 'nvme' (got \"gpu\")"),
}


@pytest.mark.parametrize("mistake", DEEPSPEED_MISTAKES)
def test_a_deepspeed_json_deepspeed_would_refuse_stops_train_py_and_the_check(tmp_path, monkeypatch, capsys,
                                                                              mistake):
    changes, message = DEEPSPEED_MISTAKES[mistake]
    ds_path = deepspeed_json(tmp_path, **changes)
    # train.py: before the Accelerator, data or model (DeepSpeed itself reads it at prepare()).
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ds_path))
    with pytest.raises(InputError, match=re.escape(message)) as refused:
        make_accelerator(TrainConfig(report_to="none"))
    assert str(ds_path) in str(refused.value) and len(str(refused.value).splitlines()) == 1
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    # The check: one error line, where it said "ZeRO-4" or "ZeRO-0".
    config = yaml.safe_load((REPO / "accelerate_configs" / "zero2.yaml").read_text())
    config["deepspeed_config"]["deepspeed_config_file"] = str(ds_path)
    yaml_path = tmp_path / "zero2.yaml"
    yaml_path.write_text(yaml.safe_dump(config))
    assert check.main(["--config_file", str(yaml_path), "--target", "cpu", "--cache_dir", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0] and str(ds_path) in errors[0], err
    assert "ZeRO-" not in out


def test_every_shipped_deepspeed_json_passes_deepspeed_s_own_parsing():
    """check_deepspeed_config runs DeepSpeedConfig._initialize_params (a private method): it must accept the
    shipped files, "auto" values included, and still refuse a stage DeepSpeed does not have."""
    for path in sorted((REPO / "ds_configs").glob("*.json")):
        config = json.loads(path.read_text())
        check_deepspeed_config(config, str(path))
        config["zero_optimization"]["stage"] = 5
        with pytest.raises(InputError, match="stage"):
            check_deepspeed_config(config, str(path))


@pytest.fixture
def peer_gone(monkeypatch):
    """The RuntimeError a real gloo collective raises on rank 0 of a 2-process group whose rank 1 has ended."""
    import torch.distributed as dist

    port = str(free_port())
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    peer = subprocess.Popen(
        [sys.executable, "-c", "import os, torch.distributed as d; d.init_process_group('gloo'); os._exit(0)"],
        env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": "1", "WORLD_SIZE": "2"})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    try:
        peer.wait(timeout=120)
        with pytest.raises(RuntimeError) as failed:
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return failed.value


def test_a_collective_whose_peer_ended_is_told_apart_from_a_failed_write(peer_gone, tmp_path):
    assert peer_ended(peer_gone)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 ** 20, limit[1]))  # no file beyond 1 MiB, as on a full disk
    try:
        with pytest.raises(RuntimeError) as torch_save_failed:  # what torch.save raises then: no errno
            torch.save({"weights": torch.zeros(1_000_000)}, tmp_path / "weights.pt")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    assert not peer_ended(torch_save_failed.value)
    assert not peer_ended(OSError(28, "No space left on device"))


def test_a_save_that_fails_because_a_rank_died_does_not_blame_the_disk(peer_gone, tmp_path):
    def save_state(folder):
        os.makedirs(folder, exist_ok=True)  # as accelerate's save_state makes it
        raise peer_gone  # as DeepSpeed's collective save raises it on rank 0

    accelerator = SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None, save_state=save_state)
    with pytest.raises(InputError) as refused:
        save_checkpoint(accelerator, str(tmp_path), {"step": 2})
    message = str(refused.value)
    assert message.startswith(f"cannot save checkpoint {tmp_path / 'step_2'}: {PEER_ENDED} (Connection closed by "
                              "peer")
    assert "free space" not in message and "MiB free" not in message and len(message.splitlines()) == 1
    assert os.listdir(tmp_path) == []


def test_a_rank_whose_collective_failed_after_another_ended_says_one_line(peer_gone, monkeypatch, capsys):
    def died(code):
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", died)  # run_command ends a multi-process rank without interpreter teardown

    def main():
        raise peer_gone

    with pytest.raises(SystemExit) as ended:
        run_command(main)
    assert ended.value.code == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [f"error: {PEER_ENDED} (Connection closed by peer "
                                + err.split("(Connection closed by peer ")[1].splitlines()[0]]
    assert "Traceback" not in err


def test_a_rank_the_launcher_stopped_during_the_failed_collective_ends_quietly_on_that_signal():
    """Once rank 0 has failed, the launcher sends the other ranks SIGTERM. One that was waiting in a collective
    meanwhile hands the signal to train.py's handler (a checkpoint at the next logging step), then meets the
    collective's failure: it must still end on that SIGTERM, silently, not report the failure after waiting."""
    rank_1 = subprocess.run(
        [sys.executable, "-c", "from textclf import errors\nerrors.stop_signals.append('SIGTERM')\n"
                               "errors.report(errors.InputError(errors.PEER_ENDED))"],
        env={**os.environ, "RANK": "1", "WORLD_SIZE": "2"}, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert rank_1.returncode == -15 and rank_1.stderr == "", rank_1.stderr


@pytest.mark.slow
def test_a_deepspeed_json_deepspeed_would_refuse_is_said_once_under_a_launch(tmp_path, reviews_csv, cache_dir):
    config = yaml.safe_load((REPO / "accelerate_configs" / "zero2.yaml").read_text())
    config["deepspeed_config"]["deepspeed_config_file"] = str(
        deepspeed_json(tmp_path, lambda ds: ds["zero_optimization"].update(stage=4)))
    yaml_path = tmp_path / "zero2.yaml"
    yaml_path.write_text(yaml.safe_dump(config))
    result = run_train([*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--output_dir", tmp_path / "out"],
                       yaml_path, check=False)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and "DeepSpeedZeroConfig stage: Input should be 0, 1, 2, 3" in errors[0], result.stderr
    # Before it nothing but the launcher's and libraries' log lines; after it only the launcher's report.
    assert "Traceback" not in "\n".join(lines[:lines.index(errors[0])])
    after = lines[lines.index(errors[0]) + 1:]
    assert not [line for line in after[:after.index("Traceback (most recent call last):")] if "[rank" in line]
    assert result.returncode != 0 and not (tmp_path / "out").exists()


def test_an_error_closes_an_open_progress_bar_first(capsys):
    """errors.report closes the bars tqdm lists in its private _instances, so the error starts a line of its own."""
    import io

    from tqdm import tqdm

    from textclf.errors import report

    bar = tqdm(total=10, file=io.StringIO())
    bar.update(3)
    assert bar in tqdm._instances
    report(InputError("bad input"))
    assert bar.disable and bar not in getattr(tqdm, "_instances", ())  # closed
    assert capsys.readouterr().err == "error: bad input\n"
