"""The config loader: defaults, sizes, the three accepted forms, and errors that always
name the key path (and never escape as anything but ConfigError)."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import tiermem
from tiermem.config import (ConfigError, IOSettings, PipelineSettings, PlacementRule, Settings,
                            load_config)

from conftest import FULL_SWEEP

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_default_yaml_equals_builtin_defaults():
    assert load_config(REPO / "configs" / "default.yaml") == load_config(None) == Settings()
    assert load_config(str(REPO / "configs" / "default.yaml")) == Settings()
    assert load_config({}) == Settings()


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_load(path):
    try:
        s = load_config(path)
    except ConfigError as exc:  # a budget larger than this machine: still a clean error
        assert exc.key == "tiers.host.capacity"
        pytest.skip(str(exc))
    assert isinstance(s, Settings)


def test_defaults():
    s = Settings()
    assert s.io == IOSettings(backend="auto", queue_depth=32, block_size=1 << 20, retries=2,
                              o_direct="auto")
    assert s.swap.checksums is True
    assert s.tiers.gpu.capacity == 0 and s.tiers.host.capacity == 2 << 30
    assert s.pipeline == PipelineSettings(64 << 20, 4, 2, True)
    assert s.placement == [] and s.optimizer.kernel == "auto"


def test_settings_object_passes_through():
    s = load_config({"pipeline": {"partition_size": "1MiB"}})
    assert load_config(s) is s


def test_mapping_types_and_none_sections():
    src = types.MappingProxyType({"io": {"backend": "threads"}, "tiers": None})
    s = load_config(src)
    assert s.io.backend == "threads" and s.tiers == Settings().tiers


@pytest.mark.parametrize("text, expected", [
    ("512MiB", 512 << 20), (4096, 4096), ("1.5GB", 1_500_000_000), ("64KiB", 64 << 10),
    ("2GiB", 2 << 30), ("1TiB", 1 << 40), ("3M", 3 << 20), ("10kb", 10_000), (" 7 MiB ", 7 << 20),
    ("0", 0), ("1.5KiB", 1536), (".5MiB", 512 << 10),
])
def test_sizes(text, expected):
    # the gpu capacity: a plain size with no bounds (the host one is checked against RAM)
    assert load_config({"tiers": {"gpu": {"capacity": text}}}).tiers.gpu.capacity == expected


def test_sizes_in_every_size_field():
    s = load_config({"io": {"block_size": "64KiB"},
                     "pipeline": {"partition_size": "1.5MiB"}})
    assert s.io.block_size == 64 << 10 and s.pipeline.partition_size == 3 << 19


def test_yaml_file_with_sizes(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("pipeline:\n  partition_size: 256KiB\n  buffer_count: 3\n"
                 "placement:\n  - {match: 'emb*', tier: host}\n")
    s = load_config(p)
    assert s.pipeline.partition_size == 256 << 10 and s.pipeline.buffer_count == 3
    assert s.placement == [PlacementRule("emb*", "host")]


# -- errors ---------------------------------------------------------------------------------


ERRORS = [
    # (document, key path, a word of the explanation)
    ({"swapp": {}}, "swapp", "unknown key"),
    ({"io": {"backend": "io_uring", "depth": 3}}, "io.depth", "unknown key"),
    ({"tiers": {"host": {"capacity": 0, "size": 1}}}, "tiers.host.size", "unknown key"),
    ({"placement": [{"match": "*", "tier": "host", "x": 1}]}, "placement[0].x", "unknown key"),
    ({"io": {"backend": "aio"}}, "io.backend", "io_uring"),
    ({"io": {"o_direct": "yes"}}, "io.o_direct", "allowed"),
    ({"io": {"o_direct": 1}}, "io.o_direct", "allowed"),
    ({"io": {"queue_depth": "32"}}, "io.queue_depth", "integer"),
    ({"io": {"queue_depth": 32.0}}, "io.queue_depth", "integer"),
    ({"io": {"queue_depth": True}}, "io.queue_depth", "integer"),
    ({"io": {"queue_depth": 0}}, "io.queue_depth", "range"),
    ({"io": {"queue_depth": 5000}}, "io.queue_depth", "range"),
    ({"io": {"block_size": "6000"}}, "io.block_size", "multiple of 4096"),
    ({"io": {"block_size": "2KiB"}}, "io.block_size", "range"),
    ({"io": {"block_size": "1 parsec"}}, "io.block_size", "size"),
    ({"io": {"block_size": -4096}}, "io.block_size", "negative"),
    ({"io": {"block_size": 1.5}}, "io.block_size", "size"),
    ({"tiers": {"host": {"capacity": "0.5"}}}, "tiers.host.capacity", "whole number"),
    ({"tiers": {"host": {"capacity": True}}}, "tiers.host.capacity", "size"),
    ({"tiers": {"host": {"capacity": "1PiB"}}}, "tiers.host.capacity", "size"),
    ({"tiers": {"host": {"capacity": "64TiB"}}}, "tiers.host.capacity", "memory"),
    ({"tiers": {"host": 5}}, "tiers.host", "mapping"),
    ({"tiers": []}, "tiers", "mapping"),
    ({"pipeline": {"partition_size": "32KiB"}}, "pipeline.partition_size", "range"),
    ({"pipeline": {"buffer_count": 1}}, "pipeline.buffer_count", "range"),
    ({"pipeline": {"buffer_count": 3, "prefetch_depth": 3}}, "pipeline.buffer_count",
     "prefetch_depth + 1"),
    ({"pipeline": {"prefetch_depth": 0}}, "pipeline.prefetch_depth", "range"),
    ({"pipeline": {"zigzag": "yes"}}, "pipeline.zigzag", "true or false"),
    ({"pipeline": {"zigzag": 1}}, "pipeline.zigzag", "true or false"),
    ({"swap": {"paths": []}}, "swap.paths", "at least one"),
    ({"swap": {"paths": "/tmp"}}, "swap.paths", "list"),
    ({"swap": {"paths": ["/tmp", 3]}}, "swap.paths[1]", "string"),
    ({"placement": {"match": "*"}}, "placement", "list"),
    ({"placement": ["*"]}, "placement[0]", "mapping"),
    ({"placement": [{"match": "*"}, {"tier": "ssd"}]}, "placement[1].tier", "nvme"),
    ({"placement": [{"match": 3}]}, "placement[0].match", "string"),
    ({"optimizer": {"kernel": "apex"}}, "optimizer.kernel", "match"),
    ([1, 2], "<root>", "mapping"),
]


@pytest.mark.parametrize("doc, key, word", ERRORS, ids=[e[1] + "-" + str(i)
                                                       for i, e in enumerate(ERRORS)])
def test_error_names_key_path(doc, key, word):
    with pytest.raises(ConfigError) as info:
        load_config(doc) if isinstance(doc, dict) else load_config_yaml_root(doc)
    err = info.value
    assert err.key == key
    msg = str(err)
    assert f"config key '{key}'" in msg
    assert word.lower() in msg.lower(), msg
    assert isinstance(err, ValueError) and isinstance(err, tiermem.TierMemError)


def load_config_yaml_root(doc, tmp=None):
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(doc, f)
        f.flush()
        return load_config(f.name)


@pytest.mark.parametrize("doc, key, word", ERRORS[:12])
def test_same_errors_from_yaml_file(tmp_path, doc, key, word):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as info:
        load_config(p)
    assert info.value.key == key


def test_error_shows_value_and_allowed():
    with pytest.raises(ConfigError) as info:
        load_config({"io": {"backend": "aio"}})
    err = info.value
    assert err.value == "aio" and "'aio'" in str(err)
    assert "'auto'" in err.allowed and "'threads'" in err.allowed


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "missing.yaml")
    assert info.value.key == "<file>" and "missing.yaml" in str(info.value)
    bad = tmp_path / "bad.yaml"
    bad.write_text("io: {backend: [\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    assert info.value.key == "<file>" and "YAML" in str(info.value)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    with pytest.raises(ConfigError) as info:
        load_config(scalar)
    assert info.value.key == "<root>"
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    assert load_config(empty) == Settings()


def test_wrong_source_type():
    with pytest.raises(ConfigError) as info:
        load_config(42)
    assert info.value.key == "<root>"


def test_huge_size_string_is_a_config_error():
    """A size string whose number overflows a float must be reported like any bad size."""
    with pytest.raises(ConfigError) as info:
        load_config({"pipeline": {"partition_size": "9" * 400}})
    assert info.value.key == "pipeline.partition_size"


@pytest.mark.parametrize("text, expected", [
    ("2.01KB", 2010), ("1.005GB", 1_005_000_000), ("8.03KB", 8030),
    ("9007199254740993", 9007199254740993),
])
def test_exact_sizes(text, expected):
    """Sizes that are whole numbers of bytes parse exactly (no binary-float rounding)."""
    assert load_config({"tiers": {"gpu": {"capacity": text}}}).tiers.gpu.capacity == expected


def test_huge_size_int_is_range_error():
    with pytest.raises(ConfigError) as info:
        load_config({"pipeline": {"partition_size": 10 ** 400}})
    assert info.value.key == "pipeline.partition_size"


# -- fuzz -----------------------------------------------------------------------------------------

SCHEMA_KEYS = ["swap", "io", "tiers", "pipeline", "placement", "optimizer", "paths", "backend",
               "queue_depth", "block_size", "o_direct", "gpu", "host", "capacity",
               "partition_size", "buffer_count", "prefetch_depth", "zigzag", "match", "tier",
               "kernel", "state_dtype", "state_rounding"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.sampled_from(["auto", "io_uring", "threads", "fused", "match", "host", "nvme", "gpu",
                     "fp32", "bf16", "stochastic", "nearest",
                     "64KiB", "1.5GB", "512MiB", "4096", "0", "-1", "1e3", "9" * 40, "nan",
                     "inf", "1.5", ".", "KiB", "10TB", "*", "~/x", "$HOME"]))
keys = st.one_of(st.sampled_from(SCHEMA_KEYS), st.text(max_size=8))
documents = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                     st.dictionaries(keys, inner, max_size=5)),
    max_leaves=25)


@st.composite
def shaped_documents(draw):
    """Documents with the right sections and keys but random leaf values (so that the
    fuzz reaches the converters, not just 'unknown key')."""
    doc = {}
    for section, fields in {"swap": ["paths"], "io": ["backend", "queue_depth", "block_size",
                                                       "o_direct"],
                            "pipeline": ["partition_size", "buffer_count", "prefetch_depth",
                                         "zigzag"],
                            "optimizer": ["kernel", "state_dtype", "state_rounding"]}.items():
        if draw(st.booleans()):
            doc[section] = {f: draw(documents) for f in fields if draw(st.booleans())}
    if draw(st.booleans()):
        doc["tiers"] = {t: {"capacity": draw(documents)} for t in ("gpu", "host")
                        if draw(st.booleans())}
    if draw(st.booleans()):
        doc["placement"] = draw(st.lists(st.fixed_dictionaries(
            {}, optional={"match": documents, "tier": documents}), max_size=3))
    return doc


def _settings_or_config_error(source):
    try:
        s = load_config(source)
    except ConfigError as exc:
        assert isinstance(exc.key, str) and f"config key '{exc.key}'" in str(exc)
        return None
    assert isinstance(s, Settings)
    return s


# 300 examples in the full tier, 100 in the default one (docs/dev/testing.md, "Two tiers")
FUZZ = settings(max_examples=300 if FULL_SWEEP else 100, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@FUZZ
@given(documents)
def test_fuzz_any_document(doc):
    if isinstance(doc, str):
        doc = {"swap": doc}  # a str source is a file path; put the text inside a document
    _settings_or_config_error(doc)


@FUZZ
@given(shaped_documents())
def test_fuzz_shaped_document(doc):
    s = _settings_or_config_error(doc)
    if s is not None:  # whatever was accepted satisfies the documented constraints
        assert s.pipeline.buffer_count >= s.pipeline.prefetch_depth + 1
        assert s.pipeline.partition_size >= 64 << 10 and s.io.block_size % 4096 == 0
        assert s.swap.paths and all(isinstance(p, str) for p in s.swap.paths)
        assert s.io.backend in ("auto", "io_uring", "threads")
        for r in s.placement:
            assert isinstance(r.match, str) and r.tier in ("gpu", "host", "nvme")


@FUZZ
@given(st.one_of(documents, shaped_documents()))
def test_fuzz_yaml_file(tmp_path, doc):
    p = tmp_path / "fuzz.yaml"
    try:
        p.write_text(yaml.safe_dump(doc))
    except yaml.YAMLError:
        assume(False)
    _settings_or_config_error(p)


def test_settings_are_frozen():
    s = Settings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.io = IOSettings()  # type: ignore[misc]
