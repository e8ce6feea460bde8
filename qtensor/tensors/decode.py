"""DecodeWeight: a quantized weight whose bytes are in the decode layout.

[Note: decode weights]
A weight-only linear at decode shapes streams its weight once per token, so the order its bytes
are stored in is the order the decode GEMM loads them fastest ([Note: decode layout] in
qtensor/formats/decode_layout.py). `DecodeWeight.pack(w)` repacks a 2-D rowwise NVFP4Tensor,
MXFP8Tensor or MXFP4Tensor weight [N, K] once (at quantize_ or load time) and keeps everything
needed to give the canonical tensor back, bit for bit: `canonical()`. Its repr names the
layout (`packing`) and the canonical class.

What sees which bytes:
- F.linear (nn.Linear's forward, eager and compiled) multiplies the packed bytes through
  qtensor::decode_mm: the CUDA decode kernel where it is built for the device, the exact
  reference elsewhere.
- `dequantize()`, the checkpoints (safetensors, torch.save, DCP, export) and `state_dict()` of
  a module whose weight `to_decode_layout` packed see the canonical tensor: a checkpoint
  written from a packed model is byte-identical to one written from the canonical model, and
  `load_state_dict` packs the loaded tensor again.
- Anything else (slicing, transposes, FSDP2 sharding) raises, naming `canonical()`: the layout
  is for serving a weight whose shape is final.
Moving the tensor to another device moves its bytes; the layout is one device's choice, so
`to_decode_layout` on the new device (or `canonical()`) decides again.
"""

from __future__ import annotations

import torch

from qtensor.formats import decode_layout
from qtensor.tensors.base import QuantizedTensor
from qtensor.tensors.common import ROWWISE

aten = torch.ops.aten
LAYOUT = "decode-v3"  # the layout version: [Note: decode layout]


class DecodeWeight(QuantizedTensor):
    storable = False  # checkpoints hold canonical()
    tensor_data_names = ("codes", "scales", "amax")
    tensor_attribute_names = (
        "fmt",  # "nvfp4", "mxfp4" or "mxfp8": the format of the bytes
        "packing",  # the decode layout's version (`layout` is torch's strided/sparse)
        "canonical_class",  # the class `canonical()` returns
        "canonical_attrs",  # that tensor's attributes, as (name, value) pairs
    )

    @classmethod
    def pack(cls, w: QuantizedTensor) -> "DecodeWeight":
        """The decode-layout form of a weight-only 2-D rowwise weight [N, K]."""
        why = pack_problem(w)
        if why:
            raise ValueError(f"the decode layout cannot hold {w!r}: {why}.")
        n, k = w.shape
        codes, scales = decode_layout.pack(w.gemm_format, w.qdata, w.scale, n, k)
        attrs = tuple((name, getattr(w, name)) for name in w.tensor_attribute_names)
        return cls(w.shape, w.dtype, w.device, codes=codes, scales=scales,
                   amax=w.amax if "amax" in w.tensor_data_names else None, fmt=w.gemm_format, packing=LAYOUT,
                   canonical_class=type(w).__name__, canonical_attrs=attrs)

    @property
    def bound(self) -> int:
        """NVFP4's E4M3 bound (448 for the MX formats, where the op ignores it)."""
        return dict(self.canonical_attrs)["spec"].e4m3_bound if self.fmt == "nvfp4" else 448

    def canonical(self) -> QuantizedTensor:
        """The tensor this one was packed from: the same class, attributes and bytes."""
        from qtensor.ops.decode_mm import unpack

        n, k = self.shape
        data, scale = unpack(self.fmt, self.codes, self.scales, n, k)
        cls = QuantizedTensor.classes[self.canonical_class]
        attrs = dict(self.canonical_attrs)
        template = cls.inner_layout(self.shape, attrs)
        inner = {"qdata": data.view(template["qdata"][1]),
                 "scale": scale.view(template["scale"][1]), "amax": self.amax}
        # The inner tensors, then the attributes, in the class's order: the order `detach`
        # gives a tensor (pickles keep it, so torch.save files are byte-identical).
        fields = {n: inner[n] for n in cls.tensor_data_names}
        fields.update((n, attrs[n]) for n in cls.tensor_attribute_names)
        return cls(self.shape, self.dtype, self.device, **fields)

    def stored(self) -> QuantizedTensor:
        return self.canonical()

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.canonical().dequantize(dtype)

    def __reduce_ex__(self, protocol):
        # torch.save of the tensor itself stores (and torch.load returns) the canonical tensor,
        # as a parameter where this one is one.
        t = self.canonical()
        if getattr(self, "_is_param", False):
            t = torch.nn.Parameter(t, requires_grad=self.requires_grad)
        return t.__reduce_ex__(protocol)

    def shard_dims(self):
        raise NotImplementedError(
            "a DecodeWeight is a serving layout and cannot be sharded: quantize the model with "
            "layout='canonical' (NVFP4/MXFP4/MXFP8WeightOnlyConfig) before fully_shard, or "
            "replace this weight by weight.canonical(), or keep it out of fully_shard.")

    def __repr__(self):
        return (f"DecodeWeight(shape={tuple(self.shape)}, dtype={self.dtype}, fmt={self.fmt}, "
                f"packing={self.packing}, canonical={self.canonical_class}, "
                f"device={self.device.type})")


def pack_problem(w) -> str | None:
    """Why `DecodeWeight.pack(w)` cannot take w, or None."""
    if not isinstance(w, QuantizedTensor) or w.gemm_format not in decode_layout.FORMATS:
        return (f"it takes an NVFP4Tensor, MXFP8Tensor or MXFP4Tensor weight; got "
                f"{type(w).__name__}")
    if w.dim() != 2 or getattr(w, "axis", None) != ROWWISE:
        return f"it takes a 2-D weight [N, K] with its blocks along K (rowwise); got {w!r}"
    if getattr(w, "act_spec", None) is not None:
        return "its products quantize the activation (a dynamic-activation weight)"
    if getattr(w, "rht", False):
        return "an RHT-transformed weight multiplies only an RHT-transformed activation"
    try:
        decode_layout.check(w.gemm_format, *w.shape)
    except ValueError as e:
        return str(e).rstrip(".")
    if w.gemm_format == "mxfp8" and bool(((w.qdata.view(torch.uint8) & 0x7F) == 0x7F).any()):
        return "it holds MXFP8 NaN codes, which the layout cannot carry"
    if w.device.type == "meta":
        return "its bytes are on the meta device (load the checkpoint first)"
    return None


@DecodeWeight.implements(aten.copy_.default)
def _copy_(func, args, kwargs):
    """load_state_dict's copy into a packed parameter: the source is packed first when it is
    the canonical tensor (the state-dict hook does that), then the bytes are copied."""
    dst, src = args[0], args[1]
    if not isinstance(src, DecodeWeight):
        src = DecodeWeight.pack(src)
    if (src.fmt, src.packing, src.canonical_class, src.canonical_attrs, src.shape) != \
            (dst.fmt, dst.packing, dst.canonical_class, dst.canonical_attrs, dst.shape):
        raise ValueError(f"copy_ into {dst!r} needs a weight of the same format, shape and "
                         f"metadata; got {src!r}. Load with assign=True to take the source's.")
    for name in dst.tensor_data_names:
        d, s = getattr(dst, name), getattr(src, name)
        if d is not None:
            d.copy_(s)
    return dst


_ALIGN = 16  # bytes: every shared part starts where the buffer's own alignment allows vector loads


def _row_fields(w) -> tuple[str, ...] | None:
    """The names of the fields a weight's rows are stored in, each contiguous with one row of
    the weight per first-dimension index, so that sibling weights' fields concatenate along
    rows; None for a weight whose bytes are not so (no sharing)."""
    if isinstance(w, DecodeWeight):
        return ("codes", "scales")
    if not isinstance(w, QuantizedTensor) or w.gemm_format is None or w.dim() != 2 or \
            getattr(w, "axis", None) != ROWWISE:
        return None
    names = tuple(n for n in w.tensor_data_names
                  if getattr(w, n) is not None and getattr(w, n).dim() > 0)
    if all(getattr(w, n).dim() <= 2 and getattr(w, n).shape[0] == w.shape[0] and
           getattr(w, n).is_contiguous() for n in names):
        return names
    return None


def share_decode_storage(model: torch.nn.Module) -> int:
    """Put the bytes of sibling quantized weights back to back: for each module, the weights of
    its direct children (the attention's q, k, v and o projections, an MLP's gate and up) of
    one class, K, device and dtypes, in the order the children were registered, move into one
    buffer per field (the codes and scales of a DecodeWeight; the data and block scales of a
    rowwise NVFP4, MXFP8 or MXFP4 weight), each weight a view of its part. The bytes do not
    change. The products of one activation with such neighbours then fuse without a copy
    ([Note: fused decode products] in qtensor/ops/decode_fusion.py). Weights whose parts
    would not all start on 16 bytes (small or odd K) are left as they are. Call it once, after
    quantizing and before compiling (a compiled graph keeps the tensors it was compiled with);
    moving the model to another device gives each weight its own bytes again. Returns the
    number of weights moved."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"share_decode_storage takes a model (an nn.Module) whose linear layers "
                        f"hold quantized weights; got {type(model).__name__}.")
    moved = 0
    for parent in model.modules():
        groups: dict[tuple, list[torch.nn.Module]] = {}
        for child in parent.children():
            w = getattr(child, "weight", None)
            names = _row_fields(w)
            if names is None:
                continue
            key = (type(w), getattr(w, "fmt", None), w.shape[1], w.device, names,
                   tuple((getattr(w, n).dtype, getattr(w, n).shape[1:]) for n in names))
            groups.setdefault(key, []).append(child)
        for (_, _, _, _, names, _), children in groups.items():
            weights = [c.weight for c in children]
            if len(children) < 2 or not all(
                    getattr(w, n).nbytes % _ALIGN == 0 for w in weights[:-1] for n in names):
                continue  # a part would start off the 16-byte alignment kernels load at
            with torch.no_grad():
                joined = {n: torch.cat([getattr(w, n) for w in weights]) for n in names}
            start = dict.fromkeys(names, 0)
            for child, w in zip(children, weights):
                views = {}
                for n in names:
                    rows = getattr(w, n).shape[0]
                    views[n] = joined[n][start[n]:start[n] + rows]
                    start[n] += rows
                child.weight = torch.nn.Parameter(w.replace(**views), requires_grad=False)
            moved += len(children)
    return moved


def _state_dict_hook(module, state_dict, prefix, local_metadata) -> None:
    """A packed module's state_dict holds the canonical weight."""
    key = prefix + "weight"
    t = state_dict.get(key)
    if isinstance(t, DecodeWeight):
        state_dict[key] = t.canonical()


def _load_hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected,
               errors) -> None:
    """Loading a canonical weight into a packed module packs it again."""
    key = prefix + "weight"
    t = state_dict.get(key)
    if isinstance(getattr(module, "weight", None), DecodeWeight) and \
            isinstance(t, QuantizedTensor) and not isinstance(t, DecodeWeight) and \
            pack_problem(t) is None:
        state_dict[key] = DecodeWeight.pack(t)


def to_decode_layout(module: torch.nn.Module) -> bool:
    """Pack `module.weight` into the decode layout (in place) and hook the module's state_dict
    and load_state_dict to the canonical tensor; True when it packed. A weight the layout
    cannot hold is left as it is (`pack_problem` says why)."""
    w = getattr(module, "weight", None)
    if isinstance(w, DecodeWeight) or pack_problem(w) is not None:
        return False
    module.weight = torch.nn.Parameter(DecodeWeight.pack(w), requires_grad=False)
    if not getattr(module, "_qtensor_decode_hooks", False):
        module.register_state_dict_post_hook(_state_dict_hook)
        module.register_load_state_dict_pre_hook(_load_hook)
        module._qtensor_decode_hooks = True
    return True
