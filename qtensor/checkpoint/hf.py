"""qtensor as a transformers quantization method: `AutoModelForCausalLM.from_pretrained` reads a
qtensor checkpoint, `model.save_pretrained` writes one, and `QTensorConfig` quantizes on load.

[Note: the transformers integration]
A qtensor checkpoint directory (docs/huggingface.md) is config.json with
`quantization_config = {"quant_method": "qtensor", "format": "qtensor-safetensors", "version"}`
and safetensors weights holding a quantized tensor KEY as its inner tensors `KEY::NAME` plus
one JSON entry in the `qtensor` header ([Note: checkpoint schema] in
qtensor/checkpoint/schema.py). This module teaches transformers that layout through its own
extension points:

- `QTensorConfig` is registered for quant_method "qtensor" (`register_quantization_config`);
  its `to_dict()` is that `quantization_config`, so a checkpoint written by
  `qtensor.save_pretrained` loads too. Its optional `quant_type` (a qtensor inference config)
  quantizes an unquantized checkpoint as it loads.
- `QTensorHfQuantizer` is registered as the quantizer of "qtensor" (`register_quantizer`).
  Loading a qtensor checkpoint, it reads and checks every header entry against the files before
  any weight is read (`Files.check`: each inner tensor present with the shape and dtype its class
  derives, none left over), then routes every `KEY::NAME` tensor through one WeightConverter to
  `QTensorDeserialize`, which rebuilds the tensor with the schema's `decode` (its layout checks
  again). Saving (`get_state_dict_and_metadata`) flattens the state_dict as `qtensor.save_file`
  does and hands transformers the header as safetensors metadata; transformers shards and
  writes the files (each shard carries the whole header; readers merge them).
- A model quantized through `TorchAoConfig(quant_type=<qtensor config>)` is saved by
  `TorchAoWithQTensorHfQuantizer`, put in transformers' quantizer mapping for "torchao" in
  place of `TorchAoHfQuantizer`. torchao's own saving cannot take qtensor tensors (its
  safetensors support knows tensor classes by bare name from a fixed list: qtensor's
  MXFP8Tensor is not on it and qtensor's NVFP4Tensor collides with torchao's), the config it
  would write does not load back (torchao's `config_from_dict` accepts only torchao's classes)
  and transformers' torchao loader routes only torchao's inner names. So when the quant_type is
  a qtensor config or the state_dict holds qtensor tensors, the subclass writes qtensor's
  layout and sets the model's `quantization_config` to a QTensorConfig, which the checkpoint
  then names; in every other case it is torchao's quantizer unchanged.

Registration runs when this module is imported. `import qtensor` does not import transformers
(about 3 s): qtensor/checkpoint/hf_hook.py installs an import hook that imports this module
right after `transformers.quantizers.auto` (transformers' quantizer registry) is executed, or at
once if that module is already imported, so the order of `import qtensor` and
`import transformers` does not matter, and a program that never imports transformers never
imports this module.

The code keeps to what transformers 5.17 through 5.24 share: `get_weight_conversions()` is
overridden (5.17 builds converters there; 5.24 derives them from `serialized_names` and
`get_load_operations`, both also provided).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps, WeightConverter
from transformers.quantizers.auto import (AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING,
                                          register_quantization_config, register_quantizer)
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizer_torchao import TorchAoHfQuantizer
from transformers.quantizers.quantizers_utils import get_module_from_name, should_convert_module
from transformers.utils.quantization_config import QuantizationConfigMixin

from qtensor.checkpoint.pretrained import QTENSOR, QTENSOR_FORMAT, quantization_config
from qtensor.checkpoint.safetensors import META_KEY, Files, flatten
from qtensor.checkpoint.schema import CheckpointError, decode, header
from qtensor.tensors import QuantizedTensor


def _inference_config(c: Any) -> bool:
    """Whether c is one of qtensor's inference configs (qtensor.quantize.CONFIGS). An instance
    exists only once qtensor.quantize is imported, so torchao is not imported to ask."""
    quantize = sys.modules.get("qtensor.quantize")
    return quantize is not None and isinstance(c, quantize.CONFIGS)


def _qtensor_config(c: Any) -> bool:
    """Whether c is any qtensor config (inference, training or QAT)."""
    return type(c).__module__.split(".")[0] == "qtensor"


def qtensor_layout(state_dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(plain tensors, safetensors metadata) of a state_dict in qtensor's layout: what
    `qtensor.save_file` writes, in the form transformers' save_pretrained takes."""
    flat, entries = flatten(state_dict)
    return flat, {META_KEY: header(entries)}


# ---- the config -----------------------------------------------------------------------------------


class QTensorConfig(QuantizationConfigMixin):
    """transformers' quantization config of qtensor checkpoints (quant_method "qtensor").

    quant_type: a qtensor inference config (NVFP4WeightOnlyConfig, ...) to quantize an
    unquantized checkpoint as it loads; a qtensor checkpoint needs none (its header describes
    every tensor). modules_to_not_convert: module names (or patterns, as transformers matches
    them) kept in high precision when quantizing on load; by default the output head and tied
    weights, as TorchAoConfig does. Neither is written to config.json: `to_dict()` is the
    checkpoint's `quantization_config`, exactly what `qtensor.save_pretrained` writes.
    """

    def __init__(self, quant_type: Any = None, modules_to_not_convert: list[str] | None = None):
        if quant_type is not None and not _inference_config(quant_type):
            raise TypeError(
                f"QTensorConfig(quant_type=...) takes a qtensor inference config "
                f"(NVFP4WeightOnlyConfig, NVFP4DynamicActivationNVFP4WeightConfig, "
                f"MXFP8WeightOnlyConfig, MXFP8DynamicActivationMXFP8WeightConfig); got "
                f"{type(quant_type).__name__}. For torchao's configs use TorchAoConfig.")
        self.quant_method = QTENSOR
        self.quant_type = quant_type
        self.modules_to_not_convert = (None if modules_to_not_convert is None
                                       else list(modules_to_not_convert))

    @classmethod
    def from_dict(cls, config_dict: dict, return_unused_kwargs: bool = False, **kwargs):
        """The config of a checkpoint's `quantization_config`; raises CheckpointError unless it
        is qtensor's (quant_method "qtensor", format "qtensor-safetensors")."""
        where = "config.json quantization_config"
        allowed = set(quantization_config())
        if not isinstance(config_dict, dict) or not set(config_dict) <= allowed:
            got = (sorted(config_dict) if isinstance(config_dict, dict)
                   else type(config_dict).__name__)
            raise CheckpointError(f"{where} of a qtensor checkpoint takes the keys "
                                  f"{sorted(allowed)}; got {got}.")
        if config_dict.get("quant_method") != QTENSOR:
            raise CheckpointError(f"{where}: quant_method must be {QTENSOR!r}; got "
                                  f"{config_dict.get('quant_method')!r}.")
        if config_dict.get("format") != QTENSOR_FORMAT:
            raise CheckpointError(f"{where}: a qtensor checkpoint has format {QTENSOR_FORMAT!r}; "
                                  f"got {config_dict.get('format')!r}.")
        config = cls()
        unused = config.update(**kwargs)
        return (config, unused) if return_unused_kwargs else config

    def to_dict(self) -> dict[str, Any]:
        return quantization_config()

    def __repr__(self) -> str:
        return (f"QTensorConfig(quant_type={self.quant_type!r}, "
                f"modules_to_not_convert={self.modules_to_not_convert!r})")


# ---- loading ops ----------------------------------------------------------------------------------


class QTensorDeserialize(ConversionOps):
    """One quantized tensor from its inner tensors (`KEY::NAME`), rebuilt by the schema's
    decode, which checks each inner tensor's shape and dtype against the class layout."""

    def __init__(self, hf_quantizer: "QTensorHfQuantizer"):
        self.hf_quantizer = hf_quantizer  # its presence also tells transformers not to cast

    def convert(self, input_dict: dict, full_layer_name: str | None = None, **kwargs) -> dict:
        key = full_layer_name
        found = self.hf_quantizer.entries.get(key)
        if found is None:
            raise CheckpointError(f"{key!r}: the checkpoint holds inner tensors "
                                  f"{sorted(input_dict)} for it but no qtensor header entry.")
        stored, entry = found
        inner = {}
        for suffix, tensors in input_dict.items():
            tensors = tensors if isinstance(tensors, list) else [tensors]
            if len(tensors) != 1:
                raise CheckpointError(f"{stored}{suffix!s}: {len(tensors)} tensors under one name; "
                                      "a qtensor checkpoint stores each inner tensor once.")
            inner[suffix] = tensors[0]

        def fetch(name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
            t = inner.get(name[len(stored):])
            if t is None:
                raise CheckpointError(f"{name!r}: missing from the checkpoint (named by the "
                                      "qtensor header).")
            if t.shape != shape or t.dtype != dtype:
                raise CheckpointError(f"{name!r}: the checkpoint holds {t.dtype} {list(t.shape)}, "
                                      f"the metadata implies {dtype} {list(shape)}.")
            return t

        return {key: nn.Parameter(decode(stored, entry, fetch), requires_grad=False)}


class QTensorQuantize(ConversionOps):
    """Quantize one linear layer's weight as it loads, with qtensor.quantize_ on that module
    (as transformers' TorchAoQuantize does with torchao's quantize_)."""

    def __init__(self, hf_quantizer: "QTensorHfQuantizer"):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: dict, model=None, full_layer_name: str | None = None,
                missing_keys=None, **kwargs) -> dict:
        from qtensor.quantize import quantize_  # torchao: only quantizing on load needs it

        (_, value), = input_dict.items()
        value = value[0] if isinstance(value, list) else value
        module, name = get_module_from_name(model, full_layer_name)
        module._parameters[name] = nn.Parameter(value, requires_grad=value.requires_grad)
        quantize_(module, self.hf_quantizer.quantization_config.quant_type)
        if missing_keys is not None:
            missing_keys.discard(full_layer_name)
        # transformers re-initializes parameters without this flag after loading.
        module._is_hf_initialized = True
        for p in module.parameters(recurse=False):
            p._is_hf_initialized = True
        return {}


# ---- the quantizer --------------------------------------------------------------------------------


def _model_key(key: str, model_keys, prefix: str) -> str | None:
    """The model's name of a checkpoint key: itself, or with the base model prefix ("model")
    added or dropped, as transformers matches keys when a base model loads a head model's
    checkpoint or the reverse; None when the model has no such tensor."""
    if key in model_keys:
        return key
    if prefix and key.startswith(prefix + ".") and key[len(prefix) + 1:] in model_keys:
        return key[len(prefix) + 1:]
    if prefix and f"{prefix}.{key}" in model_keys:
        return f"{prefix}.{key}"
    return None


def _is_qtensor_converter(conversion) -> bool:
    return any(isinstance(op, QTensorDeserialize) for op in getattr(conversion, "operations", ()))


class QTensorHfQuantizer(HfQuantizer):
    """transformers' quantizer for quant_method "qtensor" ([Note: the transformers
    integration]): reads qtensor checkpoints as they are stored, quantizes on load with a
    QTensorConfig's quant_type, and saves in qtensor's layout."""

    requires_calibration = False
    quantization_config: QTensorConfig

    def __init__(self, quantization_config: QTensorConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        if not self.pre_quantized and quantization_config.quant_type is None:
            raise ValueError(
                "This checkpoint is not quantized and QTensorConfig() has no quant_type to "
                "quantize it with. Pass one, e.g. QTensorConfig(qtensor.NVFP4WeightOnlyConfig()).")
        self.entries: dict[str, tuple[str, dict]] = {}  # model key -> (stored key, header entry)
        self.modules_to_not_convert: list[str] = []

    def validate_environment(self, *args, device_map=None, **kwargs) -> None:
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError(
                "qtensor tensors cannot be offloaded to disk (device_map names 'disk' for "
                f"{sorted(k for k, v in device_map.items() if v == 'disk')[:4]}); give them a "
                "CPU or GPU device.")

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        self.modules_to_not_convert = self.get_modules_to_not_convert(
            model, self.quantization_config.modules_to_not_convert, model._keep_in_fp32_modules)
        if self.pre_quantized:
            self._read_checkpoint(model, checkpoint_files)
        else:
            self._check_shapes(model)
        return model

    def _read_checkpoint(self, model, checkpoint_files) -> None:
        """Every header entry, checked against the files and the model before a byte is read."""
        files = [str(f) for f in checkpoint_files or ()]
        if not files or not all(f.endswith(".safetensors") for f in files):
            raise CheckpointError(
                f"a qtensor checkpoint is stored in safetensors files; got "
                f"{[os.path.basename(f) for f in files]}. Write it with model.save_pretrained or "
                "qtensor.save_pretrained, which write safetensors.")
        with Files(files) as stored:
            stored.check()
            entries = stored.entries
        want = model.state_dict()
        self.entries = {}
        for key, entry in entries.items():
            mkey = _model_key(key, want, model.base_model_prefix)
            if mkey is None:
                continue  # transformers reports it as an unexpected key
            if list(want[mkey].shape) != entry["shape"]:
                raise CheckpointError(f"{key!r}: shape {entry['shape']} in the checkpoint, "
                                      f"{list(want[mkey].shape)} in {type(model).__name__}.")
            self.entries[mkey] = (key, entry)

    def _check_shapes(self, model) -> None:
        """Quantizing on load: every layer to quantize takes the config's blocks (raised here,
        naming the layer, rather than inside transformers' loader)."""
        from qtensor.quantize import linear_shape_error

        config = self.quantization_config.quant_type
        if config.skip_incompatible:
            return
        for name, module in model.named_modules():
            if not self.param_needs_quantization(model, f"{name}.weight"):
                continue
            why = linear_shape_error(module, config)
            if why:
                raise ValueError(
                    f"{why} at layer {name!r}. Keep it in high precision with "
                    f"QTensorConfig(..., modules_to_not_convert=[{name!r}]), or pass "
                    f"skip_incompatible=True to {type(config).__name__}.")

    def _process_model_after_weight_loading(self, model, **kwargs):
        # transformers keeps the converters that matched for saving, where it reverses them;
        # saving writes qtensor's layout itself (get_state_dict_and_metadata), nothing to reverse.
        conversions = getattr(model, "_weight_conversions", None)
        if conversions:
            model._weight_conversions = [c for c in conversions if not _is_qtensor_converter(c)]
        return model

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        module_name, _, tensor_name = param_name.rpartition(".")
        if self.pre_quantized or tensor_name != "weight":
            return False
        if not should_convert_module(module_name, self.modules_to_not_convert):
            return False
        return isinstance(model.get_submodule(module_name), nn.Linear)

    def get_quantize_ops(self):
        return QTensorQuantize(self)

    def _inner_suffixes(self) -> set[str]:
        """`::NAME` (`::rowwise::qdata` for a hybrid) of every inner tensor the checkpoint holds."""
        out = set()
        for stored, entry in self.entries.values():
            todo = [entry["data"]]
            while todo:
                for v in todo.pop().values():
                    if isinstance(v, dict):
                        todo.append(v["data"])
                    elif v is not None:
                        out.add(v[len(stored):])
        return out

    @property
    def serialized_names(self) -> dict[str, list[str]]:
        """{parameter name: its stored names}, e.g. {"weight": ["weight::amax", ...]}."""
        leaves = {key.rpartition(".")[2] for key in self.entries}
        suffixes = sorted(self._inner_suffixes())
        return {leaf: [leaf + s for s in suffixes] for leaf in sorted(leaves)}

    def get_load_operations(self) -> dict:
        return {"deserialize": QTensorDeserialize}

    def get_weight_conversions(self) -> list:
        """One converter for every inner tensor: `KEY::NAME` is renamed to KEY (the pattern
        `::NAME` replaced by ""), so the tensors of KEY are collected together and handed to
        QTensorDeserialize. Plain tensors match no pattern and load as transformers loads them."""
        if not self.pre_quantized or not self.entries:
            return []
        return [WeightConverter(sorted(self._inner_suffixes()), "", [QTensorDeserialize(self)])]

    def get_state_dict_and_metadata(self, model):
        return qtensor_layout(model.state_dict())

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True  # tests/test_compile_inference.py: fullgraph compile of every config


class TorchAoWithQTensorHfQuantizer(TorchAoHfQuantizer):
    """transformers' torchao quantizer, which saves a model holding qtensor tensors (or
    quantized by a qtensor config) in qtensor's layout under quant_method "qtensor", and is
    torchao's unchanged otherwise ([Note: the transformers integration])."""

    def get_state_dict_and_metadata(self, model):
        quant_type = self.quantization_config.quant_type
        state_dict = model.state_dict()
        if not (_qtensor_config(quant_type)
                or any(isinstance(t, QuantizedTensor) for t in state_dict.values())):
            return super().get_state_dict_and_metadata(model)
        others = [k for k, t in state_dict.items()
                  if type(t) is not torch.Tensor and not isinstance(t, QuantizedTensor)]
        if others:
            raise CheckpointError(
                f"{others[0]!r}: {type(state_dict[others[0]]).__name__} is not a qtensor tensor, "
                "and the model also holds qtensor tensors; one checkpoint stores either torchao's "
                "tensors (torchao's layout) or qtensor's (qtensor's layout). Quantize every layer "
                "with qtensor configs, or every layer with torchao's.")
        flat_and_metadata = qtensor_layout(state_dict)
        model.config.quantization_config = QTensorConfig(
            quant_type if _inference_config(quant_type) else None,
            self.quantization_config.modules_to_not_convert)
        return flat_and_metadata


def register() -> None:
    """Register QTensorConfig and QTensorHfQuantizer for "qtensor", and the torchao subclass for
    "torchao". Idempotent."""
    if QTENSOR not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QTENSOR)(QTensorConfig)
    if QTENSOR not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QTENSOR)(QTensorHfQuantizer)
    # register_quantizer refuses a name already taken, so the mapping entry is replaced; only
    # transformers' own class is (another library's replacement is left alone).
    if AUTO_QUANTIZER_MAPPING.get("torchao") is TorchAoHfQuantizer:
        AUTO_QUANTIZER_MAPPING["torchao"] = TorchAoWithQTensorHfQuantizer


register()

__all__ = ["QTensorConfig", "QTensorHfQuantizer", "TorchAoWithQTensorHfQuantizer", "register"]
