"""qtensor.save_file / qtensor.load_file: round trips, a fresh process, and hostile files."""

import json
import struct
import subprocess
import sys

import pytest
import safetensors
import torch
from test_checkpoint_state_dict import CONFIGS, inputs, make_model, weight_bytes

import qtensor
from qtensor.checkpoint import CheckpointError, load_state_dict
from qtensor.tensors import QuantizedTensor


@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_trip(tmp_path, name):
    src, dst = make_model(name, 0), make_model(name, 1)
    path = tmp_path / "model.safetensors"
    qtensor.save_file(src.state_dict(), path)
    sd = qtensor.load_file(path)
    assert set(sd) == set(src.state_dict())
    load_state_dict(dst, sd)
    with torch.no_grad():
        assert torch.equal(dst(inputs()), src(inputs()))
    assert repr(dst[0].weight) == repr(src[0].weight)


def test_file_is_plain_safetensors(tmp_path):
    """Any safetensors reader sees the inner tensors as plain tensors with their own dtypes."""
    src = make_model("nvfp4_dyn_rowscaled", 0)
    path = tmp_path / "model.safetensors"
    qtensor.save_file(src.state_dict(), path, metadata={"note": "kept"})
    with safetensors.safe_open(str(path), "pt") as f:
        assert f.metadata()["note"] == "kept"
        assert f.get_tensor("0.weight::qdata").dtype == torch.uint8
        assert f.get_tensor("0.weight::scale").dtype == torch.float8_e4m3fn
        assert torch.equal(f.get_tensor("0.weight::amax"), src[0].weight.amax)
        head = json.loads(f.metadata()["qtensor"])
    assert head["version"] == 2
    attrs = head["tensors"]["0.weight"]["attributes"]
    assert attrs["spec"]["spec"] == "NVFP4Spec" and attrs["spec"]["fields"]["row_scaled"] is True
    assert attrs["act_spec"]["spec"] == "NVFP4Spec"


def test_fresh_process_reproduces_outputs(tmp_path):
    names = list(CONFIGS)
    for name in names:
        qtensor.save_file(make_model(name, 0).state_dict(), tmp_path / f"{name}.safetensors")
    # The child builds each model in high precision on the meta device and takes the file's
    # formats (assign=True): nothing of this process reaches it but the files.
    script = f"""
import torch, qtensor
from torch import nn
from qtensor.checkpoint import load_state_dict
x = torch.randn(8, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
out = {{}}
for name in {names!r}:
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)).to(torch.bfloat16)
    load_state_dict(m, qtensor.load_file(r"{tmp_path}/" + name + ".safetensors"), assign=True)
    with torch.no_grad():
        out[name] = m(x)
torch.save(out, r"{tmp_path}/out.pt")
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    for name in names:
        with torch.no_grad():
            assert torch.equal(got[name], make_model(name, 0)(inputs())), name


# ---- hostile and corrupt files --------------------------------------------------------------


def _rewrite(path, edit):
    """Apply edit(safetensors header dict, qtensor metadata dict) and write the file back."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:8 + n])
    meta = json.loads(head["__metadata__"]["qtensor"])
    edit(head, meta)
    head["__metadata__"]["qtensor"] = json.dumps(meta)
    blob = json.dumps(head).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])


def _entry(meta):
    return meta["tensors"]["0.weight"]


def _version_1_entry(meta, **changes):
    """Rewrite 0.weight's attributes as a version 1 file held them, with `changes`."""
    attrs = _entry(meta)["attributes"]
    fields = attrs.pop("spec")["fields"]
    attrs.update({k: fields[k] for k in ("block_2d", "row_scaled", "fourover6", "e4m3_bound",
                                         "rht")}, scale_layout="compact")
    attrs.update(changes)


BAD = {
    "unknown class": (lambda h, m: _entry(m).update({"class": "os.system"}), "'class' must be"),
    "wrong version": (lambda h, m: m.update({"version": 3}), "version 3 is not readable"),
    "version as text": (lambda h, m: m.update({"version": "2"}), "version '2' is not readable"),
    "version 1 entry, bad scale_layout": (lambda h, m: _version_1_entry(
        m, scale_layout="swizzled"), "'scale_layout' must be one of \\('compact',\\)"),
    "version 1 entry, invalid spec": (lambda h, m: _version_1_entry(
        m, row_scaled=True, block_2d=True), "do not form a valid NVFP4Spec: row_scaled excludes"),
    "wrong format tag": (lambda h, m: m.update({"format": "x"}), "metadata format is 'x'"),
    "extra header key": (lambda h, m: m.update({"code": "print(1)"}), "exactly the keys"),
    "extra entry key": (lambda h, m: _entry(m).update({"loader": "x"}), "exactly the fields"),
    "shape mismatch": (lambda h, m: _entry(m).update({"shape": [64, 32]}),
                       r"'0.weight::qdata': the file holds U8 \[64, 32\]"),
    "bad attribute": (lambda h, m: _entry(m)["attributes"]["spec"]["fields"].update(
        {"e4m3_bound": 300}), "'spec' is not a valid NVFP4Spec: e4m3_bound must be 448 or 256"),
    "bool as int": (lambda h, m: _entry(m)["attributes"]["spec"]["fields"].update(
        {"block_2d": 0}), "'spec' is not a valid NVFP4Spec: NVFP4Spec.block_2d must be a bool"),
    "spec of another format": (lambda h, m: _entry(m)["attributes"].update(
        {"spec": {"spec": "MXFP8Spec", "fields": {"scale_rule": "rceil", "columnwise": False}}}),
        "'spec' must be a NVFP4Spec"),
    "spec missing": (lambda h, m: _entry(m)["attributes"].update({"spec": None}),
                     "'spec' must be a NVFP4Spec"),
    "unknown attribute": (lambda h, m: _entry(m)["attributes"].update({"evil": 1}),
                          "'attributes' needs exactly"),
    "bad spec": (lambda h, m: _entry(m)["attributes"].update(
        {"act_spec": {"spec": "NVFP4Spec", "fields": {"__class__": "x"}}}), "'act_spec' needs"),
    "spec not allowed": (lambda h, m: _entry(m)["attributes"].update(
        {"act_spec": {"spec": "Popen", "fields": {}}}), "'act_spec' must be null or a spec"),
    "data renamed": (lambda h, m: _entry(m)["data"].update({"qdata": "2.bias"}),
                     "'qdata' must name the stored tensor"),
    "missing data field": (lambda h, m: _entry(m)["data"].pop("amax"), "'data' needs exactly"),
    "wrong dtype": (lambda h, m: h["0.weight::scale"].update({"dtype": "U8"}),
                    r"'0.weight::scale': the file holds U8"),
    "missing key": (lambda h, m: m["tensors"].update({"9.weight": _entry(m) | {
        "data": {k: "9.weight::" + k for k in _entry(m)["data"]}}}),
        "'9.weight::qdata': missing from the file"),
    "unexpected key": (lambda h, m: m["tensors"].pop("0.weight"),
                       "no metadata entry names \\(unexpected key\\)"),
    "claims more bytes": (lambda h, m: h["2.bias"].update(
        {"data_offsets": [h["2.bias"]["data_offsets"][0], 10**6]}), "not a readable safetensors"),
}


def test_version_1_file_loads(tmp_path):
    """A file written before the spec moved onto the tensor (version 1: each field of the spec
    an attribute of its own, plus "scale_layout": "compact") loads to the same tensors."""
    src = make_model("nvfp4_dyn_rowscaled", 0)
    path = tmp_path / "model.safetensors"
    qtensor.save_file(src.state_dict(), path)

    def to_version_1(head, meta):
        meta["version"] = 1
        for entry in meta["tensors"].values():
            attrs = entry["attributes"]
            fields = attrs.pop("spec")["fields"]
            keep = ("block_2d", "row_scaled", "fourover6", "e4m3_bound", "rht", "scale_rule")
            attrs.update({k: v for k, v in fields.items() if k in keep}, scale_layout="compact")

    _rewrite(path, to_version_1)
    loaded = qtensor.load_file(path)
    for key, t in src.state_dict().items():
        assert type(loaded[key]) is type(t)
        if isinstance(t, QuantizedTensor):
            assert loaded[key].fields().keys() == t.fields().keys()
            for name in t.tensor_data_names:
                assert torch.equal(getattr(loaded[key], name), getattr(t, name))
            for name in t.tensor_attribute_names:
                assert getattr(loaded[key], name) == getattr(t, name)


def test_gemm_backend_is_chosen_where_the_bytes_land(tmp_path):
    """The stored gemm_backend says where the file was written; the loaded tensor takes the one
    its own device chooses (here the CPU's, whatever the file says)."""
    path = tmp_path / "model.safetensors"
    qtensor.save_file(make_model("nvfp4_dyn_rowscaled", 0).state_dict(), path)
    _rewrite(path, lambda h, m: _entry(m)["attributes"].update({"gemm_backend": "triton"}))
    assert qtensor.load_file(path)["0.weight"].gemm_backend == "emulated"


@pytest.mark.parametrize("case", list(BAD))
def test_bad_file_is_refused(tmp_path, case):
    edit, message = BAD[case]
    path = tmp_path / "model.safetensors"
    qtensor.save_file(make_model("nvfp4_dyn_rowscaled", 0).state_dict(), path)
    _rewrite(path, edit)
    with pytest.raises(CheckpointError, match=message):
        qtensor.load_file(path)


def test_truncated_file_leaves_model_unchanged(tmp_path):
    path = tmp_path / "model.safetensors"
    qtensor.save_file(make_model("nvfp4", 0).state_dict(), path)
    path.write_bytes(path.read_bytes()[:-100])
    dst = make_model("nvfp4", 1)
    before = weight_bytes(dst)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_state_dict(dst, qtensor.load_file(path))
    assert all(torch.equal(before[k], v) for k, v in weight_bytes(dst).items())


def test_save_is_atomic_and_streams_with_progress(tmp_path, capsys):
    path = tmp_path / "model.safetensors"
    qtensor.save_file(make_model("nvfp4", 0).state_dict(), path, progress=True)
    assert not (tmp_path / "model.safetensors.tmp").exists()
    err = capsys.readouterr().err
    assert "saving model.safetensors: 8/8 tensors" in err  # 2 x (qdata, scale, amax) + 2 biases
    qtensor.load_file(path, progress=True)
    assert "loading model.safetensors: 8/8 tensors" in capsys.readouterr().err


def test_non_tensor_values_and_reserved_names_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="only tensors can be stored"):
        qtensor.save_file({"step": 3}, tmp_path / "x.safetensors")
    with pytest.raises(CheckpointError, match="must not contain '::'"):
        qtensor.save_file({"a::b": torch.zeros(2)}, tmp_path / "x.safetensors")
    with pytest.raises(CheckpointError, match="reserved"):
        qtensor.save_file({"a": torch.zeros(2)}, tmp_path / "x.safetensors",
                          metadata={"qtensor": "{}"})
