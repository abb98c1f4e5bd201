"""A checkpoint whose only tokenizer file is a SentencePiece `tokenizer.model` (the Llama-2/Mistral
layout; trained here offline with byte fallback): a real engine process serves it through the openai
client, the prompt is tokenized by that tokenizer, the generated tokens equal transformers' greedy ones
and the text (streamed or not) equals the tokenizer's decode of them, multi-byte characters included.
Without sentencepiece/protobuf the load fails naming the file and the missing packages."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import torch

from kascade_engine.tokenizer import HFTokenizer, TokenizerError, load_tokenizer
from kascade_engine.weights.checkpoint import tiny_model

PROMPT = "Héllo wörld: Ελλάδα 🦀"  # Greek and the crab are not in the training corpus: byte fallback


@pytest.fixture(scope="module")
def spm_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kascade_devcluster.requirement import unavailable

    try:
        import google.protobuf  # noqa: F401
        import sentencepiece  # noqa: F401
    except ImportError:
        unavailable("sentencepiece + protobuf (engine extra): pip install -e '.[engine]'")
    from kascade_engine.tinytokenizer import sentencepiece_model

    # a random model's top two logits can be nearly equal, and then float summation order (threads, MKL
    # kernels chosen by alignment) picks either: greedy outputs of two correct implementations differ. The
    # seed is chosen so transformers' greedy run over PROMPT never has a near-tie (margin >= MIN_MARGIN):
    # any difference left is the engine's
    for seed in range(20):
        ckpt = tiny_model(tmp_path_factory.mktemp("spm") / "tiny-spm", "llama", layers=2, vocab=512, seed=seed)
        sentencepiece_model(ckpt, vocab=400)
        if _min_margin(ckpt) >= MIN_MARGIN:
            break
    else:
        raise AssertionError(f"no seed in 0..19 gives a greedy run without a near-tie (< {MIN_MARGIN})")
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("tokenizer")) == ["tokenizer.model"]
    return ckpt


MIN_MARGIN = 1e-3
NEW_TOKENS = 24


def _min_margin(ckpt: Path) -> float:
    """The smallest gap between the top two logits over transformers' greedy generation of PROMPT."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(ckpt)
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    out = ref.generate(torch.tensor([tok.encode(PROMPT)]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                       eos_token_id=tok.eos_token_id, output_scores=True, return_dict_in_generate=True)
    return min(float(top[0] - top[1]) for top in (torch.topk(s[0], 2).values for s in out.scores))


def test_tokenizer_model_only_checkpoint_serves_like_transformers(spm_ckpt: Path, engine_starter) -> None:
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(spm_ckpt)
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode(PROMPT)
    assert tok.decode(ids) == PROMPT and any("\ufffd" in tok.decode([i]) for i in ids)  # byte fallback in use
    ref = AutoModelForCausalLM.from_pretrained(spm_ckpt, dtype=torch.float32).eval()
    want_ids = ref.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                            eos_token_id=tok.eos_token_id)[0, len(ids):].tolist()
    if tok.eos_token_id in want_ids:  # both stop at the tokenizer's eos (counted, decoded to nothing)
        want_ids = want_ids[:want_ids.index(tok.eos_token_id) + 1]
    want = tok.decode(want_ids)
    e = engine_starter(["--checkpoint", str(spm_ckpt), "--model-name", "tiny-spm", "--max-prompt-tokens", "64"])
    try:
        c = openai.OpenAI(base_url=e.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = c.completions.create(model="tiny-spm", prompt=PROMPT, max_tokens=24)
        assert r.usage.prompt_tokens == len(ids)
        assert r.usage.completion_tokens == len(want_ids) and r.choices[0].text == want
        chunks = list(c.completions.create(model="tiny-spm", prompt=PROMPT, max_tokens=24, stream=True))
        pieces = [ch.choices[0].text for ch in chunks]
        assert "".join(pieces) == want
        if "\ufffd" not in want:
            assert not any("\ufffd" in p for p in pieces)
    finally:
        e.stop()


def test_tokenizer_model_without_sentencepiece_names_what_is_missing(spm_ckpt: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sentencepiece" else real(name, *a)
    )
    (tmp_path / "tokenizer.model").write_bytes((spm_ckpt / "tokenizer.model").read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(TokenizerError, match=r"tokenizer.model: .*needs the sentencepiece package"):
        load_tokenizer(tmp_path)
