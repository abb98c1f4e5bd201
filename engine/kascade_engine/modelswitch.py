"""Model switching: a released engine of one model becomes an engine of another (the shared pool, issue 35).

Data flow: `bind` with a model this engine does not hold and a `modelPath` -> `switch_model(instance, name,
path)` -> the model's config.json and tokenizer read from `path` -> the instance rebuilt empty for that model
(its weights come by the plan that bound it) -> its metric series relabelled with the new model's name.
Only an engine bound to no service, holding no weights and serving nothing may switch; another model's host copy
goes (the host budget is the new model's now). One process, one rank: a TP engine's ranks are fixed at start.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from kascade_engine.config import EngineConfig
from kascade_engine.metrics import EngineMetrics
from kascade_engine.refusal import InstanceError
from kascade_engine.tokenizer import Tokenizer, load_tokenizer
from kascade_planner.engine_api import Phase

log = logging.getLogger(__name__)


class SwitchTarget(Protocol):
    """What a model switch reads and writes of the instance (instance.py's EngineInstance)."""

    instance_id: str
    config: EngineConfig
    model_service: str | None
    phase: Phase
    model: Any  # its `weights` (held blocks)
    serving: Any  # its `idle`
    tokenizer: Tokenizer
    model_cfg: dict[str, Any]
    host_copy: Any
    metrics: EngineMetrics
    pd_metrics: Any  # its `model_name`

    def rebuild(self, config: EngineConfig) -> None: ...


def switch_model(inst: SwitchTarget, name: str, path: str) -> None:
    """Make `inst` an empty engine of model `name`, configured from the directory `path` (raises InstanceError:
    409 when the engine may not switch now, 400 naming `modelPath` when `path` holds no readable config.json)."""
    if inst.model_service is not None or inst.phase not in (Phase.EMPTY, Phase.RELEASED) \
            or inst.model.weights or not inst.serving.idle:
        raise InstanceError(409, f"cannot switch to model '{name}': engine is {inst.phase.value} with "
                            f"'{inst.config.model_name}' (release it first)", "model")
    if inst.config.tp > 1:
        raise InstanceError(409, f"cannot switch to model '{name}': a tp {inst.config.tp} engine's ranks are "
                            "fixed at start", "model")
    d = Path(path)
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise InstanceError(400, f"invalid field 'modelPath': no readable config.json in {path} ({e})",
                            "modelPath") from e
    old = inst.config.model_name
    inst.tokenizer, inst.model_cfg, inst.host_copy = load_tokenizer(d), dict(cfg), None
    inst.rebuild(replace(inst.config, model_name=name, checkpoint=d))
    # its Prometheus series carry the model it serves now (the PD metrics share the registry)
    moved = inst.metrics.rename(name)
    inst.pd_metrics.model_name = name
    log.info("%s: switched from model %s to %s (%s); %d metric series relabelled", inst.instance_id, old, name,
             path, moved)
