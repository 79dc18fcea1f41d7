"""vLLM's examples/offline_inference/data_parallel.py on one node: a launcher starts one
process per data-parallel rank, each with its own LLM over its share of the prompts."""

import os
from multiprocessing import Process

from vllm import LLM, SamplingParams
from vllm.utils import FlexibleArgumentParser, get_open_port


def main(model, dp_size, local_dp_rank, global_dp_rank, dp_master_ip, dp_master_port, tp_size):
    os.environ["VLLM_DP_RANK"] = str(global_dp_rank)
    os.environ["VLLM_DP_SIZE"] = str(dp_size)
    os.environ["VLLM_DP_MASTER_IP"] = dp_master_ip
    os.environ["VLLM_DP_MASTER_PORT"] = str(dp_master_port)
    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    prompts_per_rank = len(prompts) // dp_size
    start = global_dp_rank * prompts_per_rank
    prompts = prompts[start : start + prompts_per_rank] or ["Placeholder"]
    sampling_params = SamplingParams(
        temperature=0.8, top_p=0.95, max_tokens=[4, 6][global_dp_rank % 2]
    )
    llm = LLM(
        model=model,
        tensor_parallel_size=tp_size,
        enforce_eager=True,
        enable_expert_parallel=True,
        max_model_len=128,
    )
    outputs = llm.generate(prompts, sampling_params, use_tqdm=False)
    for output in outputs:
        print(
            f"DP rank {global_dp_rank}, Prompt: {output.prompt!r}, "
            f"Generated tokens: {len(output.outputs[0].token_ids)}",
            flush=True,
        )


if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="Data Parallel Inference")
    parser.add_argument("--model", type=str, required=True)
    parser.add_argument("--dp-size", type=int, default=2)
    parser.add_argument("--tp-size", type=int, default=1)
    args = parser.parse_args()
    dp_master_ip, dp_master_port = "127.0.0.1", get_open_port()
    procs = []
    for rank in range(args.dp_size):
        proc = Process(
            target=main,
            args=(args.model, args.dp_size, rank, rank, dp_master_ip, dp_master_port, args.tp_size),
        )
        proc.start()
        procs.append(proc)
    exit_code = 0
    for proc in procs:
        proc.join()
        if proc.exitcode:
            exit_code = proc.exitcode
    exit(exit_code)
