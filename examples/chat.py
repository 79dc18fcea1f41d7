"""A multi-turn conversation with `LLM.chat`: each reply is appended to the history, and
the whole history is sent again for the next turn.

    python examples/chat.py                   # a scripted three-turn conversation
    python examples/chat.py --interactive     # type your own turns (empty line to quit)

Prefix caching makes the repeated history cheap: its KV-cache blocks from the previous
turn are found and reused, and only the new tokens are computed.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from paged_llm import LLM, SamplingParams
from paged_llm.model_files import DEFAULT_MODEL

SCRIPT = [
    "Hi! I'm planning a picnic this weekend. What food should I bring?",
    "Good ideas. What drinks would go well with that?",
    "And what games could we play afterwards?",
]


def user_turns(interactive: bool, num_turns: int) -> Iterator[str]:
    if not interactive:
        yield from SCRIPT[:num_turns]
        return
    while text := input("you> ").strip():
        yield text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--turns", type=int, default=len(SCRIPT), help="scripted turns to run")
    parser.add_argument("--interactive", action="store_true")
    args = parser.parse_args()

    llm = LLM(args.model, max_model_len=args.max_model_len)
    params = SamplingParams(
        temperature=0.3, top_p=0.9, repetition_penalty=1.2, max_tokens=args.max_tokens, seed=0
    )
    conversation = [{"role": "system", "content": "You are a friendly, concise assistant."}]
    for text in user_turns(args.interactive, args.turns):
        conversation.append({"role": "user", "content": text})
        (output,) = llm.chat(conversation, params, use_tqdm=False)
        reply = output.outputs[0].text.strip()
        conversation.append({"role": "assistant", "content": reply})
        if not args.interactive:
            print(f"you> {text}")
        print(f"assistant> {reply}")
        print(
            f"    [{len(output.prompt_token_ids)} prompt tokens, "
            f"{output.num_cached_tokens} of them from the prefix cache]\n"
        )


if __name__ == "__main__":
    main()
