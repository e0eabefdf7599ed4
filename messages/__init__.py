"""The wire protocol: msgspec Structs, one tagged union per inbox, one codec."""

from .common import PROTOCOL_VERSION, FinishReason, SamplingParams

__all__ = ["PROTOCOL_VERSION", "FinishReason", "SamplingParams"]
