"""StreamingLLM (Xiao et al., 2023): attention sinks + a recent window, exact; the rest dropped.

Initial pages (the first `sink_tokens`, plus protected spans) and the `recent_tokens` window
are kept exactly (`recent_bits` is ignored: StreamingLLM does not quantize); a page that ages
into Mid is dropped whole, whatever the budget, so the cache holds a constant number of tokens
however long the sequence grows. The window size (`recent_tokens`) is the method's only knob.
"""

from .base import MidEncoding, Policy


class Streaming(Policy):
    name = "streaming"
    reads_queries = False  # ranks nothing

    def recent_bits(self):
        return None

    def mid_encoding(self) -> MidEncoding:
        return MidEncoding(evict=True, max_tokens=0)  # no Mid token survives: nothing to rank
