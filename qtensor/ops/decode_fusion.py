"""One launch for the products of one activation with several frozen quantized weights.

[Note: fused decode products]
A decoder layer multiplies one activation by several weights: the attention's q, k and v
projections, the MLP's gate and up projections. At decode shapes each product is a launch of
the decode GEMM that streams its weight once and pays the launch's fixed cost once (about 5.6 us
on the H200 against cuBLAS's 2.4, benchmarks/RESULTS.md, "a fixed cost and a streaming rate");
the k and v weights of a GQA model are small enough that the fixed cost is most of their time.
Inductor's freezing concatenates the weights of such plain `mm`s when their shapes are equal;
the quantized products are opaque qtensor ops, which it leaves alone.

`FuseDecodeProducts` is an Inductor post-grad pass that does it for them. In a graph compiled
with freezing (the weights are constants, `get_attr` nodes), the products that share their
activation and scalars (format, K, E4M3 bounds, output dtype) and their bias presence become one
call on a weight whose rows are theirs in order, followed by a column slice per original
product. It takes `qtensor::decode_mm` (weights in the decode layout) and the dense ops of
canonical weights [N, K*] (`qtensor::nvfp4_mm`, `mxfp8_mm`, `mxfp4_mm`), whose activation is
high precision (weight-only) or quantized bytes that every product of the group reads (dynamic
activation: the compiled graph quantizes the activation once for all of them, its identical
quantizations merged):
- the fused weight's canonical bytes are the sources' canonical bytes concatenated along N
  (docs/formats.md: every row carries its own block scales, so rows concatenate); a decode
  layout is packed from them (`decode_layout.pack`), so any N packs;
- NVFP4's amax is the sources' one where they all have the same (bit for bit), else a per-row
  amax [N] that gives each row its source's amax: every row decodes to the same values as in
  its source (docs/formats.md, "row-scaled"), so each output column is the same product as
  before, exact up to fp32 accumulation order;
- biases, where every product has one, are concatenated.
Where the sources' bytes already lie back to back in one storage (`qtensor.share_decode_storage`
puts sibling weights so), the fused bytes are a view of that storage and the fusion costs no
memory: canonical rows always concatenate so; the decode layout stores whole row tiles one after
another, so there every source but the last must have whole tiles of 64 rows. Otherwise the
fused bytes are new constants of the compiled graph, held in addition to the module's own
weights.

Without freezing the weights are graph inputs and nothing is fused (concatenating them would
copy them on every call). The count of fused groups and of the products they replace is in
`torch._dynamo.utils.counters["qtensor"]`.
"""

from __future__ import annotations

import hashlib
import inspect
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from qtensor.formats import decode_layout
from qtensor.ops import decode_mm

aten = torch.ops.aten


@dataclass(frozen=True)
class _Product:
    """Where an op's arguments are: `shared`, the positions every product of a group has in
    common (the activation side, the scalars); the weight's data, scale, amax and bias
    positions (amax None: the format has none); `n`, the position of the weight's row count
    (None: the row count is the data's first dimension, a canonical weight [N, K*])."""

    shared: tuple[int, ...]
    data: int
    scale: int
    amax: int | None
    bias: int
    n: int | None = None


def _products() -> dict:
    qt = torch.ops.qtensor
    canonical_mx = _Product(shared=(0, 1, 5), data=2, scale=3, amax=None, bias=4)
    return {
        # decode_mm(x, w, s, amax, bias, fmt, n, k, bound, out_dtype)
        qt.decode_mm.default: _Product(shared=(0, 5, 7, 8, 9), data=1, scale=2, amax=3, bias=4,
                                       n=6),
        # nvfp4_mm(a, a_scale, a_amax, b, b_scale, b_amax, a_bound, b_bound, bias, out_dtype)
        qt.nvfp4_mm.default: _Product(shared=(0, 1, 2, 6, 7, 9), data=3, scale=4, amax=5,
                                      bias=8),
        # mxfp8_mm / mxfp4_mm(a, a_scale, b, b_scale, bias, out_dtype)
        qt.mxfp8_mm.default: canonical_mx,
        qt.mxfp4_mm.default: canonical_mx,
    }


class FuseDecodeProducts(CustomGraphPass):
    """An Inductor post-grad pass ([Note: fused decode products]) for a compile with freezing:
    set both where the compiled function first runs, e.g. `with
    torch._inductor.config.patch(freezing=True, post_grad_custom_post_pass=FuseDecodeProducts())`
    (Dynamo reads `freezing` while it traces, so `torch.compile(options=...)`, which reaches
    Inductor alone, does not freeze)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        fuse_decode_products(graph)

    def uuid(self) -> bytes:
        # Inductor's FX graph cache keys compiled code by this: the pass's own source and that
        # of the layout it packs.
        text = inspect.getsource(inspect.getmodule(FuseDecodeProducts)) + \
            inspect.getsource(decode_layout)
        return hashlib.sha256(text.encode()).digest()


def _constant(gm: torch.fx.GraphModule, node) -> torch.Tensor | None:
    """The tensor of a `get_attr` node (None for None; a non-constant raises KeyError)."""
    if node is None:
        return None
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        raise KeyError(node)
    value = gm
    for name in node.target.split("."):
        value = getattr(value, name)
    return value


def _fake(node) -> bool:
    """Whether an argument is a plain value or a node with a fake value (the fused output's
    shape is derived from them)."""
    return not isinstance(node, torch.fx.Node) or "val" in node.meta


def _groups(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    """The products that can be fused, in groups of two or more, in graph order."""
    gm = graph.owning_module
    table = _products()
    groups: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        spec = table.get(node.target) if node.op == "call_function" else None
        if spec is None or node.kwargs:
            continue
        shared = tuple(node.args[i] for i in spec.shared)
        if not all(_fake(a) for a in shared):
            continue  # no fake value to derive the fused output's from
        amax_arg = None if spec.amax is None else node.args[spec.amax]
        try:
            data, scale, amax, bias = (_constant(gm, a) for a in (
                node.args[spec.data], node.args[spec.scale], amax_arg, node.args[spec.bias]))
        except KeyError:
            continue  # a weight that is not a constant (no freezing): left as it is
        if scale is None or data.dim() != scale.dim() or (spec.n is None and data.dim() != 2):
            continue  # a high-precision or batched right operand: not a weight's rows
        if amax is not None and amax.dim() > 1:
            continue
        key = (node.target, shared, data.device, data.dtype, data.shape[1:], scale.dtype,
               scale.shape[1:], amax is None, None if bias is None else bias.dtype)
        groups[key].append(node)
    return [nodes for nodes in groups.values() if len(nodes) > 1]


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One tensor over the rows of `tensors` (contiguous, of one trailing shape) where they lie
    back to back, in order, in one storage (as `share_decode_storage` puts them), else None."""
    first = tensors[0]
    storage, end, rows = first.untyped_storage(), first.storage_offset(), 0
    for t in tensors:
        if not t.is_contiguous() or t.dim() == 0 or t.shape[1:] != first.shape[1:] or \
                t.storage_offset() != end or \
                t.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        end, rows = end + t.numel(), rows + t.shape[0]
    return first.new_empty(0).set_(storage, first.storage_offset(),
                                   (rows, *first.shape[1:]))


def _rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors concatenated along their rows: a view where they lie back to back."""
    joined = _joined(tensors)
    return torch.cat(tensors) if joined is None else joined


def _epilogue(amaxes: list, biases: list, ns: list[int]) -> tuple:
    """(amax, bias) of the fused weight. NVFP4's amax is the sources' one where they all have
    the same (bit for bit), else a per-row amax giving each row its source's; None where they
    have none (MX). Biases, where the sources have them, are concatenated."""
    bias = None if biases[0] is None else torch.cat(biases)
    first = amaxes[0]
    if first is None:
        return None, bias
    if all(a.dim() == 0 and torch.equal(a.view(torch.int32), first.view(torch.int32))
           for a in amaxes):
        return first.clone(), bias
    return torch.cat([a.reshape(1).expand(n) if a.dim() == 0 else a
                      for a, n in zip(amaxes, ns)]).contiguous(), bias


def fused_weight(fmt: str, k: int, parts: list[tuple]) -> tuple:
    """(codes, scales, amax, bias) of the decode-layout weight whose rows are those of `parts`,
    each (codes, scales, amax, bias, n) of one decode-layout weight [n, K], in order.

    The layout stores row tiles one after another, so where every part but the last has whole
    tiles of ROWS rows (no padding inside) the fused bytes are the parts' bytes in order: a view
    where they already lie so in one storage, no new memory. Otherwise the parts' canonical
    bytes are concatenated and packed again."""
    total = sum(p[4] for p in parts)
    codes = scales = None
    if all(p[4] % decode_layout.ROWS == 0 for p in parts[:-1]):
        codes, scales = _joined([p[0] for p in parts]), _joined([p[1] for p in parts])
    if codes is None or scales is None:
        data, scale = zip(*(decode_mm.unpack(fmt, w, s, n, k) for w, s, _, _, n in parts))
        codes, scales = decode_layout.pack(fmt, torch.cat(data), torch.cat(scale), total, k)
    return codes, scales, *_epilogue([p[2] for p in parts], [p[3] for p in parts],
                                     [p[4] for p in parts])


def fused_rows(parts: list[tuple]) -> tuple:
    """(data, scale, amax, bias) of the canonical weight whose rows are those of `parts`, each
    (data, scale, amax, bias) of one weight [n, K*] as the GEMM ops take it (docs/formats.md:
    every row carries its own block scales, so rows concatenate): a view where the parts' bytes
    lie back to back in one storage, else a copy."""
    data, scale, amax, bias = (list(field) for field in zip(*parts))
    return _rows(data), _rows(scale), *_epilogue(amax, bias, [d.shape[0] for d in data])


def _register(gm: torch.fx.GraphModule, graph: torch.fx.Graph, before, tensor, fake_mode):
    """A new constant of gm, read by a get_attr node inserted before `before`."""
    i = getattr(gm, "_qtensor_fused_count", 0)
    while hasattr(gm, f"_qtensor_fused{i}"):
        i += 1
    gm._qtensor_fused_count = i + 1
    name = f"_qtensor_fused{i}"
    gm.register_buffer(name, tensor)
    with graph.inserting_before(before):
        node = graph.get_attr(name)
    node.meta["val"] = fake_mode.from_tensor(tensor, static_shapes=True)
    return node


def _drop_constant(gm: torch.fx.GraphModule, graph: torch.fx.Graph, node) -> None:
    """Erase a get_attr node no call reads any more, and the graph's reference to its tensor."""
    if isinstance(node, torch.fx.Node) and node.op == "get_attr" and not node.users:
        graph.erase_node(node)
        if "." not in node.target and not any(
                n.op == "get_attr" and n.target == node.target for n in graph.nodes):
            delattr(gm, node.target)


def fuse_decode_products(graph: torch.fx.Graph) -> int:
    """Fuse the graph's groups of products of one activation ([Note: fused decode products])
    in place; the number of groups fused."""
    gm = graph.owning_module
    if gm is None:
        return 0
    table = _products()
    fused = 0
    for nodes in _groups(graph):
        first = nodes[0]
        spec = table[first.target]
        places = (spec.data, spec.scale, spec.amax, spec.bias)
        parts = [tuple(None if i is None else _constant(gm, n.args[i]) for i in places)
                 for n in nodes]
        if spec.n is None:
            ns = [p[0].shape[0] for p in parts]
            weight = fused_rows(parts)
        else:
            ns = [n.args[spec.n] for n in nodes]
            fmt, k = first.args[5], first.args[7]
            weight = fused_weight(fmt, k, [(*p, n) for p, n in zip(parts, ns)])
        total = sum(ns)
        fake_mode = next(a.meta["val"].fake_mode for a in first.args
                         if isinstance(a, torch.fx.Node) and "val" in a.meta and
                         isinstance(a.meta["val"], torch.Tensor))
        args = list(first.args)
        for i, t in zip(places, weight):
            if i is not None:
                args[i] = None if t is None else _register(gm, graph, first, t, fake_mode)
        if spec.n is not None:
            args[spec.n] = total
        with graph.inserting_before(first):
            out = graph.call_function(first.target, tuple(args))
            with fake_mode:
                out.meta["val"] = first.target(*(
                    a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args))
            dim, start = out.meta["val"].dim() - 1, 0
            for node, n in zip(nodes, ns):
                piece = graph.call_function(aten.slice.Tensor, (out, dim, start, start + n))
                with fake_mode:
                    piece.meta["val"] = aten.slice.Tensor(out.meta["val"], dim, start, start + n)
                node.replace_all_uses_with(piece)
                start += n
        for node in nodes:
            inputs = [node.args[i] for i in places if i is not None]
            graph.erase_node(node)
            for c in inputs:
                _drop_constant(gm, graph, c)
        fused += 1
        counters = torch._dynamo.utils.counters["qtensor"]
        counters["fused_decode_groups"] += 1
        counters["fused_decode_products"] += len(nodes)
    if fused:
        graph.lint()
    return fused
