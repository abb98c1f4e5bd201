"""Flatten a CRD openAPIV3Schema and a pydantic JSON schema into comparable field tables.

Each table maps a field path (`spec.replicas.colocated.min`, `spec.sources[].gpus[]`, `...{}` for map
values) to a normalised description: type, enum, default, bounds, and whether the field is required.
"""

from __future__ import annotations

from typing import Any

Row = dict[str, Any]


def _bounds(s: dict[str, Any], crd: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if crd:
        if "minimum" in s:
            out["gt" if s.get("exclusiveMinimum") is True else "ge"] = s["minimum"]
        if "maximum" in s:
            out["lt" if s.get("exclusiveMaximum") is True else "le"] = s["maximum"]
    else:
        for k, name in (("minimum", "ge"), ("exclusiveMinimum", "gt"), ("maximum", "le"), ("exclusiveMaximum", "lt")):
            if k in s:
                out[name] = s[k]
    for k in ("minLength", "maxLength", "pattern", "minItems"):
        if k in s:
            out[k] = s[k]
    return {k: float(v) if k in {"ge", "gt", "le", "lt"} else v for k, v in out.items()}


def crd_fields(schema: dict[str, Any], path: str = "", required: bool = False) -> dict[str, Row]:
    rows: dict[str, Row] = {}
    t = "int-or-string" if schema.get("x-kubernetes-int-or-string") else schema.get("type", "any")
    row: Row = {"type": t, "required": required, **_bounds(schema, crd=True)}
    if "enum" in schema:
        row["enum"] = sorted(schema["enum"])
    if "default" in schema:
        row["default"] = schema["default"]
    if path:
        rows[path] = row
    if t == "object":
        req = set(schema.get("required", []))
        for name, sub in schema.get("properties", {}).items():
            rows.update(crd_fields(sub, f"{path}.{name}" if path else name, name in req))
        if isinstance(schema.get("additionalProperties"), dict):
            rows.update(crd_fields(schema["additionalProperties"], f"{path}{{}}"))
    if t == "array":
        rows.update(crd_fields(schema["items"], f"{path}[]"))
    return rows


def _resolve(s: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in s:
        s = {**defs[s["$ref"].split("/")[-1]], **{k: v for k, v in s.items() if k != "$ref"}}
    variants = s.get("anyOf")
    if variants:
        non_null = [_resolve(v, defs) for v in variants if v.get("type") != "null"]
        types = sorted(v.get("type", "") for v in non_null)
        rest = {k: v for k, v in s.items() if k != "anyOf"}
        if types == ["integer", "string"]:
            return {**rest, "x-int-or-string": True}
        if len(non_null) == 1:
            return {**non_null[0], **rest}
    return s


def pydantic_fields(schema: dict[str, Any], defs: dict[str, Any] | None = None, path: str = "",
                    required: bool = False) -> dict[str, Row]:
    defs = schema.get("$defs", {}) if defs is None else defs
    s = _resolve(schema, defs)
    rows: dict[str, Row] = {}
    if s.get("x-int-or-string"):
        t = "int-or-string"
    elif "const" in s:
        t, s = "string", {**s, "enum": [s["const"]]}
    else:
        t = s.get("type", "any")
    row: Row = {"type": t, "required": required, **_bounds(s, crd=False)}
    if "enum" in s:
        row["enum"] = sorted(s["enum"])
    if s.get("default") is not None:
        row["default"] = s["default"]
    if path:
        rows[path] = row
    if t == "object":
        req = set(s.get("required", []))
        for name, sub in s.get("properties", {}).items():
            rows.update(pydantic_fields(sub, defs, f"{path}.{name}" if path else name, name in req))
        if isinstance(s.get("additionalProperties"), dict):
            rows.update(pydantic_fields(s["additionalProperties"], defs, f"{path}{{}}"))
    if t == "array":
        rows.update(pydantic_fields(s["items"], defs, f"{path}[]"))
    return rows
