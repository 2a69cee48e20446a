"""Config machinery: YAML / dict loading, dotted overrides, type checks, did-you-mean, validation."""

import dataclasses
from pathlib import Path
from typing import Literal, Optional

import pytest
import yaml

from flashformer.config import ConfigError, config_to_dict, load_config, save_config
from flashformer.model import ModelConfig

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "models"


@dataclasses.dataclass
class Optim:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)

    def validate(self):
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")


@dataclasses.dataclass
class Run:
    name: str
    steps: int = 10
    compile: bool = False
    precision: Literal["fp32", "bf16"] = "bf16"
    warmup: Optional[int] = None
    tags: list[str] = dataclasses.field(default_factory=list)
    extra: dict = dataclasses.field(default_factory=dict)
    optim: Optim = dataclasses.field(default_factory=Optim)


def test_dict_with_defaults_and_conversions():
    cfg = load_config(Run, {"name": "a", "optim": {"lr": 1, "betas": [0.8, 0.9]}})
    assert cfg == Run(name="a", optim=Optim(lr=1.0, betas=(0.8, 0.9)))
    assert isinstance(cfg.optim.lr, float) and isinstance(cfg.optim.betas, tuple)


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("name: base\nsteps: 5\noptim:\n  lr: 1e-3\n")  # YAML 1.1 reads 1e-3 as a string
    cfg = load_config(Run, path, ["steps=7", "optim.betas=[0.5, 0.6]", "extra.a.b=3", "warmup=null", "tags=[x, y]"])
    assert cfg.steps == 7 and cfg.optim.lr == 1e-3 and cfg.optim.betas == (0.5, 0.6)
    assert cfg.extra == {"a": {"b": 3}} and cfg.warmup is None and cfg.tags == ["x", "y"]


@pytest.mark.parametrize("source, overrides, message", [
    ({"name": "a", "stpes": 3}, (), "'stpes'.*did you mean 'steps'"),
    ({"name": "a"}, ["optim.llr=0.1"], "'optim.llr'.*did you mean 'lr'"),
    ({"name": "a", "steps": "many"}, (), "steps: expected int, got 'many'"),
    ({"name": "a", "compile": 1}, (), "compile: expected bool"),
    ({"name": "a", "steps": True}, (), "steps: expected int"),
    ({"name": "a", "precision": "fp8"}, (), "precision: expected one of \\['fp32', 'bf16'\\]"),
    ({"name": "a", "warmup": 1.5}, (), "warmup: expected"),
    ({"name": "a", "optim": {"betas": [0.9]}}, (), "optim.betas: expected 2 items"),
    ({"name": "a", "tags": [1]}, (), r"tags\[0\]: expected str"),
    ({"name": "a", "optim": 3}, (), "optim: expected a mapping"),
    ({"name": "a"}, ["optim.lr=-1"], "lr must be > 0"),
    ({}, (), "missing required config key 'name'"),
    ({"name": "a"}, ["steps"], "must look like 'key.subkey=value'"),
    ({"name": "a"}, ["name.x=1"], "'name' holds a value"),
    ({"name": "a"}, ["steps=[1,"], r"override 'steps=\[1,': the value is not valid YAML"),
])
def test_errors_name_the_key(source, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Run, source, overrides)


@pytest.mark.parametrize("text, message", [
    ("name: a\nsteps: [1,\n", r"not valid YAML \(.* at line 3, column 1\)"),
    ("name: a\n  steps: 2\n", r"not valid YAML \(.* at line 2"),
])
def test_a_malformed_yaml_file_is_named_with_its_line(tmp_path, text, message):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"broken.yaml: {message}"):
        load_config(Run, str(path))


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_save_and_reload(tmp_path):
    cfg = load_config(Run, {"name": "a", "tags": ["t"], "optim": {"betas": [0.1, 0.2]}})
    save_config(cfg, tmp_path / "out.yaml")
    assert yaml.safe_load((tmp_path / "out.yaml").read_text())["optim"]["betas"] == [0.1, 0.2]
    assert load_config(Run, tmp_path / "out.yaml") == cfg
    assert list(tmp_path.iterdir()) == [tmp_path / "out.yaml"]  # no temporary file left behind


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_model_configs_load(path):
    cfg = load_config(ModelConfig, path)
    assert load_config(ModelConfig, config_to_dict(cfg)) == cfg


def test_model_config_did_you_mean_and_validation():
    with pytest.raises(ConfigError, match="did you mean 'n_layer'"):
        load_config(ModelConfig, {"n_layers": 2})
    with pytest.raises(ConfigError, match="n_kv_head"):
        load_config(ModelConfig, {"n_head": 4, "n_kv_head": 3, "d_model": 64})
    with pytest.raises(ConfigError, match="head_dim"):
        load_config(ModelConfig, {"n_head": 4, "d_model": 36})
    with pytest.raises(ConfigError, match="rope_scaling.factr.*did you mean 'factor'"):
        load_config(ModelConfig, {"rope_scaling": {"rope_type": "linear", "factr": 2.0}})
    with pytest.raises(ConfigError, match="rope_type='ntk'"):
        load_config(ModelConfig, {"rope_scaling": {"type": "ntk", "factor": 2.0}})
    with pytest.raises(ConfigError, match="pos='learned'"):
        load_config(ModelConfig, {"pos": "learned", "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    with pytest.raises(ConfigError, match="sliding_window"):
        ModelConfig(sliding_window=0).validate()


def test_attn_backend_and_deterministic_are_training_options():
    """Top-level keys of a recipe; ``model.attn_backend`` (where recipes and run configs put it while it was
    a model field) still sets it, and a retired backend name says what replaces it."""
    from flashformer.train import load_train_config

    assert (load_train_config().attn_backend, load_train_config().deterministic) == ("auto", True)
    assert load_train_config({"model": {"attn_backend": "sdpa", "n_layer": 2}}).attn_backend == "sdpa"
    assert load_train_config(overrides=["model.attn_backend=naive"]).attn_backend == "naive"
    cfg = load_train_config(overrides=["attn_backend=flash", "deterministic=false"])
    assert (cfg.attn_backend, cfg.deterministic) == ("flash", False)
    with pytest.raises(ConfigError, match="attn_backend='cuda'"):
        load_train_config(overrides=["attn_backend=cuda"])
    with pytest.raises(ConfigError, match="'flash-nondeterministic' is no longer a backend: use attn_backend='flash' "
                                          "with deterministic=False"):
        load_train_config({"model": {"attn_backend": "flash-nondeterministic"}})


def test_a_model_file_override_replaces_the_recipes_model(tmp_path, monkeypatch):
    from flashformer.train import load_train_config

    recipe = CONFIG_DIR.parent / "tiny.yaml"
    from_recipe_dir = load_train_config(recipe, ["model=models/tiny-llama.yaml", "model.n_layer=3"])
    assert (from_recipe_dir.model.family, from_recipe_dir.model.n_kv_head, from_recipe_dir.model.n_layer) == \
        ("llama", 2, 3)  # the file's fields, then the later override on top
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text("family: gpt2\nd_model: 96\nn_layer: 1\nn_head: 3\n")
    assert load_train_config(recipe, ["model=mine.yaml"]).model.d_model == 96  # relative to the working directory
    with pytest.raises(ConfigError, match="model=nowhere.yaml: not a model file"):
        load_train_config(recipe, ["model=nowhere.yaml"])
