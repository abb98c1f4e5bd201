"""`kascade probe models URL`: is a Kascade front door (router or engine Service) answering the OpenAI
API? What `helm test` runs in the operator image.

Data flow: URL (https verified by --ca, names unchecked, for engines started with TLS files) -> GET
URL/v1/models (retried until --timeout, so a test pod started right after an install waits for the engines) -> the
listed model ids -> exit 0 when --expect-model is among them (or
any model is listed), else exit 1 with what was seen.
"""

from __future__ import annotations

import time

import click


@click.group("probe")
def probe() -> None:
    """Check a running Kascade endpoint."""


@probe.command("models")
@click.argument("url")
@click.option("--expect-model", help="this model id must be listed (default: any model)")
@click.option("--timeout", type=click.FloatRange(0, 3600), default=30.0, show_default=True,
              help="keep retrying this many seconds")
@click.option("--interval", type=click.FloatRange(0.05, 60), default=1.0, show_default=True)
@click.option("--ca", type=click.Path(dir_okay=False),
              help="an https URL's certificate must chain to this PEM CA; names are not checked (engines started "
                   "with TLS files, whose certificates name no Service)")
def models(url: str, expect_model: str | None, timeout: float, interval: float, ca: str | None = None) -> None:
    """GET URL/v1/models until it lists the expected model."""
    import ssl

    import httpx

    if not url.startswith(("http://", "https://")):
        raise click.BadParameter(f"{url!r}: expected http://HOST:PORT", param_hint="URL")
    verify: ssl.SSLContext | bool = True
    if ca:
        verify = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        verify.check_hostname = False  # the CA is the trust boundary, as for the operator and the router
        try:
            verify.load_verify_locations(cafile=ca)
        except (OSError, ssl.SSLError) as e:
            raise click.BadParameter(f"{ca}: {e}", param_hint="--ca") from None
    target = url.rstrip("/") + "/v1/models"
    deadline = time.monotonic() + timeout
    last = "no attempt"
    while True:
        try:
            r = httpx.get(target, timeout=5.0, verify=verify)
            if r.status_code != 200:
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            else:
                ids = [m.get("id") for m in r.json().get("data", []) if isinstance(m, dict)]
                if (expect_model in ids) if expect_model else ids:
                    click.echo(f"ok: {target} lists {', '.join(map(str, ids))}")
                    return
                last = f"listed {ids or 'no models'}, expected {expect_model or 'any model'}"
        except (httpx.HTTPError, ValueError, AttributeError) as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() >= deadline:
            raise click.ClickException(f"{target}: {last}")
        time.sleep(interval)
