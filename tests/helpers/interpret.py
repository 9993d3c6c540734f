"""Shared by the tests: from test_triton_interpret.py."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = r"""
import sys
sys.path[:0] = ["tests", "."]
import torch
torch.set_num_threads(1)
from triton.runtime import interpreter

# numpy >= 2.4 refuses int() of a 1-element array, which the interpreter hands to range() for loop
# bounds loaded from memory; take the element explicitly.
_patch_tensor = interpreter._patch_lang_tensor

def _patch_lang_tensor(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

interpreter._patch_lang_tensor = _patch_lang_tensor
from helpers.attention_checks import check_decode, check_prefill, check_store, make_batch
from helpers.attention_fp8_checks import check_attention_fp8, check_store_fp8, to_fp8
f16 = torch.float16
"""
