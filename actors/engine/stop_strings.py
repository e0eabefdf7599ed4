"""Stop strings on streamed text: hold back what could still become a stop string, cut at one.

Text is released only when no stop string can start in it any more: the last
`longest stop string - 1` characters wait for the next delta. On a match the output ends at the
stop string (or just after it with `include_stop_str_in_output`).
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str], include_in_output: bool):
        self.stops = stops
        self.include = include_in_output
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""  # all detokenized output so far
        self.released = 0  # characters of `text` already sent

    def feed(self, new_text: str, final: bool) -> tuple[str, bool]:
        """Add detokenized text; return (text to send now, whether a stop string matched)."""
        searched_from = max(0, len(self.text) - self.hold)
        self.text += new_text
        end = None
        for stop in self.stops:
            at = self.text.find(stop, searched_from)
            if at != -1 and (end is None or at < end[0]):
                end = (at, at + len(stop))
        if end is not None:
            cut = end[1] if self.include else end[0]
            out = self.text[self.released : cut]
            self.released = max(self.released, cut)
            return out, True
        upto = len(self.text) if final else max(self.released, len(self.text) - self.hold)
        out, self.released = self.text[self.released : upto], upto
        return out, False
