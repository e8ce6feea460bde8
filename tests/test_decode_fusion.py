"""FuseDecodeProducts ([Note: fused decode products], qtensor/ops/decode_fusion.py), on the CPU:
the fused weight decodes to its sources' rows bit for bit (the reference product of an identity
activation is the decoded weight itself), only constants of one activation, format, bound,
output dtype and bias presence fuse, and a tiny Llama compiled with freezing and the pass runs
4 decode products a layer instead of 7 and decodes the unfused loop's tokens."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_decode  # noqa: E402

import qtensor  # noqa: E402
from qtensor import DecodeWeight, MXFP4Tensor, MXFP8Tensor, NVFP4Tensor  # noqa: E402
from qtensor.backends import has_kernel  # noqa: E402
from qtensor.ops import decode_fusion  # noqa: E402
from qtensor.ops.decode_fusion import (FuseDecodeProducts, fuse_decode_products,  # noqa: E402
                                       fused_weight)

torch.set_num_threads(1)
K = 96  # not a multiple of the layout's 64: the packed K is padded
CLASSES = {"nvfp4": NVFP4Tensor, "mxfp4": MXFP4Tensor, "mxfp8": MXFP8Tensor}
DECODE_MM = torch.ops.qtensor.decode_mm.default
DENSE_MM = {fmt: getattr(torch.ops.qtensor, f"{fmt}_mm").default for fmt in CLASSES}
DYNAMIC = (qtensor.NVFP4DynamicActivationNVFP4WeightConfig,
           qtensor.MXFP8DynamicActivationMXFP8WeightConfig)


def canonical(fmt: str, n: int, scale: float, seed: int, bound: int = 448):
    w = torch.randn(n, K, generator=torch.Generator().manual_seed(seed)) * scale
    kw = {"e4m3_bound": bound} if fmt == "nvfp4" else {}
    return CLASSES[fmt].from_hp(w, **kw)


def weight(fmt: str, n: int, scale: float, seed: int, bound: int = 448) -> DecodeWeight:
    return DecodeWeight.pack(canonical(fmt, n, scale, seed, bound))


def back_to_back(weights: list[DecodeWeight]) -> list[DecodeWeight]:
    """The weights with their bytes moved into one buffer by share_decode_storage."""
    class Holder(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.weight = torch.nn.Parameter(w, requires_grad=False)

    holders = torch.nn.ModuleList(Holder(w) for w in weights)
    assert qtensor.share_decode_storage(holders) == len(weights)
    return [h.weight for h in holders]


class Products(torch.nn.Module):
    """x times each weight by qtensor::decode_mm, the weights (and biases) as buffers: traced,
    they are get_attr nodes, as in a graph compiled with freezing."""

    def __init__(self, weights, biases=None, out_dtype=torch.float32):
        super().__init__()
        self.meta = []
        for i, w in enumerate(weights):
            self.register_buffer(f"w{i}", w.codes)
            self.register_buffer(f"s{i}", w.scales)
            self.register_buffer(f"a{i}", w.amax)
            bias = None if biases is None else biases[i]
            self.register_buffer(f"b{i}", bias)
            self.meta.append((w.fmt, w.shape[0], w.shape[1], w.bound, out_dtype))

    def forward(self, x):
        return tuple(DECODE_MM(x, getattr(self, f"w{i}"), getattr(self, f"s{i}"),
                               getattr(self, f"a{i}"), getattr(self, f"b{i}"), *meta)
                     for i, meta in enumerate(self.meta))


def traced(module: Products, x: torch.Tensor) -> torch.fx.GraphModule:
    gm = torch.fx.symbolic_trace(module)
    (placeholder,) = [n for n in gm.graph.nodes if n.op == "placeholder"]
    placeholder.meta["val"] = FakeTensorMode().from_tensor(x)
    return gm


def products(gm) -> int:
    return sum(n.target is DECODE_MM for n in gm.graph.nodes)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_fused_products_are_the_sources_bit_for_bit(fmt):
    """q, k and v shaped weights of different amaxes (NVFP4: a per-row amax), N not a multiple
    of the layout's 64: the fused call's output columns are each product's, bit for bit, on
    the identity (the decoded weights themselves) and on a random activation."""
    weights = [weight(fmt, 80, 1.0, 0), weight(fmt, 24, 0.01, 1), weight(fmt, 24, 30.0, 2)]
    biases = [torch.randn(w.shape[0], generator=torch.Generator().manual_seed(9 + i))
              for i, w in enumerate(weights)]
    x = torch.eye(K)
    gm = traced(Products(weights, biases), x)
    before = gm(x)
    assert fuse_decode_products(gm.graph) == 1
    gm.recompile()
    assert products(gm) == 1
    fused = next(n for n in gm.graph.nodes if n.target is DECODE_MM)
    assert fused.args[6] == 128 and fused.meta["val"].shape == (K, 128)
    amax = getattr(gm, fused.args[3].target) if fmt == "nvfp4" else None
    if fmt == "nvfp4":
        assert amax.shape == (128,)
        assert torch.equal(amax, torch.cat([w.amax.expand(w.shape[0]) for w in weights]))
    after = gm(x)
    for b, a in zip(before, after):
        assert torch.equal(a, b)
    y = torch.randn(3, K, dtype=torch.bfloat16)
    before_y = traced(Products(weights, biases, torch.bfloat16), y)(y)
    fused_y = traced(Products(weights, biases, torch.bfloat16), y)
    fuse_decode_products(fused_y.graph)
    fused_y.recompile()
    for a, b in zip(fused_y(y), before_y):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=0)  # up to fp32 accumulation order


def test_equal_nvfp4_amaxes_stay_one_scalar():
    base = torch.randn(64, K, generator=torch.Generator().manual_seed(4))
    base[0, 0] = 8.0  # both weights' amax
    ws = [DecodeWeight.pack(NVFP4Tensor.from_hp(base)),
          DecodeWeight.pack(NVFP4Tensor.from_hp(base[:32].flip(1).contiguous()))]
    assert torch.equal(ws[0].amax, ws[1].amax)
    gm = traced(Products(ws), torch.eye(K))
    before = gm(torch.eye(K))
    fuse_decode_products(gm.graph)
    gm.recompile()
    fused = next(n for n in gm.graph.nodes if n.target is DECODE_MM)
    assert getattr(gm, fused.args[3].target).dim() == 0
    assert all(torch.equal(a, b) for a, b in zip(gm(torch.eye(K)), before))


def test_only_matching_constant_products_fuse():
    """Different E4M3 bounds, formats or bias presence stay apart; graph inputs (no freezing)
    are never fused; each group fuses on its own."""
    x = torch.eye(K)
    mixed = Products([weight("nvfp4", 16, 1.0, 0), weight("nvfp4", 16, 1.0, 1, bound=256),
                      weight("mxfp8", 16, 1.0, 2), weight("nvfp4", 32, 2.0, 3),
                      weight("mxfp8", 48, 1.0, 4)])
    gm = traced(mixed, x)
    before = gm(x)
    assert fuse_decode_products(gm.graph) == 2  # nvfp4 / 448 (0, 3) and mxfp8 (2, 4)
    gm.recompile()
    assert products(gm) == 3
    assert all(torch.equal(a, b) for a, b in zip(gm(x), before))
    unused = {f"w{i}" for i in (0, 2, 3, 4)}  # the graph drops its references to fused sources
    assert not unused & {n.target for n in gm.graph.nodes if n.op == "get_attr"}

    ws = [weight("mxfp4", 16, 1.0, 0), weight("mxfp4", 16, 1.0, 1)]
    with_bias = traced(Products(ws, [torch.zeros(16), None]), x)
    assert fuse_decode_products(with_bias.graph) == 0

    def inputs(x, w0, s0, w1, s1):
        return (DECODE_MM(x, w0, s0, None, None, "mxfp4", 16, K, 448, torch.float32),
                DECODE_MM(x, w1, s1, None, None, "mxfp4", 16, K, 448, torch.float32))
    gm = torch.fx.symbolic_trace(inputs)
    assert fuse_decode_products(gm.graph) == 0 and products(gm) == 2


def test_fused_weight_is_a_view_of_shared_bytes():
    """Parts lying back to back in one storage, every part but the last of whole 64-row tiles:
    the fused bytes are a view of that storage, equal to the bytes packed from the canonical
    concatenation. A part with a padded tile before another is packed again instead."""
    for fmt in ("nvfp4", "mxfp4", "mxfp8"):
        weights = [weight(fmt, 128, 1.0, 0), weight(fmt, 64, 0.01, 1), weight(fmt, 40, 3.0, 2)]
        copied = fused_weight(fmt, K, [(w.codes, w.scales, w.amax, None, w.shape[0])
                                       for w in weights])
        shared = back_to_back(weights)
        parts = [(w.codes, w.scales, w.amax, None, w.shape[0]) for w in shared]
        viewed = fused_weight(fmt, K, parts)
        assert viewed[0].data_ptr() == shared[0].codes.data_ptr()
        assert viewed[1].data_ptr() == shared[0].scales.data_ptr()
        for a, b in zip(viewed, copied):
            assert (a is None and b is None) or torch.equal(a, b)
        padded = [parts[2], parts[0]]  # 40 rows, padded to 64, before another part
        assert fused_weight(fmt, K, padded)[0].data_ptr() != shared[0].codes.data_ptr()


def test_share_decode_storage_keeps_the_bytes_and_fuses_without_copies():
    """share_decode_storage puts each layer's q/k/v/o and gate/up bytes back to back; the
    canonical weights and the eager outputs do not change, and the fused frozen loop reads the
    module's own bytes (no fused constant of new memory) and decodes the eager tokens."""
    from torch._inductor.utils import run_and_get_code

    model = tiny_llama(qtensor.MXFP8WeightOnlyConfig, hidden=128)
    before = {n: p.canonical() for n, p in model.named_parameters() if isinstance(p, DecodeWeight)}
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(ids).logits
    assert qtensor.share_decode_storage(model) == 2 * (4 + 2)
    attn = model.model.layers[1].self_attn
    q, k = attn.q_proj.weight, attn.k_proj.weight
    assert q.codes.untyped_storage().data_ptr() == k.codes.untyped_storage().data_ptr()
    assert k.codes.storage_offset() == q.codes.numel()
    for n, p in model.named_parameters():
        if isinstance(p, DecodeWeight):
            c, b = p.canonical(), before[n]
            assert torch.equal(c.qdata.view(torch.uint8), b.qdata.view(torch.uint8))
            assert torch.equal(c.scale.view(torch.uint8), b.scale.view(torch.uint8))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)
    assert qtensor.share_decode_storage(model) == 2 * (4 + 2)  # again: a new buffer, same bytes
    assert qtensor.share_decode_storage(torch.nn.Linear(4, 4)) == 0  # nothing packed: no-op
    with pytest.raises(TypeError, match="takes a model .* got dict"):
        qtensor.share_decode_storage(dict(model.named_parameters()))

    eager = bench_decode.GreedyLoop(model, ids, "eager", 4)
    eager.run(3)
    torch._dynamo.reset()
    counters.clear()
    news = []
    real_register = decode_fusion._register

    def register(gm, graph, before, tensor, fake_mode):
        news.append(tensor)
        return real_register(gm, graph, before, tensor, fake_mode)

    decode_fusion._register = register
    try:
        loop = bench_decode.GreedyLoop(model, ids, "fused", 4)
        run_and_get_code(loop.run, 3)
    finally:
        decode_fusion._register = real_register
    assert counters["qtensor"]["fused_decode_groups"] == 4
    module_storages = {p.codes.untyped_storage().data_ptr() for p in model.parameters()
                       if isinstance(p, DecodeWeight)}
    module_storages |= {p.scales.untyped_storage().data_ptr() for p in model.parameters()
                        if isinstance(p, DecodeWeight)}
    fused_bytes = [t for t in news if t.dtype == torch.uint8]
    assert len(fused_bytes) == 8  # codes and scales of 4 fused weights
    assert all(t.untyped_storage().data_ptr() in module_storages for t in fused_bytes)
    assert torch.equal(loop.tokens(), eager.tokens())


class Dense(torch.nn.Module):
    """An activation times each canonical weight by the format's dense op (qtensor::nvfp4_mm,
    mxfp8_mm, mxfp4_mm), the weights' bytes (and biases) as buffers, as in a frozen graph. The
    activation is high precision (a_scale None) or quantized (its bytes are graph inputs)."""

    def __init__(self, fmt, weights, biases=None, out_dtype=torch.float32):
        super().__init__()
        self.fmt, self.out_dtype, self.count = fmt, out_dtype, len(weights)
        for i, w in enumerate(weights):
            self.register_buffer(f"w{i}", w.qdata)
            self.register_buffer(f"s{i}", w.scale)
            self.register_buffer(f"a{i}", w.amax if fmt == "nvfp4" else None)
            self.register_buffer(f"b{i}", None if biases is None else biases[i])

    def forward(self, a, a_scale, a_amax):
        out = []
        for i in range(self.count):
            w, s, am, b = (getattr(self, f"{c}{i}") for c in "wsab")
            if self.fmt == "nvfp4":
                out.append(DENSE_MM["nvfp4"](a, a_scale, a_amax, w, s, am, 448, 448, b,
                                             self.out_dtype))
            else:
                out.append(DENSE_MM[self.fmt](a, a_scale, w, s, b, self.out_dtype))
        return tuple(out)


def traced_dense(module: Dense, activation) -> torch.fx.GraphModule:
    """Traced with the activation's data, scale and amax (None where absent) as inputs."""
    gm = torch.fx.symbolic_trace(module)
    fake = FakeTensorMode()
    for node, value in zip([n for n in gm.graph.nodes if n.op == "placeholder"], activation):
        node.meta["val"] = None if value is None else fake.from_tensor(value)
    return gm


def activation(fmt: str, x: torch.Tensor, quantized: bool) -> tuple:
    """(data, scale, amax) of the left operand: x itself, or its bytes quantized to fmt."""
    if not quantized:
        return x, None, None
    q = CLASSES[fmt].from_hp(x)
    return q.qdata, q.scale, q.amax if fmt == "nvfp4" else None


@pytest.mark.parametrize("quantized", [False, True], ids=["weight_only", "dynamic"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_fused_canonical_products_are_the_sources_bit_for_bit(fmt, quantized):
    """Canonical weights of q, k and v shapes and different amaxes (NVFP4: a per-row amax),
    with biases, times a high-precision or a quantized activation (its bytes shared by the
    three products): one dense op, whose output columns are each product's bit for bit on
    one-hot rows (each output one decoded weight entry) and up to fp32 summation order on a
    random activation."""
    weights = [canonical(fmt, 80, 1.0, 0), canonical(fmt, 24, 0.01, 1),
               canonical(fmt, 24, 30.0, 2)]
    biases = [torch.randn(w.shape[0], generator=torch.Generator().manual_seed(9 + i))
              for i, w in enumerate(weights)]
    op = DENSE_MM[fmt]
    for x in (torch.eye(K), torch.randn(5, K, generator=torch.Generator().manual_seed(3))):
        act = activation(fmt, x, quantized)
        gm = traced_dense(Dense(fmt, weights, biases), act)
        before = gm(*act)
        counters.clear()
        assert fuse_decode_products(gm.graph) == 1
        assert counters["qtensor"]["fused_decode_products"] == 3
        gm.recompile()
        (node,) = [n for n in gm.graph.nodes if n.target is op]
        assert node.meta["val"].shape == (x.shape[0], 128)
        if fmt == "nvfp4":
            amax = getattr(gm, node.args[5].target)
            assert torch.equal(amax, torch.cat([w.amax.expand(w.shape[0]) for w in weights]))
        for a, b in zip(gm(*act), before):
            if x.shape[0] == K:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_only_matching_canonical_products_fuse():
    """Canonical products of one activation fuse only with the same bias presence; a weight
    that is a graph input (no freezing) or high precision never does."""
    x = torch.eye(K)
    nv = [canonical("nvfp4", 16, 1.0, 0), canonical("nvfp4", 32, 1.0, 1)]
    gm = traced_dense(Dense("nvfp4", nv, [torch.zeros(16), None]), (x, None, None))
    assert fuse_decode_products(gm.graph) == 0

    def mixed(a, w0, s0):
        mx = DENSE_MM["mxfp8"]
        return (mx(a, None, w0, s0, None, torch.float32),
                mx(a, None, torch.ones(16, K), None, None, torch.float32))
    gm = torch.fx.symbolic_trace(mixed)
    assert fuse_decode_products(gm.graph) == 0


def test_share_decode_storage_shares_canonical_rows():
    """Sibling canonical weights (rowwise NVFP4, MXFP8, MXFP4) move into one buffer per field
    with their bytes unchanged, and the fused weight of their products is a view of it."""
    for fmt in ("nvfp4", "mxfp4", "mxfp8"):
        weights = [canonical(fmt, 64, 1.0, 0), canonical(fmt, 32, 0.01, 1),
                   canonical(fmt, 40, 3.0, 2)]
        holders = torch.nn.ModuleList(torch.nn.Module() for _ in weights)
        for h, w in zip(holders, weights):
            h.weight = torch.nn.Parameter(w, requires_grad=False)
        assert qtensor.share_decode_storage(holders) == 3
        shared = [h.weight for h in holders]
        for a, b in zip(shared, weights):
            assert type(a) is type(b)
            assert torch.equal(a.qdata.view(torch.uint8), b.qdata.view(torch.uint8))
            assert torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
        assert shared[1].qdata.untyped_storage().data_ptr() == \
            shared[0].qdata.untyped_storage().data_ptr()
        parts = [(w.qdata, w.scale, w.amax if fmt == "nvfp4" else None, None) for w in shared]
        data, scale, _, _ = decode_fusion.fused_rows(parts)
        assert data.data_ptr() == shared[0].qdata.data_ptr()
        assert scale.data_ptr() == shared[0].scale.data_ptr()
        copied = decode_fusion.fused_rows([(w.qdata, w.scale, None, None) for w in weights])
        assert torch.equal(data.view(torch.uint8), copied[0].view(torch.uint8))
        assert torch.equal(scale.view(torch.uint8), copied[1].view(torch.uint8))
        odd = torch.nn.ModuleList(torch.nn.Module() for _ in range(2))
        odd[0].weight = torch.nn.Parameter(canonical(fmt, 23, 1.0, 3), requires_grad=False)
        odd[1].weight = torch.nn.Parameter(canonical(fmt, 16, 1.0, 4), requires_grad=False)
        assert qtensor.share_decode_storage(odd) == 0  # the second part would start unaligned
        transposed = torch.nn.Module()  # columnwise storage is not rows of the weight: left
        transposed.a = torch.nn.Module()
        transposed.b = torch.nn.Module()
        transposed.a.weight = torch.nn.Parameter(weights[0].t(), requires_grad=False)
        transposed.b.weight = torch.nn.Parameter(weights[0].t(), requires_grad=False)
        assert qtensor.share_decode_storage(transposed) == 0


@pytest.mark.parametrize("config", DYNAMIC, ids=["nvfp4_dynamic", "mxfp8_dynamic"])
def test_frozen_dynamic_decoder_fuses_its_products(config):
    """A 2-layer Llama with dynamic-activation weights, compiled with freezing and the pass:
    q/k/v and gate/up become one dense product each (8 in the generated code instead of 14),
    reading the module's own bytes after share_decode_storage, and the loop decodes the eager
    loop's tokens."""
    from torch._inductor.utils import run_and_get_code

    model = tiny_llama(config)
    fmt = type(model.model.layers[0].self_attn.q_proj.weight).gemm_format
    assert qtensor.share_decode_storage(model) == 2 * (4 + 2)
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(2))
    eager = bench_decode.GreedyLoop(model, ids, "eager", 4)
    eager.run(3)
    torch._dynamo.reset()
    counters.clear()
    loop = bench_decode.GreedyLoop(model, ids, "fused", 4)
    _, code = run_and_get_code(loop.run, 3)
    calls = sum(len(re.findall(rf"qtensor\.{fmt}_mm\.default\(", c)) for c in code)
    assert calls == 8
    assert counters["qtensor"]["fused_decode_groups"] == 4
    assert torch.equal(loop.tokens(), eager.tokens())


def tiny_llama(config, device="cpu", dtype=torch.float32, family="llama", hidden=64):
    """A 2-layer decoder with weights in the decode layout (canonical weights for a config of
    DYNAMIC): Llama, or Qwen2, whose q, k and v projections have biases (initialized large
    enough that greedy tokens vary)."""
    import transformers

    kind = {"llama": "Llama", "qwen2": "Qwen2"}[family]
    cfg = getattr(transformers, f"{kind}Config")(
        vocab_size=96, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        tie_word_embeddings=False, initializer_range=0.3 if family == "qwen2" else 0.02)
    torch.manual_seed(0)
    model = getattr(transformers, f"{kind}ForCausalLM")(cfg).to(device=device, dtype=dtype).eval()
    if family == "qwen2":
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    made = config() if config in DYNAMIC else config(layout="decode")
    qtensor.quantize_(model, made,
                      filter_fn=lambda m, n: isinstance(m, torch.nn.Linear) and n != "lm_head")
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_frozen_decoder_runs_four_products_a_layer(family):
    """Compiled with freezing and the pass (bench_decode's "fused" loop), a 2-layer decoder with
    NVFP4 weights (each its own amax; Qwen2: with q/k/v biases) runs q/k/v and gate/up as one
    product each: 8 decode_mm calls in the generated code instead of 14, and the same greedy
    tokens as the eager loop."""
    from torch._inductor.utils import run_and_get_code

    model = tiny_llama(qtensor.NVFP4WeightOnlyConfig, family=family)
    layer = model.model.layers[0].self_attn
    assert not torch.equal(layer.q_proj.weight.amax, layer.k_proj.weight.amax)
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(2))
    eager = bench_decode.GreedyLoop(model, ids, "eager", 4)
    eager.run(3)
    assert len(set(eager.tokens().flatten().tolist())) > 3  # the tokens say something
    torch._dynamo.reset()
    counters.clear()
    loop = bench_decode.GreedyLoop(model, ids, "fused", 4)  # freezing and FuseDecodeProducts
    _, code = run_and_get_code(loop.run, 3)
    calls = sum(len(re.findall(r"qtensor\.decode_mm\.default\(", c)) for c in code)
    assert calls == 8
    assert counters["qtensor"]["fused_decode_groups"] == 4
    assert counters["qtensor"]["fused_decode_products"] == 10
    assert torch.equal(loop.tokens(), eager.tokens())


needs_kernel = pytest.mark.skipif(
    not (torch.cuda.is_available() and has_kernel("decode_gemm", "CUDA")),
    reason="needs a GPU and the CUDA decode kernel")


@pytest.mark.cuda
@needs_kernel
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
@pytest.mark.parametrize("shared", [False, True], ids=["packed_again", "view"])
def test_fused_kernel_products_are_the_sources(fmt, shared):
    """The decode kernel on a fused weight (NVFP4: a per-row amax), packed again from N = 80,
    24, 24 or a view of N = 128, 64, 40 back to back: one-hot activation rows (each output one
    decoded weight entry, nothing summed) give each source's columns bit for bit; bf16
    activations of 1 and 16 rows agree within fp32 summation over K."""
    rows = (128, 64, 40) if shared else (80, 24, 24)
    weights = [weight(fmt, n, scale, i).to("cuda")
               for i, (n, scale) in enumerate(zip(rows, (1.0, 0.01, 30.0)))]
    if shared:
        weights = back_to_back(weights)
    module = Products(weights)
    eye = torch.eye(K, dtype=torch.bfloat16, device="cuda")
    fused = traced(module, eye[:64])
    assert fuse_decode_products(fused.graph) == 1
    fused.recompile()
    node = next(n for n in fused.graph.nodes if n.target is DECODE_MM)
    codes = getattr(fused, node.args[1].target)
    assert (codes.data_ptr() == weights[0].codes.data_ptr()) == shared
    plain = traced(module, eye[:64])
    for rows in (eye[:64], eye[32:]):  # 64 rows: one launch of the kernel each
        for a, b in zip(fused(rows), plain(rows)):
            assert torch.equal(a, b)
    # |W| transposed, [K, N]: rows 0-63 from the first one-hot block, 64-95 from the second
    w_abs = torch.cat([torch.cat([a[:64], b[32:]]) for a, b in zip(plain(eye[:64]),
                                                                   plain(eye[32:]))], 1).abs()
    for m in (1, 16):
        x = torch.randn(m, K, dtype=torch.bfloat16, device="cuda")
        bound = 2 * K * 2**-24 * (x.float().abs() @ w_abs)
        got = torch.cat(fused(x), 1)
        want = torch.cat(plain(x), 1)
        assert bool(((got - want).abs() <= bound).all())


@pytest.mark.cuda
@needs_kernel
def test_fused_llama_on_the_kernel_decodes_the_frozen_tokens():
    """bf16 activations through the decode kernel: the fused frozen loop decodes the frozen
    loop's tokens (K = 64 is one super-tile, so each output sums in the same order)."""
    model = tiny_llama(qtensor.NVFP4WeightOnlyConfig, "cuda", torch.bfloat16)
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight, DecodeWeight)
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(2)).cuda()
    tokens = {}
    for mode in ("frozen", "fused"):
        torch._dynamo.reset()
        loop = bench_decode.GreedyLoop(model, ids, mode, 4)
        loop.run(3)
        tokens[mode] = loop.tokens()
    assert torch.equal(tokens["fused"], tokens["frozen"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("quantized", [False, True], ids=["weight_only", "dynamic"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_fused_canonical_products_on_the_gpu(fmt, quantized):
    """The dense ops' CUDA kernels on a fused canonical weight (NVFP4: a per-row amax) of
    N = 80, 24, 24 with biases: one-hot activation rows give each source's columns bit for bit,
    and bf16 rows of 1 and 16 tokens agree within fp32 summation over K."""
    weights = [canonical(fmt, n, scale, i).to("cuda")
               for i, (n, scale) in enumerate(zip((80, 24, 24), (1.0, 0.01, 30.0)))]
    biases = [torch.randn(w.shape[0], device="cuda") for w in weights]
    module = Dense(fmt, weights, biases, torch.bfloat16)
    eye = torch.eye(K, dtype=torch.bfloat16, device="cuda")
    checks = [(activation(fmt, eye, quantized), True)] + [
        (activation(fmt, torch.randn(m, K, dtype=torch.bfloat16, device="cuda"), quantized),
         False) for m in (1, 16)]
    for act, exact in checks:
        plain = traced_dense(module, act)
        fused = traced_dense(module, act)
        assert fuse_decode_products(fused.graph) == 1
        fused.recompile()
        for a, b in zip(fused(*act), plain(*act)):
            if exact:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=2**-7, atol=2**-7 * b.abs().max().item())


def test_uuid_is_stable_bytes():
    a, b = FuseDecodeProducts().uuid(), FuseDecodeProducts().uuid()
    assert a == b and isinstance(a, bytes) and len(a) == 32
