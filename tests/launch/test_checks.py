"""The launch read before the heavy imports and what of it cannot run (textclf/launch/checks.py): precision, GPU files,
FSDP and Liger without CUDA, trackers, fewer processes than asked, all answered before torch or the data."""

import os
import subprocess
import sys
import types

import accelerate.tracking
import pytest
import torch

import train
from conftest import REPO, TINY, assert_refused, free_port, run_train
from forked import launch_env, rank_env
from textclf.cli import parse_config
from textclf.errors import InputError
from textclf.launch.checks import check_trackers, resolve_precision

ZOO = REPO / "accelerate_configs"


GPU_FILES = ["ddp.yaml", "ddp_bf16.yaml", "ddp_fp16.yaml", "single_gpu.yaml", "fsdp.yaml"]


CPU_FILES = ["cpu.yaml", "zero2.yaml", "zero3.yaml", "multi_node.yaml"]


def launched_as(monkeypatch, name: str, launch_args=()) -> list[str]:
    """This process set up as a rank of `accelerate launch --config_file <zoo file> <launch_args> train.py` sets it
    up (its environment, by accelerate's own launch code) on a machine without CUDA; returns the launch line, which
    train.py reads from its parent process."""
    import torch

    from textclf.launch import launcher

    processes = 1 if name == "single_gpu.yaml" else 2
    line = ["--config_file", str(ZOO / name), "--num_processes", str(processes), *launch_args, "train.py"]
    for key in [key for key in os.environ if key.startswith(("ACCELERATE_", "FSDP_"))]:
        monkeypatch.delenv(key)
    for key, value in rank_env(launch_env(ZOO / name, processes, free_port(), launch_args), 0).items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(launcher, "parent_launch_line", lambda: line)
    return line


@pytest.fixture
def fresh_accelerator_state():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def fake_wandb(logged_in: bool):
    """Stands in for wandb: `wandb.login(verify=False, prompt=False)` answers whether credentials exist
    (as wandb 0.31 does: False with no WANDB_API_KEY, netrc or settings, without asking or connecting)."""
    module = types.ModuleType("wandb")
    module.login = lambda verify=True, prompt=True: logged_in
    return module


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def one_process_yaml(tmp_path):
    """What `accelerate config default` writes on a machine without GPUs: one process, distributed_type NO."""
    return write(tmp_path / "default.yaml", "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\n"
                                            "num_processes: 1\nmixed_precision: 'no'\nuse_cpu: true\n")


def test_liger_without_cuda_is_refused_before_the_data(tmp_path, reviews_csv):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: Liger's kernels may run here")
    result = subprocess.run([sys.executable, "train.py", "--use_liger_kernel", "--data", str(reviews_csv),
                             "--output_dir", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    said = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and said == ["error: --use_liger_kernel needs a CUDA GPU (Triton kernels), and this "
                                               "machine has none; leave it out (auto turns it on where it can run)"]
    assert "data:" not in result.stdout and not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", GPU_FILES)
def test_each_gpu_file_of_the_zoo_is_refused_in_one_line_on_a_machine_without_cuda(monkeypatch, name):
    """What accelerate would run instead: ddp*.yaml its 8 processes on the CPU, single_gpu.yaml the one, fsdp.yaml
    plain DDP; train.py refuses each before the data or the model, sending it to the CPU files."""
    import yaml

    from textclf.cli import parse_config
    from textclf.errors import InputError
    from textclf.launch.checks import check_launch_early, cuda_only

    launched_as(monkeypatch, name)
    with pytest.raises(InputError) as refused:
        check_launch_early(parse_config(["--report_to", "none"]))
    config = yaml.safe_load((ZOO / name).read_text())
    [(need, fix)] = cuda_only("FSDP" if config["distributed_type"] == "FSDP" else None, config["mixed_precision"],
                              str(config["gpu_ids"]))
    assert str(refused.value) == f"{ZOO / name}: {need}, and this machine has none: {fix}"
    assert "accelerate_configs/cpu.yaml" in fix and "zero3.yaml" in fix


@pytest.mark.parametrize("name, launch_args", [(name, ()) for name in CPU_FILES]
                         + [("cpu.yaml", ("--mixed_precision", "bf16")), ("cpu.yaml", ("--num_processes", "8"))])
def test_the_cpu_files_are_not_refused_on_a_machine_without_cuda(monkeypatch, name, launch_args):
    """cpu.yaml is MULTI_GPU on purpose (train.py forms a gloo group without CUDA), the ZeRO files run on a CPU
    over gloo: with bf16 or more processes than cores, they are still what they say."""
    from textclf.cli import parse_config
    from textclf.launch.checks import check_launch_early

    launched_as(monkeypatch, name, launch_args)
    check_launch_early(parse_config(["--report_to", "none"]))


def test_the_environment_cannot_tell_a_gpu_file_from_cpu_yaml():
    """Why the rule reads the launch line: ddp_bf16.yaml gives its ranks the environment of cpu.yaml with bf16 on as
    many processes, gpu_ids all setting no variable."""
    port = free_port()

    def launched(name, launch_args=()):
        env = launch_env(ZOO / name, 8, port, launch_args)
        return {key: value for key, value in env.items() if key.startswith(("ACCELERATE_", "FSDP_", "CUDA_"))
                or key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")}

    assert launched("ddp_bf16.yaml") == launched("cpu.yaml", ["--mixed_precision", "bf16"])


@pytest.mark.slow
def test_ddp_bf16_yaml_launched_on_a_machine_without_cuda_is_one_line_and_trains_nothing(tmp_path, reviews_csv):
    """The launch as users type it, the yaml's own 8 processes: one line from the first rank, none trained."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU runs ddp_bf16.yaml")
    out = tmp_path / "out"
    result = run_train([*TINY, "--data", reviews_csv, "--max_steps", 2, "--output_dir", out],
                       config_file=ZOO / "ddp_bf16.yaml", check=False, timeout=600)
    said = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(said) == 1, result.stderr[-3000:]
    assert said[0].startswith(f"error: {ZOO / 'ddp_bf16.yaml'}: gpu_ids all makes it a GPU launch") \
        and "accelerate_configs/cpu.yaml" in said[0], said
    assert "MULTI_CPU" not in result.stdout and "data:" not in result.stdout and not out.exists()


def test_mixed_precision_of_a_plain_run_reaches_the_accelerator(monkeypatch, fresh_accelerator_state):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    accelerator = train.make_accelerator(parse_config(["--mixed_precision", "bf16", "--report_to", "none"]))
    assert accelerator.mixed_precision == "bf16"


@pytest.mark.parametrize("launched, asked, runs", [
    (None, None, "no"), (None, "bf16", "bf16"), ("bf16", None, "bf16"), ("bf16", "bf16", "bf16"), ("no", "no", "no"),
])
def test_precision_is_the_flag_s_or_the_launch_s(monkeypatch, launched, asked, runs):
    if launched:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launched)
    else:
        monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert resolve_precision(asked) == runs


def test_precision_contradicting_the_launch_is_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # what `accelerate launch` sets from its yaml
    with pytest.raises(InputError, match="--mixed_precision bf16 contradicts the launch, which runs no"):
        resolve_precision("bf16")


def test_float16_weights_under_the_fp16_loss_scaler_are_refused_before_torch_loads(monkeypatch):
    """torch's loss scaler refuses to unscale float16 gradients at the first step; DeepSpeed and FSDP train float32
    copies of the weights, and bf16 needs no scaler."""
    from textclf.launch.checks import check_launch_early

    float16 = parse_config(["--torch_dtype", "float16", "--report_to", "none"])
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(InputError, match=r"^float16 weights under fp16 mixed precision: its loss scaler cannot "
                                         r"unscale float16 gradients .*; keep the weights in float32"):
        check_launch_early(float16)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(InputError, match="^mixed_precision fp16 needs a CUDA GPU"):  # this machine's, not this rule
        check_launch_early(float16)
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    check_launch_early(float16)


def test_a_float16_checkpoint_loaded_by_torch_dtype_auto_is_refused_under_fp16_before_the_data(tmp_path, monkeypatch):
    from transformers import BertConfig, BertForSequenceClassification

    from textclf.models.job import build_job

    folder = tmp_path / "fp16_model"
    BertForSequenceClassification(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=16)).half().save_pretrained(folder)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    cfg = parse_config(["--model", str(folder), "--torch_dtype", "auto", "--data", str(tmp_path / "unread.csv")])
    with pytest.raises(InputError, match=r"^float16 weights \(the checkpoint's, by --torch_dtype auto\) under fp16"):
        build_job(cfg)


@pytest.mark.parametrize("report_to, modules, message", [
    ("tensorboard", {"torch.utils.tensorboard": None}, "--report_to tensorboard, but tensorboard cannot be imported"),
    ("wandb", {"wandb": None}, "--report_to wandb, but wandb cannot be imported"),
    ("wandb", {"wandb": fake_wandb(False)}, "--report_to wandb, but wandb has no login here"),
    ("all", {"wandb": fake_wandb(False)}, "--report_to all, but wandb has no login here"),
])
def test_a_tracker_that_cannot_start_is_refused(monkeypatch, report_to, modules, message):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: ["tensorboard", "wandb"])
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    with pytest.raises(InputError, match=message.replace("(", r"\(")):
        check_trackers([report_to])


def test_trackers_that_can_start_pass(monkeypatch):
    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: ["tensorboard", "wandb"])
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(True))
    check_trackers(["wandb"])
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(False))
    monkeypatch.setenv("WANDB_MODE", "offline")  # an offline run needs no login
    check_trackers(["wandb", "tensorboard"])
    check_trackers(["tensorboard"])
    check_trackers(["none"])


@pytest.mark.parametrize("tracker, shadow", [
    ("tensorboard", "raise ImportError('tensorboard is not installed here')"),
    ("wandb", "def login(verify=True, prompt=True):\n    return False\n"),
])
def test_train_py_stops_before_writing_anything_when_a_tracker_cannot_start(tmp_path, tracker, shadow):
    """In a subprocess whose tensorboard is unimportable, or whose wandb has no login."""
    (tmp_path / "shadow" / tracker).mkdir(parents=True)
    (tmp_path / "shadow" / tracker / "__init__.py").write_text(shadow)
    out = tmp_path / "out"
    result = run_train([*TINY, "--report_to", tracker, "--output_dir", out], check=False,
                       env={"PYTHONPATH": str(tmp_path / "shadow"), "WANDB_MODE": "", "WANDB_API_KEY": ""})
    assert_refused(result, f"--report_to {tracker}, but {tracker} ")
    assert not out.exists()


def test_an_unknown_or_missing_tracker_is_one_line(monkeypatch):
    import accelerate.tracking

    from textclf.launch.checks import check_trackers

    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: ["tensorboard"])
    with pytest.raises(InputError, match="--report_to tensorbord: unknown tracker 'tensorbord'; accelerate knows "
                                         ".*mlflow"):
        check_trackers(["tensorbord"])
    with pytest.raises(InputError, match="--report_to tensorboard mlflow, but mlflow is not installed; "
                                         "pip install mlflow"):
        check_trackers(["tensorboard", "mlflow"])


def test_a_launch_that_starts_fewer_processes_than_asked_is_said_by_the_checks_rule(tmp_path):
    from textclf.launch.checks import launch_shortfall

    yaml = one_process_yaml(tmp_path)
    line = launch_shortfall(1, ["--config_file", yaml, "--num_processes", "2", "train.py", "--max_steps", "3"])
    assert line == (f"{yaml}: distributed_type NO starts a single process, not the 2 asked for; for several use "
                    "MULTI_GPU, as accelerate_configs/cpu.yaml does on a CPU (train.py uses gloo there), or "
                    "--multi_gpu on the launch line")
    assert launch_shortfall(1, ["--config_file", yaml, "train.py"]) is None


def test_train_py_warns_once_when_accelerate_launch_starts_one_of_two_processes(tmp_path):
    from conftest import TINY, run_train

    unlabelled = tmp_path / "unlabelled.csv"  # an error met once the data is read, after the warning
    unlabelled.write_text("review\n好\n", encoding="utf-8")
    result = run_train([*TINY, "--data", unlabelled, "--output_dir", tmp_path / "out"],
                       config_file=one_process_yaml(tmp_path), extra_launch_args=["--num_processes", "2"], check=False)
    warnings = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "distributed_type NO starts a single process, not the 2 asked for" in warnings[0]
    # accelerate's simple launcher reports the exit status 2 as its own failure (exit status 1)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1 and f"{unlabelled} has no label column 'label'" in errors[0]


@pytest.mark.parametrize("command, status, said", [
    *[(f"{command} --help", 0, "usage:") for command in ("train.py", "-m textclf.check", "-m textclf.predict",
                                                         "-m textclf.report", "-m textclf.export")],
    ("train.py --model ./my_modle", 2, "error: model not found: ./my_modle is a path"),
    ("-m textclf.check --learning_rat 1", 2, "error: unknown config key(s) --learning_rat"),
    ("-m textclf.predict --model nowhere --text 好", 2, "error: model not found: nowhere"),
    ("-m textclf.report --model nowhere --file a.csv --output_dir r", 2, "error: model not found: nowhere"),
    ("-m textclf.export nowhere exported", 2, "error: model not found: nowhere"),
    ("-m textclf.check --config_file nowhere.yaml", 2, "error: accelerate config not found: nowhere.yaml"),
    ("train.py --data nowhere.csv", 2, "error: data not found: nowhere.csv; check the path (expected CSV, TSV"),
    ("train.py --eval_data nowhere.jsonl", 2, "error: data not found: nowhere.jsonl"),
    ("train.py --model pyproject.toml", 2, "error: --model pyproject.toml is a file: give the folder"),
    ("-m textclf.predict --model . --file nowhere.csv", 2, "error: data not found: nowhere.csv"),
    ("-m textclf.report --model . --file nowhere.csv --output_dir r", 2, "error: data not found: nowhere.csv"),
])
def test_help_and_command_line_errors_answer_before_torch_is_imported(command, status, said):
    """-X importtime lists every module imported: the answer must come before torch, datasets and accelerate."""
    import subprocess
    import sys

    from conftest import REPO

    result = subprocess.run([sys.executable, "-X", "importtime", *command.split()], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == status and said in result.stdout + result.stderr, result.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}
    assert not {"torch", "transformers", "datasets", "accelerate"} & imported


@pytest.mark.parametrize("env, said", [
    ({"ACCELERATE_MIXED_PRECISION": "no"}, "error: --mixed_precision bf16 contradicts the launch, which runs no"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "nowhere.json"},
     "error: cannot read DeepSpeed config nowhere.json: No such file or directory"),
])
def test_a_launch_that_contradicts_itself_answers_before_torch_is_imported(env, said):
    import os
    import subprocess
    import sys

    from conftest import REPO

    result = subprocess.run([sys.executable, "-X", "importtime", "train.py", "--mixed_precision", "bf16"], cwd=REPO,
                            capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert result.returncode == 2 and said in result.stderr, result.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}
    assert not {"torch", "transformers", "datasets", "accelerate"} & imported


@pytest.mark.parametrize("args, said", [
    ("--report_to tensorbord", "error: --report_to tensorbord: unknown tracker 'tensorbord'; accelerate knows "),
    pytest.param("--mixed_precision fp16", "error: mixed_precision fp16 needs a CUDA GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs fp16")),
])
def test_what_the_machine_lacks_is_refused_before_transformers_or_the_data(tmp_path, args, said):
    """A tracker or a GPU needs torch and accelerate to be known (about a second), not the rest."""
    import subprocess
    import sys

    from conftest import REPO

    result = subprocess.run([sys.executable, "-X", "importtime", "train.py", *args.split(), "--output_dir",
                             str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=120)
    said_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(said_lines) == 1 and said_lines[0].startswith(said), result.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}
    assert not {"transformers", "datasets", "deepspeed"} & imported
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs FSDP")
def test_fsdp_on_a_machine_without_cuda_is_refused_by_the_check_s_rule_not_run_as_ddp(tmp_path):
    """accelerate would run an FSDP launch on a CPU as plain DDP without a word: train.py refuses it, by the rule
    the check calls a conflict (launch.cuda_only), before transformers or the data."""
    import os
    import subprocess
    import sys

    from conftest import REPO
    from textclf.launch.checks import cuda_only

    [(need, fix)] = cuda_only("FSDP", "no")
    result = subprocess.run([sys.executable, "-X", "importtime", "train.py", "--output_dir", str(tmp_path / "out")],
                            cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "ACCELERATE_USE_FSDP": "true"})  # what fsdp.yaml's launch sets
    said = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert said == [f"error: {need}, and this machine has none: {fix}"], result.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}
    assert not {"transformers", "datasets", "deepspeed"} & imported
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU runs FSDP")
def test_fsdp_yaml_launched_on_a_machine_without_cuda_is_one_line_not_a_silent_ddp_run(tmp_path, reviews_csv):
    from conftest import REPO, TINY, run_train

    out = tmp_path / "out"
    result = run_train([*TINY, "--data", reviews_csv, "--max_steps", 2, "--output_dir", out],
                       config_file=REPO / "accelerate_configs" / "fsdp.yaml",
                       extra_launch_args=["--num_processes", "2"], check=False)
    said = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(said) == 1 and "distributed_type FSDP needs CUDA GPUs" in said[0], \
        result.stderr[-3000:]
    assert "MULTI_CPU" not in result.stdout and not out.exists()


@pytest.mark.parametrize("env, launch", [
    ({}, {"num_processes": 1, "zero_stage": None, "mixed_precision": "no"}),
    ({"WORLD_SIZE": "2", "ACCELERATE_MIXED_PRECISION": "bf16"},
     {"num_processes": 2, "zero_stage": None, "mixed_precision": "bf16"}),
    ({"WORLD_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_MIXED_PRECISION": "no",
      "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds_configs/zero3.json"},
     {"num_processes": 2, "zero_stage": 3, "mixed_precision": "no"}),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1"},
     {"num_processes": 1, "zero_stage": 1, "mixed_precision": "no"}),
])
def test_the_launch_read_before_the_imports_is_the_one_the_accelerator_describes(monkeypatch, env, launch):
    """What train.py checks a resume against before torch loads; the zoo's runs record the Accelerator's account
    of the same launch in run.json (test_zoo), which this reading must agree with."""
    from conftest import REPO
    from textclf.launch.checks import this_launch

    for name in ("WORLD_SIZE", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_DEEPSPEED",
                 "ACCELERATE_DEEPSPEED_CONFIG_FILE", "ACCELERATE_DEEPSPEED_ZERO_STAGE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(REPO)
    assert this_launch(None) == launch
