"""The configuration: defaults and derived keys, TOML round trip, overrides, and every error."""

import dataclasses
import json
import tomllib
from pathlib import Path

import pytest

from boostmpi.config import DEFAULTS, SECTIONS, Config, config_from_dict, load_config, parse_overrides
from boostmpi.errors import ConfigError, UserError

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def expect_error(match, d=None, overrides=(), world_size=None):
    """The ConfigError raised for `d` + `overrides`; checks it is one line containing `match`."""
    with pytest.raises(ConfigError) as info:
        config_from_dict(d or {}, overrides, world_size)
    message = str(info.value)
    assert "\n" not in message
    assert match in message, message
    return message


# -- defaults and derived keys ------------------------------------------------------------------


def test_defaults_resolve_to_concrete_values():
    cfg = config_from_dict({})
    resolved = cfg.to_dict()
    assert list(resolved) == list(SECTIONS)
    for section, defaults in DEFAULTS.items():
        for key, default in defaults.items():
            if default is not None and key != "global_batch_size":  # None marks a derived key
                assert resolved[section][key] == default, f"{section}.{key}"
    m = cfg.model
    assert (m.n_kv_heads, m.d_ff, m.rank, m.attn_rank, m.mlp_rank) == (4, 688, 64, 64, 64)
    assert m.mlp_gate_act is False  # cola
    assert (cfg.train.grad_accum, cfg.train.global_batch_size) == (1, 8)
    assert all(value is not None for section in resolved.values() for value in section.values())


@pytest.mark.parametrize("d_model, d_ff", [(512, 1376), (1024, 2736), (256, 688), (48, 128)])
def test_d_ff_rounds_8_thirds_up_to_a_multiple_of_16(d_model, d_ff):
    assert config_from_dict({"model": {"d_model": d_model}}).model.d_ff == d_ff


@pytest.mark.parametrize("arch, gate_act", [("full", True), ("svd", True), ("cola", False)])
def test_mlp_gate_act_follows_arch_unless_set(arch, gate_act):
    assert config_from_dict({"model": {"arch": arch}}).model.mlp_gate_act is gate_act
    explicit = config_from_dict({"model": {"arch": arch, "mlp_gate_act": not gate_act}})
    assert explicit.model.mlp_gate_act is (not gate_act)


def test_derived_keys_follow_the_keys_they_come_from_but_yield_to_explicit_values():
    m = config_from_dict({"model": {"d_model": 128, "n_heads": 8, "rank": 16, "mlp_rank": 24}}).model
    assert (m.n_kv_heads, m.rank, m.attn_rank, m.mlp_rank) == (8, 16, 16, 24)
    m = config_from_dict({"model": {"d_model": 128, "n_kv_heads": 2, "d_ff": 320}}).model
    assert (m.n_kv_heads, m.d_ff, m.rank) == (2, 320, 32)


def test_model_helpers_and_linear_shapes():
    cfg = config_from_dict({"model": {"arch": "svd", "d_model": 64, "n_heads": 8, "n_kv_heads": 2,
                                      "d_ff": 96, "attn_rank": 8, "mlp_rank": 12}})
    m = cfg.model
    assert (m.head_dim, m.kv_dim, m.is_lowrank) == (8, 16, True)
    assert m.linear_shapes() == {"q": (64, 64, 8), "k": (64, 16, 8), "v": (64, 16, 8), "o": (64, 64, 8),
                                 "gate": (64, 96, 12), "up": (64, 96, 12), "down": (96, 64, 12)}
    full = cfg.replace(**{"model.arch": "full"}).model
    assert not full.is_lowrank
    assert {name: rank for name, (_, _, rank) in full.linear_shapes().items()} == dict.fromkeys(
        ["q", "k", "v", "o", "gate", "up", "down"])


def test_tokens_per_step_counts_every_sequence_of_the_global_batch():
    cfg = config_from_dict({"model": {"seq_len": 32}, "parallel": {"dp": 2},
                            "train": {"micro_batch_size": 3, "grad_accum": 5}})
    assert cfg.train.global_batch_size == 30
    assert cfg.tokens_per_step == 3 * 5 * 2 * 32


def test_global_batch_size_determines_grad_accum():
    cfg = config_from_dict({"parallel": {"dp": 2}, "train": {"micro_batch_size": 4, "global_batch_size": 24}})
    assert (cfg.train.grad_accum, cfg.train.global_batch_size) == (3, 24)
    same = config_from_dict({"parallel": {"dp": 2},
                             "train": {"micro_batch_size": 4, "global_batch_size": 24, "grad_accum": 3}})
    assert same == cfg


def test_config_is_frozen():
    cfg = config_from_dict({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.d_model = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train = None


# -- serialisation ------------------------------------------------------------------------------

AWKWARD = {
    "model": {"arch": "svd", "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "rank": 12,
              "rope_theta": 500000, "norm_eps": 1e-5},
    "parallel": {"tp": 2, "pp": 2, "dp": 2, "grouped": False, "watchdog_s": 0.1},
    "train": {"run_dir": 'runs/"quoted"\\back\tslash\nnewline é \x7f \x01', "lr": 3e-4,
              "beta2": 0.999, "global_batch_size": 32, "recompute": "lowrank"},
    "data": {"train": "shards/train_*.bin", "val": "shards/val_000.bin"},
    "checkpoint": {"every": 7, "keep": 2},
}


def test_to_toml_round_trips_through_load_config(tmp_path):
    cfg = config_from_dict(AWKWARD)
    path = tmp_path / "config.toml"
    path.write_text(cfg.to_toml(), encoding="utf-8")
    loaded = load_config(path)
    assert loaded == cfg
    assert loaded.to_dict() == cfg.to_dict()
    assert tomllib.loads(cfg.to_toml()) == cfg.to_dict()
    assert isinstance(loaded.model.rope_theta, float) and loaded.model.rope_theta == 500000.0


def test_to_dict_is_json_and_reads_back():
    cfg = config_from_dict(AWKWARD)
    assert config_from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


# -- overrides and replace ----------------------------------------------------------------------


def test_parse_overrides_reads_toml_values_or_bare_strings():
    parsed = parse_overrides(["train.steps=10", "model.arch=svd", "train.run_dir=runs/x", "train.lr=3e-4",
                              'data.train="a b.bin"', "parallel.grouped=false", "train.min_lr_ratio=0",
                              "train.steps = 12"])
    assert parsed == {"train.steps": 12, "model.arch": "svd", "train.run_dir": "runs/x", "train.lr": 3e-4,
                      "data.train": "a b.bin", "parallel.grouped": False, "train.min_lr_ratio": 0.0}
    assert isinstance(parsed["train.min_lr_ratio"], float)


def test_overrides_win_over_the_file_and_derived_keys_follow(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\narch = "cola"\nd_model = 64\n[train]\nsteps = 3\n')
    cfg = load_config(path, overrides=["train.steps=10", "model.arch=svd", "model.d_model=128"])
    assert (cfg.train.steps, cfg.model.arch, cfg.model.d_model) == (10, "svd", 128)
    assert (cfg.model.rank, cfg.model.mlp_gate_act) == (32, True)


def test_replace_derives_again_keeps_explicit_keys_and_leaves_the_original():
    cfg = config_from_dict({"model": {"d_model": 64, "d_ff": 160}, "train": {"steps": 7}})
    changed = cfg.replace(**{"model.d_model": 128, "train.lr": 1})
    assert (changed.model.d_model, changed.model.rank, changed.model.d_ff) == (128, 32, 160)
    assert changed.train.steps == 7 and changed.train.lr == 1.0
    assert cfg.model.d_model == 64
    assert cfg.replace() == cfg
    more_dp = cfg.replace(**{"parallel.dp": 4})  # global batch was derived, so it follows dp
    assert more_dp.train.global_batch_size == 32


def test_replace_validates():
    cfg = config_from_dict({})
    with pytest.raises(ConfigError, match="model.n_heads"):
        cfg.replace(**{"model.n_heads": 3})
    with pytest.raises(ConfigError, match="unknown key train.step "):
        cfg.replace(**{"train.step": 3})


@pytest.mark.parametrize("item, match", [
    ("train.steps", "must look like section.key=value"),
    ("steps=3", "did you mean train.steps"),
    ("trian.steps=3", "unknown section [trian] (did you mean [train]?)"),
    ("train.stepz=3", "unknown key train.stepz (did you mean train.steps?)"),
    ("train.steps=abc", "train.steps must be an integer, got 'abc' (str)"),
    ("train.steps=1e3", "train.steps must be an integer, got 1000.0 (float)"),
    ("train.run_dir=5", "train.run_dir must be a string, got 5 (int)"),
    ("model.d_model.x=5", "unknown key model.d_model.x"),
])
def test_bad_overrides(item, match):
    with pytest.raises(ConfigError) as info:
        parse_overrides([item])
    assert match in str(info.value)
    expect_error(match, overrides=[item])


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("d, match", [
    ({"modle": {}}, "unknown section [modle] (did you mean [model]?)"),
    ({"model": 3}, "[model] must be a table"),
    ({"steps": 3}, "key steps is outside any section (did you mean train.steps?)"),
    ({"model": {"d_modle": 3}}, "unknown key model.d_modle (did you mean model.d_model?)"),
    ({"model": {"steps": 3}}, "unknown key model.steps (did you mean train.steps?)"),
    ({"model": {"zzz": 3}}, "unknown key model.zzz (known keys of [model]: arch"),
])
def test_unknown_names(d, match):
    expect_error(match, d)


@pytest.mark.parametrize("section, key, value, match", [
    ("model", "d_model", "abc", "model.d_model must be an integer, got 'abc' (str)"),
    ("model", "d_model", True, "model.d_model must be an integer, got True (bool)"),
    ("model", "d_model", 64.0, "model.d_model must be an integer, got 64.0 (float)"),
    ("train", "lr", "fast", "train.lr must be a number"),
    ("train", "lr", True, "train.lr must be a number"),
    ("train", "lr", float("inf"), "train.lr must be a finite number"),
    ("parallel", "grouped", 1, "parallel.grouped must be true or false, got 1 (int)"),
    ("data", "train", 3, "data.train must be a string, got 3 (int)"),
    ("model", "mlp_gate_act", "yes", "model.mlp_gate_act must be true or false"),
])
def test_wrong_types(section, key, value, match):
    expect_error(match, {section: {key: value}})


@pytest.mark.parametrize("dotted, value, match", [
    ("model.arch", "lora", "model.arch must be one of full, svd, cola, got 'lora'"),
    ("parallel.tp_mode", "megatron", "parallel.tp_mode must be one of btp, vanilla"),
    ("parallel.norm", "x", "parallel.norm must be one of"),
    ("parallel.comm", "gloo", "parallel.comm must be one of"),
    ("train.device", "tpu", "train.device must be one of"),
    ("train.dtype", "float16", "train.dtype must be one of"),
    ("train.recompute", "all", "train.recompute must be one of"),
])
def test_bad_choices(dotted, value, match):
    section, key = dotted.split(".")
    expect_error(match, {section: {key: value}})


@pytest.mark.parametrize("dotted, value, match", [
    ("model.vocab_size", 0, "model.vocab_size must be positive, got 0"),
    ("model.d_model", -4, "model.d_model must be positive"),
    ("model.n_layers", 0, "model.n_layers must be positive"),
    ("model.n_heads", 0, "model.n_heads must be positive"),
    ("model.n_kv_heads", 0, "model.n_kv_heads must be positive"),
    ("model.d_ff", 0, "model.d_ff must be positive"),
    ("model.seq_len", 0, "model.seq_len must be positive"),
    ("model.rope_theta", 0, "model.rope_theta must be positive"),
    ("model.norm_eps", 0.0, "model.norm_eps must be positive"),
    ("parallel.tp", 0, "parallel.tp must be positive"),
    ("parallel.pp", -1, "parallel.pp must be positive"),
    ("parallel.dp", 0, "parallel.dp must be positive"),
    ("parallel.watchdog_s", -1, "parallel.watchdog_s must be >= 0"),
    ("train.steps", 0, "train.steps must be positive"),
    ("train.micro_batch_size", 0, "train.micro_batch_size must be positive"),
    ("train.grad_accum", 0, "train.grad_accum must be positive"),
    ("train.global_batch_size", -8, "train.global_batch_size must be >= 0"),
    ("train.lr", 0, "train.lr must be positive, got 0.0"),
    ("train.lr", -1e-3, "train.lr must be positive"),
    ("train.min_lr_ratio", 1.5, "train.min_lr_ratio must be in [0, 1]"),
    ("train.min_lr_ratio", -0.1, "train.min_lr_ratio must be in [0, 1]"),
    ("train.warmup_steps", -1, "train.warmup_steps must be >= 0"),
    ("train.weight_decay", -0.1, "train.weight_decay must be >= 0"),
    ("train.beta1", 1.0, "train.beta1 must be in [0, 1)"),
    ("train.beta2", -0.5, "train.beta2 must be in [0, 1)"),
    ("train.adam_eps", 0, "train.adam_eps must be positive"),
    ("train.grad_clip", -1, "train.grad_clip must be >= 0"),
    ("train.seed", -1, "train.seed must be >= 0"),
    ("train.log_every", 0, "train.log_every must be positive"),
    ("train.val_every", -1, "train.val_every must be >= 0"),
    ("train.val_windows", 0, "train.val_windows must be positive"),
    ("train.run_dir", "", "train.run_dir must not be empty"),
    ("data.val", "", "data.val must not be empty"),
    ("checkpoint.every", -1, "checkpoint.every must be >= 0"),
    ("checkpoint.keep", -2, "checkpoint.keep must be >= 0"),
])
def test_out_of_range(dotted, value, match):
    section, key = dotted.split(".")
    expect_error(match, {section: {key: value}})


def test_boundary_values_are_accepted():
    cfg = config_from_dict({"train": {"min_lr_ratio": 1, "beta1": 0, "warmup_steps": 0, "grad_clip": 0,
                                      "weight_decay": 0, "seed": 0},
                            "parallel": {"watchdog_s": 0}, "checkpoint": {"every": 0, "keep": 0}})
    assert cfg.train.min_lr_ratio == 1.0 and cfg.train.beta1 == 0.0


@pytest.mark.parametrize("model, match", [
    ({"d_model": 100, "n_heads": 8}, "model.d_model = 100 is not divisible by model.n_heads = 8"),
    ({"n_heads": 4, "n_kv_heads": 3}, "model.n_heads = 4 is not divisible by model.n_kv_heads = 3"),
    ({"n_heads": 4, "n_kv_heads": 8}, "model.n_kv_heads = 8"),
    ({"d_model": 36, "n_heads": 4}, "model.d_model / model.n_heads = 9"),
    ({"arch": "cola", "d_model": 2, "n_heads": 1},
     "model.attn_rank must be positive, got 0 (derived: = model.rank)"),
    ({"arch": "svd", "rank": 0}, "model.attn_rank must be positive"),
    ({"arch": "svd", "mlp_rank": -1}, "model.mlp_rank must be positive, got -1"),
    ({"arch": "cola", "rank": 300}, "model.attn_rank = 300 (derived: = model.rank) is larger than"),
    ({"arch": "svd", "attn_rank": 65, "n_kv_heads": 1},
     "model.attn_rank = 65 is larger than min(d_in, d_out) = 64 of the k projection (256 -> 64)"),
    ({"arch": "cola", "d_ff": 32, "mlp_rank": 33},
     "model.mlp_rank = 33 is larger than min(d_in, d_out) = 32 of the gate"),
])
def test_impossible_model_shapes(model, match):
    expect_error(match, {"model": model})


def test_rank_is_not_checked_for_full_arch():
    cfg = config_from_dict({"model": {"arch": "full", "d_model": 2, "n_heads": 1, "rank": 500}})
    assert cfg.model.linear_shapes()["q"] == (2, 2, None)


def test_world_size_must_match_the_process_grid():
    d = {"parallel": {"tp": 2, "pp": 2, "dp": 2}}
    expect_error("parallel.tp * parallel.pp * parallel.dp = 8 but 4 MPI ranks were started", d, world_size=4)
    expect_error("= 8 but 1 MPI rank was started", d, world_size=1)
    assert config_from_dict(d, world_size=8).parallel.dp == 2
    with pytest.raises(ConfigError, match="= 8 but 2 MPI ranks"):
        config_from_dict(d).validate(world_size=2)


@pytest.mark.parametrize("d, match", [
    ({"parallel": {"pp": 5}}, "parallel.pp = 5 is larger than model.n_layers = 4"),
    ({"model": {"vocab_size": 3, "d_model": 64, "n_heads": 4}, "parallel": {"tp": 4}},
     "parallel.tp = 4 is larger than model.vocab_size = 3"),
    ({"model": {"arch": "full"}, "parallel": {"tp": 2, "tp_mode": "btp"}},
     'parallel.tp_mode = btp needs a low-rank arch; use tp_mode = "vanilla" for full'),
    # btp shards the residual (d_model), heads, kv heads and the MLP hidden dim
    ({"model": {"d_model": 96, "n_heads": 2, "rank": 16}, "parallel": {"tp": 4}},
     "model.n_heads = 2 is not divisible by parallel.tp = 4"),
    ({"model": {"d_model": 24, "n_heads": 2}, "parallel": {"tp": 16}},
     "model.d_model = 24 is not divisible by parallel.tp = 16"),
    ({"model": {"n_heads": 4, "n_kv_heads": 2}, "parallel": {"tp": 4}},
     "model.n_kv_heads = 2 is not divisible by parallel.tp = 4"),
    ({"model": {"d_model": 64, "n_heads": 4, "d_ff": 90}, "parallel": {"tp": 4}},
     "model.d_ff = 90 is not divisible by parallel.tp = 4"),
    # vanilla on a low-rank arch splits the ranks
    ({"model": {"arch": "svd", "rank": 30}, "parallel": {"tp": 4, "tp_mode": "vanilla"}},
     "model.attn_rank = 30 (derived: = model.rank) is not divisible by parallel.tp = 4"),
    ({"model": {"arch": "svd", "mlp_rank": 30}, "parallel": {"tp": 4, "tp_mode": "vanilla"}},
     "model.mlp_rank = 30 is not divisible by parallel.tp = 4"),
    # vanilla on full splits heads and the MLP hidden dim
    ({"model": {"arch": "full", "n_heads": 2, "d_model": 64}, "parallel": {"tp": 4, "tp_mode": "vanilla"}},
     "model.n_heads = 2 is not divisible by parallel.tp = 4"),
    ({"model": {"arch": "full", "n_kv_heads": 1}, "parallel": {"tp": 2, "tp_mode": "vanilla"}},
     "model.n_kv_heads = 1 is not divisible by parallel.tp = 2"),
    ({"model": {"arch": "full", "d_ff": 30}, "parallel": {"tp": 4, "tp_mode": "vanilla"}},
     "model.d_ff = 30 is not divisible by parallel.tp = 4"),
])
def test_impossible_layouts(d, match):
    expect_error(match, d)


@pytest.mark.parametrize("d", [
    # what each mode does not need divisible is not checked
    {"model": {"arch": "svd", "n_heads": 2, "d_model": 64, "n_kv_heads": 1, "rank": 16},
     "parallel": {"tp": 4, "tp_mode": "vanilla"}},
    {"model": {"arch": "cola", "d_model": 64, "n_heads": 4, "rank": 6}, "parallel": {"tp": 4}},
    {"model": {"arch": "full", "d_model": 64, "n_heads": 4, "d_ff": 100}, "parallel": {"tp": 1}},
    {"model": {"arch": "full", "d_model": 96, "n_heads": 4, "d_ff": 128},
     "parallel": {"tp": 4, "tp_mode": "vanilla"}},
])
def test_layouts_that_are_possible(d):
    config_from_dict(d)


@pytest.mark.parametrize("train, match", [
    ({"micro_batch_size": 4, "global_batch_size": 10}, "train.global_batch_size = 10 is not divisible by "
     "train.micro_batch_size * parallel.dp = 4: micro-batches do not divide the batch"),
    ({"micro_batch_size": 4, "global_batch_size": 16, "grad_accum": 2},
     "train.grad_accum = 2 contradicts train.global_batch_size = 16, which needs grad_accum = 4"),
    ({"dtype": "bfloat16"}, 'train.dtype = "bfloat16" needs train.device = "gpu"'),
])
def test_impossible_training_settings(train, match):
    expect_error(match, {"train": train})


def test_bfloat16_on_gpu_is_accepted():
    assert config_from_dict({"train": {"dtype": "bfloat16", "device": "gpu"}}).train.dtype == "bfloat16"


def test_recompute_lowrank_needs_a_lowrank_arch():
    expect_error("train.recompute = lowrank needs a low-rank arch (svd|cola): "
                 "full-rank layers have no bottleneck",
                 {"model": {"arch": "full"}, "train": {"recompute": "lowrank"}})
    svd = config_from_dict({"model": {"arch": "svd"}, "train": {"recompute": "lowrank"}})
    assert svd.train.recompute == "lowrank"


def test_validate_catches_directly_built_configs():
    cfg = config_from_dict({})
    broken = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=24))
    with pytest.raises(ConfigError, match="train.grad_accum = 1 contradicts"):
        broken.validate()
    with pytest.raises(ConfigError, match="model.n_kv_heads must be an integer, got None"):
        Config().validate()


def test_errors_are_user_errors_on_one_line():
    with pytest.raises(UserError) as info:
        config_from_dict({"train": {"run_dir\nx": 1}})
    assert "\n" not in str(info.value) and info.value.exit_code == 2


# -- files ---------------------------------------------------------------------------------------


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*nope\.toml not found"):
        load_config(tmp_path / "nope.toml")


def test_directory_is_not_a_config(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path)


@pytest.mark.parametrize("text", ["[model\nd_model = 3\n", "[model]\nd_model = \n",
                                  b"[model]\narch = \"\xff\"\n"])  # the last is not UTF-8
def test_invalid_toml_is_named(tmp_path, text):
    path = tmp_path / "bad.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "bad.toml is not valid TOML" in str(info.value) and "\n" not in str(info.value)


def test_dotted_keys_in_the_file_are_sections(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("model.d_model = 64\ntrain.steps = 2\n")
    cfg = load_config(path)
    assert (cfg.model.d_model, cfg.train.steps) == (64, 2)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_example_configs_load(path):
    cfg = load_config(path)
    assert load_config(path, overrides=["train.steps=1"]).train.steps == 1
    assert config_from_dict(tomllib.loads(cfg.to_toml())) == cfg


def test_example_config_values():
    local = load_config(CONFIGS / "local.toml")
    m, t = local.model, local.train
    assert (m.arch, m.d_model, m.n_layers, m.n_heads, m.rank, m.seq_len) == ("cola", 256, 4, 4, 64, 128)
    assert (t.micro_batch_size, t.steps, t.lr, t.warmup_steps, t.val_every) == (8, 300, 3e-3, 20, 50)
    assert local.checkpoint.every == 100
    assert (local.train.run_dir, local.data.train, local.data.val) == ("runs/local", "builtin", "builtin")
    tiny = load_config(CONFIGS / "tiny.toml")
    assert (tiny.model.d_model, tiny.model.n_kv_heads, tiny.model.rank, tiny.model.d_ff) == (32, 2, 8, 64)
    assert (tiny.model.seq_len, tiny.train.micro_batch_size, tiny.train.steps) == (16, 2, 4)
    for mode in ("btp", "vanilla"):
        load_config(CONFIGS / "tiny.toml", [f"parallel.tp_mode={mode}", "parallel.tp=2"], world_size=2)
    big = load_config(CONFIGS / "cola_d1024.toml").model
    assert (big.d_model, big.n_layers, big.n_heads, big.rank, big.d_ff) == (1024, 4, 16, 256, 2736)
    assert big.seq_len == 256


def test_tilde_is_expanded_in_every_path_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    sets = ["train.run_dir=~/runs/x", "data.train=~/shards/train_*.bin", "data.val=~/shards/val_*.bin",
            "data.builtin_dir=~/builtin"]
    cfg = load_config(CONFIGS / "tiny.toml", sets)
    assert cfg.train.run_dir == str(tmp_path / "runs" / "x")
    assert (cfg.data.train, cfg.data.val) == (str(tmp_path / "shards" / "train_*.bin"), str(tmp_path / "shards" / "val_*.bin"))
    assert cfg.data.builtin_dir == str(tmp_path / "builtin")
    assert load_config(CONFIGS / "tiny.toml").data.train == "builtin"  # the word, not a path
    with pytest.raises(ConfigError) as exc:
        load_config(CONFIGS / "tiny.toml", ["train.run_dir=~no-such-user-boostmpi/x"])
    assert "train.run_dir" in str(exc.value) and "\n" not in str(exc.value)
