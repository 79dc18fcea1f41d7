"""Prefix caching: many questions behind one long shared system prompt.

The same requests run twice, with ``enable_prefix_caching=True`` and ``False``. With
caching, the KV-cache blocks of the shared system prompt are computed once and then found
by hash for every later request, so only each question's own tokens are prefilled.
Blocks are registered as they are computed, so requests that start in the same step as
the first one still compute the prefix themselves; a smaller --max-num-batched-tokens
starts fewer requests together.

    python examples/prefix_caching.py
    python examples/prefix_caching.py --num-questions 4 --max-tokens 4 --system-paragraphs 3
"""

from __future__ import annotations

import argparse
import time

from paged_llm import LLM, SamplingParams
from paged_llm.model_files import DEFAULT_MODEL

SYSTEM_PROMPT = """You are the customer-support assistant of Harbor Lane Outfitters, an \
outdoor-equipment shop with three stores and an online catalogue. Answer briefly, politely \
and only from the policies below. If the policies do not cover a question, say so and offer \
to connect the customer with a human colleague.

Opening hours. The Riverside store opens Monday to Friday from 9:00 to 19:00 and on \
Saturdays from 10:00 to 18:00; it is closed on Sundays. The Old Town store opens every day \
from 10:00 to 20:00. The Hillcrest outlet opens Thursday to Sunday from 11:00 to 17:00. On \
public holidays all stores close at 15:00, and all stores are closed on New Year's Day.

Returns. Unused items in their original packaging can be returned within 30 days of \
purchase for a full refund to the original payment method. Items bought at the Hillcrest \
outlet can be exchanged within 14 days but not refunded. Worn footwear, opened food \
products, gas canisters and custom-cut rope cannot be returned. Online orders can be \
returned by post with the prepaid label in the parcel or in any store; refunds are issued \
within five working days of the return arriving at our warehouse.

Warranty. Tents, backpacks and sleeping bags carry a two-year warranty against \
manufacturing defects. Our own Harbor Lane brand carries a lifetime warranty on seams and \
zips. Damage from misuse, fire, or normal wear is not covered. Customers need the receipt \
or the order number; a photograph of the defect speeds up online claims.

Repairs. The Old Town store runs a repair workshop: zip replacement costs 18 euros, seam \
re-taping costs 25 euros, and tent-pole replacement costs 12 euros per section. Repairs \
usually take seven to ten days; customers get a text message when the item is ready. \
Items not collected within 90 days are donated to a local scouting group.

Rentals. Tents, stoves and kayaks can be rented at the Riverside store. A two-person tent \
costs 15 euros per day or 60 euros per week, a stove costs 5 euros per day, and a kayak \
costs 40 euros per day including a paddle and a life jacket. A deposit of 100 euros is \
required for every rental, and rentals must be booked at least two days in advance.

Delivery. Online orders over 50 euros ship free within the country; smaller orders cost \
4.90 euros. Standard delivery takes two to four working days; express delivery costs 9.90 \
euros and arrives the next working day when ordered before 14:00. We do not ship gas \
canisters or knives by post; they can be collected in a store.

Loyalty programme. Members collect one point per euro spent and get a 10 euro voucher for \
every 200 points. Vouchers are valid for one year. Members also get early access to the \
spring and autumn sales and a free annual tent check at the Old Town workshop.

Payment. We accept cash, debit and credit cards, and mobile payments in all stores, and \
cards and bank transfer online. Gift cards are sold in any amount from 10 to 500 euros and \
are valid for three years."""

QUESTIONS = [
    "Is the Riverside store open on Sunday?",
    "Can I return worn hiking boots?",
    "How long is the warranty on a tent?",
    "How much does it cost to replace a zip?",
    "How much is a kayak rental for one day?",
    "Do you ship gas canisters?",
    "When do stores close on public holidays?",
    "How many points do I need for a voucher?",
    "Can I get a refund for something I bought at the Hillcrest outlet?",
    "How long does express delivery take?",
    "What payment methods do you accept online?",
    "How long are gift cards valid?",
    "What happens to repairs that are never collected?",
    "Is there a deposit for rentals?",
    "How much is shipping for a 30 euro order?",
    "Which store has a repair workshop?",
    "How long do refunds for online returns take?",
    "What are the opening hours of the Old Town store?",
    "Does the warranty cover fire damage?",
    "How far in advance must I book a tent rental?",
    "What does a stove rental cost?",
    "Do loyalty vouchers expire?",
    "Can I return an online order in a store?",
    "How much does re-taping a seam cost?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-questions", type=int, default=len(QUESTIONS))
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, help="tokens per step")
    parser.add_argument(
        "--system-paragraphs",
        type=int,
        help="keep only the first N paragraphs of the system prompt",
    )
    args = parser.parse_args()

    system_prompt = "\n\n".join(SYSTEM_PROMPT.split("\n\n")[: args.system_paragraphs])

    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.num_questions)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for enabled in (True, False):
        with LLM(
            args.model,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=enabled,
        ) as llm:
            prompts = [
                llm.render_chat(
                    [{"role": "system", "content": system_prompt}, {"role": "user", "content": q}]
                )
                for q in questions
            ]
            started = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - started
            metrics = llm.get_engine_metrics()
            num_prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
            print(
                f"enable_prefix_caching={enabled!s:5}: {len(prompts)} requests, "
                f"{num_prompt_tokens} prompt tokens, {seconds:.2f} s, "
                f"prefix-cache hit rate {metrics.prefix_cache_hit_rate:.0%}"
            )


if __name__ == "__main__":
    main()
