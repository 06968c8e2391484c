"""model_loader/gguf_file.py against the gguf package's own reader: the same metadata (every value
type, arrays of each, an array of arrays), the same tensors (float, integer and quantized types,
offsets, shapes, bytes) on a file its writer made, and on the packaged default model."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from pagedllm.model_loader.gguf_file import GGUFFile

Q = gguf.GGMLQuantizationType


def _reference(path):
    r = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return r, meta


def _same(path, flattened=()):
    """`flattened`: keys of arrays of arrays, which gguf's reader flattens into one list."""
    ours = GGUFFile(path)
    r, meta = _reference(path)
    assert ours.metadata.keys() == meta.keys()
    for key, value in meta.items():
        if key in flattened:
            assert [x for inner in ours.metadata[key] for x in inner] == value
            continue
        assert ours.metadata[key] == value, key
        assert type(ours.metadata[key]) is type(value), key
    assert ours.data_offset == r.data_offset
    assert len(ours.tensors) == len(r.tensors)
    for a, b in zip(r.tensors, ours.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset
        )  # fmt: skip
        assert tuple(a.shape.tolist()) == b.shape
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype
        assert np.array_equal(a.data, b.data), a.name
        assert not b.data.flags.writeable  # a view of the read-only map, not a copy
    return ours


def test_every_value_type_and_tensor_kind(tmp_path):
    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float32("t.f32", 1.5)
    w.add_float64("t.f64", -2.25e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_string("t.empty", "")
    w.add_array("t.strs", ["a", "", "Ġthe", "\n", "日本"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False])
    w.add_array("t.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 8)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 4, 8)).astype(np.float16))
    w.add_tensor("i32", np.arange(5, dtype=np.int32))
    for qtype in (Q.Q4_0, Q.Q8_0):
        floats = rng.standard_normal((4, 64)).astype(np.float32)
        w.add_tensor(qtype.name, gguf.quants.quantize(floats, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = _same(path, flattened=("t.nested",))
    assert ours.metadata["t.strs"][4] == "日本" and ours.metadata["t.nested"] == [[1, 2], [3]]
    q4 = next(t for t in ours.tensors if t.name == "Q4_0")
    assert q4.shape == (64, 4) and q4.data.shape == (4, 2 * 18)  # 2 blocks of 18 bytes a row
    assert ours.data_offset % 32 == 0


@pytest.mark.slow
def test_the_default_model():
    from pagedllm.model_loader.loader import resolve_model

    ours = _same(resolve_model(None))
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152


def test_big_endian_and_unknown_versions_are_refused(tmp_path):
    cases = ((b"\x00\x00\x00\x03", "big-endian"), (b"\x01\x00\x00\x00", "version 1 is not"))
    for version, match in cases:
        path = tmp_path / "v.gguf"
        path.write_bytes(b"GGUF" + version + bytes(16))
        with pytest.raises(ValueError, match=match):
            GGUFFile(path)
