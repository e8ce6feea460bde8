"""Checkpoints of quantized models: state_dicts, safetensors files, sharded (DCP) checkpoints and
export to the layouts serving engines read. docs/checkpoints.md walks through each."""

from qtensor.checkpoint.export import calibrate_input_amax, export_mxfp4, export_nvfp4
from qtensor.checkpoint.pretrained import from_pretrained, save_pretrained
from qtensor.checkpoint.safetensors import load_file, save_file
from qtensor.checkpoint.schema import CheckpointError
from qtensor.checkpoint.state_dict import check_state_dict, load, load_state_dict

__all__ = ["CheckpointError", "calibrate_input_amax", "check_state_dict", "export_mxfp4",
           "export_nvfp4", "from_pretrained", "load", "load_file", "load_state_dict", "save_file",
           "save_pretrained"]
