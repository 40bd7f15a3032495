"""The zoo on one CUDA GPU (skipped without one): every file trains, evaluates, resumes, exports and serves
(docs/gpu.md)."""

import json
import math
import os
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    LIBRARY_SYNCS,
    REPO,
    TINY,
    another_user,
    assert_no_sync_between_log_lines,
    losses,
    read_log,
    run_module,
    run_sync_probe,
    run_train,
)

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU, which this machine lacks (CI has none): see docs/gpu.md")]


ZOO = REPO / "accelerate_configs"


ONE = ["--num_processes", "1"]


NO_OFFLOAD = {"optimizer": "none", "param": "none"}


# name: (zoo file, launch arguments, what run.json must say: distributed_type, mixed_precision, zero_stage,
# zero_offload)
RUNS = {
    "single_gpu": ("single_gpu.yaml", [], ("NO", "no", None, None)),
    "ddp_bf16": ("ddp_bf16.yaml", ONE, ("MULTI_GPU", "bf16", None, None)),
    "ddp_fp16": ("ddp_fp16.yaml", ONE, ("MULTI_GPU", "fp16", None, None)),
    "fsdp": ("fsdp.yaml", ONE, ("FSDP", "no", None, None)),
    "zero2": ("zero2.yaml", [*ONE, "--mixed_precision", "bf16"], ("DEEPSPEED", "bf16", 2, NO_OFFLOAD)),
    "zero3": ("zero3.yaml", [*ONE, "--mixed_precision", "bf16"], ("DEEPSPEED", "bf16", 3, NO_OFFLOAD)),
    "zero2_offload": ("zero2_offload.yaml", [*ONE, "--mixed_precision", "bf16"],
                      ("DEEPSPEED", "bf16", 2, {"optimizer": "cpu", "param": "none"})),
    "zero3_offload": ("zero3_offload.yaml", [*ONE, "--mixed_precision", "bf16"],
                      ("DEEPSPEED", "bf16", 3, {"optimizer": "cpu", "param": "cpu"})),
    # DeepSpeed's own fp16 loss scaler (the ZeRO files take their precision from the launch line).
    "zero2_fp16": ("zero2.yaml", [*ONE, "--mixed_precision", "fp16"], ("DEEPSPEED", "fp16", 2, NO_OFFLOAD)),
}


# Under pytest-xdist (--dist loadgroup) the runs of one group share a worker and its module fixtures:
# the precision checks compare the torch AMP runs with single_gpu's; the offload runs share DeepSpeed's
# CPU Adam build.
GROUPS = {"single_gpu": "amp", "ddp_bf16": "amp", "ddp_fp16": "amp", "fsdp": "fsdp", "zero2": "zero2",
          "zero2_fp16": "zero2", "zero3": "zero3", "zero2_offload": "offload", "zero3_offload": "offload"}


STEPS, SAVE = 8, 4


STEPS, SAVE = 8, 4


SIXTEEN_BIT = {"bf16": torch.bfloat16, "fp16": torch.float16}


# After the first resumed step, CUDA's backward kernels may sum in another order (atomics: the attention
# backward among them), so a resumed run may drift from the uninterrupted one by rounding. The bounds sit
# far below what a real resume fault moves: a wrong dropout mask changed a loss by 1.6e-2 on a CPU
# (NOTES), a lost optimizer or scheduler state moves every weight by about the learning rate (1e-3).
LOSS_BOUND = 1e-3


WEIGHT_BOUND = 1e-4  # fp32 weights; DeepSpeed's 16-bit weights: one unit in the last place of the format


# The default job on a CPU reached 0.790 to 0.822 accuracy over 4 seeds (README); a GPU computes in
# another order, so the floor sits below all of them, and far above the majority class (0.52).
DEFAULT_JOB_ACCURACY_FLOOR = 0.78


def runs(*names):
    return [pytest.param(name, marks=pytest.mark.xdist_group(GROUPS[name])) for name in names]


def record(test: str, **measured) -> None:
    """What a test measured, for scripts/gpu_suite.py's report (one JSON line per record)."""
    path = os.environ.get("GPU_SUITE_RESULTS")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"test": test, **measured}) + "\n")


def exported(output_dir) -> dict[str, torch.Tensor]:
    return load_file(output_dir / "model" / "model.safetensors")


@pytest.fixture(scope="module")
def run_args(reviews_csv, cache_dir):
    """8 optimizer steps of 8 reviews, a checkpoint and an evaluation every 4."""
    return [*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--max_steps", STEPS, "--save_steps", SAVE,
            "--eval_steps", SAVE]


def launch(name, args, **kwargs):
    config, launch_args, _ = RUNS[name]
    return run_train(args, config_file=ZOO / config, extra_launch_args=launch_args, **kwargs)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, run_args):
    """`trained(name)`: (output_dir, the launch's result) of the uninterrupted run, once per module and worker."""
    done = {}

    def get(name):
        if name not in done:
            out = tmp_path_factory.mktemp(name)
            start = time.time()
            done[name] = out, launch(name, [*run_args, "--output_dir", out])
            record("train", run=name, wall_s=round(time.time() - start, 1))
        return done[name]

    return get


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, run_args, trained):
    """`resumed(name)`: the output_dir of a run resumed from the uninterrupted run's step_4."""
    done = {}

    def get(name):
        if name not in done:
            out = tmp_path_factory.mktemp(f"{name}_resumed")
            checkpoint = trained(name)[0] / f"step_{SAVE}"
            launch(name, [*run_args, "--output_dir", out, "--resume", checkpoint])
            done[name] = out
        return done[name]

    return get


@pytest.mark.parametrize("name", runs(*RUNS))
def test_the_file_runs_its_strategy_on_the_gpu(name, trained):
    out, result = trained(name)
    run = json.loads((out / "run.json").read_text())
    distributed_type, precision, stage, offload = RUNS[name][2]
    assert (run["distributed_type"], run["mixed_precision"], run["zero_stage"], run["zero_offload"]) == \
        (distributed_type, precision, stage, offload)
    assert run["num_processes"] == 1 and run["device"].startswith("cuda"), run["device"]
    assert f"distributed_type: {distributed_type} | num_processes: 1 | mixed_precision: {precision}" in result.stdout
    assert sorted(losses(out)) == list(range(1, STEPS + 1))
    assert all(math.isfinite(loss) for loss in losses(out).values()), losses(out)
    evals = [row for row in read_log(out) if "eval_accuracy" in row]
    assert [row["step"] for row in evals] == [SAVE, STEPS] and all(row["eval_samples"] == 24 for row in evals)
    # NCCL: DDP, FSDP and DeepSpeed form a process group (of one here); end_training destroys it, or
    # torch warns at exit that destroy_process_group() was not called.
    assert "destroy_process_group" not in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("name", runs(*RUNS))
def test_resume_on_the_gpu_reproduces_the_uninterrupted_run(name, trained, resumed):
    full, out = trained(name)[0], resumed(name)
    expected, got = losses(full), losses(out)
    assert sorted(got) == list(range(SAVE + 1, STEPS + 1)), sorted(got)
    loss_gap = max(abs(got[step] - expected[step]) for step in got)
    reference, final = exported(full), exported(out)
    assert reference.keys() == final.keys()
    sixteen_bit = SIXTEEN_BIT.get(RUNS[name][2][1]) if RUNS[name][2][2] is not None else None
    # DeepSpeed trains 16-bit weights: their gap is counted in units in the last place of that format.
    unit = {key: torch.finfo(sixteen_bit).eps * reference[key].abs().clamp(min=1e-3) for key in reference} \
        if sixteen_bit else {key: WEIGHT_BOUND for key in reference}
    weight_gap = max(((final[key] - reference[key]).abs() / unit[key]).max().item() for key in reference)
    relative_gap = (sum((final[key] - reference[key]).float().pow(2).sum() for key in reference)
                    / sum(reference[key].float().pow(2).sum() for key in reference)).sqrt().item()
    record("resume", run=name, first_step_equal=got[SAVE + 1] == expected[SAVE + 1], loss_gap=loss_gap,
           weight_gap=weight_gap, weight_gap_unit="16-bit ulp" if sixteen_bit else f"{WEIGHT_BOUND:g}",
           relative_weight_gap=relative_gap)
    # The first step after the checkpoint is a forward pass from the restored weights, on the restored
    # batch, with dropout masks from the restored CUDA RNG: deterministic kernels, so bitwise.
    assert got[SAVE + 1] == expected[SAVE + 1], (got[SAVE + 1], expected[SAVE + 1])
    # The schedule goes on where it stopped.
    learning_rates = {row["step"]: row["lr"] for row in read_log(full) if "lr" in row and row["step"] > SAVE}
    assert {row["step"]: row["lr"] for row in read_log(out) if "lr" in row} == learning_rates
    # The offload files too: DeepSpeed's CPU Adam steps on the schedule after a load, with the uninterrupted run's
    # bias corrections (on a CPU: checkpointing/test_load.py::
    # test_an_offloaded_optimizer_resumes_exactly_on_its_schedule).
    assert loss_gap <= LOSS_BOUND, f"losses after resume differ by up to {loss_gap:.2e}"
    assert weight_gap <= 1, f"final weights differ by {weight_gap:.2f} x the bound"


@pytest.mark.xdist_group("fsdp")
def test_an_fsdp_checkpoint_from_elsewhere_needs_allow_pickle(trained, run_args, tmp_path):
    with another_user(tmp_path) as env:
        result = launch("fsdp", [*run_args, "--output_dir", tmp_path / "out", "--resume",
                                 trained("fsdp")[0] / f"step_{SAVE}"], check=False, env=env)
    # The launcher (torchrun) turns train.py's exit code 2 into its own failure.
    assert result.returncode != 0 and "and FSDP's files load only with full pickle" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", runs("fsdp", "zero2", "zero3"))
def test_checkpoint_export_meets_the_runs_own_export(name, trained, tmp_path):
    out = trained(name)[0]
    if name == "fsdp":  # torch.distributed.checkpoint's folder, read by models/trained.py with dcp_to_torch_save
        assert (out / f"step_{STEPS}" / "pytorch_model_fsdp_0").is_dir()
    result = run_module("textclf.export", [out / f"step_{STEPS}", tmp_path / "exported"])
    assert "verified" in result.stdout
    from_checkpoint, at_the_end = load_file(tmp_path / "exported" / "model.safetensors"), exported(out)
    assert {n: t.shape for n, t in from_checkpoint.items()} == {n: t.shape for n, t in at_the_end.items()}
    assert all(tensor.numel() > 0 for tensor in from_checkpoint.values())
    sixteen_bit = SIXTEEN_BIT.get(RUNS[name][2][1])
    if sixteen_bit:
        # The run's own export holds the 16-bit weights it trained and evaluated with (accelerate's
        # get_state_dict, as the Trainer saves too); the checkpoint's, DeepSpeed's fp32 master weights
        # (zero_to_fp32). DeepSpeed makes the first from the second by rounding.
        different = [n for n in at_the_end if not torch.equal(from_checkpoint[n].to(sixteen_bit),
                                                              at_the_end[n].to(sixteen_bit))]
        assert not different, different[:5]
    else:
        for n, tensor in from_checkpoint.items():
            assert torch.allclose(tensor, at_the_end[n], rtol=0, atol=1e-6), n


@pytest.mark.parametrize("name", runs(*RUNS))
def test_export_serves_a_pipeline_on_the_gpu(name, trained):
    from transformers import pipeline

    from textclf.models.folder import PROBE_TEXTS

    folder = str(trained(name)[0] / "model")
    scores = {}
    for device in ("cuda:0", "cpu"):
        classify = pipeline("text-classification", model=folder, device=device, top_k=None)
        assert classify.model.device.type == torch.device(device).type
        scores[device] = [{row["label"]: row["score"] for row in rows} for rows in classify(PROBE_TEXTS)]
    assert all(set(row) == {"negative", "positive"} for row in scores["cuda:0"])
    gap = max(abs(gpu[label] - cpu[label]) for gpu, cpu in zip(scores["cuda:0"], scores["cpu"]) for label in gpu)
    assert gap < 1e-4, f"the GPU's probabilities differ from the CPU's by {gap:.2e}"  # rounding only


@pytest.mark.parametrize("name", runs("ddp_bf16", "ddp_fp16", "zero2", "zero3", "zero2_offload", "zero3_offload",
                                      "zero2_fp16"))
def test_precision_is_what_the_launch_asked_for(name, trained):
    out, _ = trained(name)
    precision, stage = RUNS[name][2][1], RUNS[name][2][2]
    sixteen_bit = SIXTEEN_BIT[precision]
    weights = exported(out)
    representable = all(torch.equal(w, w.to(sixteen_bit).float()) for w in weights.values())
    if stage is None:
        # torch autocast: 16-bit matmuls, fp32 weights that fused AdamW updates in fp32. A run that
        # silently stayed fp32 would log the fp32 run's losses but for the rounding of its padding to
        # multiples of 8 (sums with more exact zeros: 1e-7 at most). On a CPU, bf16 autocast moved this
        # job's losses by 8e-6 at the first step (logits near 0 at initialisation: the loss is ln 2
        # whatever they are) and by up to 2e-4 over the 8 steps; fp16 keeps 3 more bits.
        autocast, fp32 = losses(out), losses(trained("single_gpu")[0])
        gap = max(abs(autocast[step] - fp32[step]) for step in fp32)
        record("autocast", run=name, largest_loss_gap_to_fp32=gap)
        assert {"bf16": 2e-5, "fp16": 2e-6}[precision] < gap < 0.1, (autocast, fp32)
        assert all(w.dtype == torch.float32 for w in weights.values()) and not representable
    else:
        # DeepSpeed trains 16-bit weights (with fp32 master copies in the optimizer): the export gathers them.
        assert representable
    if precision == "fp16" and stage is None:
        # torch's GradScaler: accelerate saves its state with each checkpoint, so resume keeps the scale.
        scaler = torch.load(out / f"step_{SAVE}" / "scaler.pt", weights_only=True)
        scale = float(scaler["scale"])
        assert 1 <= scale <= 2 ** 16 and math.log2(scale).is_integer(), scale
        record("fp16_loss_scale", run=name, scale_at_step=SAVE, scale=scale)


@pytest.mark.xdist_group("amp")
def test_checkpoints_hold_the_cuda_rng_state(trained):
    states = torch.load(trained("single_gpu")[0] / f"step_{SAVE}" / "random_states_0.pkl", weights_only=False)
    assert len(states["torch_cuda_manual_seed"]) == torch.cuda.device_count()


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.xdist_group(f"probe_{name}"))
                                  for name in ("single_gpu", "ddp_bf16", "ddp_fp16", "fsdp", "zero2")])
def test_no_step_between_log_lines_waits_for_the_gpu(name, tmp_path, reviews_csv, cache_dir):
    config, launch_args, expected = RUNS[name]
    args = [*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--output_dir", tmp_path / "out",
            "--max_steps", 12, "--logging_steps", 4]
    _, [report] = run_sync_probe(args, tmp_path / "syncs.json", ZOO / config, launch_args)
    assert any(event["call"] == "cuda_sync" for event in report["events"]), "torch's sync debug mode reported nothing"
    libraries = ("transformers", "deepspeed") if expected[2] is not None else ("transformers",)
    if json.loads((tmp_path / "out" / "run.json").read_text())["speed"]["torch_compile"]:
        libraries += ("torch.compile",)
    theirs = assert_no_sync_between_log_lines(report, libraries)
    by_site = {}
    for event in theirs:
        by_site[f"{event['call']} {event['site']}"] = by_site.get(f"{event['call']} {event['site']}", 0) + 1
    record("syncs_between_log_lines", run=name, steps=9, by_site=by_site,
           libraries={library: LIBRARY_SYNCS[library] for library in libraries})


@pytest.mark.xdist_group("default_job")
def test_the_default_job_end_to_end(tmp_path):
    from transformers import pipeline

    from textclf.models.folder import PROBE_TEXTS

    start = time.time()
    result = run_train(["--output_dir", tmp_path / "out"], timeout=1200)
    wall = time.time() - start
    assert "device: cuda" in result.stdout
    final = [row for row in read_log(tmp_path / "out") if "eval_accuracy" in row][-1]
    steps = [row for row in read_log(tmp_path / "out") if "loss" in row]
    record("default_job", wall_s=round(wall, 1), steps=final["step"], eval_accuracy=final["eval_accuracy"],
           eval_f1=final["eval_f1"], eval_samples=final["eval_samples"],
           real_tokens_per_s=steps[-1]["real_tokens_per_s"])
    assert final["eval_samples"] == 1737
    assert final["eval_accuracy"] >= DEFAULT_JOB_ACCURACY_FLOOR, final
    classify = pipeline("text-classification", model=str(tmp_path / "out" / "model"), device="cuda:0")
    assert {row["label"] for row in classify(PROBE_TEXTS)} <= {"negative", "positive"}
