"""A fake Prometheus query API for PrometheusSource's unit tests: it splits the source's combined query (one
`label_replace(<query>, "kascade_query", "<key>", "", "")` per key, joined by `or`) back into its queries,
answers each with the test's function, and tags each row with its key, as Prometheus' `label_replace` does."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

import httpx

from kascade_operator.metrics import QUERY_LABEL

Rows = list[dict[str, Any]]
_PART = re.compile(r'^label_replace\((.*), "' + QUERY_LABEL + r'", "(\w+)", "", ""\)$', re.S)


def queries(req: httpx.Request) -> list[tuple[str, str]]:
    """(key, query) of each part of the combined query a POST to /api/v1/query carries."""
    (q,) = parse_qs(req.content.decode())["query"]
    out = []
    for part in q.split(" or label_replace("):
        m = _PART.match(part if part.startswith("label_replace(") else "label_replace(" + part)
        assert m, part
        out.append((m.group(2), m.group(1)))
    return out


def prometheus(answer: Callable[[str], Rows], seen: list[str] | None = None) -> httpx.AsyncClient:
    """A client whose Prometheus answers each query of the combined one with `answer(query)`."""
    def handle(req: httpx.Request) -> httpx.Response:
        assert req.method == "POST" and req.url.path == "/api/v1/query", req
        rows: Rows = []
        for key, q in queries(req):
            if seen is not None:
                seen.append(q)
            rows += [{**r, "metric": {**r["metric"], QUERY_LABEL: key}} for r in answer(q)]
        return httpx.Response(200, json={"status": "success", "data": {"result": rows}})

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))
