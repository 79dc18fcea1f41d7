"""Decode attention alone: one layer's attention over the paged cache, per backend.

A decode-only step of ``--batch-size`` sequences with ``--context-len`` cached tokens each
(SmolLM2-135M's heads by default: 9 query heads over 3 KV heads of 64), timed as one
layer's `AttentionBackend.forward` (the KV store included, the step plan not: that is made
once per step for all layers). Backends alternate, ``--repeats`` times, and the median of
wall and CPU milliseconds per call is printed; CPU time is the fairer figure on a shared
machine.

Run from the repository root:
    python -m benchmarks.decode_attention --backends torch,cpu --batch-size 64 --context-len 256
    python -m benchmarks.decode_attention --shared-prefix 448 --context-len 600 [--no-cascade]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from paged_llm.layers.attention import AttentionMetadata, KVCacheLayout, get_attention_backend


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="torch,cpu")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--context-len", type=int, default=256)
    parser.add_argument("--num-heads", type=int, default=9)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument(
        "--shared-prefix", type=int, default=0, help="leading tokens all sequences share"
    )
    parser.add_argument(
        "--no-cascade",
        action="store_true",
        help="attend shared prefixes per sequence, not once for all (the backends' cascade)",
    )
    parser.add_argument("--calls", type=int, default=30, help="timed calls per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    return parser.parse_args(argv)


def decode_step(args: argparse.Namespace) -> tuple[AttentionMetadata, dict[str, torch.Tensor]]:
    """The metadata and tensors of one decode-only step over a random paged cache."""
    dtype = getattr(torch, args.dtype)
    blocks_per_seq = -(-(args.context_len + 1) // args.block_size)
    shared_blocks = args.shared_prefix // args.block_size
    own_blocks = blocks_per_seq - shared_blocks
    num_blocks = shared_blocks + args.batch_size * own_blocks + 1
    own = torch.randperm(num_blocks - 1 - shared_blocks) + 1 + shared_blocks
    tables = torch.cat(
        [
            torch.arange(1, shared_blocks + 1).expand(args.batch_size, -1),
            own[: args.batch_size * own_blocks].view(args.batch_size, own_blocks),
        ],
        dim=1,
    ).to(torch.int32)
    seq_lens = [args.context_len + 1] * args.batch_size
    positions = torch.tensor(seq_lens) - 1
    slots = tables[torch.arange(args.batch_size), positions // args.block_size].long()
    shape = (args.num_kv_heads, num_blocks, args.block_size, args.head_dim)
    metadata = AttentionMetadata(
        slot_mapping=slots * args.block_size + positions % args.block_size,
        query_start_loc=torch.arange(args.batch_size + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        query_start_loc_cpu=list(range(args.batch_size + 1)),
        seq_lens_cpu=seq_lens,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        block_size=args.block_size,
    )
    tensors = {
        "query": torch.randn(args.batch_size, args.num_heads, args.head_dim, dtype=dtype),
        "key": torch.randn(args.batch_size, args.num_kv_heads, args.head_dim, dtype=dtype),
        "value": torch.randn(args.batch_size, args.num_kv_heads, args.head_dim, dtype=dtype),
        "key_cache": torch.randn(shape, dtype=dtype),
        "value_cache": torch.randn(shape, dtype=dtype),
    }
    return metadata, tensors


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    metadata, tensors = decode_step(args)
    backends = {}
    for name in args.backends.split(","):
        backend = get_attention_backend(name)
        dtype = tensors["query"].dtype
        backend.setup(
            KVCacheLayout(args.num_kv_heads, args.head_dim, dtype, dtype, has_sliding_window=False)
        )
        backend.cascade = not args.no_cascade
        backends[name] = (backend, backend.prepare(metadata))
    wall: dict[str, list[float]] = {name: [] for name in backends}
    cpu: dict[str, list[float]] = {name: [] for name in backends}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for name, (backend, plan) in backends.items():
                metadata.backend_data = plan
                backend.forward(**tensors, metadata=metadata, scale=0.125, sliding_window=None)
                wall_start, cpu_start = time.perf_counter(), time.process_time()
                for _ in range(args.calls):
                    backend.forward(**tensors, metadata=metadata, scale=0.125, sliding_window=None)
                wall[name].append((time.perf_counter() - wall_start) / args.calls * 1e3)
                cpu[name].append((time.process_time() - cpu_start) / args.calls * 1e3)
    results = {
        name: {"wall_ms": statistics.median(wall[name]), "cpu_ms": statistics.median(cpu[name])}
        for name in backends
    }
    print(
        f"decode attention, one layer: {args.batch_size} seqs x {args.context_len} tokens, "
        f"{args.num_heads}/{args.num_kv_heads} heads x {args.head_dim}, {args.dtype}, "
        f"{args.threads} threads, shared prefix {args.shared_prefix}"
        + (", no cascade" if args.no_cascade else "")
    )
    for name, result in results.items():
        print(f"  {name:>6}: {result['wall_ms']:.3f} ms wall, {result['cpu_ms']:.3f} ms CPU")
    return results


if __name__ == "__main__":
    main()
