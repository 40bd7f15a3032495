"""What a resolved launch cannot run, as the check's conflicts (textclf/launch/conflicts.py)."""

from conftest import run_check
from textclf.launch.conflicts import cpu_has_native_bf16


def test_bf16_warns_on_a_cpu_without_native_bf16(capsys, monkeypatch, tmp_path):
    with_bf16, without_bf16 = tmp_path / "with", tmp_path / "without"
    with_bf16.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n")
    without_bf16.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\n")
    assert cpu_has_native_bf16(str(with_bf16)) and not cpu_has_native_bf16(str(without_bf16))

    monkeypatch.setattr("textclf.launch.conflicts.cpu_has_native_bf16", lambda: False)  # an AVX2-only CPU
    status, _, err = run_check(capsys, "--config_file", "accelerate_configs/cpu.yaml", "--target", "cpu",
                               "--mixed_precision", "bf16")
    assert status == 0
    assert "warning: precision: the launch line (--mixed_precision) is bf16, but this CPU has no native bf16" in err
    status, _, err = run_check(capsys, "--config_file", "accelerate_configs/ddp_bf16.yaml", "--target", "cuda")
    assert status == 0 and "warning" not in err
