"""The benchmark's other jobs: the decoder's memory beside the check's figures, the steady-state job at tiny shapes."""

import json
import os
import subprocess
import sys

import pytest

from conftest import OFFLINE, REPO


def test_the_decoder_job_reads_the_check_s_figures():
    from benchmarks.decoder import check_figure

    output = ("model states (ZeRO paper)\nmemory per rank     3.70 GiB\n"
              "peak per rank       812.5 MiB  (activations ...)\n")
    assert check_figure("memory per rank", output) == 3.7
    assert check_figure("peak per rank", output) == 0.79
    assert check_figure("peak per rank", "error: ...") is None


@pytest.mark.slow
def test_the_decoder_job_measures_each_rank_beside_the_check(tmp_path, reviews_csv):
    """One layer of Qwen2.5-0.5B's width (its 151,936-token embedding: 150M parameters) under ZeRO-3."""
    result = subprocess.run([sys.executable, "-m", "benchmarks.decoder", "--output_dir", str(tmp_path), "--layers", "1",
                             "--data", str(reviews_csv), "zero3.yaml"],
                            cwd=REPO, capture_output=True, text=True, timeout=900, env={**os.environ, **OFFLINE})
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    run = json.loads((tmp_path / "results.json").read_text())["zero3.yaml"]
    assert run["exit_code"] == 0 and run["stopped"] is None and len(run["losses"]) == 2
    assert len(run["peak_gib_per_rank"]) == 2 and all(peak > 0.5 for peak in run["peak_gib_per_rank"])
    assert run["theory_gib"] > 0 and run["predicted_gib"] > run["theory_gib"]
    assert "zero3.yaml" in result.stdout.splitlines()[-1]


@pytest.mark.slow
def test_the_steady_state_job_runs_every_row_at_tiny_shapes_on_texts_that_fill_max_length(tmp_path, reviews_csv):
    """benchmarks/steady.py, as a CPU runs it: both jobs (a decoder and a BERT), train.py, the plain loop and the
    Trainer with train.py's settings and with its speed flags, every batch full, the warm-up steps left out."""
    result = subprocess.run([sys.executable, "-m", "benchmarks.steady", "--output_dir", str(tmp_path),
                             "--data", str(reviews_csv)], cwd=REPO, capture_output=True, text=True, timeout=2400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "steady.json").read_text(encoding="utf-8"))
    assert (report["steps"], report["warmup_steps"]) == (4, 2)
    assert [job["job"] for job in report["jobs"]] == ["decoder_tiny", "bert_tiny"]
    for job in report["jobs"]:
        rows = {row["name"]: row for row in job["rows"]}
        assert list(rows) == ["train.py", "plain_pytorch", "hf_trainer", "hf_trainer_fast"]
        for row in rows.values():
            assert row["status"] == "ok" and row["real_token_fraction"] == 1.0, row  # every text fills max_length
            assert row["ms_per_step"] > 0 and 0 < row["model_flops_per_s"] < job["matmul_limit_flops_per_s"]
            assert len(row["step_seconds"]) == 2  # steps 3 and 4: the first 2 left out
        assert rows["train.py"]["speed"]["torch_compile"] is None  # a CPU stays eager by default
    table = (tmp_path / "steady.md").read_text(encoding="utf-8")
    assert "4 optimizer steps per row, the first 2 left out" in table
    assert table.count("| hf_trainer_fast |") == 2 and "train.py runs at" in table
