"""load_model(lazy=True), what a tensor-parallel rank loads with: the same tensors as the eager
load, read one at a time when asked for."""

import pytest
import torch

from pagedllm.model_loader import load_model
from pagedllm.model_loader.loaded_model import LazyWeights
from tests.conftest import save_tiny_llama
from tests.model_loader.tiny_gguf import gpt2_vocab, random_hf_weights, write_tiny_llama

VOCAB = len(gpt2_vocab()[0])


@pytest.fixture(scope="module", params=["safetensors", "gguf"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("lazy")
    if request.param == "gguf":
        return str(write_tiny_llama(path / "tiny.gguf", random_hf_weights(VOCAB)))
    save_tiny_llama(path)
    return str(path)


def test_lazy_weights_equal_the_eager_ones(checkpoint):
    eager = load_model(checkpoint).weights
    lazy = load_model(checkpoint, lazy=True).weights
    assert isinstance(lazy, LazyWeights) and not isinstance(eager, LazyWeights)
    assert sorted(lazy) == sorted(eager) and len(lazy) == len(eager)
    for name, tensor in lazy.items():
        assert torch.equal(tensor, eager[name]), name
    # Each access reads the file again: nothing is kept.
    name = next(iter(lazy))
    assert lazy[name] is not lazy[name]
    lazy.clear()
    assert len(lazy) == 0


def test_asking_whether_a_weight_is_there_reads_nothing():
    """`name in weights` is a key look-up: the model loader asks it of every code tensor before
    reading it once (Mapping's own __contains__ decoded the tensor to answer)."""
    reads = []
    weights = LazyWeights({"w": lambda: reads.append("w") or torch.zeros(1)})
    assert "w" in weights and "v" not in weights
    assert reads == []
    weights["w"]
    assert reads == ["w"]
