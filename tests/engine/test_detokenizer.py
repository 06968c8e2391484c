"""IncrementalDetokenizer against a real byte-level BPE tokenizer (SmolLM2) and a Metaspace one."""

import os
import random

import pytest

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.model_loader import resolve_model
from pagedllm.sampling_params import SamplingParams

slow = pytest.mark.slow  # these load the real SmolLM2 tokenizer

TEXTS = [
    "안녕하세요, 세계! 오늘 날씨가 좋네요.",
    "Emoji 😀🎉 family 👩‍👩‍👧 flag 🇰🇷 done",
    "Café naïve résumé façade Ångström",
    "multiple   spaces    here  and   there",
    "line1\nline2\n\n  indented\ttab\r\nend\n",
    "mixed: 日本語 ελληνικά русский 🙂 ok",
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    path = resolve_model(None)  # the packaged default GGUF
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=path)


@pytest.fixture(scope="module")
def tok(hf_tokenizer):
    return hf_tokenizer.backend_tokenizer


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


def make(tok, prompt="User: say something.\nAssistant:", **params):
    return IncrementalDetokenizer(tok, encode(tok, prompt), SamplingParams(**params))


def stream(det, ids, finished_at_end=True):
    """Feed ids one at a time; return the concatenated deltas and the stop string (if any)."""
    out, stop = [], None
    for token_id in ids:
        stop = det.update([token_id])
        out.append(det.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            return "".join(out), stop
    if finished_at_end:
        out.append(det.get_next_output_text(finished=True, delta=True))
    return "".join(out), stop


def held_back(text, stops):
    """Reference: the longest tail of text that is a proper prefix of some stop string."""
    for n in range(len(text), 0, -1):
        if any(s.startswith(text[-n:]) and len(s) > n for s in stops):
            return n
    return 0


@slow
@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_matches_decode(hf_tokenizer, tok, text):
    ids = encode(tok, text)
    expected = hf_tokenizer.decode(ids)
    det = make(tok)
    previous = ""
    for token_id in ids:
        assert det.update([token_id]) is None
        # Text only ever grows, and never shows a half-decoded character.
        assert det.output_text.startswith(previous)
        assert "\ufffd" not in det.output_text
        previous = det.output_text
    assert det.output_text == expected
    assert make(tok).update(ids) is None  # several tokens per update work too
    assert stream(make(tok), ids)[0] == expected


@slow
def test_random_tokens_match_decode(hf_tokenizer, tok):
    # Random ids include lone UTF-8 continuation bytes and cut characters: the stream must still
    # agree with a one-shot decode, replacement characters included.
    rng = random.Random(0)
    vocab = tok.get_vocab_size()
    for _ in range(50):
        ids = [
            rng.randrange(vocab) if rng.random() < 0.5 else rng.randrange(100, 300)
            for _ in range(40)
        ]
        for skip in (True, False):
            det = make(tok, skip_special_tokens=skip)
            text, _ = stream(det, ids)
            expected = hf_tokenizer.decode(ids, skip_special_tokens=skip)
            assert text == expected
            assert det.output_text == expected


@slow
def test_output_cut_mid_character_is_flushed_on_finish(hf_tokenizer, tok):
    ids = encode(tok, "ok 😀")
    cut = ids[:-1]  # the emoji takes several byte-level tokens
    assert "\ufffd" in hf_tokenizer.decode(cut)
    det = make(tok)
    det.update(cut)
    assert det.get_next_output_text(finished=False, delta=True) == "ok"
    assert det.get_next_output_text(finished=True, delta=True) == hf_tokenizer.decode(cut)[2:]


@slow
def test_leading_space_of_first_output_token_kept(tok):
    det = make(tok, prompt="Hello")
    det.update(encode(tok, " world"))
    assert det.output_text == " world"


@slow
def test_skip_special_tokens(hf_tokenizer, tok):
    im_end = tok.token_to_id("<|im_end|>")
    ids = encode(tok, "Hi") + [im_end] + encode(tok, " there")
    for skip in (True, False):
        det = make(tok, skip_special_tokens=skip)
        text, _ = stream(det, ids)
        assert text == det.output_text == hf_tokenizer.decode(ids, skip_special_tokens=skip)
    assert det.output_text == "Hi<|im_end|> there"


@slow
def test_stop_terminated_drops_the_stop_token_text(tok):
    im_end = tok.token_to_id("<|im_end|>")
    ids = encode(tok, "Hi")
    for include, expected in ((False, "Hi"), (True, "Hi<|im_end|>")):
        det = make(tok, skip_special_tokens=False, include_stop_str_in_output=include)
        det.update(ids)
        det.update([im_end], stop_terminated=True)
        assert det.get_next_output_text(finished=True, delta=False) == expected


SENTENCE = "The quick brown fox jumps over the lazy dog."


@slow
@pytest.mark.parametrize(
    ("stop", "include", "expected"),
    [
        (["n fox j"], False, "The quick brow"),  # spans three tokens
        (["n fox j"], True, "The quick brown fox j"),
        (["ow"], False, "The quick br"),  # inside one token
        (["lazy", "quick"], False, "The "),
        (["dog."], True, SENTENCE),  # ends exactly at the end of the text
        (["cat"], False, SENTENCE),
    ],
)
def test_stop_strings_truncate(tok, stop, include, expected):
    ids = encode(tok, SENTENCE)
    det = make(tok, stop=stop, include_stop_str_in_output=include)
    text, matched = stream(det, ids)
    assert det.output_text == text == expected
    if expected == SENTENCE and stop == ["cat"]:
        assert matched is None
    else:
        assert matched in stop
        # update() reports the match on the token that completes it, not before.
        i = next(i for i in range(len(ids)) if matched in tok.decode(ids[: i + 1]))
        assert make(tok, stop=stop).update(ids[:i]) is None
        assert make(tok, stop=stop).update(ids[: i + 1]) == matched


@slow
def test_earliest_stop_string_wins_within_one_update(tok):
    det = make(tok, stop=["lazy", "quick"])
    assert det.update(encode(tok, SENTENCE)) == "quick"  # not the first one listed
    assert det.output_text == "The "


@slow
def test_stop_string_across_multibyte_characters(tok):
    text = "안녕하세요, 세계! 오늘 날씨가 좋네요."
    det = make(tok, stop=["세계"])
    out, matched = stream(det, encode(tok, text))
    assert (out, matched) == ("안녕하세요, ", "세계")


@slow
def test_partial_match_held_back_then_released(tok):
    stops = ["fox jumps high", "lazy cat"]
    ids = encode(tok, SENTENCE)
    det = make(tok, stop=stops)
    sent = ""
    saw_hold = False
    for token_id in ids:
        assert det.update([token_id]) is None
        sent += det.get_next_output_text(finished=False, delta=True)
        text = det.output_text
        # Exactly the tail that could still become a stop string is held back, nothing more.
        assert sent == text[: len(text) - held_back(text, stops)]
        assert det.get_next_output_text(finished=False, delta=False) == sent
        saw_hold |= len(sent) < len(text)
    assert saw_hold  # "fox", "fox jumps" and "lazy" were each held back for a while
    sent += det.get_next_output_text(finished=True, delta=True)
    assert sent == SENTENCE
    assert det.get_next_output_text(finished=True, delta=True) == ""


@slow
def test_hold_back_uses_only_real_prefixes(tok):
    det = make(tok, stop=["xyz"])
    det.update(encode(tok, "abc"))
    # No tail of "abc" starts "xyz": nothing held back (not a fixed len(stop) - 1 chars).
    assert det.get_next_output_text(finished=False, delta=True) == "abc"


@slow
def test_stop_strings_ignored_until_min_tokens(tok):
    ids = encode(tok, "stop here, then stop again")
    det = make(tok, stop=["stop"], min_tokens=3, max_tokens=10, include_stop_str_in_output=True)
    text, matched = stream(det, ids)
    assert matched == "stop"
    assert text == "stop here, then stop"


def test_prompt_context_keeps_the_first_output_space():
    # A Metaspace decoder strips the leading space of the first token it decodes: without the
    # prompt as context, " world" right after the prompt "Hello" would come out as "world".
    from tokenizers import Tokenizer, decoders, models

    vocab = {"[UNK]": 0, "\u2581Hello": 1, "\u2581world": 2, "!": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.decoder = decoders.Metaspace()
    assert tok.decode([2, 3]) == "world!"
    det = IncrementalDetokenizer(tok, [1], SamplingParams())
    det.update([2])
    det.update([3])
    assert det.output_text == " world!"
    det = IncrementalDetokenizer(tok, [], SamplingParams())  # no prompt: nothing to keep
    det.update([2, 3])
    assert det.output_text == "world!"
