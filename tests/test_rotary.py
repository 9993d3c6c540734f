"""The rotary module's scalings against transformers' own ROPE_INIT_FUNCTIONS, from the config.json
a transformers config writes (both spellings of the rope block), and the table the layers read."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from executor_service.layers.rotary import RotaryEmbedding, rope_inv_freq
from executor_service.model_config import rope_parameters_of

CASES = {
    "default": {"rope_type": "default", "rope_theta": 1e6},
    "linear": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768},
    "yarn_mscale": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                    "beta_fast": 16, "beta_slow": 2, "original_max_position_embeddings": 4096},
    "yarn_untruncated": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "truncate": False,
                         "attention_factor": 1.3, "original_max_position_embeddings": 2048},
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_inverse_frequencies_and_attention_factor_match_transformers(case, head_dim):
    config = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_parameters=dict(CASES[case]),
    )
    rope_type = CASES[case]["rope_type"]
    if rope_type == "default":
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        expected, factor = inv_freq, 1.0
    else:
        expected, factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    ours, our_factor = rope_inv_freq(head_dim, rope_parameters_of(config.to_dict(), "config.json"))
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)
    assert math.isclose(our_factor, factor, rel_tol=1e-12)


def test_older_rope_scaling_spelling_is_read_like_rope_parameters():
    """Files before transformers 5: `rope_scaling` with `type`, `rope_theta` at the top level."""
    old = {"rope_theta": 5e5, "max_position_embeddings": 131072,
           "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}}  # fmt: skip
    new = {"max_position_embeddings": 131072, "rope_parameters": {**CASES["llama3"]}}
    assert rope_parameters_of(old, "old") == rope_parameters_of(new, "new")


def test_yarn_table_carries_the_attention_factor_into_cos_and_sin(tmp_path):
    """The cos/sin table (what the unfused rotary and the fused kernel read) is HF's cos and sin,
    attention factor included, and a Qwen3 YaRN checkpoint extends the context to factor x original."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from executor_service.model_config import load_model_config

    rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 1024}
    config = Qwen3Config(head_dim=32, max_position_embeddings=1024, rope_parameters=dict(rope))
    (tmp_path / "config.json").write_text(
        json.dumps({**config.to_dict(), "architectures": ["Qwen3ForCausalLM"]})
    )
    mc = load_model_config(tmp_path)
    assert mc.max_context_len == 4096
    table = RotaryEmbedding(32, mc.max_context_len, mc.rope_parameters).cos_sin_cache
    positions = torch.tensor([[0, 1, 77, 1023, 4095]])
    cos, sin = Qwen3RotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    torch.testing.assert_close(table[positions[0]], torch.cat([cos[0], sin[0]], -1), rtol=1e-5, atol=1e-6)


def test_unknown_rope_type_is_one_clear_error():
    with pytest.raises(ValueError, match=r"rope_type 'su' in x is not supported; supported: default, linear"):
        rope_parameters_of({"max_position_embeddings": 8, "rope_scaling": {"type": "su"}}, "x")
    with pytest.raises(ValueError, match=r"rope_type 'llama3' in x needs low_freq_factor, high_freq_factor"):
        rope_parameters_of(
            {"max_position_embeddings": 8, "rope_parameters": {"rope_type": "llama3", "factor": 8}}, "x"
        )


@pytest.mark.parametrize("case", ["yarn", "llama3"])
def test_top_level_original_max_position_embeddings_wins_as_in_transformers(tmp_path, case):
    """A config.json with `original_max_position_embeddings` both at the top level and in the rope
    block (different): transformers' rotary table uses the top-level one, and so does ours."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from executor_service.model_config import load_model_config

    rope = {**CASES[case], "original_max_position_embeddings": 256}
    config = LlamaConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=1024,
                         rope_parameters=rope).to_dict()  # fmt: skip
    config.update(architectures=["LlamaForCausalLM"], original_max_position_embeddings=64)
    (tmp_path / "config.json").write_text(json.dumps(config))
    mc = load_model_config(tmp_path)
    assert mc.rope_parameters["original_max_position_embeddings"] == 64
    table = RotaryEmbedding(32, mc.max_context_len, mc.rope_parameters).cos_sin_cache
    positions = torch.tensor([[0, 1, 63, 64, 200, 1023]])
    hf = LlamaRotaryEmbedding(AutoConfig.from_pretrained(tmp_path))
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions)
    torch.testing.assert_close(table[positions[0]], torch.cat([cos[0], sin[0]], -1), rtol=1e-5, atol=1e-6)
