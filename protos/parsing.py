"""Request deserializers for both services' handlers: bytes that are no valid message become a
MalformedMessage, which the handler refuses with INVALID_ARGUMENT (gRPC answers an exception raised
in a deserializer with INTERNAL or UNKNOWN)."""

from __future__ import annotations

from collections.abc import Callable

from google.protobuf.message import DecodeError, Message


class MalformedMessage:
    """What a request deserializer returns for bytes that are no valid message."""

    def __init__(self, error: str) -> None:
        self.error = error


def deserializer(message_type: type[Message]) -> Callable[[bytes], Message | MalformedMessage]:
    name = message_type.DESCRIPTOR.full_name

    def parse(data: bytes) -> Message | MalformedMessage:
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            return MalformedMessage(f"the message is not a valid {name} ({len(data)} bytes): {e}")

    return parse
