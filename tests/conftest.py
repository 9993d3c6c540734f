from __future__ import annotations

import pytest
from checkpoints import build_qwen3


@pytest.fixture(scope="session")
def qwen3_tied(tmp_path_factory):
    """4 layers, GQA 2:1, tied embeddings, fp32, with a trained tokenizer."""
    return build_qwen3(tmp_path_factory.mktemp("qwen3_tied"), tie_word_embeddings=True, seed=1)


@pytest.fixture(scope="session")
def qwen3_untied(tmp_path_factory):
    """4 layers, GQA 2:1, untied LM head, fp32, two eos ids, rope_theta 1e6."""
    return build_qwen3(
        tmp_path_factory.mktemp("qwen3_untied"),
        tie_word_embeddings=False,
        rope_theta=1e6,
        eos_token_id=[0, 1],
        seed=2,
    )
