"""The pre-launch check (textclf/check.py): every shipped config passes it, each conflict it promises is found, its
counts are the model train.py builds, and it agrees with the launch's own run.json."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import NO_CACHE, REPO, TINY, run_check, run_train
from textclf import check
from textclf.cli import parse_config
from textclf.config import DATA_FORMATS

ZOO = sorted((REPO / "accelerate_configs").glob("*.yaml"))


DS_CONFIGS = sorted((REPO / "ds_configs").glob("*.json"))


# Shipped for GPUs; the rest are what the zoo tests run on this CPU machine.
NEEDS_CUDA = {"single_gpu.yaml", "ddp.yaml", "ddp_bf16.yaml", "ddp_fp16.yaml", "fsdp.yaml"}


# Values accelerate fills from the training config and the launch: a number here would be a second source of truth.
FILLED_BY_ACCELERATE = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                        "gradient_clipping")


def report(out: str) -> dict:
    """The check's `name  value` lines as a dict."""
    return {line[:18].strip(): line[18:] for line in out.splitlines() if line[:18].strip()}


def conflicts(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("conflict: ")]


def write_yaml(path, base: str, **changes):
    """A variant of a shipped yaml with some keys changed (None deletes a key)."""
    config = yaml.safe_load((REPO / "accelerate_configs" / base).read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(yaml.safe_dump(config))
    return path


def write_deepspeed_variant(tmp_path, name: str, edit) -> Path:
    """zero*.yaml pointing at a copy of ds_configs/<name>.json changed by `edit(config)`."""
    ds = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
    edit(ds)
    ds_path = tmp_path / f"{name}_variant.json"
    ds_path.write_text(json.dumps(ds))
    return write_yaml(tmp_path / f"{name}_variant.yaml", f"{name}.yaml",
                      deepspeed_config={"deepspeed_config_file": str(ds_path), "zero3_init_flag": False})


@pytest.fixture(scope="module")
def learnt_job(reviews_csv, tmp_path_factory):
    """What train.py builds for scratch-tiny with LoRA on the reviews (it learns and caches their tokenizer)."""
    from textclf.models.job import build_job

    cache = tmp_path_factory.mktemp("tokenizer_cache")
    args = ["--model", "scratch-tiny", "--data", str(reviews_csv), "--cache_dir", str(cache), "--max_length", "32"]
    return args, build_job(parse_config([*args, "--lora"]))


@pytest.fixture(scope="module")
def accelerate_home(tmp_path_factory):
    """An HF_HOME whose default accelerate config is what `accelerate config default` writes on this machine."""
    home = tmp_path_factory.mktemp("hf_home")
    subprocess.run([sys.executable, "-m", "accelerate.commands.accelerate_cli", "config", "default"],
                   env={**os.environ, "HF_HOME": str(home)}, check=True, capture_output=True, timeout=300)
    assert (home / "accelerate" / "default_config.yaml").is_file()
    return home


def peak_line(out: str) -> tuple[float, str]:
    lines = out.splitlines()
    index = next(i for i, line in enumerate(lines) if line.startswith("peak per rank"))
    return float(lines[index].split()[3]), lines[index + 1]


def made_checkpoint(folder, world_size=1, zero_stage=None, step_number=6, **made_with):
    """A step_<step_number>/ folder in `folder` with the (sealed) position.json of a run of scratch-tiny on
    `world_size` processes."""
    import dataclasses

    from textclf.checkpointing.write import sealed
    from textclf.config import TrainConfig

    made_with = {"model": "scratch-tiny", **made_with}
    step = folder / f"step_{step_number}"
    step.mkdir(parents=True)
    global_batch = made_with["per_device_train_batch_size"] * made_with["gradient_accumulation_steps"] * world_size
    step.joinpath("position.json").write_text(json.dumps(sealed({
        "step": step_number, "world_size": world_size, "global_batch_size": global_batch, "zero_stage": zero_stage,
        "mixed_precision": "no", **made_with, "config": {**dataclasses.asdict(TrainConfig()), **made_with}})))
    return step


def test_the_zoo_is_complete():
    names = {path.name for path in ZOO}
    assert names >= {"cpu.yaml", "single_gpu.yaml", "ddp.yaml", "ddp_bf16.yaml", "ddp_fp16.yaml", "fsdp.yaml",
                     "zero2.yaml", "zero2_offload.yaml", "zero3.yaml", "zero3_offload.yaml", "multi_node.yaml"}
    assert {path.name for path in DS_CONFIGS} >= {"zero2.json", "zero2_offload.json", "zero3.json",
                                                  "zero3_offload.json"}


@pytest.mark.parametrize("path", ZOO, ids=lambda p: p.name)
def test_every_shipped_config_passes_the_check_and_starts_with_its_launch_line(capsys, path):
    lines = path.read_text().splitlines()
    assert lines[0].startswith("# ") and f"--config_file accelerate_configs/{path.name}" in path.read_text()
    target = "cuda" if path.name in NEEDS_CUDA else "cpu"
    status, out, err = run_check(capsys, "--config_file", path.relative_to(REPO), "--target", target)
    assert status == 0, err
    assert not conflicts(err)
    shown = report(out)
    expected = yaml.safe_load(path.read_text())
    assert shown["processes"].startswith(f"{expected['num_processes']} process")
    # What train.py will report in run.json: without CUDA a MULTI_GPU launch forms a gloo group, MULTI_CPU.
    yaml_type = expected["distributed_type"]
    runs = "MULTI_CPU" if target == "cpu" and yaml_type == "MULTI_GPU" else yaml_type
    assert shown["strategy"].split(" on ")[0].endswith(
        f"({runs})" if runs == yaml_type else f"({runs}; the yaml says {yaml_type})")


@pytest.mark.parametrize("path", DS_CONFIGS, ids=lambda p: p.name)
def test_every_deepspeed_config_is_used_by_the_zoo_and_leaves_the_training_config_in_charge(capsys, path):
    users = [yaml_path for yaml_path in ZOO
             if yaml.safe_load(yaml_path.read_text()).get("deepspeed_config", {}).get("deepspeed_config_file")
             == f"ds_configs/{path.name}"]
    assert len(users) == 1, f"{path.name} should be the json of exactly one zoo file"
    ds = json.loads(path.read_text())
    assert all(ds[key] == "auto" for key in FILLED_BY_ACCELERATE)
    assert ds["fp16"]["enabled"] == "auto" and ds["bf16"]["enabled"] == "auto"
    assert "optimizer" not in ds and "scheduler" not in ds
    stage = ds["zero_optimization"]["stage"]
    if stage == 3:
        assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    status, out, _ = run_check(capsys, "--config_file", users[0].relative_to(REPO), "--target", "cpu",
                               "--gradient_accumulation_steps", 3, "--mixed_precision", "bf16")
    assert status == 0
    shown = report(out)
    assert shown["deepspeed config"] == f"ds_configs/{path.name}"
    assert shown["strategy"].startswith(f"DeepSpeed ZeRO-{stage}")
    assert shown["precision"].startswith("bf16, from the launch line")
    assert "x accumulation 3 x" in shown["batch"]


def test_the_report_merges_launch_overrides_with_the_training_config(capsys):
    status, out, _ = run_check(capsys, "--config_file", "accelerate_configs/zero3_offload.yaml", "--target", "cpu",
                               "--num_processes", 4, "--per_device_train_batch_size", 5,
                               "--gradient_accumulation_steps", 3, "--model", "scratch-tiny")
    assert status == 0
    shown = report(out)
    assert shown["processes"] == "4 processes on 1 machine"
    assert shown["batch"] == "micro 5 x accumulation 3 x 4 processes = global 60"
    assert shown["zero"] == "stage 3, offload: optimizer states to cpu, weights to cpu"
    assert shown["model"].startswith("scratch-tiny:")


def test_multi_node_counts_processes_over_all_machines(capsys):
    status, out, _ = run_check(capsys, "--config_file", "accelerate_configs/multi_node.yaml", "--target", "cuda",
                               "--num_processes", 32, "--num_machines", 4)
    assert status == 0
    assert report(out)["processes"] == "32 processes on 4 machines, 8 per machine"


def test_before_any_run_a_scratch_model_s_count_is_an_upper_bound_at_the_vocabulary_cap():
    cfg = parse_config(["--model", "scratch-tiny", *NO_CACHE])
    total, trainable = check.count_parameters(cfg)
    assert total == trainable
    # scratch-tiny: 2 layers, hidden 128, intermediate 512, vocabulary 8000, 512 positions, 2 labels.
    embeddings = (8000 + 512 + 2) * 128 + 2 * 128
    layer = 4 * (128 * 128 + 128) + 2 * 128 + (128 * 512 + 512) + (512 * 128 + 128) + 2 * 128
    head = (128 * 128 + 128) + (128 * 2 + 2)
    assert total == embeddings + 2 * layer + head
    assert "an upper bound: the vocabulary at its cap of 8,000 tokens" in check.planned_model(cfg)[1]


def test_after_a_run_the_count_is_the_trained_model_s_with_its_learnt_vocabulary(capsys, learnt_job):
    from textclf.models.build import in_units, parameter_counts

    args, job = learnt_job
    expected = parameter_counts(job.model)
    assert check.count_parameters(parse_config([*args, "--lora"])) == (expected["params"], expected["trainable"])
    status, out, _ = run_check(capsys, "--config_file", "accelerate_configs/cpu.yaml", *args, "--lora")
    assert status == 0
    shown = report(out)["model"]
    assert f"{in_units(expected['params'])} parameters, {in_units(expected['trainable'])} trainable" in shown
    assert f"({expected['trainable'] / expected['params']:.2%}, LoRA)" in shown
    assert f"the vocabulary of {len(job.tokenizer):,} tokens learnt from this data (cached)" in shown
    assert len(job.tokenizer) < 8000


@pytest.mark.parametrize("lora", [False, True])
def test_a_pretrained_model_s_count_is_the_model_train_py_builds(family_model, reviews_csv, tmp_path, lora):
    from textclf.models.build import parameter_counts
    from textclf.models.job import build_job

    args = ["--model", str(family_model("llama")), "--data", str(reviews_csv), "--cache_dir", str(tmp_path),
            "--max_length", "32", *(["--lora"] if lora else [])]
    built = parameter_counts(build_job(parse_config(args)).model)
    assert check.count_parameters(parse_config(args)) == (built["params"], built["trainable"])
    assert (built["trainable"] < built["params"]) == lora


def test_fsdp_wraps_the_model_s_own_layer_class_whatever_its_family(capsys, family_model):
    assert "fsdp_transformer_layer_cls_to_wrap" not in yaml.safe_load(
        (REPO / "accelerate_configs" / "fsdp.yaml").read_text())["fsdp_config"]
    for model, layer in (("scratch-tiny", "BertLayer"), (family_model("llama"), "LlamaDecoderLayer"),
                         (family_model("gpt2"), "GPT2Block")):
        status, out, err = run_check(capsys, "--config_file", "accelerate_configs/fsdp.yaml", "--target", "cuda",
                                     "--model", model, "--max_length", 32)
        assert status == 0, err
        assert report(out)["fsdp wraps"] == f"{layer} (the model's own layer class)"


def test_fsdp_leaves_the_input_embeddings_to_accelerate(capsys, tmp_path):
    # BERT declares BertEmbeddings in _no_split_modules; accelerate shards the word embeddings inside it
    # on their own, and FSDP2 fails the launch on the second sharding (seen on a GPU).
    config = yaml.safe_load((REPO / "accelerate_configs" / "fsdp.yaml").read_text())
    config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] = "BertLayer,BertEmbeddings"
    variant = write_yaml(tmp_path / "fsdp_embeddings.yaml", "fsdp.yaml", fsdp_config=config["fsdp_config"])
    status, _, err = run_check(capsys, "--config_file", variant, "--target", "cuda", "--model", "scratch-tiny")
    assert status == 1
    [line] = conflicts(err)
    assert "BertEmbeddings" in line and "input embeddings" in line and "BertLayer" in line


def test_an_fsdp_yaml_naming_a_class_the_model_does_not_have_is_a_conflict(capsys, tmp_path, family_model):
    llama_model = family_model("llama")
    config = yaml.safe_load((REPO / "accelerate_configs" / "fsdp.yaml").read_text())
    config["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] = "BertLayer"
    variant = write_yaml(tmp_path / "fsdp_bert.yaml", "fsdp.yaml", fsdp_config=config["fsdp_config"])
    status, _, err = run_check(capsys, "--config_file", variant, "--target", "cuda", "--model", llama_model,
                               "--max_length", 32)
    assert status == 1
    [line] = conflicts(err)
    assert str(variant) in line and "BertLayer" in line and "LlamaDecoderLayer" in line
    status, out, err = run_check(capsys, "--config_file", variant, "--target", "cuda", "--model", "scratch-tiny")
    assert status == 0, err
    assert report(out)["fsdp wraps"] == f"BertLayer (named in {variant})"


def test_precision_in_the_yaml_next_to_a_deepspeed_json_is_refused(capsys, tmp_path):
    variant = write_yaml(tmp_path / "zero2_mp.yaml", "zero2.yaml", mixed_precision="bf16")
    status, _, err = run_check(capsys, "--config_file", variant, "--target", "cpu")
    assert status == 1
    [line] = conflicts(err)
    assert str(variant) in line and "ds_configs/zero2.json" in line and "mixed_precision bf16" in line


@pytest.mark.parametrize("launch_precision", ["no", "fp16"])
def test_precision_hard_coded_in_the_json_differing_from_the_launch_is_a_conflict(capsys, tmp_path, launch_precision):
    variant = write_deepspeed_variant(tmp_path, "zero2", lambda ds: ds.update(bf16={"enabled": True}))
    status, _, err = run_check(capsys, "--config_file", variant, "--target", "cuda",
                               "--mixed_precision", launch_precision)
    assert status == 1
    [line] = conflicts(err)
    assert f"launch line (--mixed_precision) is {launch_precision}" in line
    assert "zero2_variant.json" in line and '"bf16": {"enabled": true}' in line


def test_precision_hard_coded_in_the_json_agreeing_with_the_launch_passes(capsys, tmp_path):
    variant = write_deepspeed_variant(tmp_path, "zero2", lambda ds: ds.update(bf16={"enabled": True}))
    status, out, err = run_check(capsys, "--config_file", variant, "--target", "cuda", "--mixed_precision", "bf16")
    assert status == 0, err
    assert report(out)["precision"].startswith("bf16")


@pytest.mark.parametrize("key, value, flag", [
    ("gradient_accumulation_steps", 4, "--gradient_accumulation_steps"),
    ("train_micro_batch_size_per_gpu", 16, "--per_device_train_batch_size"),
    ("train_batch_size", 1000, "--per_device_train_batch_size x --gradient_accumulation_steps x 2 processes"),
    ("gradient_clipping", 0.5, "--max_grad_norm"),
])
def test_accumulation_and_batch_hard_coded_in_the_json_differing_from_the_training_config(
        capsys, tmp_path, key, value, flag):
    variant = write_deepspeed_variant(tmp_path, "zero3", lambda ds: ds.update({key: value}))
    status, _, err = run_check(capsys, "--config_file", variant, "--target", "cpu",
                               "--per_device_train_batch_size", 8)
    assert status == 1
    [line] = conflicts(err)
    assert line.startswith(f"conflict: {key}: ") and "zero3_variant.json" in line
    assert f"hard-codes {value}" in line and flag in line


def test_accumulation_hard_coded_in_the_json_agreeing_with_the_training_config_passes(capsys, tmp_path):
    variant = write_deepspeed_variant(tmp_path, "zero3", lambda ds: ds.update(gradient_accumulation_steps=2))
    status, _, err = run_check(capsys, "--config_file", variant, "--target", "cpu",
                               "--gradient_accumulation_steps", 2)
    assert status == 0, err


def test_fp16_is_refused_for_a_machine_without_cuda_and_accepted_for_a_gpu_machine(capsys, tmp_path):
    variant = write_yaml(tmp_path / "cpu_fp16.yaml", "cpu.yaml", mixed_precision="fp16")
    status, _, err = run_check(capsys, "--config_file", variant, "--target", "cpu")
    assert status == 1
    [line] = conflicts(err)
    assert f"precision ({variant} mixed_precision): mixed_precision fp16 needs a CUDA GPU" in line
    assert "no CUDA GPU" in line
    status, _, err = run_check(capsys, "--config_file", variant, "--target", "cuda")
    assert status == 0, err


def test_float16_weights_under_the_fp16_loss_scaler_are_a_conflict_as_train_py_refuses_them(capsys):
    from textclf.launch.checks import float16_weights_conflict

    status, _, err = run_check(capsys, "--config_file", "accelerate_configs/ddp_fp16.yaml", "--target", "cuda",
                               "--torch_dtype", "float16")
    assert status == 1 and conflicts(err) == [f"conflict: {float16_weights_conflict('fp16', None, 'float16')}"]
    status, _, err = run_check(capsys, "--config_file", "accelerate_configs/ddp_fp16.yaml", "--target", "cuda")
    assert status == 0, err


def test_torch_compile_in_a_yaml_passes_the_check(capsys, tmp_path):
    # train.py takes a launch's dynamo settings (models.speed_up), compiling the blocks in place.
    variant = write_yaml(tmp_path / "cpu_compiled.yaml", "cpu.yaml", dynamo_config={"dynamo_backend": "INDUCTOR"})
    status, _, err = run_check(capsys, "--config_file", variant)
    assert status == 0, err


@pytest.mark.parametrize("name", sorted(NEEDS_CUDA))
def test_each_gpu_file_of_the_zoo_is_one_conflict_for_a_machine_without_cuda(capsys, name):
    """What train.py refuses (tests/launch/test_checks.py), by the same rule: the GPUs the yaml names, with whatever
    else of it needs CUDA, in one line that sends the launch to the CPU files."""
    from textclf.launch.checks import cuda_only

    yaml_config = yaml.safe_load((REPO / "accelerate_configs" / name).read_text())
    [(need, fix)] = cuda_only("FSDP" if yaml_config["distributed_type"] == "FSDP" else None,
                              yaml_config["mixed_precision"], str(yaml_config["gpu_ids"]))
    import torch

    for target in (["--target", "cpu"], *([] if torch.cuda.is_available() else [[]])):  # and this machine's own
        status, _, err = run_check(capsys, "--config_file", f"accelerate_configs/{name}", *target)
        assert status == 1
        assert conflicts(err) == [f"conflict: accelerate_configs/{name}: {need}, and "
                                  f"{'the target machine (--target cpu)' if target else 'this machine'} has no CUDA "
                                  f"GPU: train.py refuses it there; {fix}, or --target cuda for a GPU machine"]
        assert "accelerate_configs/cpu.yaml" in fix and f"gpu_ids {yaml_config['gpu_ids']}" in need
    if name == "fsdp.yaml":
        assert cuda_only("FSDP", "no")[0][0] in need
    if name == "ddp_fp16.yaml":
        assert cuda_only(None, "fp16")[0][0] in need


def test_a_missing_data_file_is_an_error_and_num_processes_0_a_conflict(capsys, tmp_path):
    status, _, err = run_check(capsys, "--data", tmp_path / "nowhere.csv", *NO_CACHE)
    assert status == 2 and err.strip() == f"error: data not found: {tmp_path / 'nowhere.csv'}; check the path " \
        f"(expected {DATA_FORMATS})"
    variant = write_yaml(tmp_path / "none.yaml", "cpu.yaml", num_processes=0)
    status, _, err = run_check(capsys, "--config_file", variant, *NO_CACHE)
    assert status == 1
    [line] = conflicts(err)
    assert line == f"conflict: {variant}: num_processes 0; a launch needs at least 1 process (num_processes " \
        "counts those of all machines together)"


def test_zero3_without_16bit_gather_on_save_would_export_no_weights(capsys, tmp_path):
    def no_gather(ds):
        del ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]
    variant = write_deepspeed_variant(tmp_path, "zero3", no_gather)
    status, _, err = run_check(capsys, "--config_file", variant, "--target", "cpu")
    assert status == 1
    [line] = conflicts(err)
    assert line.startswith("conflict: export: ") and "zero3_variant.json" in line and "textclf/export.py" in line


def test_a_deepspeed_config_file_that_does_not_exist(capsys, tmp_path):
    variant = write_yaml(tmp_path / "zero2_missing.yaml", "zero2.yaml",
                         deepspeed_config={"deepspeed_config_file": "ds_configs/nope.json"})
    status, _, err = run_check(capsys, "--config_file", variant, "--target", "cpu")
    assert status == 1
    [line] = conflicts(err)
    assert str(variant) in line and "ds_configs/nope.json, which does not exist" in line


@pytest.mark.parametrize("stage, part, message", [
    (2, "offload_param", "offloads parameters to cpu at ZeRO stage 2"),
    (0, "offload_optimizer", "offloads the optimizer to cpu at ZeRO stage 0"),
])
def test_offload_on_a_stage_that_does_not_support_it(capsys, tmp_path, stage, part, message):
    def offload(ds):
        ds["zero_optimization"].update({"stage": stage, part: {"device": "cpu"}})
    variant = write_deepspeed_variant(tmp_path, "zero2", offload)
    status, _, err = run_check(capsys, "--config_file", variant, "--target", "cpu")
    assert status == 1
    [line] = conflicts(err)
    assert line.startswith("conflict: offload: ") and "zero2_variant.json" in line and message in line


def test_an_optimizer_block_in_the_json_conflicts_with_train_py_s_optimizer(capsys, tmp_path):
    variant = write_deepspeed_variant(
        tmp_path, "zero2", lambda ds: ds.update(optimizer={"type": "AdamW", "params": {"lr": "auto"}}))
    status, _, err = run_check(capsys, "--config_file", variant, "--target", "cpu")
    assert status == 1
    [line] = conflicts(err)
    assert '"optimizer" block' in line and "train.py builds AdamW" in line


@pytest.mark.parametrize("changes, message", [
    ({"distributed_type": "MULTI_CPU"}, "MULTI_CPU starts a single process without mpirun"),
    ({"use_cpu": True}, "starts 2 independent single-process runs"),
    ({"num_processes": 3, "num_machines": 2, "main_process_ip": "10.0.0.1"}, "is not a multiple of num_machines 2"),
    ({"num_machines": 2, "num_processes": 4}, "no main_process_ip"),
])
def test_yaml_mistakes_that_silently_start_something_else(capsys, tmp_path, changes, message):
    variant = write_yaml(tmp_path / "variant.yaml", "cpu.yaml", **changes)
    status, _, err = run_check(capsys, "--config_file", variant, "--target", "cpu")
    assert status == 1
    [line] = conflicts(err)
    assert str(variant) in line and message in line


@pytest.mark.parametrize("argv, message", [
    (["--config_file", "accelerate_configs/nope.yaml"], "accelerate config not found: accelerate_configs/nope.yaml"),
    (["--config_file", "accelerate_configs/cpu.yaml", "--learning_rat", "1"], "unknown config key(s) --learning_rat"),
    (["--config_file", "accelerate_configs/cpu.yaml", "--mixed_precision", "fp8"], "invalid choice: 'fp8'"),
])
def test_unreadable_input_is_one_error_line_and_exit_2(capsys, argv, message):
    status, out, err = run_check(capsys, *argv)
    assert status == 2 and out == ""
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


def test_the_command_line_entry_point(tmp_path):
    """`python -m textclf.check` as users run it: report on stdout, conflicts on stderr, exit status."""
    ok = subprocess.run([sys.executable, "-m", "textclf.check", "--config_file", "accelerate_configs/zero3.yaml",
                         "--target", "cpu", "--model", "scratch-tiny", *NO_CACHE],
                        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "DeepSpeed ZeRO-3 (DEEPSPEED)" in ok.stdout and "memory per rank" in ok.stdout
    variant = write_yaml(tmp_path / "cpu_fp16.yaml", "cpu.yaml", mixed_precision="fp16")
    bad = subprocess.run([sys.executable, "-m", "textclf.check", "--config_file", str(variant), "--target", "cpu",
                          *NO_CACHE],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "conflict: precision (" in bad.stderr


@pytest.mark.slow
def test_without_any_accelerate_config_the_check_says_one_process_as_the_launch_runs(tmp_path, reviews_csv):
    """No --config_file and no default config: accelerate asks for as many processes as CUDA GPUs, 0 here, and its
    simple launcher starts one; the check says so, and no conflict."""
    env = {key: value for key, value in os.environ.items() if key != "XDG_CACHE_HOME"}
    env.update(HOME=str(tmp_path), HF_HOME=str(tmp_path / "hf"))  # where no `accelerate config` has written one
    result = subprocess.run([sys.executable, "-m", "textclf.check", "--data", str(reviews_csv), "--model",
                             "scratch-tiny", "--target", "cpu", *NO_CACHE],
                            cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0 and "conflict" not in result.stderr, result.stderr
    shown = report(result.stdout)
    assert shown["accelerate config"] == "none: one process, as `python train.py`"
    assert shown["processes"] == "1 process on 1 machine"


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_the_check_agrees_with_the_launch_s_own_run_json_for_the_default_config(
        capsys, tmp_path, accelerate_home, reviews_csv, cache_dir, processes):
    config = accelerate_home / "accelerate" / "default_config.yaml"
    out = tmp_path / "out"
    run_train([*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--output_dir", out, "--max_steps", 1,
               "--save_strategy", "no"], config_file=config, extra_launch_args=["--num_processes", str(processes)])
    ran = json.loads((out / "run.json").read_text())
    status, stdout, err = run_check(capsys, "--config_file", config, "--num_processes", processes, *TINY)
    shown = report(stdout)
    assert shown["processes"].startswith(f"{ran['num_processes']} process ")
    assert shown["strategy"].split(" on ")[0].endswith(f"({ran['distributed_type']})")
    if processes > ran["num_processes"]:  # asked for 2, the launch starts 1: the check says so
        assert status == 1 and "starts a single process, not the 2 asked for" in " ".join(conflicts(err))
    # The user's default config (no --config_file) resolves the same way.
    default = subprocess.run([sys.executable, "-m", "textclf.check", "--num_processes", str(processes),
                              *map(str, TINY), *NO_CACHE],
                             cwd=REPO, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "HF_HOME": str(accelerate_home)})
    assert report(default.stdout)["processes"] == shown["processes"]
    assert report(default.stdout)["strategy"] == shown["strategy"]
    assert report(default.stdout)["accelerate config"] == str(config)


def test_the_peak_per_rank_follows_the_launch(capsys, tmp_path):
    status, out, _ = run_check(capsys, "--config_file", "accelerate_configs/zero3_offload.yaml", "--target", "cpu",
                               "--model", "scratch-base")
    assert status == 0
    on_cpu, parts = peak_line(out)
    assert "gathered weights" in parts and "the process" in parts and "fp32 gradient of the partition" in parts
    # On GPUs the offloaded states and the optimizer's fp32 buffers leave the device, and the process is not counted.
    status, out, _ = run_check(capsys, "--config_file", "accelerate_configs/zero3_offload.yaml", "--target", "cuda",
                               "--model", "scratch-base", "--mixed_precision", "bf16")
    on_gpu, parts = peak_line(out)
    assert on_gpu < on_cpu and "the process" not in parts and "fp32 gradient" not in parts
    # A json that keeps fewer parameters live gathers fewer.
    variant = write_deepspeed_variant(tmp_path, "zero3",
                                      lambda ds: ds["zero_optimization"].update(stage3_max_live_parameters=1000))
    status, out, _ = run_check(capsys, "--config_file", variant, "--target", "cpu", "--model", "scratch-base")
    assert status == 0 and peak_line(out)[0] < on_cpu
    # Checkpointing keeps fewer activations.
    plain, _ = peak_line(run_check(capsys, "--config_file", "accelerate_configs/cpu.yaml", "--model",
                                   "scratch-base")[1])
    checkpointed, parts = peak_line(run_check(capsys, "--config_file", "accelerate_configs/cpu.yaml", "--model",
                                              "scratch-base", "--gradient_checkpointing")[1])
    assert checkpointed < plain and "checkpointed" in parts and "DDP gradient buckets" in parts


def test_a_resume_shows_the_accumulation_that_keeps_the_checkpoint_s_global_batch(capsys, tmp_path):
    step = made_checkpoint(tmp_path / "run", per_device_train_batch_size=8, gradient_accumulation_steps=4)
    cpu = ["--config_file", "accelerate_configs/cpu.yaml", "--target", "cpu", "--resume", step]
    status, out, err = run_check(capsys, *cpu)
    assert status == 0, err
    assert report(out)["batch"] == "micro 8 x accumulation 2 x 2 processes = global 32"
    assert report(out)["resume"] == f"{step}: made by 1 process with micro-batch 8 and gradient accumulation 4, " \
                                    "on 2 processes: micro-batch 8 and gradient accumulation 2 keep its global " \
                                    "batch of 32; the order gradients are summed in differs, so from here it " \
                                    "matches the uninterrupted run to rounding, not bit for bit"
    # Beyond what the accumulation can give, the micro-batch is split.
    status, out, err = run_check(capsys, *cpu, "--num_processes", 8)
    assert status == 0, err
    assert report(out)["batch"] == "micro 4 x accumulation 1 x 8 processes = global 32"
    status, out, err = run_check(capsys, *cpu, "--num_processes", 3)
    assert status == 1 and "on 3 processes: its global batch of 32" in err
    assert "resume it on 1, 2, 4, 8, 16, 32 processes" in err
    status, out, err = run_check(capsys, "--config_file", "accelerate_configs/zero2.yaml", "--target", "cpu",
                                 "--resume", step)
    assert status == 1 and "DeepSpeed ZeRO stage None (this launch: 2)" in err


def test_a_resume_by_path_is_checked_in_the_checkpoint_s_folder_as_train_py_resumes_it(capsys, tmp_path, monkeypatch):
    """Another run holding the default output folder is no concern of a checkpoint elsewhere; one holding the
    checkpoint's own folder is, as train.py would refuse it."""
    import fcntl

    # As train.py does, the check refuses ZeRO's states on another number of processes with the best model's reload.
    zero = made_checkpoint(tmp_path / "zero", zero_stage=2, per_device_train_batch_size=32,
                           gradient_accumulation_steps=1)
    status, out, err = run_check(capsys, "--config_file", REPO / "accelerate_configs" / "zero2.yaml", "--target",
                                 "cpu", "--resume", zero, "--load_best_model_at_end", "--eval_steps", 500)
    assert status == 1 and f"conflict: cannot resume {zero} on 2 processes with --load_best_model_at_end" in err
    step = made_checkpoint(tmp_path / "run", per_device_train_batch_size=32, gradient_accumulation_steps=1)
    monkeypatch.chdir(tmp_path)
    cpu = ["--config_file", REPO / "accelerate_configs" / "cpu.yaml", "--target", "cpu", "--resume", step]
    for held in (tmp_path / "checkpoints", tmp_path / "run"):
        held.mkdir(exist_ok=True)
        with open(held / ".lock", "w") as lock:
            lock.write("pid 1 on another host")
            lock.flush()
            fcntl.flock(lock, fcntl.LOCK_EX)
            status, out, err = run_check(capsys, *cpu)
        if held.name == "checkpoints":
            assert status == 0, err
            # From 1 process to 2 with the default accumulation: the micro-batch halves.
            assert report(out)["batch"] == "micro 16 x accumulation 1 x 2 processes = global 32"
            assert report(out)["resume"].endswith("on 2 processes: micro-batch 16 and gradient accumulation 1 keep "
                                                  "its global batch of 32; its dropout masks (micro-batches split) "
                                                  "and the order gradients are summed in differ, so from here it "
                                                  "matches the uninterrupted run closely, not bit for bit")
        else:
            assert status == 2 and f"error: {held} is in use by another run (pid 1 on another host)" in err
        (held / ".lock").unlink()


def test_a_resume_s_refusals_are_all_conflicts_of_one_check(capsys, tmp_path):
    """What train.py would refuse one launch at a time: checkpoints after the one resumed, a changed config field,
    a launch of another strategy; all named by one check, in train.py's words."""
    run = tmp_path / "run"
    step_10 = made_checkpoint(run, world_size=2, zero_stage=2, step_number=10, per_device_train_batch_size=8,
                              gradient_accumulation_steps=1)
    made_checkpoint(run, world_size=2, zero_stage=2, step_number=12, per_device_train_batch_size=8,
                    gradient_accumulation_steps=1)
    later = (f"--resume {step_10}: {run} holds checkpoints after it (step_12), which this run would write over; "
             "pass --overwrite_output_dir to move them aside, or --output_dir <another folder> to keep both runs")
    seed = (f"cannot resume from {step_10}: it was made with seed = 42, this run has 7; a resumed run keeps what "
            "shapes its training (leave out --seed, or start a new run in another --output_dir)")
    zero2 = ["--config_file", "accelerate_configs/zero2.yaml", "--target", "cpu", "--resume", step_10]
    status, _, err = run_check(capsys, *zero2, "--seed", 7)
    assert status == 1 and conflicts(err) == [f"conflict: {later}", f"conflict: {seed}"], err
    status, _, err = run_check(capsys, "--config_file", "accelerate_configs/cpu.yaml", "--target", "cpu", "--resume",
                               step_10, "--seed", 7)
    first, second, launch = conflicts(err)
    assert status == 1 and (first, second) == (f"conflict: {later}", f"conflict: {seed}")
    assert launch.startswith(f"conflict: cannot resume from {step_10}: it was made by a launch with DeepSpeed ZeRO "
                             "stage 2 (this launch: None)")
    status, out, err = run_check(capsys, *zero2, "--overwrite_output_dir")
    assert status == 0, err
    assert report(out)["resume"] == f"{step_10}: the launch that made it, micro-batch 8 and gradient accumulation 1"
