"""The NVFP4 training recipe: knobs, validation errors, QTENSOR_* parsing, operands per role."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qtensor.formats.mxfp8 import MXFP8Spec
from qtensor.formats.nvfp4 import NVFP4Spec
from qtensor.training import NVFP4TrainingRecipe, OperandSpecs, RoleSpec, SRSeeds
from qtensor.training.roles import SR_SLOTS, advance, nth_call

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
        (dict(fourover6="activations", rht=True), "excludes RHT"),
        (dict(fourover6="some"), "fourover6 must be one of"),
        (dict(fourover6_err="max"), "fourover6_err must be one of"),
        (dict(fourover6_e4m3_256="grads"), "fourover6_e4m3_256 must be one of"),
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
        fourover6="all", fourover6_err="mse", fourover6_e4m3_256="weights",
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


def test_dgrad_mxfp8_operands_are_the_seed_hybrids():
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
    r = NVFP4TrainingRecipe(fourover6_grad=True, fourover6_e4m3_256=scope, fourover6_err="mse",
                            **RL)
    dy = r.operand_specs().grad_output
    for spec in (dy.rowwise, dy.columnwise):
        assert (spec.fourover6, spec.e4m3_bound) == ("mse", bound)


def test_fourover6_all_leaves_gradients_unless_asked():
    r = NVFP4TrainingRecipe(fourover6="all", **RL)
    s = r.operand_specs()
    assert s.grad_output.rowwise.fourover6 is None and s.grad_output.rowwise.e4m3_bound == 448
    assert s.input.rowwise.fourover6 == "mae" and s.weight.rowwise.e4m3_bound == 256
    w_only = NVFP4TrainingRecipe(fourover6="weights", fourover6_e4m3_256="activations", **RL)
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
    assert torch.equal(nth_call(taken, 2)[:, 0], first[:, 0] + 2)
    assert nth_call(taken, 0) is taken and nth_call(None, 1) is None
