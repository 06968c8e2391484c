"""Loading a Hugging Face model directory: its weights (*.safetensors, sharded too; gpt-oss's MXFP4
experts as codes, mxfp4.py), with the config and tokenizer hf_config.py reads."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from pagedllm.model_loader.hf_config import config_from_file, load_hf_tokenizer, read_json
from pagedllm.model_loader.loaded_model import LazyCodes, LazyWeights, LoadedModel
from pagedllm.model_loader.mxfp4 import mxfp4_checkpoint

# Pickle checkpoints: loading one runs whatever code it carries, so they need an explicit opt-in.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
_NOT_WEIGHTS = {"training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth"}


def _index_files(index: Path) -> list[str]:
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index} has no weight_map of tensor names to files")
    names = sorted(set(weight_map.values()))
    if any(os.path.basename(n) != n for n in names):  # nothing outside the model directory
        raise ValueError(f"{index} names files outside its directory")
    for name in names:
        if not (index.parent / name).is_file():
            raise FileNotFoundError(f"{index} lists {name}, which is missing from {index.parent}")
    return names


def _load_safetensors_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, ValueError, OSError) as e:
        raise ValueError(
            f"{path} is not a readable safetensors file (truncated or corrupt?): {e}"
        ) from None


def _pickle_files(directory: Path) -> list[str]:
    for index_name in ("pytorch_model.bin.index.json", "model.bin.index.json"):
        if (directory / index_name).exists():
            return _index_files(directory / index_name)
    return sorted(
        p.name
        for p in directory.iterdir()
        if p.suffix in PICKLE_SUFFIXES and p.name not in _NOT_WEIGHTS and p.is_file()
    )


def _load_pickle_file(path: Path) -> dict[str, torch.Tensor]:
    """torch.load with weights_only=True: its unpickler builds tensors and plain containers
    only, and refuses any other object (a payload) instead of running it."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=False)
    except Exception as e:  # noqa: BLE001 - UnpicklingError, RuntimeError, EOFError...
        raise ValueError(
            f"{path} cannot be loaded as plain tensors (weights_only=True): "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise ValueError(f"{path} does not hold a dict of tensor names to tensors")
    return state


def _open_safetensors(directory: Path, files: list[str]) -> dict:
    """Each tensor's name -> the safe_open handle of its file (which maps the file: nothing is
    read until a tensor is asked for)."""
    handles = {}
    for name in files:
        path = directory / name
        try:
            handle = safe_open(path, "pt")
        except (SafetensorError, ValueError, OSError) as e:
            raise ValueError(
                f"{path} is not a readable safetensors file (truncated or corrupt?): {e}"
            ) from None
        for key in handle.keys():  # noqa: SIM118 - safe_open has keys(), no iteration
            if not key.endswith("rotary_emb.inv_freq"):
                handles[key] = handle
    return handles


def _lazy_safetensors(directory: Path, files: list[str]) -> LazyWeights:
    """Each tensor read from its file when asked for."""
    handles = _open_safetensors(directory, files)
    return LazyWeights({k: functools.partial(h.get_tensor, k) for k, h in handles.items()})


def _safetensors_files(directory: Path) -> list[str]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        return _index_files(index)
    return sorted(p.name for p in directory.glob("*.safetensors"))


def load_safetensors(
    directory: Path, allow_pickle: bool = False, lazy: bool = False
) -> dict[str, torch.Tensor] | LazyWeights:
    """The weights of a HF directory: *.safetensors (sharded too). A directory with only pickle
    checkpoints (pytorch_model.bin, *.pt, *.pth) is refused unless `allow_pickle`. `lazy`:
    safetensors read one tensor at a time as the model takes them (pickles load whole)."""
    files = _safetensors_files(directory)
    load = _load_safetensors_file
    if not files:
        pickles = _pickle_files(directory)
        if not pickles:
            raise FileNotFoundError(f"no *.safetensors weights in {directory}")
        if not allow_pickle:
            raise ValueError(
                f"{directory} holds only pickle checkpoints ({', '.join(pickles)}), and loading "
                "a pickle can run any code it carries, so they are refused. Convert them to "
                "safetensors (e.g. save_pretrained(..., safe_serialization=True)), or pass "
                "--allow-pickle-checkpoints (EngineArgs.allow_pickle_checkpoints) to load them "
                "with torch.load(weights_only=True), which builds tensors only"
            )
        files, load = pickles, _load_pickle_file
    elif lazy:
        return _lazy_safetensors(directory, files)
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load(directory / name))
    # Old checkpoints store the rotary inv_freq buffer; it's derived from the config, not a weight.
    return {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}


def _load_mxfp4(directory: Path, num_experts: int, keep_codes: bool):
    """gpt-oss's MXFP4 experts (mxfp4.py): always read lazily, never all in float at once."""
    files = _safetensors_files(directory)
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {directory} (MXFP4 checkpoint)")
    try:
        return mxfp4_checkpoint(_open_safetensors(directory, files), num_experts, keep_codes)
    except ValueError as e:
        raise ValueError(f"{directory}: {e}") from None


def load_hf_dir(
    path: str | os.PathLike,
    tokenizer: str | os.PathLike | None = None,
    allow_pickle: bool = False,
    lazy: bool = False,
    with_tokenizer: bool = True,
    keep_codes: bool = False,
) -> LoadedModel:
    """`allow_pickle`: load pytorch_model.bin / *.pt weights (with torch.load(weights_only=True))
    when the directory has no safetensors; refused by default. `lazy`: see load_safetensors.
    `keep_codes`: also give gpt-oss's MXFP4 experts as int6 codes (LoadedModel.quant_codes)."""
    directory = Path(path)
    if not (directory / "config.json").exists():
        raise FileNotFoundError(
            f"{directory} has no config.json: not a Hugging Face model directory"
        )
    config = config_from_file(directory / "config.json")
    codes = LazyCodes()
    # hf_config.py sets quantized_codes for OpenAI's MXFP4 experts only (it refuses other
    # quant_methods): lazy whatever `lazy` says, as a float copy of them is what does not fit.
    if config.quantized_codes:
        weights, codes = _load_mxfp4(directory, config.num_experts, keep_codes)
    else:
        weights = load_safetensors(directory, allow_pickle, lazy)
    return LoadedModel(
        config=config,
        weights=weights,
        quant_codes=codes,
        tokenizer=load_hf_tokenizer(tokenizer or directory) if with_tokenizer else None,
        name=directory.name,
        source=str(directory),
    )
