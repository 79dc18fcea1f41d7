"""LoRA on the CPU: `LoRASlots.add_to`'s grouped path against a per-token gather (BGMV)
and a masked dense product.

Times one call of each path for each of a layer's four adapted projections at SmolLM2-135M's
shapes (hidden 576, intermediate 1536, 9 query / 3 KV heads of 64; q/k/v and gate/up
packed), and their sum for the layer, in a decode batch (one token per sequence) and a
prefill chunk (64-token sequences), with 1, 4 and 8 adapters given to the sequences round
robin (ranks alternating 8 and 16, every slice adapted):

- grouped: the engine's torch path: per adapter, one shrink matmul and one expand matmul per
  slice; a group whose tokens are contiguous adds in place, a scattered one gathers its rows
  and adds with ``index_add_``.
- bgmv: per token, ``torch.bmm`` against its slot's ``A`` (gathered), then its slot's ``B``
  (gathered), one add per slice for the whole batch: vLLM's punica BGMV, written in torch.
- masked: every slot's adapter for every token in one shrink matmul, masked to the token's
  slot, then one expand matmul per slice against all slots' ``B`` (laid out once, as an
  engine would at load): a fixed number of operators whatever the mix.

All paths add the same values (checked before timing). The paths alternate call by call,
``--calls`` times each, and the median wall milliseconds of a call is printed: on a shared
machine the median of single calls shrugs off the calls another job interrupted.

Run from the repository root:
    python -m benchmarks.lora_kernels --threads 2
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from benchmarks.report import format_table
from paged_llm.layers.lora import LoRABatch, LoRAShard, LoRASlots, LoRAState

# SmolLM2-135M: hidden 576, intermediate 1536, 9 query and 3 KV heads of 64.
HIDDEN, INTERMEDIATE, Q_SIZE, KV_SIZE = 576, 1536, 9 * 64, 3 * 64
# Projection -> (input features, output rows of each packed slice).
PROJECTIONS: dict[str, tuple[int, tuple[int, ...]]] = {
    "qkv_proj": (HIDDEN, (Q_SIZE, KV_SIZE, KV_SIZE)),
    "o_proj": (Q_SIZE, (HIDDEN,)),
    "gate_up_proj": (HIDDEN, (INTERMEDIATE, INTERMEDIATE)),
    "down_proj": (INTERMEDIATE, (HIDDEN,)),
}
MAX_RANK = 16


@dataclass(frozen=True)
class StepShape:
    """A step's tokens: ``num_seqs`` sequences of ``tokens_per_seq`` tokens each."""

    name: str
    num_seqs: int
    tokens_per_seq: int


STEP_SHAPES = (StepShape("decode", 32, 1), StepShape("prefill", 8, 64))


def bgmv_add_to(slots: LoRASlots, out: torch.Tensor, x: torch.Tensor) -> None:
    """Every token's adapter through a per-token gather of its slot's matrices."""
    batch = slots.state.batch
    if batch is None:
        return
    token_slots = batch.token_slots
    # NOTE: a base-model token (-1) reads slot 0 and is masked to zero after the shrink.
    gathered = token_slots.clamp(min=0)
    lora_a = slots.lora_a.flatten(1, 2)[gathered]  # [T, slices * rank, in]
    shrunk = torch.bmm(lora_a, x.unsqueeze(2))  # [T, slices * rank, 1]
    shrunk = shrunk * (token_slots >= 0).to(shrunk.dtype)[:, None, None]
    num_slices, rank = slots.lora_a.shape[1], slots.lora_a.shape[2]
    shrunk = shrunk.view(-1, num_slices, rank)
    lora_b = slots.lora_b[gathered]  # [T, out, rank]
    for slice_index in range(num_slices):
        start, stop = slots.slice_offsets[slice_index], slots.slice_offsets[slice_index + 1]
        delta = torch.bmm(lora_b[:, start:stop], shrunk[:, slice_index].unsqueeze(2))
        out[:, start:stop] += delta.squeeze(2)


class MaskedDense:
    """Every slot's adapter for every token, masked to the token's own slot: one shrink
    matmul against all slots' ``A``, a multiply by the tokens' one-hot slots, and one expand
    matmul per slice against all slots' ``B``. The slots' matrices are laid out for this
    once, as an engine would keep them (at load), not in the timed call."""

    def __init__(self, slots: LoRASlots) -> None:
        self.slots = slots
        num_slots, _, rank, in_features = slots.lora_a.shape
        # [slices * slots * rank, in] and, per slice, [slots * rank, rows].
        self.lora_a = slots.lora_a.transpose(0, 1).reshape(-1, in_features).contiguous()
        self.lora_b = [
            slots.lora_b[:, start:stop].permute(0, 2, 1).reshape(num_slots * rank, -1).contiguous()
            for start, stop in zip(slots.slice_offsets, slots.slice_offsets[1:], strict=False)
        ]

    def __call__(self, out: torch.Tensor, x: torch.Tensor) -> None:
        batch = self.slots.state.batch
        if batch is None:
            return
        num_slots, num_slices, rank, _ = self.slots.lora_a.shape
        one_hot = batch.token_slots[:, None] == torch.arange(num_slots)  # -1: all False
        shrunk = (x @ self.lora_a.T).view(-1, num_slices, num_slots, rank)
        shrunk = shrunk * one_hot[:, None, :, None]
        for slice_index, lora_b in enumerate(self.lora_b):
            start, stop = self.slots.slice_offsets[slice_index : slice_index + 2]
            out[:, start:stop] += shrunk[:, slice_index].flatten(1) @ lora_b


def make_slots(
    in_features: int, slice_sizes: tuple[int, ...], num_adapters: int, seed: int
) -> LoRASlots:
    """The slots of one projection, ``num_adapters`` of them loaded with random adapters of
    ranks alternating 8 and 16 that adapt every slice."""
    # Each slice's rows start at 0 of its own checkpoint projection (no tensor parallelism).
    shard = LoRAShard(tuple((0, size) for size in slice_sizes), (0, in_features))
    slots = LoRASlots(
        LoRAState(use_triton=False),
        shard,
        num_adapters,
        MAX_RANK,
        torch.float32,
        torch.device("cpu"),
    )
    generator = torch.Generator().manual_seed(seed)
    for slot in range(num_adapters):
        rank = 8 if slot % 2 == 0 else 16
        for slice_index, size in enumerate(slice_sizes):
            lora_a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            lora_b = torch.randn(size, rank, generator=generator) / rank**0.5
            slots.load(slot, slice_index, lora_a, lora_b)
    return slots


def step_token_slots(shape: StepShape, num_adapters: int) -> np.ndarray:
    """Each token's slot: the adapters go to the sequences round robin."""
    seq_slots = np.arange(shape.num_seqs, dtype=np.int64) % num_adapters
    return np.repeat(seq_slots, shape.tokens_per_seq)


AddTo = Callable[[torch.Tensor, torch.Tensor], None]


def time_call(add_to: AddTo, out: torch.Tensor, x: torch.Tensor) -> float:
    """Milliseconds of one call of a path."""
    started = time.perf_counter()
    add_to(out, x)
    return (time.perf_counter() - started) * 1e3


def paths(slots: LoRASlots) -> dict[str, AddTo]:
    """Each path's ``add_to(out, x)`` on these slots."""
    return {
        "grouped": slots.add_to,
        "bgmv": functools.partial(bgmv_add_to, slots),
        "masked": MaskedDense(slots),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--adapters", default="1,4,8", help="comma-separated numbers of adapters in a step"
    )
    parser.add_argument(
        "--calls", type=int, default=31, help="timed calls of each path, alternating"
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    return parser.parse_args(argv)


def time_projection(
    shape: StepShape, num_adapters: int, projection: str, calls: int
) -> dict[str, float]:
    """Median milliseconds per call of each path, for one projection in one step."""
    in_features, slice_sizes = PROJECTIONS[projection]
    token_slots = step_token_slots(shape, num_adapters)
    slots = make_slots(in_features, slice_sizes, num_adapters, seed=num_adapters)
    slots.state.batch = LoRABatch.from_token_slots(token_slots, torch.device("cpu"))
    x = torch.randn(len(token_slots), in_features)
    add_tos = paths(slots)
    outs = {path: torch.zeros(len(token_slots), sum(slice_sizes)) for path in add_tos}
    for path, add_to in add_tos.items():
        add_to(outs[path], x)
        torch.testing.assert_close(outs[path], outs["grouped"])
    ms: dict[str, list[float]] = {path: [] for path in add_tos}
    for _ in range(calls):
        for path, add_to in add_tos.items():
            ms[path].append(time_call(add_to, outs[path], x))
    return {path: statistics.median(times) for path, times in ms.items()}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    results: list[dict[str, Any]] = []
    with torch.inference_mode():
        for shape in STEP_SHAPES:
            for num_adapters in (int(n) for n in args.adapters.split(",")):
                rows: list[dict[str, Any]] = [
                    {
                        "step": shape.name,
                        "tokens": shape.num_seqs * shape.tokens_per_seq,
                        "adapters": num_adapters,
                        "projection": projection,
                        "ms": time_projection(shape, num_adapters, projection, args.calls),
                    }
                    for projection in PROJECTIONS
                ]
                layer = {
                    **rows[0],
                    "projection": "layer (sum)",
                    "ms": {path: sum(row["ms"][path] for row in rows) for path in rows[0]["ms"]},
                }
                results += [*rows, layer]
    names = list(results[0]["ms"])
    print(
        f"LoRA add_to per call, float32, {args.threads} threads, median of {args.calls} calls of "
        "each path, alternating; decode: 32 sequences x 1 token, prefill: 8 sequences x 64 "
        "tokens; adapters round robin over the sequences"
    )
    print(
        format_table(
            ["step", "tokens", "adapters", "projection"]
            + [f"{name} ms" for name in names]
            + [f"{name} / grouped" for name in names[1:]],
            [
                [r["step"], r["tokens"], r["adapters"], r["projection"]]
                + [r["ms"][name] for name in names]
                + [r["ms"][name] / r["ms"]["grouped"] for name in names[1:]]
                for r in results
            ],
        )
    )
    return results


if __name__ == "__main__":
    main()
