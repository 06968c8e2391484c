"""Loading a checkpoint's HF-named tensors into a model through its parameters' weight_loaders."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from pagedllm.layers.quantization import QuantWeight
from pagedllm.layers.weight_utils import default_weight_loader

EMBEDDING, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    codes: Mapping[str, QuantWeight] | None = None,
) -> None:
    """Each checkpoint tensor to its parameter's weight_loader: a part of a packed layer
    (model.packed_modules_mapping: q_proj is part 0 of qkv_proj) with its shard id. A Mapping is
    read one tensor at a time, and not at all for a layer built to take the checkpoint's codes
    (`codes`, by the same names) instead. Names are taken as the model's `weight_renames`
    rewrite them. A tied LM head is not read from the checkpoint (some store the copy); a
    quantized one loads its own codes from the embedding's tensor.

    Raises ValueError on an unknown name, a wrong shape, or a parameter left unloaded.
    """
    config, codes = model.config, codes or {}
    part_of = {
        part: (packed, i)
        for packed, parts in model.packed_modules_mapping.items()
        for i, part in enumerate(parts)
    }
    params = dict(model.named_parameters())  # a tied float head's weight appears once: embed's
    tied = config.tie_word_embeddings
    # (parameter, shard id) -> the checkpoint tensor that fills it
    required: dict[tuple[str, int | None], str] = {}
    for name in params:
        *path, module, kind = name.split(".")
        parts = model.packed_modules_mapping.get(module)
        for i, part in enumerate(parts or [module]):
            required[name, i if parts else None] = ".".join([*path, part, kind])
    if tied and LM_HEAD in params:  # a quantized tied head: its own codes, of the embedding
        required[LM_HEAD, None] = EMBEDDING
    loaded: set[tuple[str, int | None]] = set()

    def load(target: str, name: str, shard_id: int | None, read: Callable) -> None:
        param = params[target]
        module = model.get_submodule(target.rpartition(".")[0])
        method = getattr(module, "quant_method", None)
        takes_codes = getattr(method, "takes_codes", False) or getattr(module, "takes_codes", False)
        taken = takes_codes and name in codes
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        tensor = codes[name] if taken else read()  # a file's own errors name their tensor
        try:
            weight_loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"weight {name!r} {e}") from None
        loaded.update(k for k in required if k[0] == target and shard_id in (None, k[1]))

    renames = [(re.compile(p), r) for p, r in getattr(model, "weight_renames", ())]
    for name, read in _split(model, _entries(weights), renames):
        if name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed from the config
        if name == LM_HEAD and tied:
            continue  # some checkpoints store the tied copy too
        prefix, _, kind = name.rpartition(".")
        path, _, module = prefix.rpartition(".")
        packed, shard_id = part_of.get(module, (module, None))
        target = ".".join(p for p in (path, packed, kind) if p)
        if target not in params:
            raise ValueError(f"unexpected weight {name!r} for {config.architecture}")
        if name == EMBEDDING and tied and LM_HEAD in params:
            read = functools.cache(read)  # one read for the embedding and the head
            load(LM_HEAD, name, None, read)
        load(target, name, shard_id, read)
    missing = sorted({name for key, name in required.items() if key not in loaded})
    if missing:
        raise ValueError(f"weights missing from the checkpoint: {', '.join(missing)}")


def _split(model, entries, renames) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """Entries renamed by the model's weight_renames (and those its ignored_weights match left
    out, unread), and each tensor that holds several of the model's split by its split_weight
    (read at once: stacked experts)."""
    split = getattr(model, "split_weight", None)
    split_names = getattr(model, "split_names", None)
    ignored = getattr(model, "ignored_weights", None)
    for name, read in entries:
        if ignored is not None and ignored.match(name):
            continue
        for pattern, replacement in renames:
            name = pattern.sub(replacement, name)
        if split is None or not split_names.search(name):
            yield name, read
            continue
        for part, tensor in split(name, read()):
            yield part, functools.partial(lambda t: t, tensor)


def _entries(weights) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """(name, a function that reads the tensor): a Mapping's read only when called."""
    if isinstance(weights, Mapping):
        for name in weights:
            yield name, functools.partial(weights.__getitem__, name)
    else:
        for name, tensor in weights:
            yield name, functools.partial(lambda t: t, tensor)
