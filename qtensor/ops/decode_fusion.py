"""One launch for the products of one activation with several frozen decode-layout weights.

[Note: fused decode products]
A decoder layer multiplies one activation by several weights: the attention's q, k and v
projections, the MLP's gate and up projections. At decode shapes each product is a launch of
the decode GEMM that streams its weight once and pays the launch's fixed cost once (about 5.6 us
on the H200 against cuBLAS's 2.4, benchmarks/RESULTS.md, "a fixed cost and a streaming rate");
the k and v weights of a GQA model are small enough that the fixed cost is most of their time.
Inductor's freezing concatenates the weights of such plain `mm`s when their shapes are equal;
the quantized products are opaque `qtensor::decode_mm` calls, which it leaves alone.

`FuseDecodeProducts` is an Inductor post-grad pass that does it for them. In a graph compiled
with freezing (the weights are constants, `get_attr` nodes), the `decode_mm` calls that share
their activation node, format, K, E4M3 bound, output dtype and bias presence become one call on
a weight whose rows are theirs in order, followed by a column slice per original product:
- the fused weight's canonical bytes are the sources' canonical bytes concatenated along N, and
  its decode layout is packed from them (`decode_layout.pack`), so any N packs;
- NVFP4's amax is the sources' one where they all have the same (bit for bit), else a per-row
  amax [N] that gives each row its source's amax: every row decodes to the same values as in
  its source (docs/formats.md, "row-scaled"), so each output column is the same product as
  before, exact up to fp32 accumulation order;
- biases, where every product has one, are concatenated.
The decode layout stores a weight's row tiles one after another, so where the sources' bytes
already lie back to back in one storage (`qtensor.share_decode_storage` puts sibling weights
so) and every source but the last has whole tiles of 64 rows, the fused codes and scales are a
view of that storage: the fusion costs no memory. Otherwise they are new constants of the
compiled graph, held in addition to the module's own weights.

Without freezing the weights are graph inputs and nothing is fused (concatenating them would
copy them on every call). The count of fused groups and of the products they replace is in
`torch._dynamo.utils.counters["qtensor"]`.
"""

from __future__ import annotations

import hashlib
import inspect
from collections import defaultdict

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from qtensor.formats import decode_layout
from qtensor.ops import decode_mm

aten = torch.ops.aten
_ARGS = ("x", "w", "s", "amax", "bias", "fmt", "n", "k", "bound", "out_dtype")


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


def _groups(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    """The decode_mm calls that can be fused, in groups of two or more, in graph order."""
    gm = graph.owning_module
    groups: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.qtensor.decode_mm.default \
                or node.kwargs:
            continue
        a = dict(zip(_ARGS, node.args))
        if not isinstance(a["x"], torch.fx.Node) or "val" not in a["x"].meta:
            continue  # no fake value to derive the fused output's from
        try:
            w, _, _, bias = (_constant(gm, a[name]) for name in ("w", "s", "amax", "bias"))
        except KeyError:
            continue  # a weight that is not a constant (no freezing): left as it is
        key = (a["x"], a["fmt"], a["k"], a["bound"], a["out_dtype"], w.device,
               None if bias is None else bias.dtype)
        groups[key].append(node)
    return [nodes for nodes in groups.values() if len(nodes) > 1]


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One tensor over the bytes of `tensors` where they lie back to back, in order, in one
    storage (as `share_decode_storage` puts them), else None."""
    first = tensors[0]
    storage, end = first.untyped_storage(), first.storage_offset()
    for t in tensors:
        if t.dim() != 1 or t.stride(0) != 1 or t.storage_offset() != end or \
                t.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        end += t.numel()
    return first.new_empty(0).set_(storage, first.storage_offset(), (end - first.storage_offset(),))


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
    amaxes = [p[2] for p in parts]
    amax = None
    if fmt == "nvfp4":
        first = amaxes[0]
        if all(a.dim() == 0 and torch.equal(a.view(torch.int32), first.view(torch.int32))
               for a in amaxes):
            amax = first.clone()
        else:
            amax = torch.cat([a.reshape(1).expand(p[4]) if a.dim() == 0 else a
                              for a, p in zip(amaxes, parts)]).contiguous()
    biases = [p[3] for p in parts]
    bias = None if biases[0] is None else torch.cat(biases)
    return codes, scales, amax, bias


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
    node.meta["val"] = fake_mode.from_tensor(tensor)
    return node


def _drop_constant(gm: torch.fx.GraphModule, graph: torch.fx.Graph, node) -> None:
    """Erase a get_attr node no call reads any more, and the graph's reference to its tensor."""
    if isinstance(node, torch.fx.Node) and node.op == "get_attr" and not node.users:
        graph.erase_node(node)
        if "." not in node.target and not any(
                n.op == "get_attr" and n.target == node.target for n in graph.nodes):
            delattr(gm, node.target)


def fuse_decode_products(graph: torch.fx.Graph) -> int:
    """Fuse the graph's groups of decode_mm calls ([Note: fused decode products]) in place;
    the number of groups fused."""
    gm = graph.owning_module
    if gm is None:
        return 0
    fused = 0
    for nodes in _groups(graph):
        a = dict(zip(_ARGS, nodes[0].args))
        x = a["x"]
        fake_mode = x.meta["val"].fake_mode
        parts = [(_constant(gm, n.args[1]), _constant(gm, n.args[2]), _constant(gm, n.args[3]),
                  _constant(gm, n.args[4]), n.args[6]) for n in nodes]
        codes, scales, amax, bias = fused_weight(a["fmt"], a["k"], parts)
        total = sum(p[4] for p in parts)
        first = nodes[0]
        consts = [None if t is None else _register(gm, graph, first, t, fake_mode)
                  for t in (codes, scales, amax, bias)]
        with graph.inserting_before(first):
            out = graph.call_function(torch.ops.qtensor.decode_mm.default,
                                      (x, *consts, a["fmt"], total, a["k"], a["bound"],
                                       a["out_dtype"]))
            with fake_mode:
                out.meta["val"] = x.meta["val"].new_empty((x.meta["val"].shape[0], total),
                                                          dtype=a["out_dtype"])
            start = 0
            for node in nodes:
                n = node.args[6]
                piece = graph.call_function(aten.slice.Tensor, (out, 1, start, start + n))
                with fake_mode:
                    piece.meta["val"] = aten.slice.Tensor(out.meta["val"], 1, start, start + n)
                node.replace_all_uses_with(piece)
                start += n
        for node in nodes:
            inputs = node.args[1:5]
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
