"""`--model ORG/NAME`: a snapshot already in the local Hugging Face cache, never downloaded.

The cache layout (huggingface_hub's): `$HF_HUB_CACHE` (default `$HF_HOME/hub`, `HF_HOME` defaulting
to `~/.cache/huggingface`) holds `models--ORG--NAME/refs/<revision>` (a file naming a commit) and
`models--ORG--NAME/snapshots/<commit>/` (the files). A revision is a branch or tag with a ref
file, or a commit hash. Read directly, so neither service needs huggingface_hub (the executor resolves --model, the
scheduler --tokenizer, `tandem up` both)."""

from __future__ import annotations

import os
import re
from pathlib import Path

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home).expanduser() / "hub"


def resolve_model(model: str, revision: str | None = None) -> str:
    """A checkpoint directory for `model`: itself when it is a path (or not a hub id), else the
    cached snapshot of that revision (default "main"). FileNotFoundError, naming where it looked,
    when the snapshot is not in the cache."""
    if Path(model).expanduser().exists() or not _REPO_ID.match(model):
        return model
    revision = revision or "main"
    repo = hub_cache_dir() / f"models--{model.replace('/', '--')}"
    ref = repo / "refs" / revision
    if ref.is_file():
        commit = ref.read_text().strip()
    elif _COMMIT.match(revision):
        commit = revision
    else:
        commit = None
    snapshot = repo / "snapshots" / commit if commit else ref
    if commit and (snapshot / "config.json").is_file():
        return str(snapshot)
    raise FileNotFoundError(
        f"model {model!r} (revision {revision}) is not a directory and not in the Hugging Face cache: "
        f"looked for {snapshot} (set HF_HUB_CACHE or HF_HOME; tandem never downloads)"
    )
