"""No step between two log lines waits for the device (tests/sync_probe.py), one process and under DeepSpeed."""

import pytest

from conftest import REPO, TINY, assert_no_sync_between_log_lines, quiet_steps, run_sync_probe

STEPS, LOGGING = 12, 4


STEPS, LOGGING = 12, 4


def probe_args(reviews_csv, cache_dir, output_dir):
    return [*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--output_dir", output_dir,
            "--max_steps", STEPS, "--logging_steps", LOGGING]


@pytest.mark.slow
def test_one_process_waits_for_the_device_only_at_log_lines(tmp_path, reviews_csv, cache_dir):
    _, [report] = run_sync_probe(probe_args(reviews_csv, cache_dir, tmp_path / "out"), tmp_path / "syncs.json")
    assert report["steps"] == STEPS and quiet_steps(report) == {1, 2, 3, 5, 6, 7, 9, 10, 11}
    assert_no_sync_between_log_lines(report, ("transformers",))


@pytest.mark.slow
def test_under_deepspeed_only_deepspeed_itself_waits_between_log_lines(tmp_path, reviews_csv, cache_dir):
    """ZeRO-2 on 2 processes. DeepSpeed clips gradients itself, so train.py does not ask accelerate to:
    that would read the norm back (accelerate's get_global_grad_norm, `.item()`) at every step."""
    _, reports = run_sync_probe(probe_args(reviews_csv, cache_dir, tmp_path / "out"), tmp_path / "syncs.json",
                                config_file=REPO / "accelerate_configs" / "zero2.yaml")
    assert len(reports) == 2
    for report in reports:
        assert_no_sync_between_log_lines(report, ("transformers", "deepspeed"))
