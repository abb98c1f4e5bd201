"""Model sources by URI: where the first copy of a model comes from when the ModelService names
`spec.model.source.uri` instead of a mounted directory.

- `file:///DIR`: a directory on this pod's filesystem (no download).
- `hf://OWNER/NAME[@REVISION]`: a Hugging Face Hub repository (REVISION: a branch, tag or commit
  hash without `/`; default `main`), fetched with `huggingface_hub.snapshot_download` into the Hub cache
  (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`; files already there are not
  fetched again), only config, tokenizer and safetensors files. The Hub is `$HF_ENDPOINT` (a mirror or
  a private Hub; default huggingface.co), the token `$HF_TOKEN` (the pod template fills it from the
  installation's Secret); both are read at call time, not at import.

Data flow: bind `source.uri` -> `parse_uri()` (synchronous: a malformed URI is a 400 naming
`source.uri` before anything starts) -> `resolve()` in the loader's worker thread -> a local snapshot
directory -> `blocks.pack_checkpoint`, exactly as a path source. A failed download raises `SourceError`
whose message names the URI and the Hub's answer (401, repository not found, ...): the engine reports it
as its `loadError`, which the operator puts on the ScalePlan and in an Event.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kascade_planner.engine_api import MODEL_URI_PATTERN

log = logging.getLogger(__name__)

# the files `pack_checkpoint` and the tokenizer read; no .bin/.pt/.gguf duplicates
PATTERNS = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt")
MODEL_URI = re.compile(MODEL_URI_PATTERN)  # shared with the CRD and the operator
URI_SYNTAX = "file:///DIR or hf://OWNER/NAME[@REVISION]"


class SourceError(ValueError):
    """A source URI that is malformed or cannot be fetched; the message names the URI and the cause."""


@dataclass(frozen=True)
class HubSource:
    repo: str
    revision: str = "main"

    def __str__(self) -> str:
        return f"hf://{self.repo}@{self.revision}"


def parse_uri(uri: str) -> HubSource | Path:
    """`hf://...` -> HubSource, `file:///DIR` -> Path; anything else raises SourceError."""
    if MODEL_URI.match(uri) is None or ".." in uri.split("/"):
        raise SourceError(f"{uri!r} is not a model URI (expected {URI_SYNTAX})")
    if uri.startswith("file://"):
        return Path(uri[len("file://"):])
    repo, _, rev = uri[len("hf://"):].partition("@")
    return HubSource(repo, rev or "main")


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def download(src: HubSource, cache_dir: Path | None = None) -> Path:
    """Fetch a Hub snapshot (or find it complete in the cache); SourceError names what went wrong."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = os.environ.get("HF_ENDPOINT") or None
    where = f"{src} from {endpoint or 'huggingface.co'}"
    log.info("downloading %s into %s", where, cache_dir or hub_cache_dir())
    try:
        out = snapshot_download(repo_id=src.repo, revision=src.revision, cache_dir=cache_dir or hub_cache_dir(),
                                endpoint=endpoint, token=os.environ.get("HF_TOKEN") or None,
                                allow_patterns=list(PATTERNS))
    except RevisionNotFoundError:
        raise SourceError(f"{where}: revision {src.revision!r} not found") from None
    except GatedRepoError:
        raise SourceError(f"{where}: gated repository; HF_TOKEN has no access to it") from None
    except RepositoryNotFoundError as e:
        status = e.response.status_code if e.response is not None else None
        hint = " (or HF_TOKEN is invalid)" if status == 401 else ""
        raise SourceError(f"{where}: repository not found or not accessible{hint} (HTTP {status})") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status == 401:
            raise SourceError(f"{where}: the Hub rejected HF_TOKEN (HTTP 401: {e.server_message or 'unauthorized'})"
                              ) from None
        raise SourceError(f"{where}: HTTP {status}: {str(e).splitlines()[0]}") from None
    except (OSError, ValueError) as e:  # connection refused, disk full, offline cache incomplete, ...
        raise SourceError(f"{where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    d = Path(out)
    if not any(d.glob("*.safetensors")):
        raise SourceError(f"{where}: the snapshot holds no .safetensors weights")
    return d


def resolve(uri: str, cache_dir: Path | None = None) -> Path:
    """A model URI -> the local checkpoint directory (downloading a Hub snapshot first)."""
    src = parse_uri(uri)
    return src if isinstance(src, Path) else download(src, cache_dir)
