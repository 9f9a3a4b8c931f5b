"""``deploy/ray_serve.yaml`` is a valid Ray Serve config (Serve's own schema) whose
``import_path`` is our ``app_builder`` and whose ``args`` are ``build_app``'s keyword
arguments and ``EngineConfig`` fields (no cluster, no model needed)."""

from __future__ import annotations

import importlib
import inspect

import pytest
import yaml

from helpers import REPO

pytestmark = [pytest.mark.server, pytest.mark.text, pytest.mark.ray]


def test_deploy_yaml_is_a_serve_config_for_app_builder():
    from ray.serve.schema import ServeDeploySchema

    from atlas_vlm.config import EngineConfig
    from atlas_vlm.entrypoints.ray_serve import app_builder, build_app

    config = ServeDeploySchema.model_validate(yaml.safe_load((REPO / "deploy/ray_serve.yaml").read_text()))
    (app,) = config.applications
    module, name = app.import_path.split(":")
    assert getattr(importlib.import_module(module), name) is app_builder
    args = dict(app.args)
    engine = args.pop("engine")
    assert set(args) - {"num_replicas"} <= set(inspect.signature(build_app).parameters)
    assert set(engine) <= set(EngineConfig.flat_names())
    EngineConfig(**engine)  # the values are valid too


def test_replica_health_check_reports_a_dead_engine():
    """Ray Serve replaces a replica whose ``check_health`` raises: it must once the engine
    is dead (``AsyncLLM`` gave up after repeated step faults), not only when its thread ended."""
    from types import SimpleNamespace

    from atlas_vlm.entrypoints.ray_serve import EngineReplica

    replica = object.__new__(EngineReplica.func_or_class)
    replica.front = SimpleNamespace(alive=True, dead=False, _dead=None)
    replica.check_health()  # serving: no error
    replica.front = SimpleNamespace(alive=False, dead=True, _dead=RuntimeError("injected step fault"))
    with pytest.raises(RuntimeError, match="engine is dead: injected step fault"):
        replica.check_health()
    replica.front = SimpleNamespace(alive=False, dead=False, _dead=None)
    with pytest.raises(RuntimeError, match="engine thread is not running"):
        replica.check_health()
