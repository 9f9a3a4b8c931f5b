"""Settings in one place (issue 33 item 6): every flag of ``serve`` / ``generate`` / ``chat`` /
``run-batch`` / ``plan`` that is a setting comes from a config field: each sub-config and
``ServerConfig`` field has a flag or a stated reason for none, the help is the field's
docstring, and a flag's value lands, parsed, in that field (serve and generate alike)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
from dataclasses import dataclass, field, fields

import pytest

from helpers import REPO
from atlas_vlm.config import SUB_CONFIGS, EngineConfig, MediaFetchPolicy
from atlas_vlm.config.cli import Flag, add_flags, flag, flag_specs, flag_values
from atlas_vlm.config.docs import attr_docs
from atlas_vlm.config.server import ServerConfig
from atlas_vlm.entrypoints import cli
from atlas_vlm.entrypoints.generate_args import NOT_ENGINE_FLAGS, engine_kwargs
from atlas_vlm.entrypoints.openai.cli_args import engine_config_from_args, server_config_from_args

pytestmark = pytest.mark.text
MODEL = "org/tiny-GGUF"  # a Hub GGUF repo id: --mmproj and --hf-file accept it (nothing is fetched)
COMPANIONS = {"--num-speculative-tokens": ["--speculative", "ngram"], "--kv-cache-dir-max-gb": ["--kv-cache-dir", "kv"]}
EXPLICIT = {"--compile-decode": (["true"], True), "--device": (["cpu"], "cpu"), "--mmproj": (["mm.gguf"], "mm.gguf"),
            "--hf-file": (["m-Q8_0.gguf"], "m-Q8_0.gguf"), "--kv-cache-dir-max-gb": (["1.5"], int(1.5 * (1 << 30))),
            "--allowed-media-domains": (["a.example", "b.example"], ["a.example", "b.example"]),
            "--served-model-name": (["one", "two"], ["one", "two"])}


def _subparser(name: str) -> argparse.ArgumentParser:
    return cli.build_parser()._subparsers._group_actions[0].choices[name]


#: (sub-config attribute, flag spec) of every engine flag; a nested policy's spec.path starts with its field.
ENGINE_SPECS = [(attr, s) for attr, cls in SUB_CONFIGS.items() for s in flag_specs(cls)]


def _classes():
    """(class, {field: skip reason}) of every settings class the flags come from."""
    for cls in [*SUB_CONFIGS.values(), ServerConfig]:
        yield cls, {f.name: (f.metadata.get("cli") or Flag()).skip for f in fields(cls)}
        for f in fields(cls):
            if dataclasses.is_dataclass(f.default_factory):  # a nested policy: its flags are the parent's sub=
                sub = f.metadata["cli"].sub or {}
                yield f.default_factory, {g.name: sub.get(g.name, Flag()).skip for g in fields(f.default_factory)}


def _non_default(spec) -> tuple[list[str], object]:
    """argv words after the option and the field value they give, other than the default."""
    if spec.option in EXPLICIT:
        return EXPLICIT[spec.option]
    default = spec.kwargs["default"]
    if spec.kwargs.get("action") is argparse.BooleanOptionalAction:
        return None, not default
    if "choices" in spec.kwargs:
        choice = [c for c in spec.kwargs["choices"] if c != default][-1]
        return [choice], choice
    if spec.meta.bytes:
        return ["3MiB"], 3 << 20
    kind = spec.kwargs["type"]
    if kind is int:
        value = (default or 0) + 3
    elif kind is float:
        value = default / 2 if default else 1.5
    else:
        value = "given-" + spec.dest
    return [str(value)], value


def _argv(spec, words) -> list[str]:
    option = spec.option if words is not None or spec.kwargs["default"] is False else "--no-" + spec.option[2:]
    return [*COMPANIONS.get(spec.option, []), option, *(words or [])]


def test_every_field_has_a_flag_or_a_reason():
    serve = {a.dest for a in _subparser("serve")._actions}
    flagged = {s.path[-1] for _, s in ENGINE_SPECS} | {s.path[-1] for s in flag_specs(ServerConfig)}
    for cls, skips in _classes():
        for f in fields(cls):
            if dataclasses.is_dataclass(f.default_factory):
                continue
            assert (f.name in flagged) != bool(skips[f.name]), f"{cls.__name__}.{f.name}: a flag or skip=REASON"
            assert attr_docs(cls).get(f.name), f"{cls.__name__}.{f.name} has no docstring (its --help)"
    assert {s.dest for _, s in ENGINE_SPECS} | {s.dest for s in flag_specs(ServerConfig)} <= serve
    assert set(NOT_ENGINE_FLAGS) == {"seed"} and all(NOT_ENGINE_FLAGS.values())


@pytest.mark.parametrize("command", ["serve", "chat", "run-batch", "plan"])
def test_help_is_the_field_docstring(command):
    parser = _subparser(command)
    actions = {a.dest: a for a in parser._actions}
    added = parser.get_default("_config_flags")
    checked = 0
    for cls, _ in _classes():
        for spec in flag_specs(cls):
            if spec.dest in added and spec.dest in actions and len(spec.path) == 1:
                doc = attr_docs(cls)[spec.path[-1]]
                assert actions[spec.dest].help.startswith(doc.replace("%", "%%")), spec.option
                checked += 1
    assert checked >= {"plan": 10}.get(command, 40)


def test_docs_read_docstrings_and_comments():
    assert attr_docs(ServerConfig)["port"] == "TCP port."
    assert attr_docs(SUB_CONFIGS["cache_config"])["block_size"] == "Tokens per KV block."
    assert attr_docs(MediaFetchPolicy)["max_redirects"].startswith("redirect hops followed per download")


@pytest.mark.parametrize(("attr", "spec"), ENGINE_SPECS, ids=[s.option for _, s in ENGINE_SPECS])
def test_serve_and_generate_flag_lands_in_its_field(attr, spec):
    words, want = _non_default(spec)
    argv = _argv(spec, words)
    config = engine_config_from_args(cli.build_parser().parse_args(["serve", MODEL, *argv]))
    node = getattr(config, attr)
    for part in spec.path:
        node = getattr(node, part)
    assert node == want and node != _default_of(spec)
    if spec.dest not in NOT_ENGINE_FLAGS:  # scripts/generate.py: the same flag, the same field
        args = _generate().parse_args(["--prompt", "x", "--model", MODEL, *argv])
        assert EngineConfig(model=MODEL, limit_request_pixels=True, **engine_kwargs(args)) == config


def _default_of(spec):
    return None if spec.option == "--kv-cache-dir-max-gb" else spec.kwargs["default"]


def _generate():
    module_spec = importlib.util.spec_from_file_location("generate_cli", REPO / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("spec", flag_specs(ServerConfig), ids=lambda s: s.option)
def test_serve_flag_lands_in_its_server_config_field(spec):
    words, want = _non_default(spec)
    server = server_config_from_args(cli.build_parser().parse_args(["serve", MODEL, *_argv(spec, words)]))
    assert getattr(server, spec.path[-1]) == want != getattr(ServerConfig(), spec.path[-1])


def test_defaults_round_trip_and_generate_seed_stays_the_sampling_seed():
    args = cli.build_parser().parse_args(["serve", MODEL])
    assert engine_config_from_args(args) == EngineConfig(model=MODEL, limit_request_pixels=True)
    assert server_config_from_args(args) == ServerConfig()
    gen = _generate().parse_args(["--prompt", "x", "--seed", "7"])
    assert gen.seed == 7 and "seed" not in engine_kwargs(gen)


def test_a_new_settings_dataclass_gets_its_flags():
    """What a new sub-config (say a LoRA one) gets by declaring fields with docstrings."""
    @dataclass
    class ToyConfig:
        enable_toy: bool = False
        """Turn the toy on."""
        max_toys: int = 1
        """Toys at most."""
        toy_modules: list[str] | None = field(default=None, metadata=flag(metavar="NAME=PATH"))
        """Toy modules to load."""

    parser = argparse.ArgumentParser()
    add_flags(parser, ToyConfig)
    args = parser.parse_args(["--enable-toy", "--max-toys", "4", "--toy-modules", "a=/x", "b=/y"])
    assert ToyConfig(**flag_values(args, ToyConfig)) == ToyConfig(True, 4, ["a=/x", "b=/y"])
    helps = {a.dest: a.help for a in parser._actions}
    assert helps["max_toys"] == "Toys at most. (default: 1)" and helps["toy_modules"] == "Toy modules to load."


def test_a_bad_value_names_its_flag():
    with pytest.raises(ValueError, match="--kv-cache-dir-max-gb needs --kv-cache-dir"):
        engine_config_from_args(cli.build_parser().parse_args(["serve", MODEL, "--kv-cache-dir-max-gb", "1"]))
    with pytest.raises(ValueError, match="--input-workers must be >= 1, got 0"):
        server_config_from_args(cli.build_parser().parse_args(["serve", MODEL, "--input-workers", "0"]))
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", MODEL, "--compile-decode", "maybe"])
