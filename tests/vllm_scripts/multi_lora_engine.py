"""vLLM's examples/offline_inference/multilora_inference.py: two adapters (one slot, so they
take turns) and the base model, fed to LLMEngine one request per step.
Usage: multi_lora_engine.py MODEL ADAPTER_DIR"""

import sys

from vllm import EngineArgs, LLMEngine, RequestOutput, SamplingParams
from vllm.lora.request import LoRARequest

SQL_PROMPT = (
    "[user] Write a SQL query to answer the question based on the table schema.\n\n"
    " context: CREATE TABLE table_name_74 (icao VARCHAR, airport VARCHAR)\n\n"
    " question: Name the ICAO for lilongwe international airport [/user] [assistant]"
)


def create_test_prompts(
    lora_path: str,
) -> list[tuple[str, SamplingParams, LoRARequest | None]]:
    return [
        (
            "A robot may not injure a human being",
            SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1, max_tokens=8),
            None,
        ),
        (
            "To be or not to be,",
            SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2, max_tokens=8),
            None,
        ),
        (
            SQL_PROMPT,
            SamplingParams(
                temperature=0.0, logprobs=1, prompt_logprobs=1, max_tokens=8, stop_token_ids=[32003]
            ),
            LoRARequest("sql-lora", 1, lora_path),
        ),
        (
            SQL_PROMPT,
            SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1, max_tokens=8),
            LoRARequest("sql-lora2", 2, lora_path),
        ),
    ]


def process_requests(
    engine: LLMEngine, test_prompts: list[tuple[str, SamplingParams, LoRARequest | None]]
) -> list[RequestOutput]:
    finished = []
    request_id = 0
    while test_prompts or engine.has_unfinished_requests():
        if test_prompts:
            prompt, sampling_params, lora_request = test_prompts.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params, lora_request=lora_request)
            request_id += 1
        for request_output in engine.step():
            if request_output.finished:
                print(request_output)
                finished.append(request_output)
    return finished


engine = LLMEngine.from_engine_args(
    EngineArgs(
        model=sys.argv[1],
        enable_lora=True,
        max_loras=1,
        max_lora_rank=8,
        max_cpu_loras=2,
        max_num_seqs=256,
        max_model_len=128,
    )
)
finished = process_requests(engine, create_test_prompts(sys.argv[2]))
