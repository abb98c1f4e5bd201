"""The CRDs and their pydantic mirror declare the same API, and judge documents the same way."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from pydantic import BaseModel, ValidationError
from schema_walk import crd_fields, pydantic_fields

from kascade_operator.api import ModelService, ScalePlan

REPO = Path(__file__).resolve().parents[2]
KINDS: dict[str, tuple[str, type[BaseModel]]] = {
    "ModelService": ("kascade.io_modelservices.yaml", ModelService),
    "ScalePlan": ("kascade.io_scaleplans.yaml", ScalePlan),
}
SAMPLES = sorted((REPO / "manifests" / "samples").glob("*.yaml"))
INVALID = sorted((REPO / "tests" / "data" / "invalid").glob("*.yaml"))


def crd_schema(kind: str) -> dict[str, Any]:
    crd = yaml.safe_load((REPO / "crds" / KINDS[kind][0]).read_text())
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_same_fields_types_bounds_defaults(kind: str) -> None:
    crd = crd_fields(crd_schema(kind))
    pyd = pydantic_fields(KINDS[kind][1].model_json_schema(by_alias=True))
    # metadata and the opaque plan payload are free-form objects on both sides.
    only_crd = sorted(set(crd) - set(pyd))
    only_pyd = sorted(set(pyd) - set(crd))
    assert not only_crd and not only_pyd, f"fields only in CRD: {only_crd}; only in pydantic: {only_pyd}"
    differing = {p: (crd[p], pyd[p]) for p in crd if crd[p] != pyd[p]}
    assert not differing, "field definitions differ (CRD, pydantic):\n" + "\n".join(
        f"{k}: {v}" for k, v in differing.items()
    )
    assert len(crd) > 40 if kind == "ModelService" else len(crd) > 30


def test_walker_notices_a_missing_field() -> None:
    """The agreement test can fail: drop one property from the CRD side and it is reported."""
    schema = crd_schema("ModelService")
    del schema["properties"]["spec"]["properties"]["slo"]["properties"]["tbtMs"]
    crd = crd_fields(schema)
    pyd = pydantic_fields(ModelService.model_json_schema(by_alias=True))
    assert set(pyd) - set(crd) == {"spec.slo.tbtMs"}


def _load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("path", SAMPLES, ids=[p.name for p in SAMPLES])
def test_samples_valid_for_both(path: Path) -> None:
    doc = _load(path)
    # OpenAPI v3.0 schemas use draft-4 semantics (boolean exclusiveMinimum).
    jsonschema.Draft4Validator(crd_schema(doc["kind"])).validate(doc)
    model = KINDS[doc["kind"]][1].model_validate(doc)
    # Round trip through the pydantic model loses nothing that was written.
    dumped = model.model_dump(by_alias=True, exclude_unset=True)
    assert dumped == doc


def expected_field(path: Path) -> str:
    m = re.search(r"^# expect-field: (\S+)", path.read_text(), re.M)
    assert m, f"{path.name} lacks an '# expect-field:' line"
    return m.group(1)


def _pydantic_paths(err: ValidationError) -> list[str]:
    out = []
    for e in err.errors():
        parts = ""
        for p in e["loc"]:
            parts += f"[{p}]" if isinstance(p, int) else (f".{p}" if parts else str(p))
        out.append(parts + " " + e["msg"])
    return out


@pytest.mark.parametrize("path", INVALID, ids=[p.name for p in INVALID])
def test_invalid_rejected_by_pydantic_naming_field(path: Path) -> None:
    doc = _load(path)
    field = expected_field(path)
    with pytest.raises(ValidationError) as e:
        KINDS[doc["kind"]][1].model_validate(doc)
    messages = _pydantic_paths(e.value)
    # Either the error location is the field, or (cross-field rules) the message names it.
    assert any(m.startswith(field) or field in m for m in messages), messages


def _set(doc: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    node = doc
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    return doc


@pytest.mark.parametrize(
    ("field", "value"),
    [("spec.replicas.colocated.min", "1"), ("spec.replicas.desired", 1.5), ("spec.engine.tp", 2.0),
     ("spec.engine.port", "8000"), ("spec.scaling.live", "true"), ("spec.scalePlanHistoryLimit", "3"),
     ("spec.slo.ttftMs", "500"), ("spec.scaling.threshold.upper", None), ("spec.model.layers", True),
     ("spec.scaling.multicast", "Chain")],
)
def test_wrong_types_rejected_by_both(field: str, value: Any) -> None:
    """Differential check on the sample: a wrongly typed value the CRD refuses, pydantic refuses too
    (no lax coercion of "1" -> 1 or "true" -> True), naming the same field."""
    doc = _set(_load(REPO / "manifests" / "samples" / "modelservice.yaml"), field, value)
    errors = list(jsonschema.Draft4Validator(crd_schema("ModelService")).iter_errors(doc))
    assert errors and any(".".join(map(str, e.absolute_path)) == field for e in errors), errors
    with pytest.raises(ValidationError) as e:
        ModelService.model_validate(doc)
    assert any(m.startswith(field + " ") for m in _pydantic_paths(e.value)), _pydantic_paths(e.value)
