"""Whether a ModelService's model source works: when the newest finished ScalePlan that loaded the first
copy from the current `spec.model.source.uri` failed because the engines could not fetch it (unknown
repository or revision, a token the Hub rejects, the Hub unreachable), the service is Stalled with
reason `SourceUnavailable` and the engine's words, naming the field. The next plan still tries (a Hub
outage ends by itself); the condition clears once a plan from that source succeeds or the source
changes.

Data flow (pure): the service's raw ScalePlans + where its first copy comes from (`checkpoint_path`)
-> `source_blocker()` -> a `Blocker` for `service_status`, or None.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kascade_operator.status import Blocker

FIELD = "spec.model.source.uri"  # engines name it in their loadError when a download fails


def source_blocker(plans: Iterable[Mapping[str, Any]], service: str, source: str) -> Blocker | None:
    """`plans`: ScalePlans (any service); `source`: the path or URI the service's first copy loads from."""
    first_copies = [
        p
        for p in plans
        if (p.get("spec") or {}).get("modelServiceRef", {}).get("name") == service
        and (p.get("status") or {}).get("phase") in ("Succeeded", "Failed")
        and any(s.get("kind") == "host" and s.get("path") == source for s in p["spec"].get("sources") or [])
    ]
    if not first_copies:
        return None
    newest = max(first_copies, key=lambda p: ((p.get("status") or {}).get("completionTime") or "",
                                              p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"]))
    if newest["status"]["phase"] != "Failed":
        return None
    why = [t["failed"] for t in newest["status"].get("targets") or [] if FIELD in (t.get("failed") or "")]
    if not why:
        return None
    detail = why[0].split(f"({FIELD}): ", 1)[-1]
    return Blocker("SourceUnavailable", f"{FIELD}: the first copy could not be fetched (ScalePlan "
                                        f"{newest['metadata']['name']}): {detail}"[:1024])
