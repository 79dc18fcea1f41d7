"""Quantized weights take their own bytes, and no float copy of them stays resident."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import smollm2_gguf_path

# Measured in a fresh process each: the resident-size growth of LLM(...) over a process
# that has imported everything, with the same small KV cache.
_PROBE = """
import json, sys
from paged_llm import LLM
from paged_llm.layers.linear import Linear

def rss_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096

before = rss_bytes()
llm = LLM(sys.argv[1], quantization=json.loads(sys.argv[2]), max_model_len=256,
          kv_cache_memory_bytes=16 * 2**20)
grown = rss_bytes() - before
model = llm.engine.model_runner.model
projections = sum(
    m.in_features * m.out_features for m in model.modules()
    if isinstance(m, Linear) and m is not model.lm_head
)
print(json.dumps({"growth": grown, "projection_params": projections}))
"""


def _resident_growth(quantization: str | None) -> dict[str, int]:
    completed = subprocess.run(
        [sys.executable, "-c", _PROBE, str(smollm2_gguf_path()), json.dumps(quantization)],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, int] = json.loads(completed.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def float32_growth() -> dict[str, int]:
    return _resident_growth(None)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("quantization", "bytes_per_param"),
    # int8: one byte a weight (scales are 1/576th of that). gguf: SmolLM2's file is Q4_1,
    # kept as 4-bit codes plus a float32 scale and offset per 32: 0.75 bytes a weight.
    [("int8", 1.0), ("gguf", 0.75)],
)
def test_quantized_smollm2_saves_its_projections_float_bytes(
    quantization: str, bytes_per_param: float, float32_growth: dict[str, int]
) -> None:
    float32 = float32_growth
    quantized = _resident_growth(quantization)
    expected_saving = float32["projection_params"] * (4 - bytes_per_param)
    # NOTE: before quantized layers created their own tensors, a float copy stayed resident
    # and int8 saved 79% of this.
    assert float32["growth"] - quantized["growth"] >= 0.9 * expected_saving
