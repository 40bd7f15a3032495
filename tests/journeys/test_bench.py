"""The benchmark as a user runs it (python -m benchmarks, benchmarks.data_stage): tables, json and chart written,
medians of repeated rows, the plain loop and the Trainer beside train.py."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import OFFLINE, REPO, TINY, losses

NUMBERS = ("startup_s", "steps_per_s", "samples_per_s", "real_tokens_per_s", "real_token_fraction",
           "model_flops_per_s", "limit_fraction", "peak_rss_mb", "theory_model_states_mb", "eval_accuracy", "wall_s")


@pytest.mark.slow
def test_quick_benchmark_writes_table_json_and_chart(tmp_path, reviews_csv):
    result = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--steps", "3", "--data", str(reviews_csv),
                             "--output_dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                            timeout=1800, env={**os.environ, **OFFLINE})
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"

    rows = json.loads((tmp_path / "bench.json").read_text(encoding="utf-8"))
    ran = [row for row in rows if row["status"] == "ok"]
    names = {row["name"] for row in ran}
    expected = {"single", "plain_pytorch", "hf_trainer", "cpu", "single_small", "plain_pytorch_small"}
    if importlib.util.find_spec("deepspeed"):
        expected.add("zero2")
    assert expected <= names
    for row in ran:
        for key in NUMBERS:
            assert isinstance(row[key], (int, float)) and row[key] >= 0, (row["name"], key, row.get(key))
        assert row["processes"] >= 1 and len(row["peak_rss_mb_per_rank"]) == row["processes"], row["name"]
        # The console output stays where the docs say, beside the row's folder (train.py's --overwrite_output_dir
        # moves what is inside it aside), with the row's log.jsonl in the folder.
        assert (tmp_path / "runs" / f"{row['name']}.console.log").stat().st_size > 0, row["name"]
        assert (tmp_path / "runs" / row["name"] / "log.jsonl").is_file(), row["name"]
    assert not [path.name for path in (tmp_path / "runs").iterdir() if ".replaced-" in path.name]
    for row in rows:
        assert row["status"] in ("ok", "skipped"), (row["name"], row.get("reason"))
        if row["status"] == "skipped":
            assert row["skipped"], row["name"]  # never skipped silently

    table = (tmp_path / "bench.md").read_text(encoding="utf-8")
    assert all(f"| {row['name']} |" in table for row in rows)
    assert "## Padding over one epoch of reviews.csv" in table
    assert ("train.py `single` against `hf_trainer` (transformers.Trainer, train.py's settings), "
            "the same examples in one epoch: real tokens/s") in table
    assert (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG")


def test_repeated_rows_report_their_median_run():
    from benchmarks.measure import median_run

    runs = [{"status": "ok", "steps_per_s": speed, "run": k} for k, speed in enumerate([3.0, 1.0, 2.0, 4.0])]
    merged = median_run([*runs, {"status": "failed", "reason": "exit 1"}])
    assert merged["run"] == 2  # 2.0: the slower middle one of four
    assert merged["steps_per_s_runs"] == [3.0, 1.0, 2.0, 4.0, None] and merged["failed_runs"] == 1
    assert median_run(runs[:1]) == runs[0]  # one run is shown as it is


@pytest.mark.slow
def test_repeats_alternate_rows_and_compare_medians(tmp_path, reviews_csv):
    result = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--steps", "3", "--repeats", "2",
                             "--only", "single,plain_pytorch",  # the cheaper of --quick's two jobs
                             "--data", str(reviews_csv), "--output_dir", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True, timeout=1800, env={**os.environ, **OFFLINE})
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"

    rows = {row["name"]: row for row in json.loads((tmp_path / "bench.json").read_text(encoding="utf-8"))}
    assert set(rows) == {"single", "plain_pytorch"}
    for name, row in rows.items():
        assert len(row["steps_per_s_runs"]) == 2 and row["steps_per_s"] in row["steps_per_s_runs"], name
        assert all((tmp_path / "runs" / f"round_{k}" / name / "log.jsonl").exists() for k in (1, 2)), name
    assert "Over 2 alternating rounds" in (tmp_path / "bench.md").read_text(encoding="utf-8")


def test_a_job_trains_exactly_one_epoch_of_examples_held_apart_from_its_eval_set(tmp_path, reviews_csv):
    from benchmarks.measure import job_data
    from benchmarks.plan import BenchJob
    from textclf.data.reading import load_table

    job = BenchJob("scratch-mini", steps=5, eval_rows=40)
    train_file, eval_file = job_data(job, str(reviews_csv), str(tmp_path))
    train, held_out = load_table(train_file), load_table(eval_file)
    assert len(train) == 5 * 32 and len(held_out) == 40
    assert train.column_names == ["label", "review"]  # train.py's default columns
    assert not set(train["review"]) & set(held_out["review"])
    assert load_table(job_data(job, str(reviews_csv), str(tmp_path))[0])["review"] == train["review"]  # seeded


def test_data_too_small_for_the_job_is_one_clear_line_and_writes_nothing(tmp_path, reviews_csv):
    result = subprocess.run([sys.executable, "-m", "benchmarks", "--data", str(reviews_csv), "--only", "single",
                             "--output_dir", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
                            timeout=300, env={**os.environ, **OFFLINE})
    assert result.returncode == 2 and not (tmp_path / "out").exists()
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {reviews_csv} has 240 examples with text; the benchmark's scratch-mini job needs 2920 "
        "(1920 to train 60 steps, 1000 to evaluate)")


def test_on_a_gpu_train_py_the_plain_loop_and_the_trainer_also_run_in_bf16_against_the_bf16_matmul_limit():
    from benchmarks.measure import limit_of
    from benchmarks.plan import BenchJob, command, plan_rows

    job = BenchJob("scratch-mini", steps=6, eval_rows=48)
    bf16_rows = ("single_bf16", "plain_pytorch_bf16", "hf_trainer_bf16")
    on_gpu = {row["name"]: row for row in plan_rows(job, cuda_devices=1)}
    for name in bf16_rows:
        row = on_gpu[name]
        assert "skipped" not in row and row["precision"] == "bf16" and row["processes"] == 1, row
        launched = command(row, ["--max_steps", "6"])
        assert launched[-2:] == ["--mixed_precision", "bf16"] and "accelerate.commands.launch" not in launched
    assert command(on_gpu["plain_pytorch_bf16"], [])[2:4] == ["benchmarks.baselines", "plain_pytorch"]
    on_cpu = {row["name"]: row for row in plan_rows(job, cuda_devices=0)}
    assert all(on_cpu[name]["skipped"].startswith("needs CUDA") for name in bf16_rows)

    gpu_limit = {"flops_per_s": 60e12, "bf16_flops_per_s": 700e12}
    assert limit_of(on_gpu["single_bf16"], gpu_limit) == 700e12 and limit_of(on_gpu["single"], gpu_limit) == 60e12
    assert limit_of(on_cpu["cpu_bf16"], {"flops_per_s": 150e9}) == 150e9  # no bf16 rate measured on a CPU


@pytest.mark.slow
def test_the_plain_loop_autocasts_in_bf16_when_asked(tmp_path, reviews_csv, cache_dir):
    """The plain loop's bf16 row really computes in bf16: its losses leave fp32's, by bf16's rounding only."""


    def plain_loop(out, *extra):
        subprocess.run([sys.executable, "-m", "benchmarks.baselines", "plain_pytorch", *TINY,
                        "--data", str(reviews_csv), "--cache_dir", str(cache_dir), "--max_steps", "3",
                        "--output_dir", str(out), *extra],
                       cwd=REPO, check=True, capture_output=True, timeout=600, env={**os.environ, **OFFLINE})
        return losses(out)

    fp32, bf16 = plain_loop(tmp_path / "fp32"), plain_loop(tmp_path / "bf16", "--mixed_precision", "bf16")
    assert fp32.keys() == bf16.keys() == {1, 2, 3}
    assert fp32 != bf16 and all(abs(fp32[step] - bf16[step]) < 0.05 for step in fp32)


@pytest.mark.slow
def test_the_data_stage_benchmark_writes_its_table(tmp_path, reviews_csv):
    result = subprocess.run([sys.executable, "-m", "benchmarks.data_stage", "--data", str(reviews_csv), "--rows",
                             "300,600", "--output_dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                            timeout=1800, env={**os.environ, **OFFLINE})
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    rows = json.loads((tmp_path / "data_stage.json").read_text(encoding="utf-8"))
    assert [(row["rows"], row["run"]) for row in rows] == [(300, "first"), (300, "second"), (600, "first"),
                                                           (600, "second")]
    assert all(0 < row["first_step_s"] < row["wall_s"] and row["peak_rss_mb"] > 0 and row["cpu_s"] > 0 for row in rows)
    assert "| 600 | warm (second run) |" in (tmp_path / "data_stage.md").read_text(encoding="utf-8")
    second = (tmp_path / "rows_600" / "console_second.txt").read_text(encoding="utf-8")
    assert "tokenized before, from the cache" in second  # the second run is a cache hit
