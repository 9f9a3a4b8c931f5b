"""``EngineConfig``: the engine's settings as sub-configs (vLLM's ``VllmConfig``), built from
sub-config objects or from the flat keywords of ``LLM(...)``.

Scope: ``EngineConfig`` holds one object per concern (``SUB_CONFIGS``: ``model_config``,
``cache_config``, ``scheduler_config``, ``multimodal_config``, ``device_config``,
``speculative_config``), each validating its own fields on creation, plus the checks that
span two of them. The flat keywords (``EngineConfig(model=..., kvcache_block_size=32)``,
``LLM(..., max_num_seqs=8)``) are generated from the sub-configs' fields (``flat_routes``):
a field's own name, or the alias in its ``flat(...)`` metadata; a nested policy's fields
(``multimodal_config.media``) are flat keywords too. Adding a setting is adding one field
to one sub-config; its command-line flag follows too (``add_cli_args`` / ``from_cli_args``,
``atlas_vlm.config.cli``). Reading ``config.<flat name>`` still works (a read-only view through
the same routes) for code written before the split; the code base reads the sub-configs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields, is_dataclass

import torch

from atlas_vlm.config.cache import CacheConfig
from atlas_vlm.config.cli import add_flags, flag_values
from atlas_vlm.config.device import DeviceConfig
from atlas_vlm.config.model import ModelConfig
from atlas_vlm.config.multimodal import MultiModalConfig
from atlas_vlm.config.scheduler import SchedulerConfig
from atlas_vlm.config.speculative import SpeculativeConfig

#: EngineConfig attribute -> sub-config class (the one list of the sub-configs).
SUB_CONFIGS = {"model_config": ModelConfig, "cache_config": CacheConfig, "scheduler_config": SchedulerConfig,
               "multimodal_config": MultiModalConfig, "device_config": DeviceConfig,
               "speculative_config": SpeculativeConfig}


def _nested_class(f: dataclasses.Field):
    """The dataclass a field holds (its ``default_factory``), or None for a plain value."""
    factory = f.default_factory
    return factory if factory is not dataclasses.MISSING and is_dataclass(factory) else None


def _routes() -> dict[str, tuple[str, ...]]:
    routes: dict[str, tuple[str, ...]] = {}

    def add(name: str, path: tuple[str, ...]) -> None:
        if name in routes:
            raise RuntimeError(f"flat keyword {name!r} names both {'.'.join(routes[name])} and {'.'.join(path)}")
        routes[name] = path

    for attr, cls in SUB_CONFIGS.items():
        for f in fields(cls):
            nested = _nested_class(f)
            if nested is None:
                add(f.metadata.get("flat") or f.name, (attr, f.name))
                continue
            renames = f.metadata.get("flat_names", {})
            for g in fields(nested):
                add(renames.get(g.name, g.name), (attr, f.name, g.name))
    return routes


#: flat keyword -> attribute path from an EngineConfig, e.g. "kvcache_block_size" -> ("cache_config", "block_size").
FLAT_ROUTES = _routes()
_FLAT_BY_PATH = {path: name for name, path in FLAT_ROUTES.items()}


def _build(cls, values: dict, base=None):
    """``cls`` from ``values`` (field -> value; a nested dataclass field takes a dict of its
    own fields too), over ``base`` (an instance) when given. Runs ``cls``'s checks."""
    kwargs = {}
    for f in fields(cls):
        nested = _nested_class(f)
        if nested is not None and isinstance(values.get(f.name), dict):
            kwargs[f.name] = _build(nested, values[f.name], getattr(base, f.name) if base is not None else None)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)


@dataclass(init=False)
class EngineConfig:
    """Engine settings (names follow vLLM), as sub-configs.

    ``EngineConfig(model=..., **flat)`` takes the flat keywords (``flat_names()``: every
    sub-config field, by its flat name) and/or whole sub-configs (``cache_config=CacheConfig(...)``;
    flat keywords then apply over it).

    Raises:
        TypeError: an unknown keyword (the message names it and the known ones), or no model.
        ValueError: on creation, for any out-of-range field (the message names it).
    """

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    multimodal_config: MultiModalConfig
    device_config: DeviceConfig
    speculative_config: SpeculativeConfig

    def __init__(self, model: str | None = None, **kwargs):
        subs = {attr: kwargs.pop(attr) for attr in SUB_CONFIGS if attr in kwargs}
        unknown = sorted(set(kwargs) - set(FLAT_ROUTES))
        if unknown:
            raise TypeError(f"EngineConfig got unknown keyword(s) {unknown}; known: the sub-configs "
                            f"{list(SUB_CONFIGS)} and the flat keywords {sorted(FLAT_ROUTES)}")
        if model is not None:
            kwargs["model"] = model
        values: dict[str, dict] = {attr: {} for attr in SUB_CONFIGS}
        for name, value in kwargs.items():
            attr, *path = FLAT_ROUTES[name]
            into = values[attr]
            for part in path[:-1]:
                into = into.setdefault(part, {})
            into[path[-1]] = value
        if "model_config" not in subs and "model" not in values["model_config"]:
            raise TypeError("EngineConfig needs model=... (or model_config=ModelConfig(...))")
        for attr, cls in SUB_CONFIGS.items():
            base = subs.get(attr)
            if base is not None and not isinstance(base, cls):
                raise TypeError(f"{attr} must be a {cls.__name__}, got {type(base).__name__}")
            object.__setattr__(self, attr, _build(cls, values[attr], base) if values[attr] or base is None else base)
        # a check spanning two sub-configs goes here, after both are built; today every check is
        # within one (kv_cache_dir needing prefix caching is CacheConfig's: both fields are there), and
        # those that need the loaded model run at load (the exclusion table, engine/plan_rules.py)

    # ---- flat view (read-only), generated from FLAT_ROUTES -------------------------------------
    def __getattr__(self, name: str):
        route = FLAT_ROUTES.get(name)
        if route is None or route[0] not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        value = self
        for part in route:
            value = getattr(value, part)
        return value

    def __setattr__(self, name: str, value) -> None:
        if name in FLAT_ROUTES:
            raise AttributeError(f"EngineConfig.{name} is a read-only view of {'.'.join(FLAT_ROUTES[name])}: "
                                 "set it there, or build a new EngineConfig")
        object.__setattr__(self, name, value)

    @classmethod
    def flat_names(cls) -> tuple[str, ...]:
        """Every flat keyword ``EngineConfig(...)`` / ``LLM(...)`` takes, sorted."""
        return tuple(sorted(FLAT_ROUTES))

    def flat_kwargs(self) -> dict:
        """This config as flat keywords: ``EngineConfig(**config.flat_kwargs()) == config``."""
        return {name: getattr(self, name) for name in FLAT_ROUTES}

    # ---- command-line flags, generated from the sub-configs' fields (atlas_vlm.config.cli) ------
    @staticmethod
    def add_cli_args(parser, *, exclude=(), only=None, overrides: dict | None = None) -> None:
        """Add one flag per sub-config field to ``parser`` (one argument group per sub-config),
        less the field names in ``exclude`` and the fields marked ``flag(skip=...)`` (only
        those in ``only`` when given); ``overrides``: ``{field name: {Flag attribute: value}}``
        (a command's own default, choices or help; ``atlas_vlm.config.cli.flag_specs``)."""
        for cls in SUB_CONFIGS.values():
            title = f"{cls.__doc__.strip().splitlines()[0].rstrip('.')} ({cls.__name__})"
            add_flags(parser, cls, exclude=exclude, only=only, overrides=overrides, group=title)

    @staticmethod
    def cli_kwargs(args, *, overrides: dict | None = None) -> dict:
        """The flat ``EngineConfig(...)`` / ``LLM(...)`` keywords of the parsed flags that
        ``add_cli_args`` added (those ``args`` lacks are left out: their defaults apply).

        Raises:
            ValueError: a flag's value refused by its converter, or a flag without the one it needs.
        """
        out = {}
        for attr, cls in SUB_CONFIGS.items():
            stack = [((attr,), flag_values(args, cls, overrides=overrides))]
            while stack:
                path, values = stack.pop()
                for name, value in values.items():
                    if isinstance(value, dict):
                        stack.append((path + (name,), value))
                    else:
                        out[_FLAT_BY_PATH[path + (name,)]] = value
        return out

    @classmethod
    def from_cli_args(cls, args, *, overrides: dict | None = None, **kwargs) -> EngineConfig:
        """``EngineConfig(**cli_kwargs(args), **kwargs)``: the parsed flags, then ``kwargs`` over them."""
        return cls(**{**cls.cli_kwargs(args, overrides=overrides), **kwargs})

    # ---- derived values that need two sub-configs ----------------------------------------------
    def torch_device(self) -> torch.device:
        """``device_config.torch_device()``."""
        return self.device_config.torch_device()

    def torch_dtype(self) -> torch.dtype:
        """The compute / weight / KV dtype: ``model_config.dtype`` on this device
        (``ModelConfig.torch_dtype``).

        Raises:
            ValueError: ``dtype`` is not "auto", "float32", "bfloat16" or "float16".
        """
        return self.model_config.torch_dtype(self.torch_device())
