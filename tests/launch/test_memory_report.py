"""The check's memory lines (textclf/launch/memory_report.py): what each framework holds beyond the model states."""


def test_the_peak_per_rank_adds_what_each_framework_holds_beyond_the_model_states():
    from textclf.launch.estimates import framework_buffer_bytes

    params = 1_000_000
    ddp = framework_buffer_bytes(params, params, world=2, stage=0, layout="fp32", strategy="ddp")
    assert ddp == {"DDP gradient buckets": 4e6}
    zero2 = framework_buffer_bytes(params, params, world=2, stage=2, layout="fp32", strategy="deepspeed")
    assert zero2 == {"fp32 copy of the weight partition": 2e6, "fp32 gradient of the partition": 2e6}
    # ZeRO-3 keeps gathered weights up to stage3_max_live_parameters; 16-bit training has its fp32 copy in the states.
    zero3 = framework_buffer_bytes(params, params, world=2, stage=3, layout="16-bit", strategy="deepspeed",
                                   live_parameters=400_000)
    assert zero3 == {"fp32 gradient of the partition": 2e6, "gathered weights": 0.8e6}
    assert framework_buffer_bytes(params, params, world=1, stage=0, layout="fp32", strategy="NO") == {}
