"""Rebuilding a tokenizer from the `tokenizer.ggml.*` metadata of a GGUF file.

A GGUF carries no tokenizer.json, only the vocabulary, merges, token types and special ids under
llama.cpp's key names. We rebuild the equivalent `tokenizers.Tokenizer`:
  - "gpt2": byte-level BPE; the pre-tokenizer (how text is split before merging) is chosen by
    `tokenizer.ggml.pre`, because each vocabulary was trained with its own split rule.
  - "llama": SentencePiece-style BPE with byte fallback; merges derived from the token scores
    (for Gemma, from the vocabulary order: its scores do not rank its merges).
"""

from __future__ import annotations

import logging
from functools import lru_cache

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from pagedllm.model_loader.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# llama.cpp's token types (gguf.TokenType)
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _split_then_bytes(regex: str):
    return lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _digits_then_gpt2():
    # SmolLM / StarCoder: every digit on its own, then GPT-2's split (as in their tokenizer.json).
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


# tokenizer.ggml.pre -> pre-tokenizer factory (llama.cpp's names).
_PRE_TOKENIZERS = {
    "default": _byte_level,
    "gpt-2": _byte_level,
    "smollm": _digits_then_gpt2,
    "starcoder": _digits_then_gpt2,
    "refact": _digits_then_gpt2,
    "codeshell": _digits_then_gpt2,
    "llama3": _split_then_bytes(_LLAMA3_SPLIT),
    "llama-v3": _split_then_bytes(_LLAMA3_SPLIT),
    "llama-bpe": _split_then_bytes(_LLAMA3_SPLIT),
    "smaug-bpe": _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": _split_then_bytes(_QWEN2_SPLIT),
    "deepseek-r1-qwen": _split_then_bytes(_QWEN2_SPLIT),
}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocabularies are spelled in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _gpt2_backend(meta: dict) -> BackendTokenizer:
    tokens, types = meta["tokens"], meta["token_types"]
    alphabet = set(bytes_to_unicode().values())
    vocab = {}
    for i, (tok, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind not in (_CONTROL, _USER_DEFINED) and not set(tok) <= alphabet:
            # A plain token written in raw UTF-8 rather than the byte alphabet: respell it.
            tok = "".join(bytes_to_unicode()[b] for b in tok.encode("utf-8"))
        vocab[tok] = i
    merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = meta.get("pre") or "default"
    if pre not in _PRE_TOKENIZERS:
        logger.warning("GGUF pre-tokenizer %r is not known here; using GPT-2's split", pre)
    backend.pre_tokenizer = _PRE_TOKENIZERS.get(pre, _byte_level)()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """A SentencePiece BPE vocabulary has no merges list: every split of a token into two tokens
    is a merge, ranked by the merged token's score (higher merges first), as HF derives them."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = []
    for tok, score in zip(tokens, scores, strict=True):
        local = [
            (tok[:k], tok[k:], score)
            for k in range(1, len(tok))
            if tok[:k] in vocab and tok[k:] in vocab
        ]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


# Gemma's SentencePiece vocabularies, whose GGUF files spell whitespace pieces with real spaces.
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")


def _sentencepiece_backend(meta: dict) -> BackendTokenizer:
    tokens, scores = meta["tokens"], meta.get("scores")
    if meta.get("architecture") in _GEMMA_ARCHS:
        # Runs of spaces ("  ") are stored with real spaces, but text reaches the model spelled
        # with "▁": respell them so merges can build them. And pieces merge in vocabulary order.
        tokens = ["▁" * len(t) if t and not t.strip(" ") else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    if scores is None:
        raise ValueError("GGUF 'llama' tokenizer without tokenizer.ggml.scores cannot be rebuilt")
    merges = (
        [tuple(m.split(" ", 1)) for m in meta["merges"]]
        if meta.get("merges")
        else _sentencepiece_merges(tokens, scores)
    )
    unk_id = meta.get("unk_token_id")
    bpe = models.BPE(
        vocab={tok: i for i, tok in enumerate(tokens)},
        merges=merges,
        unk_token=tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,  # <0xNN> tokens spell bytes the vocabulary lacks
    )
    backend = BackendTokenizer(bpe)
    prefix = meta.get("add_space_prefix", True)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend


_BUILDERS = {"gpt2": _gpt2_backend, "llama": _sentencepiece_backend}

# Gemma's turn format, for Gemma files without tokenizer.chat_template (llama.cpp's converter
# leaves it out when the source has none): system text opens the next user turn, and the
# assistant's role is called "model".
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}"
    "{% set ns.system = ns.system + (m['content'] | default('') | trim) + '\n\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
    "{{ ns.system + (m['content'] | default('') | trim) }}<end_of_turn>\n"
    "{% set ns.system = '' %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def tokenizer_from_gguf_metadata(meta: dict) -> Tokenizer:
    """`meta` holds the tokenizer.ggml.* values without the prefix (tokens, token_types, merges,
    scores, pre, model, *_token_id, add_bos_token, add_space_prefix) plus chat_template."""
    kind = meta.get("model")
    if kind not in _BUILDERS:
        raise ValueError(
            f"cannot rebuild a GGUF tokenizer of type {kind!r}; supported: {sorted(_BUILDERS)}"
        )
    backend = _BUILDERS[kind](meta)
    tokens, types = meta["tokens"], meta["token_types"]
    # Control tokens (<|im_start|>, <s>) must stay whole in text and vanish on skip_special_tokens;
    # user-defined ones stay whole but are ordinary text. They keep their ids: they're in the vocab
    # (one the builder respelled is not, and is left to the merges).
    in_vocab = [backend.token_to_id(t) == i for i, t in enumerate(tokens)]
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k, ok in zip(tokens, types, in_vocab, strict=True)
            if k == _CONTROL and ok
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k, ok in zip(tokens, types, in_vocab, strict=True)
            if k == _USER_DEFINED and ok
        ]
    )

    def token(key: str) -> str | None:
        i = meta.get(f"{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    # llama.cpp adds BOS to sentencepiece vocabularies unless the file says otherwise.
    add_bos = meta.get("add_bos_token", kind == "llama")
    chat_template = meta.get("chat_template")
    if chat_template is None and meta.get("architecture") in _GEMMA_ARCHS:
        chat_template = GEMMA_CHAT_TEMPLATE if "<start_of_turn>" in tokens else None
    return Tokenizer(
        backend,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        add_bos_token=add_bos,
        chat_template=chat_template,
    )
