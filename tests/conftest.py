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


def pytest_configure(config):
    # Each xdist worker draws free ports from a range of its own: a port one worker's test checked
    # free could otherwise be taken by another worker's service (one restarted on its port, say)
    # before this worker's service binds it.
    import os

    from client import defaults

    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker and count and worker.removeprefix("gw").isdigit():
        lo, hi = defaults._FREE_PORT_RANGE
        share = (hi - lo + 1) // int(count)
        start = lo + int(worker.removeprefix("gw")) * share
        defaults._FREE_PORT_RANGE = (start, start + share - 1)
    # Two xdist workers on two cores: one intra-op thread each avoids oversubscription.
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory):
    """family name -> its tiny checkpoint (tests/checkpoints.py FAMILIES), built once per session."""
    from checkpoints import FAMILY_SEEDS, build_checkpoint

    built = {}

    def get(family: str):
        if family not in built:
            path = tmp_path_factory.mktemp(family)
            built[family] = build_checkpoint(path, family, seed=FAMILY_SEEDS.get(family, 0))
        return built[family]

    return get
