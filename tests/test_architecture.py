"""The package's structure, as docs/architecture.md draws it: imports run one way down the layers,
no import cycle (lazy imports included), every quantized class answers its layout protocol, and
no source file grows past 600 lines."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest
import torch

from qtensor.formats.fp8_block import FP8BlockSpec
from qtensor.formats.mxfp4 import MXFP4Spec
from qtensor.formats.mxfp8 import MXFP8Spec
from qtensor.formats.nvfp4 import NVFP4Spec
from qtensor.tensors import (FP8BlockTensor, HybridSpec, HybridTensor, MXFP4Tensor, MXFP8Tensor,
                             NVFP4Tensor, QuantizedTensor, quantize_spec)
from qtensor.tensors import layout
from qtensor.tensors.common import metadata_mismatch

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "qtensor"

# Bottom to top: a module may import modules of its own layer or of a layer below.
# Keep in step with docs/architecture.md.
LAYERS = [
    {"formats", "version", "_torchao"},
    {"backends"},
    {"kernels"},
    {"ops"},
    {"tensors"},
    {"gemm"},
    {"training"},
    {"qat"},
    {"distributed"},
    {"quantize"},
    {"checkpoint"},
    {"testing", "cli", "__main__", ""},  # "" is the package root, qtensor/__init__.py
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """The qtensor modules `name` imports anywhere in its body (function-level imports too)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                if sub in MODULES:
                    found.add(sub)
                elif module in MODULES:
                    found.add(module)
    found.discard(name)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_subpackage_has_a_layer():
    missing = sorted({_layer(m) for m in MODULES} - set(RANK))
    assert not missing, f"add {missing} to LAYERS (and to docs/architecture.md)"


def test_imports_run_down_the_layers():
    upward = [
        f"{a} imports {b}"
        for a, targets in GRAPH.items() for b in targets
        if RANK[_layer(b)] > RANK[_layer(a)]
    ]
    assert not upward, "imports that go up a layer:\n  " + "\n  ".join(sorted(upward))


def test_no_import_cycle():
    """Tarjan's strongly connected components over every import, lazy ones included."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_walk_sees_lazy_imports():
    """The graph is only as good as its parser: a function-level import must show up."""
    assert "qtensor.tensors.gather" in GRAPH["qtensor.tensors"]
    lazy = [name for name, path in MODULES.items()
            if any(isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("qtensor")
                   for f in ast.walk(ast.parse(path.read_text()))
                   if isinstance(f, ast.FunctionDef) for n in ast.walk(f))]
    assert lazy, "no function-level import found: the walk would not test them"
    for name in lazy:
        assert GRAPH[name], name


def test_no_source_file_over_600_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"split these files (600 lines at most): {long}"


# ---- the layout protocol, for every class ------------------------------------------------------


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


SPECS = [
    NVFP4Spec(), NVFP4Spec(block_2d=True), NVFP4Spec(row_scaled=True),
    NVFP4Spec(fourover6="mse", e4m3_bound=256), NVFP4Spec(columnwise=True),
    NVFP4Spec(rht=True, columnwise=True), MXFP8Spec(), MXFP8Spec(scale_rule="floor"),
    MXFP8Spec(columnwise=True), FP8BlockSpec(), FP8BlockSpec(columnwise=True),
    FP8BlockSpec("128x128"), MXFP4Spec(), MXFP4Spec(columnwise=True),
]


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_spec_is_the_spec_quantized_with(spec):
    shape = (128, 256) if isinstance(spec, FP8BlockSpec) else (64, 96)
    t = quantize_spec(_x(*shape), spec)
    assert t.spec == spec
    again = type(t).from_spec(_x(*shape), t.spec)
    for name in t.tensor_data_names:
        assert torch.equal(getattr(again, name), getattr(t, name))


def test_spec_is_kept_by_a_transpose_and_drops_stochastic_rounding():
    """`spec` is how the bytes were made, `axis` the way the blocks run in this view."""
    t = MXFP8Tensor.from_spec(_x(64, 96), MXFP8Spec())
    assert t.t().spec == MXFP8Spec() and t.t().axis == "columnwise"
    spec = NVFP4Spec(rht=True, columnwise=True)
    rht = NVFP4Tensor.from_spec(_x(64, 96), spec)
    assert rht.t().spec == spec and rht.t().axis == "rowwise" and rht.t().rht
    sr = NVFP4Tensor.from_spec(_x(64, 96), NVFP4Spec(stochastic_rounding=True))
    assert sr.spec == NVFP4Spec()


def test_the_direction_at_quantization_is_not_what_the_bytes_mean():
    """A rowwise quantization of x.t(), transposed, holds the bytes of x's columnwise one: the
    two compare equal as metadata and copy into each other, although their specs record
    different directions."""
    x = _x(64, 96)
    for direct, via in ((NVFP4Tensor.from_spec(x, NVFP4Spec(columnwise=True)),
                         NVFP4Tensor.from_spec(x.t().contiguous(), NVFP4Spec()).t()),
                        (MXFP8Tensor.from_spec(x, MXFP8Spec(columnwise=True)),
                         MXFP8Tensor.from_spec(x.t().contiguous(), MXFP8Spec()).t())):
        assert direct.spec.columnwise != via.spec.columnwise and direct.axis == via.axis
        assert metadata_mismatch(direct, via) == []
        assert torch.equal(direct.dequantize(), via.dequantize())
        direct.clone().copy_(via)
    a = NVFP4Tensor.from_spec(x, NVFP4Spec())
    b = NVFP4Tensor.from_spec(x, NVFP4Spec(e4m3_bound=256))
    assert metadata_mismatch(a, b) == ["spec.e4m3_bound: 448 != 256"]


def test_spec_fields_are_tensor_attributes():
    t = NVFP4Tensor.from_spec(_x(64, 96), NVFP4Spec(block_2d=True, e4m3_bound=256))
    assert (t.block_2d, t.row_scaled, t.e4m3_bound, t.rht, t.fourover6) == (True, False, 256,
                                                                          False, None)
    with pytest.raises(TypeError, match="has no fields"):
        t.replace(block_2d=False)


def test_a_tensor_pickled_before_the_spec_moved_loads():
    """torch.load of a tensor whose pickled state holds the spec unpacked (and scale_layout)."""
    for t in (NVFP4Tensor.from_spec(_x(64, 96), NVFP4Spec(row_scaled=True)),
              NVFP4Tensor.from_spec(_x(64, 96), NVFP4Spec(rht=True, columnwise=True)).t(),
              NVFP4Tensor.from_spec(_x(64, 96), NVFP4Spec()).t(),
              MXFP8Tensor.from_spec(_x(64, 96), MXFP8Spec()).t(),
              MXFP8Tensor.from_spec(_x(64, 96), MXFP8Spec(scale_rule="floor", columnwise=True))):
        rebuild, (func, cls, args, state) = t.__reduce_ex__(2)
        legacy = {k: v for k, v in state.items() if k != "spec"}
        spec = state["spec"]
        if isinstance(spec, NVFP4Spec):
            legacy.update(block_2d=spec.block_2d, row_scaled=spec.row_scaled,
                          fourover6=spec.fourover6, e4m3_bound=spec.e4m3_bound, rht=spec.rht)
        else:
            legacy.update(scale_rule=spec.scale_rule)
        legacy["scale_layout"] = "compact"
        old = rebuild(func, cls, args, legacy)
        # The direction at quantization was not stored before: it is read off the axis, which
        # a metadata check does not hold against the tensor (the bytes mean the same).
        assert old.axis == t.axis and "scale_layout" not in vars(old)
        assert dataclasses.replace(old.spec, columnwise=t.spec.columnwise) == t.spec
        assert metadata_mismatch(t, old) == []
        t.clone().copy_(old)
        for name in t.tensor_data_names:
            a, b = getattr(old, name), getattr(t, name)
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_hybrid_spec():
    row, col = NVFP4Spec(block_2d=True), MXFP8Spec(columnwise=True)
    h = HybridTensor.from_hp(_x(64, 96), rowwise=row, columnwise=col)
    assert h.spec == HybridSpec(row, col, "original")
    assert set(h.parts()) == {"rowwise", "columnwise"}


def _samples():
    x = _x(64, 96)
    yield NVFP4Tensor.from_spec(x, NVFP4Spec())
    yield NVFP4Tensor.from_spec(x, NVFP4Spec(row_scaled=True))
    yield NVFP4Tensor.from_spec(x, NVFP4Spec(block_2d=True))
    yield NVFP4Tensor.from_spec(x, NVFP4Spec(columnwise=True))
    yield MXFP8Tensor.from_spec(x, MXFP8Spec())
    yield MXFP8Tensor.from_spec(x, MXFP8Spec(columnwise=True))
    yield HybridTensor.from_hp(x, rowwise=NVFP4Spec(block_2d=True), columnwise=MXFP8Spec())
    wide = _x(256, 512)  # FP8 blocks are 128 long (half of either dim stays whole tiles)
    yield FP8BlockTensor.from_spec(wide, FP8BlockSpec())
    yield FP8BlockTensor.from_spec(wide, FP8BlockSpec(columnwise=True))
    yield FP8BlockTensor.from_spec(wide, FP8BlockSpec("128x128"))
    yield FP8BlockTensor.from_spec(wide, FP8BlockSpec("128x128")).t()
    yield MXFP4Tensor.from_spec(x, MXFP4Spec())
    yield MXFP4Tensor.from_spec(x, MXFP4Spec(columnwise=True))
    yield MXFP4Tensor.from_spec(_x(2, 64, 96), MXFP4Spec()).transpose(-1, -2)  # gpt-oss experts


@pytest.mark.parametrize("t", list(_samples()), ids=lambda t: repr(t)[:60])
def test_layout_protocol_agrees_with_the_bytes(t):
    """inner_layout is what the tensor holds; shard_dims name dims whose size is dim 0's in
    storage units; block_size divides the dims it names; flat() decodes to the same values."""
    assert type(t).__name__ in QuantizedTensor.classes
    attrs = {n: getattr(t, n) for n in t.tensor_attribute_names}
    for name, want in type(t).inner_layout(t.shape, attrs).items():
        inner = getattr(t, name)
        if isinstance(want, str):
            assert inner.axis == want
        else:
            assert (inner.shape, inner.dtype) == want, name
    for leaf in layout.leaves(t):
        inner = layout.get_leaf(t, leaf.path)
        if leaf.dim is not None:  # rows of the leaf are whole multiples of the tensor's rows
            assert (inner.shape[leaf.dim] * t.block_size(0)) % t.shape[0] == 0 or \
                t.shape[0] % inner.shape[leaf.dim] == 0
    for dim in range(t.dim()):
        assert t.shape[dim] % t.block_size(dim) == 0
    flat = t.flat()
    if flat is not None:
        assert torch.equal(flat.dequantize(), t.dequantize().reshape(-1))
    half = layout.rows_resized(t, t.shape[0] // 2, torch.zeros_like, torch.zeros)
    assert type(half) is type(t) and half.shape[0] == t.shape[0] // 2


def test_a_class_without_a_layout_says_so():
    class Bare(QuantizedTensor):
        tensor_data_names = ("payload",)

    try:
        bare = Bare((2, 2), torch.float32, "cpu", payload=torch.zeros(2, 2))
        with pytest.raises(NotImplementedError, match="Bare declares no storage layout"):
            layout.leaves(bare)
    finally:
        QuantizedTensor.classes.pop("Bare")
