"""How the decode kernel splits each sequence's keys (flash-decoding) by batch size, and the start-up
warm-up's batch sizes: on the CPU (the policy is host code; the kernels are in test_triton_kernels)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

tk = pytest.importorskip("executor_service.attention.triton_kernels")
from executor_service.attention import triton_paged  # noqa: E402

H200_SMS = 132


def test_default_policy_fills_about_four_programs_an_sm():
    # 8 KV heads: from 33 sequences on (264 programs, 2 an SM) the keys are not split.
    assert tk.choose_num_splits(33, 8, H200_SMS) == 1
    assert tk.choose_num_splits(256, 8, H200_SMS) == 1
    # 32 sequences: 256 programs, split in 2 (512, about 4 an SM); 1 sequence: 8 programs, 32 splits.
    assert tk.choose_num_splits(32, 8, H200_SMS) == 2
    assert tk.choose_num_splits(1, 8, H200_SMS) == tk.MAX_SPLITS
    for n in range(1, 300):
        splits = tk.choose_num_splits(n, 8, H200_SMS)
        assert splits & (splits - 1) == 0  # a power of two
        programs = n * 8 * splits
        # at most one split past 4 programs an SM, and 2 an SM at least unless at the cap
        assert programs < 4 * H200_SMS + n * 8, (n, splits)
        assert splits in (1, tk.MAX_SPLITS) or programs >= 2 * H200_SMS, (n, splits)


def test_a_config_sets_its_own_split_policy():
    one_warp = {"num_warps": 1, "split_below": 24, "split_to": 48}
    # 256 sequences x 8 KV heads = 2,048 programs, 15.5 an SM: under 24, so split in 4 (8,192
    # programs, 62 an SM: 48 an SM would take 3.1 splits, rounded up then down to a power of two).
    assert tk.choose_num_splits(256, 8, H200_SMS, one_warp) == 4
    assert tk.choose_num_splits(256, 8, H200_SMS) == 1
    assert tk.choose_num_splits(512, 8, H200_SMS, one_warp) == 1
    # Keys the config does not name keep the module's defaults.
    assert tk.choose_num_splits(20, 8, H200_SMS, {"BLOCK_N": 32}) == tk.choose_num_splits(20, 8, H200_SMS)


@pytest.mark.parametrize("fp8", [False, True])
def test_warm_up_reaches_every_split_count(fp8):
    """The warm-up runs one decode step at each batch size variant_batch_sizes returns: between them
    they must reach every split count a batch of 1..max_num_seqs can launch with the cache's config,
    or a kernel variant would compile in the middle of serving."""
    kv_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    policy = {"split_below": 24, "split_to": 48}
    with (
        mock.patch.object(triton_paged, "_num_sms", return_value=H200_SMS),
        mock.patch.dict(tk.decode_config(kv_dtype), policy),
    ):
        backend = triton_paged.TritonPagedBackend()
        sizes = backend.variant_batch_sizes(256, 8, torch.device("cpu"), kv_dtype)
        config = tk.decode_config(kv_dtype)
        wanted = {tk.choose_num_splits(n, 8, H200_SMS, config) for n in range(1, 257)}
        assert {tk.choose_num_splits(n, 8, H200_SMS, config) for n in sizes} == wanted
        assert len(wanted) > 3  # the policy above splits up to 255 sequences
    assert "split_below" not in tk.decode_config(kv_dtype)  # (the patch is undone)
