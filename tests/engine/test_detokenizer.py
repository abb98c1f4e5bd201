"""Incremental detokenization on real tokenizers: streamed pieces concatenate to the full decode (also
across multi-byte characters split over tokens), no replacement character is ever streamed for an
incomplete character, stop strings that span tokens cut exactly where a full-text search cuts, and the
work per token stays flat as the generation grows."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kascade_engine.http.detokenizer import Detokenizer
from kascade_engine.http.openai_api import TextStop
from kascade_engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

TEXTS = (
    "Héllo wörld, naïve café — “quotes” déjà vu.",
    "日本語のテキストです。Ελληνικά κείμενα and русский текст.",
    "Emoji 🎉🚀 👩‍💻 🦀 then ∑ √ ≤ and plain ASCII at the end.",
    "  leading spaces,\nnew lines\tand tabs 123 4567.",
)


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    from kascade_engine.tinytokenizer import byte_level_bpe

    return HFTokenizer(byte_level_bpe())


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    from kascade_devcluster.requirement import unavailable

    try:
        import google.protobuf  # noqa: F401  (transformers reads tokenizer.model with it)
        import sentencepiece  # noqa: F401
    except ImportError:
        unavailable("sentencepiece + protobuf (engine extra): pip install -e '.[engine]'")
    from kascade_engine.tinytokenizer import sentencepiece_model

    d = tmp_path_factory.mktemp("spm")
    sentencepiece_model(d)
    (d / "config.json").write_text('{"model_type": "llama"}')
    return load_tokenizer(d)


def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    d = Detokenizer(tok.decode, getattr(tok, "byte_tokens", ()))
    return [d.push(t, last=i == len(ids) - 1) for i, t in enumerate(ids)]


def check_streams_exactly(tok: Tokenizer, ids: list[int]) -> None:
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    full = tok.decode(ids)
    if "\ufffd" not in full:  # valid text: an incomplete character is never streamed
        assert not any("\ufffd" in p for p in pieces), pieces


def test_a_byte_fallback_run_streams_as_the_full_decode_reads_it(spm: Tokenizer) -> None:
    """`<0x5E><0x51><0xE2>`: alone `^Q` reads as ASCII, but with the invalid 0xE2 after them the whole run
    decodes to U+FFFD x 3; streaming must not have released `^Q` first."""
    assert isinstance(spm, HFTokenizer) and len(spm.byte_tokens) == 256
    vocab = spm.tok.get_vocab()
    run = [vocab["<0x5E>"], vocab["<0x51>"], vocab["<0xE2>"]]
    word = spm.encode("hello")
    for ids in ([*word, *run, *word], [*word, *run]):
        assert "^Q" not in spm.decode(ids) and "".join(stream(spm, ids)) == spm.decode(ids)
    assert "".join(stream(spm, [*word, *run[:2], *word])) == spm.decode([*word, *run[:2], *word])  # valid: ^Q


def test_byte_tokenizer_holds_multibyte_characters_until_complete() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("a🎉é日")
    pieces = stream(tok, ids)
    assert pieces == ["a", "", "", "", "🎉", "", "é", "", "", "日"]


@pytest.mark.parametrize("which", ["bpe", "spm"])
def test_streamed_text_equals_full_decode_on_real_tokenizers(which: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(which)
    split = False
    for text in TEXTS:
        ids = tok.encode(text)
        split |= any("\ufffd" in tok.decode([i]) for i in ids)
        check_streams_exactly(tok, ids)
    assert split, "the texts must make the tokenizer split a character over tokens, or this tests nothing"
    rng = random.Random(0)  # arbitrary token sequences, including ones that are not valid UTF-8
    vocab = max(max(tok.encode(t)) for t in TEXTS) + 1
    words = [w for t in TEXTS for w in t.split(" ")]
    for _ in range(50):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        # byte-level BPE decodes bytes, so even invalid UTF-8 streams exactly; SentencePiece's byte
        # fallback turns a whole invalid byte run into U+FFFD per byte (ASCII bytes of the run included),
        # so the detokenizer holds a run of byte tokens until it ends: streamed text equals it too
        assert "".join(stream(tok, ids)) == tok.decode(ids), ids
        ids = [i for w in rng.sample(words, 6) for i in tok.encode(w + rng.choice(" ,\n"))]  # tokens of shuffled words
        check_streams_exactly(tok, ids)


def check_fast_decode_is_transformers_decode(tok: Tokenizer) -> None:
    """HFTokenizer decodes with the Rust tokenizer directly: the same text as transformers' decode,
    special tokens (eos) skipped alike."""
    assert isinstance(tok, HFTokenizer) and tok._fast is not None
    rng = random.Random(2)
    vocab = len(tok.tok)
    cases = [tok.encode(t) for t in TEXTS] + [[rng.randrange(vocab) for _ in range(30)] for _ in range(30)]
    cases += [[*ids, tok.eos_token_id, *ids] for ids in cases[:4] if tok.eos_token_id is not None]
    for ids in cases:
        assert tok.decode(ids) == tok.tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("which", ["bpe", "spm"])
def test_fast_decode_equals_transformers_decode(which: str, request: pytest.FixtureRequest) -> None:
    check_fast_decode_is_transformers_decode(request.getfixturevalue(which))


@pytest.mark.smollm
def test_streamed_text_equals_full_decode_on_smollm2(smollm_ckpt: Path) -> None:
    tok = load_tokenizer(smollm_ckpt)
    check_fast_decode_is_transformers_decode(tok)
    for text in TEXTS:
        check_streams_exactly(tok, tok.encode(text))


def reference_cut(full: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    hits = [i for i in (full.find(s) for s in stops) if i >= 0]
    return (full[:min(hits)], True) if hits else (full, False)


@pytest.mark.parametrize("which", ["bpe", "spm"])
def test_stop_strings_spanning_tokens_cut_where_the_full_text_does(which: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(which)
    rng = random.Random(1)
    spanning = 0
    for text in TEXTS:
        ids = tok.encode(text)
        full = tok.decode(ids)
        ends = [len(tok.decode(ids[:k])) for k in range(1, len(ids) + 1)]  # where each token's text ends
        for _ in range(25):
            a = rng.randrange(len(full) - 1)
            stop = full[a:a + rng.randrange(1, 7)]
            stops = (stop, "never-in-the-text")
            spanning += any(a < e < a + len(stop) for e in ends)
            ts = TextStop(tok.decode, stops)
            out = []
            for i, t in enumerate(ids):
                out.append(ts.feed(t, i == len(ids) - 1))
                if ts.stopped:
                    break
            want, stopped = reference_cut(full, stops)
            assert ("".join(out), ts.stopped) == (want, stopped), (text, stop)
            assert ts.text == want
    assert spanning > 20, "most stop strings must cross a token boundary"


def test_text_without_stop_is_the_full_decode_including_held_text(bpe: Tokenizer) -> None:
    ids = bpe.encode("the end is near")
    ts = TextStop(bpe.decode, ("near!",))
    assert "".join(ts.feed(t, False) for t in ids) == "the end is "  # "near" may begin the stop: held
    assert ts.text == "the end is near" and not ts.stopped


def test_work_per_token_is_flat_in_the_generation_length(bpe: Tokenizer) -> None:
    """Counted, not timed: tokens handed to `decode` per pushed token stay bounded over 3000 tokens
    (the old path decoded the whole list, 1 + 2 + ... + n)."""
    ids = bpe.encode(" ".join(TEXTS)) * 40
    decoded = []

    def counting(x: list[int]) -> str:
        decoded.append(len(x))
        return bpe.decode(x)

    ts = TextStop(counting, ("zzz",))
    per_token = []
    for i, t in enumerate(ids):
        before = sum(decoded)
        ts.feed(t, i == len(ids) - 1)
        per_token.append(sum(decoded) - before)
    assert len(ids) > 3000
    assert max(per_token) <= 16, max(per_token)
    first, last = per_token[:500], per_token[-500:]
    assert sum(last) <= sum(first) * 1.2
    assert ts.text == bpe.decode(ids)
