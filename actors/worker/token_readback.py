"""A step's sampled token ids, on their way from the device to the host.

On CUDA the [N] int64 ids are copied into a persistent pinned buffer on a stream of their own,
after an event recorded on the stream that computed them; the host waits (on the copy's event)
only when it asks for the list. On the CPU the ids are the list already: nothing is copied.

The pinned buffer is reused by the next step's copy, so a SampledTokens reads its list before
that copy starts (TokenReadback.start does it) and keeps it.
"""

from __future__ import annotations

import torch


class SampledTokens:
    """`device`: the ids [N] int64 on the logits' device, ready for more device work (logprobs,
    the next step's inputs); `tolist()`: the same ids on the host."""

    __slots__ = ("device", "_host", "_ready", "_list")

    def __init__(
        self,
        device: torch.Tensor,
        host: torch.Tensor | None = None,
        ready: torch.cuda.Event | None = None,
    ):
        self.device = device
        self._host = device if host is None else host
        self._ready = ready
        self._list: list[int] | None = None

    def tolist(self) -> list[int]:
        """The ids as ints (waits for the copy the first time; the same list afterwards)."""
        if self._list is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._list = self._host.tolist()
        return self._list


class TokenReadback:
    """The copy of sampled ids to the host, for one device."""

    def __init__(self, device: torch.device | str):
        device = torch.device(device)
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.pinned: torch.Tensor | None = None  # grown to the largest step's N
        self.last: SampledTokens | None = None  # the one whose list the buffer may still hold

    def start(self, tokens: torch.Tensor) -> SampledTokens:
        """tokens [N] int64, just computed on the current stream -> their SampledTokens, the copy
        to the host under way (CUDA)."""
        if self.stream is None:
            return SampledTokens(tokens)
        if self.last is not None:
            self.last.tolist()  # its ids leave the buffer before this copy overwrites them
        n = tokens.shape[0]
        if self.pinned is None or self.pinned.shape[0] < n:
            size = max(64, 1 << max(0, n - 1).bit_length())
            self.pinned = torch.empty(size, dtype=torch.int64, pin_memory=True)
        computed = torch.cuda.Event()
        computed.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(computed)
        host = self.pinned[:n]
        with torch.cuda.stream(self.stream):
            host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        tokens.record_stream(self.stream)  # not reused by the allocator before the copy ran
        self.last = SampledTokens(tokens, host, ready)
        return self.last
