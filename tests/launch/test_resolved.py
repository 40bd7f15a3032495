"""The launch accelerate would start, resolved from its config file (textclf/launch/resolved.py): a config it cannot
read is one line."""

import pytest

from conftest import REPO, run_check


@pytest.mark.parametrize("text, message", [
    ("distributed_type: [MULTI_GPU\n", "while parsing a flow sequence"),
    ("distributed_type: MULTI_GPU\nnum_procesess: 2\n", "had unknown keys (['num_procesess'])"),
    ("distributed_type: MULTI_PGU\n", "'MULTI_PGU' is not a valid DistributedType"),
    ("- MULTI_GPU\n", "'list' object has no attribute 'get'"),
])
def test_an_unreadable_accelerate_config_is_one_line(capsys, tmp_path, text, message):
    (tmp_path / "bad.yaml").write_text(text)
    status, _, err = run_check(capsys, "--config_file", str(tmp_path / "bad.yaml"), "--target", "cpu")
    assert status == 2 and [line for line in err.splitlines() if line.startswith("error:")] == [
        line for line in err.splitlines() if line.startswith(f"error: cannot read {tmp_path / 'bad.yaml'}: ")]
    assert message in err and "Traceback" not in err


def test_an_unquoted_no_in_the_yaml_is_named(capsys, tmp_path):
    variant = tmp_path / "single.yaml"
    variant.write_text((REPO / "accelerate_configs" / "single_gpu.yaml").read_text()
                       .replace('distributed_type: "NO"', "distributed_type: NO"))
    status, _, err = run_check(capsys, "--config_file", variant, "--target", "cuda")
    assert status == 2 and "a bare NO is YAML for false" in err
