"""The run's process (textclf/launch/process.py): the library state a run changes, put back when it ends, and what it
keeps quiet."""

import warnings

import pytest
import torch


@pytest.fixture
def fresh_accelerator_state():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def library_state() -> dict:
    """What a run may change in this process: warning filters, DeepSpeed's logger filters, the libraries' bars, the
    stop signals' handlers."""
    import logging
    import signal

    import datasets
    from transformers.utils import logging as transformers_logging

    return {"warning filters": list(warnings.filters), "DeepSpeed": list(logging.getLogger("DeepSpeed").filters),
            "bars": (transformers_logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled()),
            "handlers": [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]}


def test_deepspeeds_cpu_fallback_is_filtered_at_its_logger_unless_verbose(monkeypatch):
    import logging

    from textclf.launch.process import actionable, run_scope

    with run_scope():  # a run's, put back at its end
        assert actionable in logging.getLogger("DeepSpeed").filters
    assert actionable not in logging.getLogger("DeepSpeed").filters
    record = logging.LogRecord("DeepSpeed", logging.WARNING, "real_accelerator.py", 213, "Setting accelerator to "
                               "CPU. If you have GPU or other accelerator, we were unable to detect it.", None, None)
    assert not actionable(record)
    assert actionable(logging.LogRecord("DeepSpeed", logging.WARNING, "x.py", 1, "something else", None, None))
    monkeypatch.setenv("TEXTCLF_VERBOSE", "1")
    assert actionable(record)


@pytest.mark.parametrize("verbose", ["", "1"])
def test_a_run_s_quiet_libraries_are_put_back_when_it_ends(verbose, monkeypatch):
    """Inside the run's scope, library code's deprecation warnings are silenced by message and module (the same
    message from elsewhere still shows), the bars are off and train.py may set its handlers; after it, all is as
    before, an error ending it too. TEXTCLF_VERBOSE=1 silences nothing."""
    import signal

    from textclf.launch.process import run_scope

    monkeypatch.setenv("TEXTCLF_VERBOSE", verbose)
    deprecated = "`torch.distributed.reduce_scatter_tensor` is deprecated. Please use ..."

    def shown(module) -> bool:
        with warnings.catch_warnings(record=True) as caught:
            warnings.warn_explicit(deprecated, FutureWarning, "c10d_logger.py", 83, module=module)
        return bool(caught)

    before = library_state()
    with pytest.raises(KeyError), run_scope():
        signal.signal(signal.SIGTERM, lambda *_: None)
        assert shown("torch.distributed.c10d_logger") == bool(verbose)
        assert shown("my_code")  # not a library's call: the user's to see
        assert library_state()["bars"] == ((True, True) if verbose else (False, False))
        raise KeyError("the run failed")
    assert library_state() == before and shown("torch.distributed.c10d_logger")


def test_a_library_setting_a_run_changes_is_put_back_when_its_scope_ends():
    """speed_up's TF32 and dynamo's recompile limit (launch.set_for_the_run): the run's value inside, the process's
    after, nested scopes each putting back their own."""

    from textclf.launch.process import run_scope, set_for_the_run

    limit, precision = torch._dynamo.config.recompile_limit, torch.backends.cuda.matmul.fp32_precision
    with pytest.raises(KeyError), run_scope():
        set_for_the_run(torch._dynamo.config, "recompile_limit", limit + 56)
        set_for_the_run(torch.backends.cuda.matmul, "fp32_precision", "tf32")
        with run_scope():
            set_for_the_run(torch._dynamo.config, "recompile_limit", limit + 100)
        assert torch._dynamo.config.recompile_limit == limit + 56
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        raise KeyError("the run failed")
    assert (torch._dynamo.config.recompile_limit, torch.backends.cuda.matmul.fp32_precision) == (limit, precision)


def test_a_compiled_run_takes_down_what_it_set_up_in_accelerate_and_torch_when_its_scope_ends(
        fresh_accelerator_state):
    """compile_model turns accelerate's compile of the whole model off (the blocks are compiled already) and starts
    the compile clock (dynamo's callbacks, an optimizer hook): for the run. After it, the launch's dynamo backend is
    back for the next run of the process, and no callback or hook of the clock is left."""
    from accelerate import Accelerator
    from accelerate.utils import DynamoBackend
    from transformers import BertConfig, BertForSequenceClassification

    from textclf.launch.process import run_scope
    from textclf.models.speed import CompileClock, compile_model

    accelerator = Accelerator(cpu=True, dynamo_backend="inductor")  # a launch's --dynamo_backend inductor
    model = BertForSequenceClassification(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=16))
    callbacks = torch._dynamo.callback_handler
    with run_scope():
        compile_model(model, {"backend": "inductor", "dynamic": False}, accelerator)  # compiles at the first call
        assert accelerator.state.dynamo_plugin.backend == DynamoBackend.NO
        assert CompileClock.on_start in callbacks.start_callbacks and CompileClock.said is not None
    assert accelerator.state.dynamo_plugin.backend == DynamoBackend.INDUCTOR
    assert CompileClock.on_start not in callbacks.start_callbacks and CompileClock.on_end not in callbacks.end_callbacks
    assert CompileClock.said is None


@pytest.mark.slow
def test_main_twice_in_one_process_starts_and_ends_with_the_same_library_state(tmp_path, reviews_csv, cache_dir):
    """A notebook that calls train.main twice: each run starts from the state the process had, and leaves it so."""
    import train
    from conftest import TINY
    from textclf.cli import parse_config

    before = library_state()
    for run in ("first", "second"):
        train.main(parse_config(list(map(str, [*TINY, "--data", reviews_csv, "--cache_dir", cache_dir, "--max_steps",
                                               2, "--output_dir", tmp_path / run]))))
        assert library_state() == before, run
    assert (tmp_path / "first" / "model").is_dir() and (tmp_path / "second" / "model").is_dir()
