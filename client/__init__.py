"""Python client of the tandem scheduler service (sync and asyncio) and the `tandem` CLI."""

from client.aio import AsyncGenerationStream, AsyncTandemClient
from client.client import GenerationStream, TandemClient
from client.messages import Chunk, Completion, Final, ModelInfo, TandemError, TokenLogprob, ToolCall

__all__ = [
    "AsyncGenerationStream",
    "AsyncTandemClient",
    "Chunk",
    "Completion",
    "Final",
    "GenerationStream",
    "ModelInfo",
    "TandemClient",
    "TandemError",
    "TokenLogprob",
    "ToolCall",
]
