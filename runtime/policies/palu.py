"""Palu-like (Chang et al., 2024): low-rank only, no eviction, no quantization.

Mid keys and values are stored as float16 coefficients on each kv-head's principal directions,
the smallest rank holding `key_energy` / `value_energy` of the energy (Config sets both to 0.9
when neither is given; fitted once per sequence and layer by the store, on the first prefill
chunk, never refitted). Palu proper factorises the K/V projection weights offline and stores a
latent before RoPE; this fits the directions on the rotated keys of the sequence's first chunk,
which holds their energy on that chunk but loses it as RoPE turns later keys away (topo refits
at each doubling, `Lifecycle.next_refit`; Palu here does not). Recent, Initial and Terminal
are exact; `mid_bits` and `recent_bits` are ignored. No token is dropped, so a byte budget is not enforced: the bytes follow from the
energies.
"""

from .base import MidEncoding, Policy


class Palu(Policy):
    name = "palu"
    projects = True

    def recent_bits(self):
        return None

    def mid_encoding(self) -> MidEncoding:
        return MidEncoding(project=True)  # Config gives palu its energies: it always projects
