"""The fp8 formats a KV cache can be stored in, as the kernels need to know them."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    """The grid of one fp8 format: its spacing is ``2 ** (exponent - mantissa_bits)`` for
    values with that exponent, and ``2 ** (min_exponent - mantissa_bits)`` below it."""

    mantissa_bits: int
    min_exponent: int
    max: float


# float8_e4m3fn has no infinities: a value cast past 448 becomes NaN, so stores saturate.
FP8_FORMATS: dict[torch.dtype, Fp8Format] = {
    torch.float8_e4m3fn: Fp8Format(3, -6, torch.finfo(torch.float8_e4m3fn).max),
    torch.float8_e5m2: Fp8Format(2, -14, torch.finfo(torch.float8_e5m2).max),
}
