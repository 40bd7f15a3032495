"""A DeepSpeed launch's JSON (textclf/launch/deepspeed_config.py): refused before torch where it hard-codes what the
training config owns or where DeepSpeed's own parser would refuse it."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, TINY, run_train
from textclf import check
from textclf.config import TrainConfig
from textclf.errors import InputError
from textclf.launch.deepspeed_config import check_deepspeed_config
from train import make_accelerator


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


def test_a_deepspeed_json_hard_coding_the_accumulation_is_refused_before_torch_is_imported(tmp_path):
    """Accelerate would take the JSON's accumulation with a warning while train.py's schedule counts its own."""
    import json

    from conftest import REPO

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}))
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ds)}
    result = subprocess.run([sys.executable, "-X", "importtime", "train.py", "--output_dir", str(tmp_path / "out")],
                            cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert result.returncode == 2, result.stderr[-2000:]
    assert (f"error: gradient_accumulation_steps: {ds} hard-codes 4, the training config has 1 "
            '(--gradient_accumulation_steps); set it to "auto"') in result.stderr
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}
    assert not {"torch", "transformers", "datasets", "accelerate"} & imported
