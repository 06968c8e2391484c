"""The workloads of `python -m benchmarks.speculative`: chat requests whose answers repeat text
of their prompts (where drafting from the request's own tokens works), and the ShareGPT-shaped
random-token workload (where it does not). Seeded: the same requests in every run.

- `code-edit`: a small Python module and an instruction to rename one function; the answer is
  the module again.
- `rewrite`: a paragraph to repeat word for word.
- `multi-turn`: an assistant's earlier list of facts, then a request to repeat it with one more.
- `random`: token ids drawn uniformly, ShareGPT's lengths (pagedllm.bench.workload), ignore_eos.
"""

from __future__ import annotations

import random

from pagedllm.bench.workload import workload_from_tokenizer, workload_tokenizer

WORKLOADS = ("code-edit", "rewrite", "multi-turn", "random")
SENTENCES = [
    "The kettle boiled while the rain kept falling on the tin roof.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Every morning the baker opens the shop at half past six.",
    "The river froze early that winter, and the ferry stopped running.",
    "Block tables map each sequence's logical blocks to physical ones.",
    "She wrote the results in a notebook with a green cover.",
    "Continuous batching lets new requests join a running batch.",
    "The old lighthouse keeper counted ships until midnight.",
    "Prefix caching reuses the blocks of prompts seen before.",
    "Two trains left the station ten minutes apart.",
    "The museum closes on Mondays for cleaning and repairs.",
    "Speculative decoding verifies several guessed tokens at once.",
]
TOPICS = ["the moon", "honey bees", "volcanoes", "the Roman empire", "coral reefs", "glaciers"]
NAMES = ["load", "parse", "merge", "split", "score", "render", "flush", "fetch", "clean", "index"]


def _module(rng: random.Random) -> tuple[str, str]:
    names = rng.sample(NAMES, 4)
    body = "\n\n".join(
        f"def {name}(items, limit={rng.randint(2, 9)}):\n"
        f"    result = []\n"
        f"    for item in items[:limit]:\n"
        f"        result.append(item * {rng.randint(2, 7)})\n"
        f"    return result"
        for name in names
    )
    return body, names[rng.randrange(4)]


def chat_requests(kind: str, num: int, seed: int) -> list[list[dict]]:
    """`num` chat conversations of a repetitive workload."""
    rng = random.Random(f"{kind}-{seed}")
    conversations = []
    for _ in range(num):
        if kind == "code-edit":
            code, name = _module(rng)
            text = (f"Rename the function {name} to {name}_all and output the whole module, "
                    f"nothing else.\n\n{code}")  # fmt: skip
            conversations.append([{"role": "user", "content": text}])
        elif kind == "rewrite":
            paragraph = " ".join(rng.sample(SENTENCES, 5))
            text = f"Repeat this paragraph word for word:\n\n{paragraph}"
            conversations.append([{"role": "user", "content": text}])
        else:  # multi-turn
            topic = rng.choice(TOPICS)
            facts = "\n".join(f"{i + 1}. {s}" for i, s in enumerate(rng.sample(SENTENCES, 5)))
            conversations.append([
                {"role": "user", "content": f"List five facts about {topic}."},
                {"role": "assistant", "content": facts},
                {"role": "user", "content": "Repeat your list exactly, then add a sixth fact."},
            ])  # fmt: skip
    return conversations


def requests_for(engine, kind: str, num: int, seed: int, max_tokens: int):
    """(prompt token ids, max_tokens, ignore_eos) per request of workload `kind`."""
    tokenizer = engine.tokenizer
    if kind == "random":
        requests = workload_from_tokenizer(
            num, workload_tokenizer(engine), vocab_size=engine.model_config.vocab_size,
            seed=seed, max_model_len=engine.max_model_len,
        )  # fmt: skip
        return [
            (list(prompt), min(output_len, max_tokens), True) for prompt, output_len in requests
        ]
    out = []
    for messages in chat_requests(kind, num, seed):
        prompt = tokenizer.apply_chat_template(messages)
        out.append((tokenizer.encode(prompt, add_special_tokens=False), max_tokens, False))
    return out
