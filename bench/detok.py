"""Detokenization cost per streamed token, incremental (`TextStop` over `Detokenizer`) against the old
way (decode the whole generated list on every token, then search the stop strings in it), at growing
generation lengths on a real tokenizer: SmolLM2's when the package is installed, else a byte-level BPE
trained offline here (the output says which). Real wall clock, one process; on a shared machine the
absolute numbers are noisy, the trend with n is the point.

Data flow: a multilingual text encoded and repeated to n tokens -> each way fed token by token, timed
-> µs/token per n, `incremental_growth` (µs/token at the largest n / at the smallest: ~1 = flat) and
`full_decode_growth` -> bench/results/detok.json. The streamed text of both ways must match the full
decode (checked, the bench fails otherwise).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

from kascade_engine.http.openai_api import TextStop
from kascade_engine.tokenizer import HFTokenizer, Tokenizer, load_tokenizer

TEXT = ("Héllo wörld, naïve café — “quotes” déjà vu. 日本語のテキストです。Emoji 🎉🚀 then ∑ √ ≤ and plain "
        "ASCII words to make the text long enough. ")
STOPS = ("never-in-text", "zzz")


def tokenizer() -> tuple[Tokenizer, str]:
    from kascade_engine.weights.checkpoint import smollm_checkpoint

    ck = smollm_checkpoint()
    if ck is not None:
        return load_tokenizer(ck), "SmolLM2-135M"
    from kascade_engine.tinytokenizer import byte_level_bpe

    return HFTokenizer(byte_level_bpe()), "byte-level BPE trained offline (SmolLM2 not installed)"


def full_decode_way(decode: Callable[[list[int]], str], ids: list[int]) -> str:
    """The previous TextStop: a full decode and a stop search over the whole text per token."""
    toks: list[int] = []
    text = ""
    for t in ids:
        toks.append(t)
        text = decode(toks)
        for s in STOPS:
            text.find(s)
    return text


def incremental_way(decode: Callable[[list[int]], str], ids: list[int]) -> str:
    ts = TextStop(decode, STOPS)
    for i, t in enumerate(ids):
        ts.feed(t, i == len(ids) - 1)
    return ts.text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="n up to 2048 instead of 8192")
    args = ap.parse_args()
    tok, which = tokenizer()
    base = tok.encode(TEXT)
    ns = [256, 1024, 2048] if args.quick else [256, 1024, 4096, 8192]
    rows = []
    for n in ns:
        ids = (base * (n // len(base) + 1))[:n]
        full = tok.decode(ids)
        row: dict[str, float | int] = {"n": n}
        for name, way in (("incremental", incremental_way), ("full_decode", full_decode_way)):
            t0 = time.perf_counter()
            text = way(tok.decode, ids)
            row[f"{name}_us_per_token"] = round((time.perf_counter() - t0) / n * 1e6, 2)
            if text != full:
                raise SystemExit(f"{name} streamed text differs from the full decode at n={n}")
        rows.append(row)
        print(f"n={n:5d}  incremental {row['incremental_us_per_token']:8.1f} µs/token   "
              f"full decode {row['full_decode_us_per_token']:9.1f} µs/token", flush=True)
    res = {"tokenizer": which, "rows": rows,
           "incremental_growth": round(rows[-1]["incremental_us_per_token"] / rows[0]["incremental_us_per_token"], 2),
           "full_decode_growth": round(rows[-1]["full_decode_us_per_token"] / rows[0]["full_decode_us_per_token"], 2),
           "note": "real wall clock in one process; the machine may be shared"}
    out = Path(__file__).parent / "results" / "detok.json"
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}))


if __name__ == "__main__":
    main()
