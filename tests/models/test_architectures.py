"""Every supported architecture vs transformers on a tiny random model: saved with save_pretrained
(safetensors) or written to GGUF as llama.cpp's converter would, loaded by pagedllm's loaders,
built from the registry, then run through the paged cache. fp32 logits within 1e-4 (prefill, and
every decode step) and the same 32 greedy tokens as HF generate(do_sample=False)."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model_loader import load_gguf, load_hf_dir
from pagedllm.model_loader.hf_config import config_from_hf
from pagedllm.models import get_model_class, supported_architectures
from tests.model_loader.tiny_gguf import gpt2_vocab, write_gguf_from_hf
from tests.models.paged_runner import PagedRunner, Req

transformers = pytest.importorskip("transformers")

VOCAB = len(gpt2_vocab()[0])  # the GGUF files carry this tokenizer
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,  # small weights give near-uniform attention, a weak test
    bos_token_id=None,
    eos_token_id=None,  # greedy decoding runs the full length
    pad_token_id=None,
)
# Qwen3-Next's and Qwen3.5's: a Gated DeltaNet (2 key heads, 4 value heads) before gated
# attention; and experts beside a gated shared expert.
GATED_DELTANET = dict(
    head_dim=16, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
)  # fmt: skip
MOE_SHARED = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)  # fmt: skip
# name -> (config class, model class, config overrides). Windows are smaller than the prompts
# plus 32 new tokens, so they change the result.
ARCHS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=1)),
    "qwen2_sliding": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        # layer 0 attends fully, layer 1 slides (i >= max_window_layers)
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(head_dim=32, tie_word_embeddings=True),  # head_dim * heads != hidden_size
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=4.0,
            num_key_value_heads=4,
        ),
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(partial_rotary_factor=0.5, sliding_window=9),
    ),
    # Mixtures of experts: more experts than a prompt's tokens pick, so some go unused.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    # Not renormalised, and a dense first layer (neither is in llama.cpp's qwen3moe graph).
    "qwen3_moe_dense_layer": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=4, num_experts_per_tok=3, moe_intermediate_size=48, mlp_only_layers=[0]),
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
    # Hybrid: a Mamba-2 layer (2 groups of 4 heads) before an attention layer without RoPE,
    # Granite's multipliers; and the same with RoPE.
    "granite_hybrid": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(
            num_local_experts=0,
            layer_types=["mamba", "attention"],
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_n_groups=2,
            mamba_d_state=16,
            shared_intermediate_size=96,
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=3.0,
        ),  # fmt: skip
    ),
    "granite_hybrid_rope": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(
            num_local_experts=0,
            layer_types=["attention", "mamba"],
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_d_state=8,
            shared_intermediate_size=64,
            position_embedding_type="rope",
        ),  # fmt: skip
    ),
    # Granite 4.0-H tiny's kind: experts (the softmax of the top k logits) beside its MLP.
    "granite_hybrid_moe": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            layer_types=["mamba", "attention"],
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_d_state=16,
            shared_intermediate_size=48,
            residual_multiplier=0.5,
        ),  # fmt: skip
    ),
    # Gated DeltaNet layers before gated attention with partial RoPE, (1 + w) norms; experts
    # beside a gated shared expert (Qwen3-Next, Qwen3.5-MoE; the latter's attention first, its
    # key heads as many as its value heads) or a dense MLP (Qwen3.5).
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(GATED_DELTANET, **MOE_SHARED),
    ),
    "qwen3_5": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(
            GATED_DELTANET,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000.0,
                partial_rotary_factor=0.5,
                mrope_section=[2, 1, 1],
                mrope_interleaved=True,
            ),
        ),  # fmt: skip
    ),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        dict(
            GATED_DELTANET,
            layer_types=["full_attention", "linear_attention"],
            linear_num_key_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=16,
            **MOE_SHARED,
        ),
    ),
    # Sinks, biases, alternating sliding / full layers, YaRN with a small original context.
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=6,
            swiglu_limit=2.0,  # small enough that the clamps bite on these weights
            rope_parameters=dict(
                rope_type="yarn",
                factor=8.0,
                beta_fast=32.0,
                beta_slow=1.0,
                rope_theta=150000.0,
                original_max_position_embeddings=32,
                truncate=False,
            ),
        ),  # fmt: skip
    ),
}
PROMPTS = [[3, 17, 42, 8, 99, 5, 61], [7, 1, 2], [11, 23, 5, 90, 64, 33, 2, 8, 77, 15, 4, 40, 9]]
MAX_NEW_TOKENS = 32
ATOL = 1e-4


@pytest.fixture(autouse=True)
def _inference_mode():
    with torch.inference_mode():
        yield


def random_hf_model(config_cls: str, model_cls: str, fields: dict):
    """A transformers model of random weights (seed 0). It starts norms at 1 (at 0 where they
    weigh by 1 + w) and biases and attention sinks at 0: those are randomised about their
    starts too, so that loading them is tested."""
    config = getattr(transformers, config_cls)(**fields)
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(p + 0.2 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif pname.endswith("sinks"):
                p.copy_(torch.randn_like(p))
    return hf


@functools.cache
def hf_reference(name: str):
    """(hf model, [(greedy tokens, per-step logits)] per prompt), each prompt generated alone."""
    config_cls, model_cls, overrides = ARCHS[name]
    hf = random_hf_model(config_cls, model_cls, {**BASE, **overrides})
    expected = []
    for prompt in PROMPTS:
        out = hf.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
            min_new_tokens=MAX_NEW_TOKENS,
            return_dict_in_generate=True,
            output_logits=True,
        )
        expected.append((out.sequences[0, len(prompt) :].tolist(), [x[0] for x in out.logits]))
    return hf, expected


def load(name: str, source: str, tmp_path):
    hf, _ = hf_reference(name)
    tmp_path.mkdir(parents=True, exist_ok=True)
    if source == "hf_dir":
        hf.save_pretrained(tmp_path)
        loaded = load_hf_dir(tmp_path)
    else:
        loaded = load_gguf(write_gguf_from_hf(tmp_path / "model.gguf", hf))
    want = type(hf).__name__
    if source == "gguf" and want in ("MistralForCausalLM", "MixtralForCausalLM"):
        want = "LlamaForCausalLM"  # llama.cpp converts these to its llama architecture
    assert loaded.config.architecture == want
    model = get_model_class(loaded.config.architecture)(loaded.config)
    model.load_weights(loaded.weights)
    return model.eval(), loaded


# Not qwen2_sliding from GGUF: llama.cpp's converter stores no Qwen2 sliding window (nor layer
# types), so such a file holds a full-attention model; nor a dense layer among experts.
HF_ONLY = ("qwen2_sliding", "qwen3_moe_dense_layer", "gpt_oss", "granite_hybrid",
           "granite_hybrid_rope", "granite_hybrid_moe", "qwen3_next", "qwen3_5",
           "qwen3_5_moe")  # fmt: skip
CASES = [
    (n, s) for n in sorted(ARCHS) for s in ("hf_dir", "gguf") if (s, n in HF_ONLY) != ("gguf", True)
]


def checkpoint_state(tensors, model) -> dict[str, torch.Tensor]:
    """Named tensors (hf's state_dict, or a loaded checkpoint's) by the names the model takes
    them: its weight_renames, then its split_weight (transformers 5 holds each layer's experts
    stacked; a checkpoint may hold them apart). A tied head's copy left out."""
    state = {}
    for name, tensor in tensors.items():
        if model.ignored_weights.match(name):
            continue
        for pattern, replacement in model.weight_renames:
            name = re.sub(pattern, replacement, name)
        for part, t in model.split_weight(name, tensor):
            if part.endswith("gate_up_proj.weight"):  # fused in some files, apart in others
                gate, up = t.chunk(2)
                state[part.replace("gate_up_proj", "gate_proj")] = gate
                state[part.replace("gate_up_proj", "up_proj")] = up
            else:
                state[part] = t
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


@pytest.mark.parametrize("name,source", CASES)
def test_matches_transformers(name, source, tmp_path):
    hf, expected = hf_reference(name)
    model, loaded = load(name, source, tmp_path)
    state = checkpoint_state(hf.state_dict(), model)
    weights = checkpoint_state(loaded.weights, model)
    assert set(weights) == set(state)
    for k, v in state.items():  # GGUF: q/k rows un-permuted where llama.cpp permutes them
        assert torch.equal(weights[k].float(), v), k

    # Prefill: all prompts in one flattened batch, logits of every position.
    runner = PagedRunner(model, block_size=4)
    hidden = runner.step([(Req(list(p), len(p)), len(p)) for p in PROMPTS])
    logits = model.compute_logits(hidden)
    start = 0
    for prompt in PROMPTS:
        want = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits[start : start + len(prompt)], want, atol=ATOL, rtol=0)
        start += len(prompt)

    # Greedy decoding, prompts prefilled in chunks next to other requests' decode steps, block
    # tables spanning many 4-token blocks.
    runner = PagedRunner(model, block_size=4, seed=len(name))
    reqs = runner.generate(PROMPTS, MAX_NEW_TOKENS, chunk_sizes=[3, 2, 5])
    for i, (req, (hf_tokens, hf_logits)) in enumerate(zip(reqs, expected, strict=True)):
        assert req.token_ids[len(PROMPTS[i]) :] == hf_tokens, f"prompt {i}"
        for step, (ours, theirs) in enumerate(zip(req.logits, hf_logits, strict=True)):
            torch.testing.assert_close(
                ours, theirs, atol=ATOL, rtol=0, msg=f"prompt {i} step {step}"
            )


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_whole_engine_gives_hf_greedy_tokens(name, tmp_path):
    """LLM (scheduler, KV cache manager, runner) on the saved model, chunked prefill and all."""
    hf, expected = hf_reference(name)
    hf.save_pretrained(tmp_path)
    llm = LLM(
        dtype="float32",
        model=str(tmp_path),
        kv_cache_memory="4MiB",
        block_size=4,
        max_num_batched_tokens=7,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, min_tokens=MAX_NEW_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [tokens for tokens, _ in expected]


@pytest.mark.parametrize("backend", ["sdpa", "torch"])
@pytest.mark.parametrize("name", ["mistral", "qwen2_sliding"])
def test_sliding_window_on_both_backends(name, backend, tmp_path):
    """The window is what makes these differ from full attention, on either backend."""
    hf, expected = hf_reference(name)
    model, loaded = load(name, "hf_dir", tmp_path)
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == [loaded.config.layer_sliding_window(i) for i in range(2)]
    assert any(windows)
    model = get_model_class(loaded.config.architecture)(loaded.config, attention_backend=backend)
    model.load_weights(loaded.weights)
    reqs = PagedRunner(model, block_size=2).generate(PROMPTS, MAX_NEW_TOKENS, [4, 3, 6])
    for req, (hf_tokens, hf_logits) in zip(reqs, expected, strict=True):
        assert req.token_ids[req.num_prompt_tokens :] == hf_tokens
        torch.testing.assert_close(
            torch.stack(req.logits), torch.stack(hf_logits), atol=ATOL, rtol=0
        )


def test_configs_read_from_each_architecture(tmp_path):
    qwen2 = load("qwen2_sliding", "hf_dir", tmp_path / "q2")[1].config
    assert qwen2.qkv_bias and not qwen2.attention_bias
    assert [qwen2.layer_sliding_window(i) for i in range(2)] == [None, 6]
    qwen3 = load("qwen3", "gguf", tmp_path / "q3")[1].config
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.tie_word_embeddings
    granite = load("granite", "gguf", tmp_path / "g")[1].config
    assert (
        granite.embedding_multiplier,
        granite.residual_multiplier,
        granite.attention_multiplier,
        granite.logits_scaling,
    ) == (3.0, 0.5, pytest.approx(0.1), 4.0)
    phi3 = load("phi3", "gguf", tmp_path / "p")[1].config
    assert phi3.partial_rotary_factor == 0.5 and phi3.sliding_window == 9
    mistral = load("mistral", "hf_dir", tmp_path / "m")[1].config
    assert mistral.sliding_window == 5 and mistral.layer_types is None


def test_mistral_gguf_without_a_window_key_loads_as_full_attention(tmp_path):
    # llama.cpp's converter writes Mistral as a plain "llama" file without its sliding window.
    hf, _ = hf_reference("mistral")
    path = write_gguf_from_hf(tmp_path / "m.gguf", hf, sliding_window_key=False)
    config = load_gguf(path).config
    assert config.architecture == "LlamaForCausalLM" and config.sliding_window is None


def test_unknown_architecture_lists_the_supported_ones():
    supported = supported_architectures()
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"} <= set(supported)
    assert {"Qwen3ForCausalLM", "GraniteForCausalLM", "Phi3ForCausalLM"} <= set(supported)
    listed = ", ".join(supported)
    with pytest.raises(ValueError, match=f"'GPT2LMHeadModel'; supported: {listed}$"):
        get_model_class("GPT2LMHeadModel")
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16}
    base |= {"num_hidden_layers": 1, "num_attention_heads": 2}
    with pytest.raises(ValueError, match=f"GPT2LMHeadModel.*supported: {listed}$"):
        config_from_hf({**base, "architectures": ["GPT2LMHeadModel"]})


def test_unsupported_rope_scaling_is_a_clear_error():
    cfg = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 10, "hidden_size": 8}
    cfg |= {"intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    cfg["rope_scaling"] = {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'longrope'"):
        config_from_hf(cfg)


def test_qwen2_gguf_reads_the_same_in_transformers(tmp_path):
    """An independent check of the tensor layout (no q/k permutation for this NEOX-RoPE arch):
    transformers' own GGUF reader gives the same weights."""
    hf, _ = hf_reference("qwen2")
    write_gguf_from_hf(tmp_path / "q.gguf", hf)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="q.gguf", dtype=torch.float32
    ).state_dict()
    ours = load_gguf(tmp_path / "q.gguf").weights
    assert set(ours) == set(ref)
    for k, v in ours.items():
        assert torch.equal(v, ref[k]), k


def test_transformers4_style_configs():
    base = {"vocab_size": 10, "hidden_size": 16, "intermediate_size": 16}
    base |= {"num_hidden_layers": 4, "num_attention_heads": 2}
    # Qwen2.5 ships sliding_window set but disabled; enabled, layers >= max_window_layers slide.
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32768}
    qwen |= {"max_window_layers": 2, "use_sliding_window": False}
    assert config_from_hf(qwen).sliding_window is None
    cfg = config_from_hf({**qwen, "use_sliding_window": True})
    assert [cfg.layer_sliding_window(i) for i in range(4)] == [None, None, 32768, 32768]
    phi = {**base, "architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.75}
    cfg = config_from_hf({**phi, "rope_theta": 250000.0, "rope_scaling": None})
    assert cfg.partial_rotary_factor == 0.75 and cfg.rope_theta == 250000.0
    assert cfg.rope_scaling is None and cfg.sliding_window is None
    granite = config_from_hf({**base, "architectures": ["GraniteForCausalLM"]})
    assert granite.attention_multiplier == 1.0  # HF's default, not head_dim**-0.5


def test_phi3_gguf_with_longrope_factors_is_a_clear_error(tmp_path):
    hf, _ = hf_reference("phi3")
    factors = np.ones(4, dtype=np.float32)  # rotary_dim / 2
    extra = {"rope_factors_long.weight": factors, "rope_factors_short.weight": factors}
    path = write_gguf_from_hf(tmp_path / "p.gguf", hf, extra_tensors=extra)
    with pytest.raises(ValueError, match="LongRoPE"):
        load_gguf(path)


def add_mtp_layer(directory, layer: int) -> None:
    """A multi-token-prediction block in a saved Qwen3-Next / Qwen3.5 checkpoint, as the
    released ones carry (`mtp.*`, decoder layer `layer`'s weights copied, a projection and
    norms): pagedllm leaves it unread, llama.cpp's converter writes it as an extra block."""
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(path)
    stem = next(k for k in tensors if k.endswith("embed_tokens.weight")).removesuffix(
        "embed_tokens.weight"
    )
    hidden = tensors[stem + "norm.weight"].shape[0]
    prefix = f"{stem}layers.{layer}."
    extra = {"mtp.layers.0." + k.removeprefix(prefix): v.clone()
             for k, v in tensors.items() if k.startswith(prefix)}  # fmt: skip
    extra["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        extra[f"mtp.{norm}.weight"] = torch.randn(hidden)
    save_file({**tensors, **extra}, path, metadata={"format": "pt"})


def test_qwen3_5s_multimodal_checkpoint_runs_its_text_model(tmp_path):
    """Qwen3.5 is released as Qwen3_5ForConditionalGeneration (text under
    model.language_model, a vision tower, multi-token-prediction layers): pagedllm runs the text
    model, reading neither of the others, and its greedy tokens equal transformers'."""
    from tests.conftest import hf_greedy

    _, _, text = ARCHS["qwen3_5"]
    fields = dict(
        text_config={**BASE, **text},
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=64, num_position_embeddings=64),
    )  # fmt: skip
    hf = random_hf_model("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", fields)
    hf.save_pretrained(tmp_path)
    add_mtp_layer(tmp_path, 1)
    loaded = load_hf_dir(tmp_path)
    assert loaded.config.architecture == "Qwen3_5ForCausalLM"
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory="4MiB", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [
        hf_greedy(hf, p, MAX_NEW_TOKENS) for p in PROMPTS
    ]
