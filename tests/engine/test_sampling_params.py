"""The sampling parameters OpenAI and vLLM clients send, on the batched engine over the real tiny Llama
(EOS set to a token greedy decoding is known to produce, since the random model has none of its own):
ignore_eos, min_tokens, top_k, penalties; defaults leave greedy output untouched; a batch mixing
adjusted and plain rows gives each what it would get alone."""

from __future__ import annotations

import pytest
import torch

from kascade_engine.batch.engine import Engine
from kascade_engine.batch.model import LlamaModel
from kascade_engine.batch.sampling import SamplingParams, adjust, extras, with_extras

PROMPT = [40, 41, 42, 43, 44]


def _model(blocks) -> LlamaModel:
    m = LlamaModel(blocks.config)
    for b in blocks.blocks.values():
        m.add_block(b.id, b.tensors())
    return m


def test_eos_min_tokens_and_ignore_eos(tiny_blocks) -> None:
    m = _model(tiny_blocks)
    greedy = Engine(m).generate(PROMPT, SamplingParams(max_tokens=12))
    eos = greedy[2]  # greedy reaches it as its 3rd token
    assert eos not in greedy[:2]
    assert Engine(m, eos=eos).generate(PROMPT, SamplingParams(max_tokens=12)) == greedy[:3]
    ran = Engine(m, eos=eos).generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    assert ran == greedy  # runs to max_tokens through EOS
    forced = Engine(m, eos=eos).generate(PROMPT, SamplingParams(max_tokens=12, min_tokens=6))
    assert len(forced) >= 6 and eos not in forced[:6] and forced[:2] == greedy[:2]
    stop_ids = Engine(m).generate(PROMPT, SamplingParams(max_tokens=12, stop_token_ids=(greedy[0],), min_tokens=4))
    assert len(stop_ids) >= 4 and greedy[0] not in stop_ids[:4]


def test_top_k_penalties_and_batch_mixing(tiny_blocks) -> None:
    m = _model(tiny_blocks)
    plain = SamplingParams(max_tokens=16)
    greedy = Engine(m).generate(PROMPT, plain)
    top1 = SamplingParams(max_tokens=16, temperature=1.0, top_k=1, seed=3)
    assert Engine(m).generate(PROMPT, top1) == greedy  # top_k=1 is greedy whatever the temperature
    loop = [7] * 8  # greedy repeats itself after this prompt
    g = Engine(m).generate(loop, SamplingParams(max_tokens=32))
    assert len(set(g)) < 32
    runs = {}
    for kw in ({"repetition_penalty": 5.0}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        runs[next(iter(kw))] = out = Engine(m).generate(loop, SamplingParams(max_tokens=32, **kw))  # type: ignore[arg-type]
        assert out != g and len(set(out)) > len(set(g)), kw  # repeats are discouraged
        assert Engine(m).generate(loop, SamplingParams(max_tokens=32, **kw)) == out  # type: ignore[arg-type]
    rep = runs["repetition_penalty"]
    e = Engine(m)  # one batch: penalised and plain rows together, each as alone
    outs = {
        p: e.submit(loop, p)
        for p in (SamplingParams(max_tokens=32), SamplingParams(max_tokens=32, repetition_penalty=5.0))
    }
    got: dict[str, list[int]] = {r: [] for r in outs.values()}
    while any(r in e.requests for r in got):
        for ev in e.step():
            got[ev.request].append(ev.token)
    assert list(got.values()) == [g, rep]


def test_adjust_values() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    out = adjust(logits, [(SamplingParams(repetition_penalty=2.0), [0, 1], [])], None)
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]
    out = adjust(logits, [(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [3], [2, 2])], None)
    assert out.tolist() == [[2.0, -2.0, -0.25, 0.5]]
    out = adjust(logits, [(SamplingParams(min_tokens=1), [], [])], 0)
    assert out[0, 0] == float("-inf") and out[0, 1:].tolist() == [-2.0, 1.0, 0.5]
    p = SamplingParams(top_k=3, min_tokens=2, ignore_eos=True, presence_penalty=0.5)
    assert with_extras(SamplingParams(), extras(p)) == p and extras(SamplingParams()) == {}


def test_extras_cross_the_wires() -> None:
    """A prompt prefilled on another engine, or redirected live, keeps its sampling parameters."""
    from kascade_engine.live.redirect import params_from_wire
    from kascade_engine.pd.kv_wire import KVShape, PrefillOp
    from kascade_engine.pd.prefill_server import _params

    p = SamplingParams(max_tokens=9, temperature=0.5, seed=4, top_k=7, min_tokens=2, repetition_penalty=1.5)
    op = PrefillOp("r", [1, 2], p.temperature, p.top_p, p.seed, KVShape(2, 1, 4, "float32", 4), extras=extras(p))
    assert _params(op.to_header()) == SamplingParams(max_tokens=1, temperature=0.5, seed=4, top_k=7, min_tokens=2,
                                                     repetition_penalty=1.5)
    entry = ["r", [1, 2], p.max_tokens, p.temperature, p.top_p, p.seed, [], extras(p)]
    assert params_from_wire(entry)[2] == p
    with pytest.raises(ValueError, match="sampling extras"):
        params_from_wire([*entry[:7], {"logit_bias": 1}])


def test_sample_rows_applies_each_rows_own_parameters_in_one_draw() -> None:
    """Unseeded sampling rows are drawn together (sampling.sample_rows): top_k 1 or a tiny top_p is the argmax,
    top_k 2 never leaves the two best, temperature spreads the draws; rows do not leak into each other."""
    from kascade_engine.batch.sampling import sample_rows

    torch.manual_seed(0)
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 4)
    ps = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=0.01),
          SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=5.0)]
    draws = torch.stack([sample_rows(logits, ps) for _ in range(400)])  # [400, 4]
    assert draws[:, 0].eq(1).all() and draws[:, 1].eq(1).all()
    assert set(draws[:, 2].tolist()) == {1, 3}
    assert set(draws[:, 3].tolist()) == {0, 1, 2, 3}
    with pytest.raises(RuntimeError):  # a row with no mass cannot be drawn: the caller never builds one
        sample_rows(torch.full((1, 4), float("-inf")), [SamplingParams(temperature=1.0)])
