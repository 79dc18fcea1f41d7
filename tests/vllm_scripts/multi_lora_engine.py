"""The loop of vLLM's examples/offline_inference/multilora_inference.py, with a LoRA adapter
on one request: paged_llm runs no adapters yet, so add_request refuses it."""

import sys

from vllm import EngineArgs, LLMEngine, SamplingParams
from vllm.lora.request import LoRARequest

engine = LLMEngine.from_engine_args(EngineArgs(model=sys.argv[1], max_model_len=128))
params = SamplingParams(temperature=0.0, max_tokens=4)
engine.add_request("base", "[user] Write a SQL query [/user] [assistant]", params)
try:
    engine.add_request(
        "sql",
        "[user] Write a SQL query [/user] [assistant]",
        params,
        lora_request=LoRARequest("sql", 1, "/a"),
    )
except ValueError as error:
    refusal = str(error)
finished = []
while engine.has_unfinished_requests():
    finished += engine.step()
