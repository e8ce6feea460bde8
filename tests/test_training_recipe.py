"""The NVFP4 training recipe: knobs, validation errors, QTENSOR_* parsing, operands per role,
and the deprecated names of the renamed 4over6 fields."""

from __future__ import annotations

import dataclasses
import pickle
import warnings

import pytest
import torch

from qtensor.formats.mxfp8 import MXFP8Spec
from qtensor.formats.nvfp4 import NVFP4Spec
from qtensor.training import NVFP4TrainingRecipe, OperandSpecs, RoleSpec, SRSeeds
from qtensor.training.recipe import RENAMED_FIELDS
from qtensor.training.roles import SR_SLOTS, advance, each_call

RL = dict(rht=False, stochastic_rounding=False, weight_2d=False)


# ---- validation errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dgrad_mxfp8=True, backward_override="high_precision"), "set one of them"),
        (dict(dgrad_mxfp8=True, backward_override="dequantized"), "set one of them"),
        (dict(fourover6_grad=True, rht=True, stochastic_rounding=False), "rht=True"),
        (dict(fourover6_grad=True, rht=False, stochastic_rounding=True),
         "stochastic_rounding=True"),
        (dict(row_scaled_activation=True, rht=True, weight_2d=False, stochastic_rounding=False),
         "row_scaled_activation"),
        (dict(row_scaled_activation=True, rht=False, weight_2d=True, stochastic_rounding=False),
         "weight_2d=True"),
        (dict(row_scaled_activation=True, rht=False, weight_2d=False, stochastic_rounding=True),
         "stochastic_rounding=True"),
        (dict(fourover6_roles="activations", rht=True), "excludes RHT"),
        (dict(fourover6_roles="some"), "fourover6_roles must be one of"),
        (dict(fourover6_error="max"), "fourover6_error must be one of"),
        (dict(fourover6_e4m3_256_roles="grads"), "fourover6_e4m3_256_roles must be one of"),
        (dict(backward_override="fp32"), "backward_override must be one of"),
        (dict(seed=-1), "seed must be"),
    ],
)
def test_invalid_combinations_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NVFP4TrainingRecipe(**kwargs)


def test_bool_knobs_reject_non_bools():
    with pytest.raises(TypeError, match="dgrad_mxfp8 must be a bool"):
        NVFP4TrainingRecipe(dgrad_mxfp8="yes")


def test_recipe_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        NVFP4TrainingRecipe().dgrad_mxfp8 = True


# ---- the environment ---------------------------------------------------------------------------


def test_from_env_reads_every_knob():
    env = {
        "QTENSOR_NVFP4_DISABLE_2D_QUANTIZATION": "1",
        "QTENSOR_NVFP4_DISABLE_RHT": "1",
        "QTENSOR_NVFP4_DISABLE_STOCHASTIC_ROUNDING": "1",
        "QTENSOR_NVFP4_ROW_SCALED_ACTIVATION": "1",
        "QTENSOR_NVFP4_4OVER6": "ALL",
        "QTENSOR_NVFP4_4OVER6_ERR_MODE": "MSE",
        "QTENSOR_NVFP4_4OVER6_E4M3_USE_256": "weights",
        "QTENSOR_NVFP4_4OVER6_GRAD": "1",
        "QTENSOR_NVFP4_DGRAD_MXFP8": "1",
        "QTENSOR_NVFP4_SEED": "7",
    }
    r = NVFP4TrainingRecipe.from_env(env)
    assert r == NVFP4TrainingRecipe(
        weight_2d=False, rht=False, stochastic_rounding=False, row_scaled_activation=True,
        fourover6_roles="all", fourover6_error="mse", fourover6_e4m3_256_roles="weights",
        fourover6_grad=True, dgrad_mxfp8=True, seed=7,
    )


def test_from_env_defaults_and_override(setenv):
    for var in ("QTENSOR_BACKWARD_OVERRIDE", "QTENSOR_NVFP4_DGRAD_MXFP8"):
        setenv(var, "")  # empty counts as unset
    assert NVFP4TrainingRecipe.from_env() == NVFP4TrainingRecipe()
    setenv("QTENSOR_BACKWARD_OVERRIDE", "dequantized")
    assert NVFP4TrainingRecipe.from_env().backward_override == "dequantized"
    # Keyword arguments win over the environment.
    assert NVFP4TrainingRecipe.from_env(backward_override=None).backward_override is None
    setenv("QTENSOR_BACKWARD_OVERRIDE", "none")
    assert NVFP4TrainingRecipe.from_env().backward_override is None


@pytest.mark.parametrize(
    "env, match",
    [
        ({"QTENSOR_NVFP4_DGRAD_MXFP8": "2"}, "QTENSOR_NVFP4_DGRAD_MXFP8 must be a boolean"),
        ({"QTENSOR_NVFP4_SEED": "x"}, "QTENSOR_NVFP4_SEED must be an integer"),
        ({"QTENSOR_NVFP4_DGRAD_MXFP8": "1", "QTENSOR_BACKWARD_OVERRIDE": "high_precision"},
         "set one of them"),
        ({"QTENSOR_NVFP4_4OVER6_GRAD": "1"}, "fourover6_grad=True needs"),
    ],
)
def test_from_env_errors_name_the_variable_or_rule(env, match):
    with pytest.raises(ValueError, match=match):
        NVFP4TrainingRecipe.from_env(env)


# ---- deprecated names of the renamed 4over6 fields ----------------------------------------------

# A value for each renamed field that differs from its default, so a dropped value shows.
RENAMED_VALUES = {"fourover6_roles": "weights", "fourover6_error": "mse",
                  "fourover6_e4m3_256_roles": "activations"}


def _named_in(record) -> set[str]:
    """The new field names that the DeprecationWarnings of `record` point to."""
    return {str(w.message).rsplit("use ", 1)[1].rstrip(".") for w in record}


@pytest.mark.parametrize("old, new", RENAMED_FIELDS.items())
def test_old_keyword_warns_at_the_caller_and_sets_the_new_field(old, new):
    value = RENAMED_VALUES[new]
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated .*; use {new}") as record:
        r = NVFP4TrainingRecipe(**{old: value}, **RL)
    assert [w.filename for w in record] == [__file__]  # stacklevel points at this call
    assert r == NVFP4TrainingRecipe(**{new: value}, **RL) and getattr(r, new) == value
    assert hash(r) == hash(NVFP4TrainingRecipe(**{new: value}, **RL))
    assert old not in {f.name for f in dataclasses.fields(r)}


@pytest.mark.parametrize("old, new", RENAMED_FIELDS.items())
def test_old_attribute_warns_and_reads_the_new_field(old, new):
    r = NVFP4TrainingRecipe(**{new: RENAMED_VALUES[new]}, **RL)
    with pytest.warns(DeprecationWarning, match=f"use {new}") as record:
        assert getattr(r, old) == RENAMED_VALUES[new]
    assert [w.filename for w in record] == [__file__]
    with pytest.raises(AttributeError):  # a read-only alias, and the recipe is frozen
        setattr(r, old, "all")


@pytest.mark.parametrize("old, new", RENAMED_FIELDS.items())
def test_old_and_new_name_together_is_a_type_error(old, new):
    with pytest.raises(TypeError, match=f"both {old}=.*and {new}=.*pass only {new}"):
        NVFP4TrainingRecipe(**{old: RENAMED_VALUES[new], new: RENAMED_VALUES[new]}, **RL)


def test_new_names_raise_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = NVFP4TrainingRecipe(**RENAMED_VALUES, **RL)
        assert repr(r).count("fourover6_roles='weights'") == 1 and "fourover6=" not in repr(r)
        dataclasses.replace(r, seed=3)
        pickle.loads(pickle.dumps(r))


def test_replace_by_new_name_and_by_old_name():
    r = NVFP4TrainingRecipe(**RENAMED_VALUES, **RL)
    moved = dataclasses.replace(r, fourover6_roles="all", seed=5)
    assert (moved.fourover6_roles, moved.fourover6_error, moved.seed) == ("all", "mse", 5)
    # replace passes every field by its new name, so an old name meets its new one.
    with pytest.raises(TypeError, match="replace fourover6_roles"):
        dataclasses.replace(r, fourover6="all")


def test_pickles_round_trip_and_old_pickles_load_with_a_warning():
    r = NVFP4TrainingRecipe(**RENAMED_VALUES, **RL)
    assert pickle.loads(pickle.dumps(r)) == r
    # A pickle written before the rename: the instance's state under the old names.
    new_to_old = {new: old for old, new in RENAMED_FIELDS.items()}
    old = object.__new__(NVFP4TrainingRecipe)
    vars(old).update({new_to_old.get(k, k): v for k, v in vars(r).items()})
    blob = pickle.dumps(old)
    with pytest.warns(DeprecationWarning) as record:
        loaded = pickle.loads(blob)
    assert _named_in(record) == set(RENAMED_FIELDS.values())
    assert loaded == r and set(vars(loaded)) == set(vars(r))


def test_from_env_sets_the_new_fields_and_takes_old_overrides():
    env = {"QTENSOR_NVFP4_4OVER6": "weights", "QTENSOR_NVFP4_4OVER6_ERR_MODE": "MSE",
           "QTENSOR_NVFP4_4OVER6_E4M3_USE_256": "activations"}
    assert NVFP4TrainingRecipe.from_env(env, **RL) == NVFP4TrainingRecipe(**RENAMED_VALUES, **RL)
    with pytest.warns(DeprecationWarning, match="use fourover6_roles") as record:
        r = NVFP4TrainingRecipe.from_env(env, fourover6="all", **RL)  # the override wins
    assert [w.filename for w in record] == [__file__]
    assert (r.fourover6_roles, r.fourover6_error) == ("all", "mse")


@pytest.fixture
def qtensor_configs_loadable(monkeypatch):
    """torchao's config_from_dict finds classes only in ALLOWED_AO_MODULES; a user who loads
    qtensor configs from a dict adds qtensor.training there."""
    from torchao.core import config as ao_config

    monkeypatch.setattr(ao_config, "ALLOWED_AO_MODULES",
                        {*ao_config.ALLOWED_AO_MODULES, "qtensor.training"})
    return ao_config


def test_config_dicts_use_the_new_names_and_old_key_dicts_load(qtensor_configs_loadable):
    from qtensor.training import TrainingConfig

    ao_config = qtensor_configs_loadable
    config = TrainingConfig(NVFP4TrainingRecipe(**RENAMED_VALUES, **RL))
    d = ao_config.config_to_dict(config)
    recipe_keys = d["_data"]["recipe"]["_data"]
    assert {k: recipe_keys[k] for k in RENAMED_VALUES} == RENAMED_VALUES
    assert not set(RENAMED_FIELDS) & set(recipe_keys)
    assert ao_config.config_from_dict(d) == config
    # A dict saved before the rename: the recipe's values under the old keys.
    new_to_old = {new: old for old, new in RENAMED_FIELDS.items()}
    d["_data"]["recipe"]["_data"] = {new_to_old.get(k, k): v for k, v in recipe_keys.items()}
    with pytest.warns(DeprecationWarning) as record:
        assert ao_config.config_from_dict(d) == config
    assert _named_in(record) == set(RENAMED_FIELDS.values())


def test_transformers_torchao_config_round_trip(qtensor_configs_loadable):
    transformers = pytest.importorskip("transformers")
    from qtensor.training import TrainingConfig

    config = TrainingConfig(NVFP4TrainingRecipe(**RENAMED_VALUES, **RL))
    saved = transformers.TorchAoConfig(quant_type=config).to_dict()
    assert saved["quant_type"]["default"]["_data"]["recipe"]["_data"]["fourover6_roles"] == "weights"
    assert transformers.TorchAoConfig.from_dict(saved).quant_type == config


# ---- operands per role -------------------------------------------------------------------------


def test_default_recipe_operands():
    s = NVFP4TrainingRecipe().operand_specs()
    assert s.input == RoleSpec(NVFP4Spec(), NVFP4Spec(rht=True, columnwise=True))
    assert s.weight == RoleSpec(NVFP4Spec(block_2d=True), NVFP4Spec(block_2d=True, columnwise=True))
    assert s.grad_output == RoleSpec(
        NVFP4Spec(stochastic_rounding=True),
        NVFP4Spec(rht=True, stochastic_rounding=True, columnwise=True),
    )
    assert s.backward_override is None


def test_dgrad_mxfp8_operands_are_nvfp4_mxfp8_hybrids():
    s = NVFP4TrainingRecipe(dgrad_mxfp8=True).operand_specs()
    assert s.weight == RoleSpec(NVFP4Spec(block_2d=True), MXFP8Spec(columnwise=True),
                                "rowwise_dequantized")
    assert s.grad_output == RoleSpec(
        MXFP8Spec(), NVFP4Spec(rht=True, stochastic_rounding=True, columnwise=True), "original"
    )
    # The input quantizers are unchanged, row-scaled activations included.
    r = NVFP4TrainingRecipe(dgrad_mxfp8=True, row_scaled_activation=True, **RL)
    assert r.operand_specs().input == NVFP4TrainingRecipe(
        row_scaled_activation=True, **RL).operand_specs().input


@pytest.mark.parametrize("scope, bound", [("all", 256), ("activations", 448), ("none", 448)])
def test_gradient_fourover6_bound_follows_all(scope, bound):
    r = NVFP4TrainingRecipe(fourover6_grad=True, fourover6_e4m3_256_roles=scope,
                            fourover6_error="mse", **RL)
    dy = r.operand_specs().grad_output
    for spec in (dy.rowwise, dy.columnwise):
        assert (spec.fourover6, spec.e4m3_bound) == ("mse", bound)


def test_fourover6_all_leaves_gradients_unless_asked():
    r = NVFP4TrainingRecipe(fourover6_roles="all", **RL)
    s = r.operand_specs()
    assert s.grad_output.rowwise.fourover6 is None and s.grad_output.rowwise.e4m3_bound == 448
    assert s.input.rowwise.fourover6 == "mae" and s.weight.rowwise.e4m3_bound == 256
    w_only = NVFP4TrainingRecipe(fourover6_roles="weights",
                                 fourover6_e4m3_256_roles="activations", **RL)
    spec = w_only.operand_specs()
    assert spec.weight.rowwise == NVFP4Spec(fourover6="mae", e4m3_bound=448)
    assert spec.input.rowwise == NVFP4Spec()


@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
def test_overrides_quantize_only_the_forward(override):
    s = NVFP4TrainingRecipe(backward_override=override, **RL).operand_specs()
    assert s.input.columnwise is None and s.weight.columnwise is None
    assert s.grad_output.rowwise is None and s.backward_override == override


def test_operand_specs_check_gemm_pairs():
    good = NVFP4TrainingRecipe(**RL).operand_specs()
    with pytest.raises(ValueError, match="dgrad GEMM needs both operands in one format"):
        dataclasses.replace(good, grad_output=RoleSpec(MXFP8Spec(), good.grad_output.columnwise))
    with pytest.raises(ValueError, match="wgrad GEMM needs RHT on both"):
        dataclasses.replace(
            good, input=RoleSpec(NVFP4Spec(), NVFP4Spec(rht=True, columnwise=True)))
    with pytest.raises(ValueError, match="must be None"):
        OperandSpecs(good.input, good.weight, good.grad_output, backward_override="dequantized")
    with pytest.raises(ValueError, match="columnwise=True"):
        RoleSpec(NVFP4Spec(), NVFP4Spec())


def test_sr_seeds_are_deterministic_and_distinct_per_slot_and_module():
    a, b, c = SRSeeds(0, 0), SRSeeds(0, 0), SRSeeds(0, 1)
    state = a.initial_state()
    assert state.dtype == torch.int64 and state.shape == (len(SR_SLOTS), 2)
    assert torch.equal(state, b.initial_state())
    assert not torch.equal(state[:, 0], c.initial_state()[:, 0])  # another module
    assert len(set(state[:, 0].tolist())) == len(SR_SLOTS)  # one seed per slot
    assert not torch.equal(state[:, 0], SRSeeds(1, 0).initial_state()[:, 0])  # another recipe seed
    assert bool((state[:, 1] == 0).all())


def test_advance_returns_this_step_and_moves_the_buffer_in_place():
    buf = SRSeeds(3, 2).initial_state()
    first = buf.clone()
    taken = advance(buf, calls=3)
    assert torch.equal(taken, first) and taken.data_ptr() != buf.data_ptr()
    assert torch.equal(buf[:, 0], first[:, 0] + 3) and torch.equal(buf[:, 1], first[:, 1])
    calls = each_call(taken, 5)
    assert calls.shape == (5, *taken.shape) and calls.data_ptr() != taken.data_ptr()
    for j in range(5):
        assert torch.equal(calls[j][:, 0], first[:, 0] + j)
        assert torch.equal(calls[j][:, 1], first[:, 1])
    assert torch.equal(taken, first) and each_call(None, 3) is None
