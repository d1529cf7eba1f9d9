"""[train]'s tables ([train.elastic], [train.distill], [train.regularize]): each built and
checked by its own dataclass, and every flat name of earlier versions still loading, from a
config file, a --set, a saved run and an old checkpoint, to the same config."""

import dataclasses
import json
import warnings

import pytest

from conftest import REPO
from continuumlm import ConfigError, load_config
from continuumlm.cli import main
from continuumlm.config import RunConfig, canonical_key, dump_toml
from continuumlm.config.distill import DistillConfig
from continuumlm.config.elastic import ElasticConfig
from continuumlm.config.regularize import RegularizeConfig
from continuumlm.config.train import LEGACY_TRAIN_KEYS, TABLES
from continuumlm.errors import OldSpelling

OLD_TABLES = {t for t, _ in LEGACY_TRAIN_KEYS.values()}  # the tables earlier versions spelled flat

# one value for each old key that a config accepts on its own or with its partners
OLD = {
    "elastic": {"ode_steps_choices": [2, 4], "ode_solver_choices": ["euler", "rk4"],
                "ode_max_nfe": 16, "elastic_from": 3, "consistency_weight": 0.5,
                "consistency_max_nfe": 32, "consistency_every": 2},
    "distill": {"distill_from": "runs/teacher", "distill_weight": 1.5},
    "regularize": {"step_readout_weight": 0.25},
}
ODE = "[model]\ndepth = 'ode'\node_solver = 'rk4'\node_steps = 4\n"


def _toml(values: dict) -> str:
    return "\n".join(f"{k} = {json.dumps(v)}" for k, v in values.items())


def test_every_old_key_has_a_table_field_and_back():
    # every field of the tables that earlier versions spelled flat had a flat name (a table
    # added since, [train.any_depth], never had one)
    fields = {(t, f.name) for t, klass in TABLES.items() if t in OLD_TABLES
              for f in dataclasses.fields(klass)}
    assert set(LEGACY_TRAIN_KEYS.values()) == fields
    assert OLD_TABLES == {"elastic", "distill", "regularize"}
    assert {k for table in OLD.values() for k in table} | {"kinetic_weight",
                                                           "jacobian_weight",
                                                           "steer"} == set(LEGACY_TRAIN_KEYS)
    for old, (table, leaf) in LEGACY_TRAIN_KEYS.items():
        assert canonical_key(f"train.{old}") == f"train.{table}.{leaf}"
    assert canonical_key("model.cat_basis") == "model.continuous.basis"
    assert canonical_key("train.lr") == "train.lr"


@pytest.mark.parametrize("table", list(OLD))
def test_a_flat_config_loads_as_its_table_with_one_note(tmp_path, table):
    old, new = tmp_path / "old.toml", tmp_path / "new.toml"
    values = OLD[table]
    old.write_text(f"{ODE}[train]\nmax_steps = 10\n{_toml(values)}\n")
    leaves = {LEGACY_TRAIN_KEYS[k][1]: v for k, v in values.items()}
    new.write_text(f"{ODE}[train]\nmax_steps = 10\n\n[train.{table}]\n{_toml(leaves)}\n")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        a = load_config(old)
    notes = [str(w.message) for w in seen if issubclass(w.category, OldSpelling)]
    assert len(notes) == 1 and notes[0].endswith(f"(in {old}); the old names still load.")
    assert notes[0].startswith(", ".join(
        f"train.{key} is now train.{LEGACY_TRAIN_KEYS[key][0]}.{LEGACY_TRAIN_KEYS[key][1]}"
        for key in values))
    with warnings.catch_warnings():
        warnings.simplefilter("error", OldSpelling)
        b = load_config(new)
    assert a == b
    assert getattr(a.train, table) == TABLES[table](**leaves)


def test_the_regularizers_old_names(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[model]\ndepth = 'ode'\node_solver = 'tsit5'\node_grad = 'checkpoint'\n"
                 "[train]\nkinetic_weight = 0.01\njacobian_weight = 0.02\nsteer = 0.5\n")
    with pytest.warns(OldSpelling, match="train.steer is now train.regularize.steer"):
        cfg = load_config(p)
    assert cfg.train.regularize == RegularizeConfig(kinetic_weight=0.01, jacobian_weight=0.02,
                                                    steer=0.5)


def test_set_replaces_the_file_value_under_either_spelling(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(f"{ODE}[train]\node_steps_choices = [2, 4]\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OldSpelling)
        cfg = load_config(p, ["train.elastic.steps=[1, 8]"])
        assert cfg.train.elastic.steps == [1, 8]
        p.write_text(f"{ODE}[train.elastic]\nsteps = [2, 4]\n")
    with pytest.warns(OldSpelling, match=r"from --set train.ode_steps_choices=\[3\]"):
        cfg = load_config(p, ["train.ode_steps_choices=[3]"])
    assert cfg.train.elastic.steps == [3]


def test_both_spellings_at_once_are_refused(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(f"{ODE}[train]\ndistill_weight = 1.0\n[train.distill]\nweight = 2.0\n"
                 "teacher = 'x'\n")
    with pytest.raises(ConfigError, match=r"train.distill_weight and train.distill.weight both "
                                          r"set weight.*older spelling"):
        load_config(p)


@pytest.mark.parametrize("text,needle", [
    ("[train.elastic]\nstep = [2]\n", r"unknown key train.elastic.step \(did you mean 'steps'"),
    ("[train.distil]\nweight = 1.0\n", r"unknown key train.distil .*did you mean 'distill'"),
    ("[train]\nelastic = 3\n", r"\[train.elastic\] must be a table"),
    ("[train.elastic]\nsteps = [2, 'x']\n", "train.elastic.steps must be"),
    ("[train.regularize]\nsteer = -1.0\n", "train.regularize.steer must be >= 0"),
    ("[train.distill]\nteacher = 'x'\n", "go together"),
    ("[train.elastic]\nsteps = [2, 4]\nmax_nfe = true\n", "train.elastic.max_nfe must be"),
])
def test_bad_tables_name_the_key(tmp_path, text, needle):
    p = tmp_path / "c.toml"
    p.write_text(ODE + text)
    with pytest.raises(ConfigError, match=needle):
        load_config(p)


def test_each_table_checks_itself_alone():
    with pytest.raises(ConfigError, match="it needs train.elastic.steps with at least two"):
        ElasticConfig(steps=[4], consistency_weight=0.5)
    with pytest.raises(ConfigError, match="train.distill.weight must be >= 0"):
        DistillConfig(teacher="x", weight=-1.0)
    with pytest.raises(ConfigError, match="train.regularize.kinetic_weight must be >= 0"):
        RegularizeConfig(kinetic_weight=-1.0)
    assert not ElasticConfig().enabled and ElasticConfig(solvers=["euler"]).enabled
    assert DistillConfig(teacher="x", weight=1.0).enabled
    assert RegularizeConfig(steer=0.1).enabled and not RegularizeConfig().enabled


def test_a_saved_run_with_flat_keys_loads_without_a_note():
    new = load_config(REPO / "configs/shakespeare_char/ode_elastic_dial_capped.toml")
    flat = new.to_dict()
    for table in TABLES:
        values = flat["train"].pop(table)
        for old, (t, leaf) in LEGACY_TRAIN_KEYS.items():
            if t == table:
                flat["train"][old] = values[leaf]
    with warnings.catch_warnings():
        warnings.simplefilter("error", OldSpelling)
        assert RunConfig.from_dict(flat, saved=True) == new
    assert RunConfig.from_dict(json.loads(json.dumps(new.to_dict()))) == new


def test_written_configs_hold_the_tables_and_read_back(tmp_path):
    cfg = load_config(REPO / "configs/shakespeare_char/ode_elastic_dial_capped.toml")
    text = dump_toml(cfg)
    assert "[train.elastic]\nsteps = [2, 4, 8, 16]" in text and "ode_steps_choices" not in text
    p = tmp_path / "c.toml"
    p.write_text(text)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OldSpelling)
        assert load_config(p) == cfg


def test_every_committed_config_uses_todays_names():
    for path in sorted((REPO / "configs").rglob("*.toml")):
        with warnings.catch_warnings():
            warnings.simplefilter("error", OldSpelling)
            load_config(path)


def test_the_cli_prints_an_old_name_as_one_note(tiny_corpus, tmp_path, capsys):
    p = tmp_path / "c.toml"
    p.write_text(f"{ODE}[data]\ndataset = 'text'\npath = '{tiny_corpus}'\n"
                 f"[train]\nelastic_from = 2\node_steps_choices = [2, 4]\n")
    assert main(["inspect", "--config", str(p)]) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if line.startswith("note: ")]
    assert notes == [f"note: train.elastic_from is now train.elastic.start, "
                     f"train.ode_steps_choices is now train.elastic.steps (in {p}); the old "
                     f"names still load."]


def _flat(d: dict) -> dict:
    """A config dict with [train]'s tables spelled as earlier versions wrote them, flat."""
    train = dict(d["train"])
    for table in TABLES:
        values = train.pop(table)
        if table not in OLD_TABLES:  # a table earlier versions did not write
            assert values == dataclasses.asdict(TABLES[table]())  # left at its defaults
            continue
        for leaf, value in values.items():
            train[next(k for k, s in LEGACY_TRAIN_KEYS.items() if s == (table, leaf))] = value
    return {**d, "train": train}


def test_an_old_run_with_flat_keys_evaluates_and_resumes_exactly(tiny_corpus, tmp_path):
    """A run trained with today's tables to step 4, its saved configs then rewritten in the
    flat spelling of earlier versions (config.toml and every checkpoint's run.json),
    evaluates and resumes through the CLI, and ends where the uninterrupted run ends: the same
    draws and losses."""
    from continuumlm.config.loading import _toml_value
    from continuumlm.runs.checkpoint import _write_manifest, load_run_config
    from continuumlm.train.logging import read_metrics

    sets = ["data.dataset=text", f'data.path="{tiny_corpus}"', "model.hidden_size=16",
            "model.num_heads=2", "model.num_layers=1", "model.depth=ode",
            "model.ode_solver=euler", "model.ode_steps=2", "train.elastic.steps=[1, 2, 4]",
            "train.elastic.consistency_weight=0.5", "train.batch_size=2", "train.seq_len=16",
            "train.lr_decay_steps=8", "train.warmup_steps=1", "train.log_interval=1",
            "train.eval_interval=4", "train.eval_iters=1", "train.checkpoint_interval=4",
            "train.device=cpu", "train.threads=1"]
    args = [a for s in sets for a in ("--set", s)]
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main(["train", "--out", str(full), "--quiet", *args,
                 "--set", "train.max_steps=8"]) == 0
    assert main(["train", "--out", str(cut), "--quiet", *args,
                 "--set", "train.max_steps=4"]) == 0
    checkpoints = sorted({p.resolve() for p in cut.glob("checkpoints/*/run.json")})
    assert checkpoints
    for path in checkpoints:  # as the earlier version wrote them, manifest and all
        path.write_text(json.dumps(_flat(json.loads(path.read_text())), indent=2))
        _write_manifest(path.parent, json.loads((path.parent / "manifest.json").read_text())[
            "step"])
    d = _flat(RunConfig.from_dict(json.loads(checkpoints[0].read_text()), saved=True).to_dict())
    (cut / "config.toml").write_text("\n".join(
        f"[{name}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in section.items()
                                if v is not None and not isinstance(v, dict))
        for name, section in d.items()))
    assert "ode_steps_choices = [1, 2, 4]" in (cut / "config.toml").read_text()
    with warnings.catch_warnings():
        warnings.simplefilter("error", OldSpelling)
        cfg = load_run_config(checkpoints[-1].parent)
        assert cfg.train.elastic == ElasticConfig(steps=[1, 2, 4], consistency_weight=0.5)
        assert main(["eval", "--checkpoint", str(cut)]) == 0
        assert main(["train", "--out", str(cut), "--resume", "--quiet",
                     "--set", "train.max_steps=8"]) == 0

    def events(run):
        return {e["step"]: (e["loss"], e["ode_steps"], e.get("consistency"))
                for e in read_metrics(run) if "loss" in e}

    assert sorted(events(cut)) == list(range(1, 9))
    assert events(cut) == events(full)


def test_an_old_key_beside_a_built_table_is_refused():
    """from_dict with a table already built (a dataclass) and a flat key of an earlier
    spelling beside it: refused by name, never dropped."""
    d = {"model": {"depth": "ode"}, "train": {"elastic": ElasticConfig(steps=[2, 4]),
                                             "consistency_weight": 0.5}}
    with pytest.raises(ConfigError, match=r"train.consistency_weight is given beside a built "
                                          r"\[train.elastic\] table"):
        RunConfig.from_dict(d, saved=True)
