import pytest

from conftest import REPO
from continuumlm import ConfigError, ModelConfig, load_config
from continuumlm.config import DataConfig, RunConfig, TrainConfig, dump_toml


def test_defaults_are_valid():
    cfg = ModelConfig()
    assert cfg.ffn_hidden_size == 4 * cfg.hidden_size


def test_hidden_not_divisible_names_both_numbers():
    with pytest.raises(ValueError, match=r"hidden_size \(130\).*num_heads \(4\)"):
        ModelConfig(hidden_size=130, num_heads=4)


def test_unknown_key_suggests(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[model]\nnum_head = 4\n")
    with pytest.raises(ConfigError, match="did you mean 'num_heads'"):
        load_config(p)


def test_unknown_section(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[modle]\nnum_heads = 4\n")
    with pytest.raises(ConfigError, match=r"did you mean 'model'"):
        load_config(p)


@pytest.mark.parametrize("override,needle", [
    ("model.hidden_size=\"big\"", "model.hidden_size must be int"),
    ("model.num_layers=0", "model.num_layers must be positive"),
    ("train.lr=-1", "train.lr must be positive"),
    ("model.dropout=1.5", "model.dropout must lie in"),
    ("train.batch_size=true", "train.batch_size must be int"),
    ("model.norm_type=batchnorm", "model.norm_type = 'batchnorm' is not one of"),
    ("train.max_steps=-5", "train.max_steps must be positive"),
    # sizes torch cannot index, and basis/quadrature sizes that would stall, are refused here
    # (they ended in an overflow or numpy allocation traceback)
    ("model.vocab_size=9000000000000000000", "model.vocab_size = 9000000000000000000 is larger"),
    ("model.ffn_hidden_size=9000000000000000000", "model.ffn_hidden_size = .* is larger"),
    ("model.continuous.n_quad=1000000000",
     r"model.continuous.n_quad = 1000000000 is larger .* 1,024"),
    ("model.cat_n_freq=100000000", r"model.continuous.n_freq = 100000000 is larger"),  # old name
    ("model.ode_t1=1e300", r"model.ode_t1 = 1e\+300 is outside .*float32"),
    ("mqar.power_a=1e10", r"mqar.power_a = 10000000000.0: query distances .* overflows"),
    ("mqar.vocab_size=0", r"mqar.vocab_size = 0 leaves 0 distinct keys .* at least 34"),
    ("data.vocab_size=100", r"data.vocab_size = 100 has no effect with data.tokenizer = 'char'"),
    ("data.tokenizer=word data.vocab_size=1", r"data.vocab_size = 1 is too small .* at least 3"),
    ("data.tokenizer=word data.vocab_size=0", r"data.vocab_size = 0 is too small"),
    ("data.tokenizer=bpe data.vocab_size=0", r"data.vocab_size = 0 is too small .* at least 257"),
    ("mqar.seq_len=40", r"mqar.seq_len = 40 is too short for 16 .* at least 63"),
])
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, override.split())


@pytest.mark.parametrize("key,value", [("mixer", "nope"), ("depth", "odee")])
def test_unknown_selector_lists_available(key, value):
    with pytest.raises(ValueError, match="available: "):
        ModelConfig(**{key: value})


def test_learned_positions_shorter_than_context():
    with pytest.raises(ConfigError, match="max_seq_len"):
        load_config(None, ["model.position=learned", "model.max_seq_len=32", "train.seq_len=64"])


def test_override_parsing_and_toml_round_trip(tmp_path):
    cfg = load_config(None, ["train.lr=3e-4", "model.mixer=softmax", "data.path=/x/y.txt",
                             "model.use_bitnet=true"])
    assert cfg.train.lr == 3e-4 and cfg.model.use_bitnet is True and cfg.data.path == "/x/y.txt"
    p = tmp_path / "round.toml"
    p.write_text(dump_toml(cfg))
    assert load_config(p) == cfg


@pytest.mark.parametrize("item", ["lr=3", "model.=3", ".lr=3", "model.lr"])
def test_bad_override_syntax(item):
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, [item])


def test_limits_of_this_version_spare_the_configs_of_saved_runs():
    """A run saved before a size limit or a do-nothing setting was refused still loads (for
    eval and resume); what a user writes now is refused. MQAR's edges are exact: 63 tokens
    hold 16 pairs, and power_a above 1 is a valid (increasing) law."""
    from continuumlm import ModelConfig

    d = RunConfig().to_dict()
    d["data"]["vocab_size"] = 100  # ignored by the char tokenizer before it was refused
    d["model"]["cat_n_quad"] = 2048
    for bad in ("data", "model"):
        one = RunConfig().to_dict()
        one[bad] = d[bad]
        with pytest.raises(ConfigError):
            RunConfig.from_dict(one)
    assert RunConfig.from_dict(d, saved=True).model.component("continuous").n_quad == 2048
    assert ModelConfig.from_dict(d["model"], saved=True).component("continuous").n_quad == 2048
    with pytest.raises(ConfigError, match="n_quad"):  # strict again afterwards
        ModelConfig.from_dict(d["model"])
    assert load_config(None, ["mqar.seq_len=63"]).mqar.seq_len == 63
    assert load_config(None, ["mqar.power_a=2"]).mqar.power_a == 2
    assert load_config(None, ["data.train_chars=3000000000"]).data.train_chars == 3_000_000_000


def test_a_folder_given_as_config_is_named_as_such(tmp_path):
    with pytest.raises(ConfigError, match="is a folder, not a TOML file"):
        load_config(tmp_path)


def test_recipes_all_load():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs"
    files = sorted(root.rglob("*.toml"))
    assert files
    for f in files:
        assert isinstance(load_config(f), RunConfig), f


def test_config_file_with_a_byte_order_mark(tmp_path):
    p = tmp_path / "bom.toml"
    p.write_bytes("\ufeff[model]\nhidden_size = 64\nnum_heads = 4\n".encode("utf-8"))
    assert load_config(p).model.hidden_size == 64


@pytest.mark.parametrize("overrides,blamed,not_blamed", [
    # a bad value given on the command line is blamed on --set, not on the file
    (["train.max_steps=-1"], r"\(from --set train\.max_steps=-1\)$", "in {file}"),
    (["model.mixer=sofmax"], r"\(from --set model\.mixer=sofmax\)$", "in {file}"),
    (["train.foo=1"], r"unknown key train\.foo \(from --set train\.foo=1\);", "in {file}"),
    (["foo.bar=1"], r"unknown section \[foo\] \(from --set foo\.bar=1\);", "in {file}"),
    # a clash between a --set value and a file value names both
    (["model.num_heads=5"], r"\(from --set model\.num_heads=5; in {file}\)$", None),
    # a bad value in the file is still blamed on the file, --set or not
    (["train.lr=1e-3"], r"model\.dropout must lie in .* \(in {file}\)$", "--set"),
])
def test_errors_say_whether_the_file_or_set_gave_the_value(tmp_path, overrides, blamed,
                                                           not_blamed):
    import re

    p = tmp_path / "c.toml"
    bad_dropout = "dropout = 2.0\n" if "dropout" in blamed else ""
    p.write_text(f"[model]\nhidden_size = 96\nnum_heads = 4\n{bad_dropout}[train]\nmax_steps = 10\n")
    with pytest.raises(ConfigError) as info:
        load_config(p, overrides)
    message = str(info.value)
    assert re.search(blamed.replace("{file}", re.escape(str(p))), message), message
    if not_blamed:
        assert not_blamed.replace("{file}", str(p)) not in message, message


def test_cross_section_error_blames_the_set_value(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[model]\nposition = \"learned\"\nmax_seq_len = 32\n")
    with pytest.raises(ConfigError, match=r"\(from --set train\.seq_len=64; in .*c\.toml\)$"):
        load_config(p, ["train.seq_len=64"])


def test_every_setting_is_documented():
    """--explain and error messages can say what each key means: every field of every
    section and of every registered component's Config has its docstring."""
    import dataclasses

    from continuumlm.config import MQARConfig, _configurable, field_docs

    classes = [ModelConfig, DataConfig, TrainConfig, MQARConfig,
               *(c.Config for c in _configurable().values())]
    missing = [f"{c.__qualname__}.{f.name}" for c in classes for f in dataclasses.fields(c)
               if f.name != "components" and not field_docs(c).get(f.name)]
    assert not missing, missing


def test_inspect_explain_prints_values_defaults_and_docs(tmp_path):
    from conftest import run_cli

    r = run_cli("inspect", "--config", "configs/shakespeare_char/deltanet_conv.toml",
                "--explain", "--set", "model.deltanet.short_conv=3", cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "[model.deltanet]\n  short_conv = 3  [int]  (default 0)" in r.stdout
    assert "Peak learning rate of AdamW" in r.stdout and "[train]" in r.stdout


def test_a_gpu_by_index_is_a_valid_device():
    """train.device = "cuda:N" is documented (and chosen under torchrun as one GPU per rank);
    the config check refused it. Misspellings are still refused, naming the form."""
    assert TrainConfig(device="cuda:1").device == "cuda:1"
    for bad in ("cuda:x", "cuda:", "gpu", "cpu:0"):
        with pytest.raises(ConfigError, match="cuda:N"):
            TrainConfig(device=bad)
