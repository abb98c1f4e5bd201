"""The engine control token: one Secret (key `token`) that the operator and every engine pod read.

Why the operator makes it: a chart that generates the token at render time (`randAlphaNum`) renders a
new one at every `helm template`, which is how Argo CD (and any GitOps renderer) installs; Helm's
`lookup` sees nothing there. Pods started after the next sync would get a token the running operator
does not know (401 on every control call). So the chart renders the Secret only when the token is given
(`engineToken.value`) and otherwise names it; the operator creates it once, at startup, with a random
token when it is absent, and adopts it when it exists (every replica and restart reads the same one).
Engine pods reference the Secret (secretKeyRef): the kubelet starts them once it exists.

Data flow: settings (Secret name, namespace, create?) -> `ensure()` -> get, else create (a replica that
loses the create race reads the winner's) -> the token string the engine client sends.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from typing import Protocol

log = logging.getLogger(__name__)

TOKEN_KEY = "token"
CREATED_BY = "kascade.io/created-by"  # label on a Secret the operator made (helm uninstall leaves it)


class TokenUnavailable(RuntimeError):
    """No token Secret and none may be created (or the API refused it): the message says which."""


class _SecretApi(Protocol):
    async def secret_value(self, ns: str, name: str, key: str = "token") -> str | None: ...
    async def create_secret(self, ns: str, name: str, data: dict[str, str], labels: dict[str, str]) -> bool: ...


def new_token() -> str:
    return secrets.token_urlsafe(30)  # 240 bits, URL- and header-safe


def token_namespace(configured: str) -> str:
    """Where the Secret lives: the configured namespace, else the operator pod's (the release's)."""
    return configured or os.environ.get("POD_NAMESPACE") or "default"


async def ensure(kube: _SecretApi, ns: str, name: str, create: bool, wait_s: float = 60.0,
                 poll_s: float = 2.0) -> str:
    """The token in Secret `ns/name`. Absent: create it (`create`) or wait up to `wait_s` for someone else
    to (a user's `existingSecret`, an external secrets operator), then raise TokenUnavailable."""
    deadline = time.monotonic() + wait_s
    while True:
        token = await kube.secret_value(ns, name, TOKEN_KEY)
        if token:
            return token
        if create:
            made = new_token()
            try:
                created = await kube.create_secret(ns, name, {TOKEN_KEY: made}, {CREATED_BY: "kascade-operator"})
            except PermissionError as e:
                raise TokenUnavailable(f"engine token Secret {ns}/{name} does not exist and the operator may not "
                                       f"create it ({e}): grant it `create secrets` in {ns} (the chart does "
                                       "when engineToken sets neither value nor existingSecret) or create the "
                                       "Secret") from None
            if created:
                log.warning("engine token Secret %s/%s created (helm uninstall leaves it: it is not the "
                            "chart's)", ns, name)
                return made
            continue  # another replica created it first: read theirs
        if time.monotonic() >= deadline:
            raise TokenUnavailable(f"engine token Secret {ns}/{name} (key {TOKEN_KEY!r}) does not exist and this "
                                   "operator may not create it: create it, or install the chart with neither "
                                   "engineToken.existingSecret nor engineToken.value so the operator makes one")
        log.warning("engine token Secret %s/%s not there yet; waiting", ns, name)
        await asyncio.sleep(poll_s)
