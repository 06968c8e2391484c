"""GGUF-rebuilt tokenizers vs transformers on the same file; chat templates; the sandbox."""

from __future__ import annotations

import gguf
import pytest
from jinja2.exceptions import SecurityError, TemplateError

from pagedllm.model_loader import Tokenizer, load_gguf_tokenizer

from .tiny_gguf import CHAT_TEMPLATE, gpt2_vocab, random_hf_weights, write_tiny_llama

transformers = pytest.importorskip("transformers")

TEXTS = [
    "hello world",
    "the the hello",
    "  leading, trailing and   multiple   spaces  ",
    "new\nlines\n\n\nand\ttabs\r\n",
    "digits 12345 and 3.14159, -7",
    "안녕하세요 세계, 日本語のテキスト, 中文",
    "emoji 🎉🚀 and 👩‍👩‍👧",
    "accents: café, naïve, Ærøskøbing, façade",
    "def f(x):\n    return x ** 2  # code\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "",
]


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2")
    write_tiny_llama(d / "tok.gguf", random_hf_weights(len(gpt2_vocab()[0])))
    return d


@pytest.fixture(scope="module")
def ours(gpt2_dir):
    return load_gguf_tokenizer(gpt2_dir / "tok.gguf")


@pytest.fixture(scope="module")
def hf(gpt2_dir):
    return transformers.AutoTokenizer.from_pretrained(gpt2_dir, gguf_file="tok.gguf")


@pytest.mark.parametrize("text", TEXTS)
def test_gpt2_encode_matches_transformers(ours, hf, text):
    assert ours.encode(text) == hf.encode(text)
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_gpt2_decode_round_trip(ours, hf, text):
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_special_tokens(ours, hf):
    assert ours.bos_token == "<|im_start|>" and ours.bos_token_id == 1
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_id == 2
    assert ours.add_bos_token is False
    assert ours.all_special_ids == {0, 1, 2}
    assert ours.vocab_size == len(hf) == len(gpt2_vocab()[0])
    assert ours.decode([1, 74, 2]) == "h"
    assert ours.convert_ids_to_tokens([1, 223, 277]) == ["<|im_start|>", "Ġ", "ĊĊĊ"]
    assert ours.convert_ids_to_tokens(2) == "<|im_end|>"


CONVERSATIONS = [
    [{"role": "user", "content": "hello"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "the world?"},
    ],
]

# Exercises what HF templates lean on: tojson (no HTML escaping, unicode kept), tools,
# raise_exception, namespace, loop controls, whitespace control, strftime_now's presence.
RICH_TEMPLATE = """
{%- set ns = namespace(system=none) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' %}{% set ns.system = m.content %}{% continue %}{% endif -%}
  {%- if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad: ' + m.role) }}{% endif -%}
<|im_start|>{{ m.role }}
{{ m.content | trim }}<|im_end|>
{% endfor -%}
{%- if ns.system is not none %}[system: {{ ns.system }}]{% endif -%}
{%- if tools %}
Tools: {{ tools | tojson }} / {{ tools[0] | tojson(indent=2) }}
{%- endif %}
{{ {"quote": "<a & 'b'>", "k": "한국어"} | tojson }} {{ bos_token }}{{ eos_token }}
{%- if strftime_now is defined %} time{% endif %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <now> & later",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, RICH_TEMPLATE], ids=["simple", "rich"])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["user", "system+turns"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    ours, hf, template, conversation, add_generation_prompt
):
    kwargs = dict(add_generation_prompt=add_generation_prompt, chat_template=template, tools=TOOLS)
    expected = hf.apply_chat_template(conversation, tokenize=False, **kwargs)
    assert ours.apply_chat_template(conversation, **kwargs) == expected
    ids = ours.apply_chat_template(conversation, tokenize=True, **kwargs)
    assert ids == hf.encode(expected, add_special_tokens=False)


def test_default_template_and_extra_variables(ours):
    text = ours.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    template = "{{ greeting }} {{ bos_token }}"
    assert ours.apply_chat_template([], chat_template=template, greeting="yo") == "yo <|im_start|>"
    # None-valued keys are dropped, as HF does, so templates can test `is defined`.
    template = "{% for m in messages %}{{ 'c' if m.content is defined else 'none' }}{% endfor %}"
    assert ours.apply_chat_template(
        [{"role": "assistant", "content": None}], chat_template=template
    ) == ("none")


def test_raise_exception_surfaces_as_template_error(ours):
    with pytest.raises(TemplateError, match="only user"):
        ours.apply_chat_template([], chat_template="{{ raise_exception('only user') }}")


def test_missing_chat_template_is_a_clear_error(ours):
    bare = Tokenizer(ours.backend, bos_token="<|im_start|>", eos_token="<|im_end|>")
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_tokenized_template_does_not_double_bos(ours):
    with_bos = Tokenizer(
        ours.backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        add_bos_token=True,
        chat_template="{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}",
    )
    body = with_bos.encode("hello", add_special_tokens=False)
    assert with_bos.encode("hello") == [1, *body]
    ids = with_bos.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=True)
    assert ids == [1, *body]


ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__globals__['datetime'] }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ namespace.__init__.__globals__ }}",
    "{% set ns = namespace(__class__=1) %}",
    "{% set ns = namespace() %}{% set ns.__dict__ = 1 %}",
    "{{ messages.append('x') }}",
    "{{ messages[0].update({'role': 'system'}) }}",
    "{{ dict.__class__ }}",
    "{{ (messages[0].content|attr('__class__')).__subclasses__() }}",
    "{{ self.__init__.__globals__.__builtins__ }}",
]


@pytest.mark.parametrize("template", ESCAPES)
def test_sandbox_blocks_escapes(ours, template):
    messages = [{"role": "user", "content": "x"}]
    try:
        out = ours.apply_chat_template(messages, chat_template=template)
    except SecurityError:
        return
    # Anything that rendered must not have reached Python objects.
    assert "class" not in out and "function" not in out and "module" not in out, out


def test_objects_in_messages_become_inert_text(ours):
    class Evil:
        def __str__(self):
            return "evil"

        def run(self):
            return "ran"

    template = "{% for m in messages %}{{ m.content }}|{{ m.content.run is defined }}{% endfor %}"
    out = ours.apply_chat_template([{"role": "user", "content": Evil()}], chat_template=template)
    assert out == "<Evil>|False"


# --- SentencePiece ("llama") vocabularies -----------------------------------------------------

SP_PIECES = ["▁", "t", "h", "e", "l", "o", "w", "r", "d", "a", "n", "i", "s", "▁t", "he"]
SP_PIECES += ["▁the", "ll", "▁h", "▁he", "▁hell", "▁hello", "or", "▁w", "▁wor", "▁world", "▁a"]
SP_PIECES += ["▁an", "is", "▁is", "▁▁", "▁▁▁▁"]


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SP_PIECES
    tokens.append("<start_of_turn>")
    types = [2, 3, 3] + [6] * 256 + [1] * len(SP_PIECES) + [3]
    scores = [0.0] * 259 + [-float(i) for i in range(len(SP_PIECES))] + [0.0]
    w = gguf.GGUFWriter(str(d / "sp.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return d


SP_TEXTS = [
    "hello world",
    "the world is an hello",
    " leading space",
    "  two  spaces    four",
    "byte fallback: é 한 🎉\n",
    "<start_of_turn>user hi",
    "",
]


@pytest.mark.parametrize("text", SP_TEXTS)
def test_sentencepiece_matches_transformers(sp_dir, text):
    ours = load_gguf_tokenizer(sp_dir / "sp.gguf")
    hf = transformers.AutoTokenizer.from_pretrained(sp_dir, gguf_file="sp.gguf")
    assert ours.add_bos_token is True  # llama.cpp's default for sentencepiece vocabularies
    assert ours.encode(text) == hf.encode(text)
    ids = ours.encode(text)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)


# --- Gemma's SentencePiece vocabulary in GGUF files ------------------------------------------

GEMMA_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "el", "ll", "hel", "ell", "hell"]
GEMMA_PIECES += ["hello", "▁h", "▁hello", "wo", "or", "rl", "wor", "orl", "world", "▁world"]


def write_gemma_vocab(path, arch: str):
    """A Gemma-like vocabulary as llama.cpp writes it: space runs spelled with real spaces and
    newline runs as user-defined tokens, turn markers as control tokens, and scores that do not
    follow the vocabulary order (here: the reverse of it)."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    user = ["\n", "\n\n", "  ", "   "]
    tokens = specials + user + [f"<0x{b:02X}>" for b in range(256)] + GEMMA_PIECES
    types = [3] * len(specials) + [4] * len(user) + [6] * 256 + [1] * len(GEMMA_PIECES)
    scores = [float(i) for i in range(len(tokens))]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_space_prefix(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


GEMMA_TEXTS = [
    "hello world",
    "helloworld hello worl",
    " hello  world   hello    world",
    "hello\n\nworld\n\n\n",
    "<start_of_turn>user\nhello<end_of_turn>\n",
    "byte fallback: é 🎉",
    "",
]


@pytest.fixture(scope="module")
def gemma_vocab(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma_vocab")
    write_gemma_vocab(d / "gemma3.gguf", "gemma3")
    hf = transformers.AutoTokenizer.from_pretrained(d, gguf_file="gemma3.gguf")
    return load_gguf_tokenizer(d / "gemma3.gguf"), hf, d


@pytest.mark.parametrize("text", GEMMA_TEXTS)
def test_gemma_vocabulary_matches_transformers(gemma_vocab, text):
    ours, hf, _ = gemma_vocab
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)


def test_gemma_merges_follow_the_vocabulary_order(gemma_vocab):
    ours, _, d = gemma_vocab
    # Read as a plain llama vocabulary, the scores would rank the merges: another split.
    plain = load_gguf_tokenizer(write_gemma_vocab(d / "llama.gguf", "llama"))
    assert ours.encode("worl") != plain.encode("worl")
    assert ours.convert_ids_to_tokens(ours.encode("a  b", add_special_tokens=False)[1:2]) == ["▁▁"]


def test_gemma_fallback_chat_template(gemma_vocab):
    ours, _, _ = gemma_vocab
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello "},
        {"role": "assistant", "content": "world"},
        {"role": "user", "content": "again"},
    ]
    assert ours.apply_chat_template(messages) == (
        "<bos><start_of_turn>user\nBe brief.\n\nhello<end_of_turn>\n"
        "<start_of_turn>model\nworld<end_of_turn>\n"
        "<start_of_turn>user\nagain<end_of_turn>\n<start_of_turn>model\n"
    )
    ids = ours.apply_chat_template(messages[1:2], tokenize=True)
    assert ids[:2] == [2, 4] and ids.count(2) == 1  # one BOS, <start_of_turn> kept whole
