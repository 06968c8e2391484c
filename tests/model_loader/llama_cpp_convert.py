"""llama.cpp's own converter (convert_hf_to_gguf.py) for tests: GGUF files written exactly as
users get them, from tiny transformers models.

The converter comes from the llama-cpp-python source distribution on PyPI that
benchmarks/build_llama_server.sh builds llama-server from (the same pinned version): the
tarball it downloaded, or a fresh download (package registries are reachable in CI). Only the
converter's Python files are unpacked, beside the build's tree, never into it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PEERS_DIR = Path(os.environ.get("PAGEDLLM_PEERS_DIR", Path.home() / ".cache/pagedllm/peers"))
VERSION = re.search(
    r"LLAMA_CPP_PYTHON_VERSION:-([0-9.]+)", (REPO / "benchmarks/build_llama_server.sh").read_text()
).group(1)
# What the converter needs from llama.cpp's tree: itself, its per-architecture modules and the
# gguf package it writes with (newer than the installed one: it knows every architecture).
_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
# The converter imports sentencepiece before it looks for a tokenizer.model; a model without
# one (these have tokenizer.json) never uses it, so an empty stand-in lets the converter go on
# to tokenizer.json, as it does where sentencepiece is installed. Not a pagedllm dependency.
_SENTENCEPIECE_STANDIN = "class SentencePieceProcessor:\n    pass\n"


def converter() -> Path:
    """The directory holding convert_hf_to_gguf.py, unpacked (and downloaded) if needed."""
    root = PEERS_DIR / f"converter-{VERSION}"
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    src = PEERS_DIR / "src"
    sdist = src / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.is_file():
        src.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
             "-d", str(src), f"llama-cpp-python=={VERSION}"],
            check=True, capture_output=True,
        )  # fmt: skip
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    partial = root.with_name(root.name + ".partial")
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            rel = m.name.removeprefix(prefix)
            if m.name.startswith(prefix) and rel.startswith(_MEMBERS) and (m.isfile() or m.isdir()):
                m.name = rel
                members.append(m)
        tar.extractall(partial, members=members, filter="data")
    (partial / "standins").mkdir(exist_ok=True)
    (partial / "standins/sentencepiece.py").write_text(_SENTENCEPIECE_STANDIN)
    partial.rename(root)  # whole or not at all: a second run never sees half a tree
    return root


def convert(hf_dir: Path, out: Path, outtype: str = "f32", *options: str) -> Path:
    """`hf_dir` (a saved model with its tokenizer) -> `out`, a GGUF of `outtype` (f32, q8_0...),
    with the converter's other `options` (--no-mtp)."""
    root = converter()
    env = {**os.environ, "PYTHONPATH": str(root / "standins")}
    env.pop("NO_LOCAL_GGUF", None)  # the converter's own gguf-py, not the installed package
    result = subprocess.run(
        [sys.executable, str(root / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(out),
         "--outtype", outtype, *options],
        cwd=root, env=env, capture_output=True, text=True,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{result.stderr[-4000:]}")
    return out
