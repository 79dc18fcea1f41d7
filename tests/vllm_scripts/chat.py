"""vLLM's examples/offline_inference/basic/chat.py (with its utils.py's two helpers here): the
engine's flags from `EngineArgs.add_cli_args` on the parser itself, sampling flags and a
``--chat-template-path`` of the script's own, and `LLM(**vars(args))`."""

from argparse import Namespace

from vllm import LLM, EngineArgs, SamplingParams
from vllm.utils import FlexibleArgumentParser


def add_sampling_params_args(parser: FlexibleArgumentParser) -> FlexibleArgumentParser:
    defaults = SamplingParams()
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--temperature", type=float, default=defaults.temperature)
    parser.add_argument("--top-p", type=float, default=defaults.top_p)
    parser.add_argument("--top-k", type=int, default=defaults.top_k)
    return parser


def del_sampling_params_args(args: Namespace) -> Namespace:
    del args.max_tokens, args.temperature, args.top_p, args.top_k
    return args


conversation = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {"role": "user", "content": "Write an essay about the importance of higher education."},
]


def main(args: Namespace):
    chat_template_path = args.chat_template_path
    del args.chat_template_path

    sampling_params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
    )
    args = del_sampling_params_args(args)

    llm = LLM(**vars(args))
    one = llm.chat(conversation, sampling_params, use_tqdm=False)
    # A batch of conversations in one call.
    batch = llm.chat([conversation for _ in range(3)], sampling_params, use_tqdm=True)
    templated = None
    if chat_template_path:
        with open(chat_template_path) as f:
            chat_template = f.read()
        templated = llm.chat(
            conversation, sampling_params, use_tqdm=False, chat_template=chat_template
        )
    for output in one + batch:
        print(f"Prompt: {output.prompt!r}\nGenerated text: {output.outputs[0].text!r}")
    llm.shutdown()
    return one, batch, templated


if __name__ == "__main__":
    parser = FlexibleArgumentParser()
    parser = EngineArgs.add_cli_args(parser)
    parser = add_sampling_params_args(parser)
    parser.set_defaults(model="meta-llama/Llama-3.2-1B-Instruct")
    parser.add_argument("--chat-template-path", type=str, default=None)
    args = parser.parse_args()
    one, batch, templated = main(args)
