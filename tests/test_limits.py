"""The stated limits (docs/spec.md, README), each refused in one line before anything is
expanded or allocated: YAML aliases and nesting, keys given twice, formula size and depth,
ASCII names, model sizes against the fixed bounds and against the machine's memory."""
from __future__ import annotations

import time

import pytest

from bad_inputs.case import bomb
from eulergen.errors import EulerError
from eulergen.generator.formula import FORMULA_MAX_DEPTH, parse, Where
from eulergen.generator.opspec import symbol
from eulergen.generator.spec import load_spec
from eulergen.runtime.train import budget
from eulergen.runtime.model.arch import arch_of
from eulergen.runtime.engine.backend import NUMPY
from eulergen.runtime.train.config import load_config
from eulergen.runtime.model.optimizer_plan import plan_optimizer, update_ops
from eulergen.runtime.model.plan import plan_model
from eulergen.runtime.engine.ops import OpLibrary
from eulergen.userfiles import YAML_MAX_DEPTH, load_json, load_yaml


def error(fn, *args) -> str:
    with pytest.raises(EulerError) as info:
        fn(*args)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_yaml_alias_bomb_is_refused_before_it_expands():
    started = time.perf_counter()
    text = error(load_yaml, f"model:\n  hidden_dim: {bomb()}\n", "c.yaml")
    assert time.perf_counter() - started < 1.0
    assert text.startswith("c.yaml:2: model.hidden_dim.") and "aliases expanded" in text


def test_an_alias_bomb_in_a_config_value_is_one_line_in_under_a_second(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(f"model:\n  hidden_dim: {bomb()}\n")
    started = time.perf_counter()
    assert "alias bomb" in error(load_config, path)
    assert time.perf_counter() - started < 1.0


def test_an_alias_bomb_in_an_op_spec_is_one_line(tmp_path):
    path = tmp_path / "laugh.yaml"
    path.write_text(f"name: laugh\nkind: pointwise\ninputs: [x]\noutputs: {{y: x}}\n"
                    f"doc: {bomb()}\n")
    assert error(load_spec, path).startswith(f"{path}:5: doc.")


def test_aliases_that_stay_small_are_fine():
    assert load_yaml("a: &x {b: 1}\nc: *x\n", "f.yaml") == {"a": {"b": 1}, "c": {"b": 1}}


def test_a_recursive_alias_is_refused():
    assert "contains it" in error(load_yaml, "&a [*a]", "f.yaml")


def test_yaml_and_json_nested_past_the_limit_are_refused():
    deep = "[" * 100_000 + "]" * 100_000
    assert f"deeper than {YAML_MAX_DEPTH}" in error(load_yaml, deep, "f.yaml")
    assert "nested too deeply" in error(load_json, deep, "f.json")
    assert load_yaml("[" * YAML_MAX_DEPTH + "]" * YAML_MAX_DEPTH, "f.yaml") is not None


@pytest.mark.parametrize("name, text, says", [
    ("dup.yaml", "model:\n  hidden_dim: 64\n  hidden_dim: 128\n",
     "dup.yaml:3: model.hidden_dim: given twice, on lines 2 and 3"),
    ("dup.json", '{"model": {"hidden_dim": 64,\n  "hidden_dim": 128}}',
     "dup.json:2: model.hidden_dim: given twice, on lines 1 and 2"),
    ("sec.yaml", "model: {}\ntraining: {}\nmodel: {}\n", "sec.yaml:3: model: given twice, on lines 1 and 3"),
])
def test_a_config_key_given_twice_names_the_key_and_both_lines(tmp_path, name, text, says):
    (tmp_path / name).write_text(text)
    assert error(load_config, tmp_path / name) == f"{tmp_path / says}"


def test_a_binary_config_file_is_one_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"model:\n  \xff\xfe\x00garbage")
    assert error(load_config, path) == f"{path}:2: not UTF-8 text (byte 9): is this a config file?"


# -- formulas -------------------------------------------------------------------------------

WHERE = Where("ops/f.yaml", 5, "outputs.y")
NAMES = {"x": symbol("x")}


def test_a_thousand_term_formula_parses():
    expr = parse(" + ".join(f"x**{k}" for k in range(1, 1001)), NAMES, WHERE)
    assert len(expr.args) == 1000


def test_a_formula_past_the_size_limit_is_refused_not_a_recursion_error():
    # 5,000 terms would make Python's own parser recurse too deep
    assert "11,999 characters: at most 10,000" in error(parse, "+".join(["x"] * 6000), NAMES,
                                                        WHERE)


def test_nesting_past_the_limit_is_refused():
    ok = "exp(" * FORMULA_MAX_DEPTH + "x" + ")" * FORMULA_MAX_DEPTH
    parse(ok, NAMES, WHERE)
    assert "nests 65 levels deep: at most 64" in error(parse, "exp(" + ok + ")", NAMES, WHERE)
    parse(" * ".join(["(x + 1)"] * 500), NAMES, WHERE)   # a long chain is one level
    # past 200, Python's parser refuses the parentheses itself: still one line
    assert "too many nested parentheses" in error(parse, "(" * 300 + "x" + ")" * 300, NAMES,
                                                  WHERE)


def test_lets_that_double_at_each_step_are_refused_once_expanded(tmp_path):
    lets = "\n".join(f"  l{i}: l{i - 1}*x + sin(l{i - 1})" for i in range(1, 20))
    path = tmp_path / "grow.yaml"
    path.write_text(f"name: grow\nkind: pointwise\ninputs: [x]\nlet:\n  l0: x + 1\n{lets}\n"
                    "outputs:\n  y: l19\n")
    assert "expands (its `let` names inlined)" in error(load_spec, path)


@pytest.mark.parametrize("edit, key", [
    (("inputs: [x]", "inputs: [ξ]"), "inputs.0"),
    (("params: {eps: 1.0e-5}", "params: {épsilon: 1.0e-5}"), "params.épsilon"),
    (("  y: x", "  ÿ: x"), "outputs.ÿ"),
])
def test_non_ascii_names_are_refused_by_the_spec_loader(tmp_path, edit, key):
    good = "name: myop\nkind: pointwise\ninputs: [x]\nparams: {eps: 1.0e-5}\noutputs:\n  y: x*eps\n"
    path = tmp_path / "myop.yaml"
    path.write_text(good.replace(*edit), encoding="utf-8")
    text = error(load_spec, path)
    assert f": {key}: " in text and "names are ASCII" in text


def test_a_non_ascii_op_name_and_reduction_are_refused(tmp_path):
    path = tmp_path / "mísh.yaml"
    path.write_text("name: mísh\nkind: pointwise\ninputs: [x]\noutputs: {y: x}\n")
    assert "name: 'mísh' is not a valid name" in error(load_spec, path)
    path = tmp_path / "rn.yaml"
    path.write_text("name: rn\nkind: row\ninputs: {x: row}\nreduce:\n  µ: mean(x)\n"
                    "outputs:\n  y: x\n")
    assert "reduce.µ" in error(load_spec, path)


def test_a_non_ascii_character_in_a_formula_is_refused():
    # Python would read the fullwidth 'ｘ' as x (NFKC): the rule says ASCII only
    assert "U+FF58" in error(parse, "ｘ + 1", NAMES, WHERE)


# -- model sizes ----------------------------------------------------------------------------

@pytest.mark.parametrize("setting, key, says", [
    ("model.num_layers=1000000", "model.num_layers", "at most 1,024"),
    ("model.vocab_size=1000000000000", "model.vocab_size", "32 bits"),
    ("model.hidden_dim=4294967296", "model.hidden_dim", "32 bits"),
    ("training.gradient_accumulation=1000000000", "training.gradient_accumulation",
     "at most 33,554,432"),
])
def test_fixed_bounds_are_refused_from_the_config(setting, key, says):
    cfg = load_config(None, [setting, "model.num_heads=1", "model.num_kv_heads=1"])
    text = error(budget.check_config, cfg)
    assert text.startswith(f"{key}: ") and says in text


def test_the_plan_of_a_deep_model_is_priced_from_two_small_plans():
    lib = OpLibrary(NUMPY)
    cfg = load_config(None, ["model.num_layers=7"])
    arch = arch_of(cfg.model, lib)
    assert budget.plan_bytes(arch, lambda a: plan_model(a, 8, 64)) == \
        plan_model(arch, 8, 64).total_bytes


def test_a_model_larger_than_the_machine_names_the_key_and_both_sizes(monkeypatch):
    lib = OpLibrary(NUMPY)
    monkeypatch.setattr(budget, "available", lambda backend: (16 * 2**30, "memory"))
    cfg = load_config(None, ["model.hidden_dim=1048576", "model.num_heads=16384",
                             "model.num_kv_heads=16384"])
    started = time.perf_counter()
    adamw = update_ops(lib, "adamw")
    text = error(lambda: budget.check_fits(
        cfg, arch_of(cfg.model, lib), NUMPY,
        lambda a: plan_model(a, 8, 64, optimizer=plan_optimizer(a, adamw)), what="training",
        batch=("training.batch_size", 8, 8)))
    assert time.perf_counter() - started < 1.0
    assert text == ("model.hidden_dim: the training plan needs 576.13 TiB; this machine has "
                    "16.00 GiB of memory free (see `eulergen plan`)")


def test_gpt2_xl_at_a_batch_of_1024_is_refused_before_its_plan_is_made(monkeypatch):
    lib = OpLibrary(NUMPY)
    monkeypatch.setattr(budget, "available", lambda backend: (128 * 2**30, "memory"))
    cfg = load_config(None, ["model.preset=gpt2-xl", "training.batch_size=1024"])
    text = error(lambda: budget.check_fits(cfg, arch_of(cfg.model, lib), NUMPY,
                                           lambda a: plan_model(a, 1024, 1024), what="training",
                                           batch=("training.batch_size", 1024, 16)))
    assert text.startswith("training.batch_size: the training plan needs ")
    assert text.endswith(" TiB; this machine has 128.00 GiB of memory free (see `eulergen plan`)")
