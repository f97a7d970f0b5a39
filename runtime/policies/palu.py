"""Palu-like (Chang et al., 2024): low-rank only, no eviction, no quantization.

Mid keys and values are stored as float16 coefficients on each kv-head's principal directions,
the smallest rank holding `key_energy` / `value_energy` of the energy (Config sets both to 0.9
when neither is given; fitted once per sequence and layer by the store, on the first prefill
chunk). Palu proper factorises the K/V projection
weights offline; this fits the directions on the sequence itself, which is at least as good
for the same rank. Recent, Initial and Terminal are exact; `mid_bits` and `recent_bits` are
ignored. No token is dropped, so a byte budget is not enforced: the bytes follow from the
energies.
"""

from .base import MidEncoding, Policy


class Palu(Policy):
    name = "palu"

    def __init__(self, config):
        super().__init__(config)
        if (config.key_energy is None) != (config.value_energy is None):
            raise ValueError(
                f"policy 'palu' projects keys and values alike: set both key_energy and value_energy or neither, "
                f"got key_energy={config.key_energy!r}, value_energy={config.value_energy!r}"
            )

    def recent_bits(self):
        return None

    def mid_encoding(self) -> MidEncoding:
        return MidEncoding(project=True)  # Config gives palu its energies: it always projects
