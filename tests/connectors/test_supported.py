"""Configurations the connector cannot serve correctly are refused at start."""

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

from sessionkv.connectors.startup import check_supported

FULL = KVCacheGroupSpec(
    ["l0"], FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
)
SWA = KVCacheGroupSpec(
    ["l1"],
    SlidingWindowSpec(
        block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=128
    ),
)


def test_full_attention_single_group_tp1_is_supported():
    check_supported("kv_both", [FULL], 1, 1, device_worker=False)
    # Tensor parallel on a device: test_tp_layout.py proves its G2 and G3 layout.
    for tp in (1, 2, 4, 8):
        check_supported("kv_both", [FULL], tp, 1, device_worker=True)


def test_pipeline_parallel_on_a_device_is_refused_naming_the_setting_and_why():
    for tp, pp in ((1, 2), (4, 2), (2, 4)):
        with pytest.raises(
            ValueError,
            match=f"pipeline_parallel_size=1 only, got {pp}: "
            r".*stages with different layer counts",
        ):
            check_supported("kv_both", [FULL], tp, pp, device_worker=True)


@pytest.mark.parametrize(
    "args, message",
    [
        (("kv_producer", [FULL], 1, 1, False), "kv_role"),
        (("kv_both", [FULL, SWA], 1, 1, False), "one KV cache group"),
        (("kv_both", [SWA], 1, 1, False), "SlidingWindowSpec"),
        (("kv_both", [FULL], 2, 1, False), "tensor_parallel_size"),
        (("kv_both", [FULL], 1, 2, False), "pipeline_parallel_size"),
    ],
)
def test_unsupported_configurations_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        check_supported(*args)
