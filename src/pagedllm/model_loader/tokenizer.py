"""Tokenizer: a `tokenizers.Tokenizer` plus the special tokens, BOS policy and chat template.

The BOS policy lives here, not in the backend's post-processor: the backend always encodes with
`add_special_tokens=False` and we prepend BOS when `add_bos_token` says so. That gives GGUF files
(which have no post-processor) and tokenizer.json files one behaviour. Encoders (BERT) are the
exception: their post-processor also appends tokens ([SEP]), so it adds their special tokens.
"""

from __future__ import annotations

from typing import Any

import tokenizers

from pagedllm.model_loader.chat_template import check_chat_template, render_chat_template


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
        post_processor_specials: bool = False,
    ):
        self.backend = backend
        # The backend's post-processor adds the special tokens (an encoder's [CLS] ... [SEP])
        # instead of the BOS policy
        self.post_processor_specials = post_processor_specials
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.unk_token = unk_token
        self.pad_token = pad_token
        self.bos_token_id = self._id_of(bos_token)
        self.eos_token_id = self._id_of(eos_token)
        self.unk_token_id = self._id_of(unk_token)
        self.pad_token_id = self._id_of(pad_token)
        self.add_bos_token = bool(add_bos_token) and self.bos_token_id is not None
        if chat_template is not None:
            check_chat_template(chat_template)  # a hostile model file fails at load
        self.chat_template = chat_template
        special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        named = (self.bos_token_id, self.eos_token_id, self.unk_token_id, self.pad_token_id)
        self.all_special_ids: set[int] = special | {i for i in named if i is not None}

    def _id_of(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"special token {token!r} is not in the tokenizer's vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.post_processor_specials:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(
                "this tokenizer has no chat template: pass chat_template=... or use plain "
                "completion (a prompt string) instead of chat messages"
            )
        variables = {**self.special_tokens_map, **kwargs}  # caller's kwargs win, as in HF
        text = render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **variables,
        )
        if not tokenize:
            return text
        # The template writes every special token it wants (BOS included); adding them again on top
        # would double BOS, so HF encodes rendered chats without special tokens, and so do we.
        return self.encode(text, add_special_tokens=False)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
            f"eos={self.eos_token!r}, "
            f"add_bos_token={self.add_bos_token}, chat_template={self.chat_template is not None})"
        )
