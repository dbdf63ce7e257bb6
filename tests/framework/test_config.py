"""Strict config loading: every bad value names its dotted path and a fix; every shipped YAML loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from framework.base.errors import ConfigError
from framework.base.yaml_config import apply_overrides, parse_override
from framework.config import Config, dump_config, load_config

REPO = Path(__file__).resolve().parents[2]
ALL_CONFIGS = sorted(p for p in (REPO / "configs").rglob("*.yaml"))


def test_defaults_load() -> None:
    cfg = load_config(None)
    assert isinstance(cfg, Config)
    assert cfg.train.global_batch_size % cfg.train.micro_batch_size == 0


def _loader(path: Path):  # type: ignore[no-untyped-def]
    """configs/data/ holds data-build configs, *.ablate.yaml ablation specs; everything else trains."""
    kind = path.relative_to(REPO / "configs").parts[0]
    if kind == "data":
        from data_pipeline.build.config import load_build_config

        return load_build_config
    if path.name.endswith(".ablate.yaml"):
        from framework.drivers.ablate import load_spec

        return load_spec
    return load_config


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_config_loads(path: Path) -> None:
    assert _loader(path)(path) is not None


def test_configs_exist() -> None:
    assert len(ALL_CONFIGS) >= 2, "configs/ must ship at least the smoke configs"


def _err(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "configs/smoke/tiny.yaml", overrides)
    return str(info.value)


def test_unknown_key_names_path_and_closest() -> None:
    msg = _err(["train.learning_rate=1e-3"])
    assert "train.learning_rate" in msg
    msg = _err(["train.global_bach_size=8"])
    assert "train.global_bach_size" in msg and "global_batch_size" in msg
    msg = _err(["modle.hidden=8"])
    assert "'modle.hidden'" not in msg and "modle" in msg and "model" in msg


def test_wrong_type_names_expected_type() -> None:
    msg = _err(["train.steps=ten"])
    assert "train.steps" in msg and "expected an int" in msg
    msg = _err(["train.lr=[1]"])
    assert "train.lr" in msg and "float" in msg
    msg = _err(["train.precision=fp8"])
    assert "train.precision" in msg and "'bf16'" in msg
    msg = _err(["model.tied_embeddings=3"])
    assert "model.tied_embeddings" in msg and "bool" in msg


def test_heads_must_divide_hidden() -> None:
    msg = _err(["model.hidden=66", "model.n_heads=4"])
    assert "model.n_heads=4" in msg and "model.hidden=66" in msg and "choose" in msg


def test_kv_heads_must_divide_heads() -> None:
    msg = _err(["model.n_kv_heads=3"])
    assert "model.n_kv_heads=3" in msg and "model.n_heads=4" in msg and "choose one of [1, 2, 4]" in msg


def test_negative_learning_rate() -> None:
    msg = _err(["train.lr=-1e-3"])
    assert "train.lr=-0.001" in msg and "must be > 0" in msg


def test_batch_divisibility_and_seq_len() -> None:
    assert "train.global_batch_size=7" in _err(["train.global_batch_size=7"])
    assert "data.seq_len=1024" in _err(["data.seq_len=1024"])


def test_unknown_preset() -> None:
    msg = _err(["model.preset=llama3-7b"])
    assert "model.preset" in msg and "llama3-8b" in msg


def test_overrides_parse_yaml() -> None:
    assert parse_override("a.b=3") == (["a", "b"], 3)
    # YAML 1.1 reads 3e-4 as a string; float fields still accept it
    assert load_config(REPO / "configs/smoke/tiny.yaml", ["train.lr=3e-4"]).train.lr == 3e-4
    assert parse_override("x={k: 1}") == (["x"], {"k": 1})
    assert apply_overrides({"a": {"b": 1, "c": 2}}, ["a.b=5"]) == {"a": {"b": 5, "c": 2}}
    with pytest.raises(ConfigError, match=r"a\.b\.c=value"):
        parse_override("novalue")


def test_preset_fields_and_override() -> None:
    cfg = load_config(REPO / "configs/smoke/tiny.yaml", ["model.n_layers=2"])
    assert cfg.model.hidden == 64 and cfg.model.n_layers == 2 and cfg.model.preset == "test-tiny"


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs/smoke/smoke.yaml", ["train.lr=1e-3"])
    (tmp_path / "c.yaml").write_text(dump_config(cfg))
    again = load_config(tmp_path / "c.yaml")
    assert again == cfg


def test_base_inheritance(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text("train: {steps: 5, lr: 0.01, warmup_steps: 1}\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\ntrain: {steps: 7}\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert cfg.train.steps == 7 and cfg.train.lr == 0.01


def test_data_vocab_follows_the_model_and_the_old_key_warns() -> None:
    import logging

    cfg = load_config(REPO / "configs/smoke/tiny.yaml", ["model.vocab_size=1024"])
    assert cfg.data.vocab_size == cfg.model.vocab_size == 1024  # one canonical key, the other derived
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("tessera.config")
    logger.addHandler(handler)
    try:
        assert load_config(REPO / "configs/smoke/tiny.yaml", ["data.vocab_size=512"]).data.vocab_size == 512
        assert not seen  # equal to model.vocab_size: redundant, silent
        assert load_config(REPO / "configs/smoke/tiny.yaml", ["data.vocab_size=256"]).data.vocab_size == 256
    finally:
        logger.removeHandler(handler)
    assert len(seen) == 1 and "data.vocab_size=256" in seen[0] and "deprecated" in seen[0]
