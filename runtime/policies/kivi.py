"""KIVI-like (Liu et al., 2024): quantization only, no eviction.

Mid keys are quantized per channel (statistics over the page's tokens, so a page is KIVI's
token group) and values per token, at `mid_bits` (2 or 4; 8 works too; None = no
quantization, an exact cache). Recent is KIVI's full-precision residual window
(`recent_tokens`, exact; `recent_bits` is ignored), Initial and Terminal are exact.
No token is ever dropped, so a byte budget (`target_ratio`/`layer_budget_bytes`) is not
enforced: the bytes follow from `mid_bits`.
"""

from .base import MidEncoding, Policy


class KIVI(Policy):
    name = "kivi"

    def recent_bits(self):
        return None

    def mid_encoding(self) -> MidEncoding:
        bits = self.config.mid_bits
        return MidEncoding(key_bits=bits, value_bits=bits)
