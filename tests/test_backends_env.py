"""The one reader of the environment (qtensor/backends/env.py): nothing else in the package
reads it, its one boolean parser, each variable's validation, the table against the code that
uses it and against docs/environment.md, and the process-wide policy read once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from qtensor import backends
from qtensor.backends import BackendPolicy, GemmBackend, QuantBackend, ScaledMMFormat, choice, env
from qtensor.backends.env import BY_NAME, FALSE, TRUE, VARIABLES, Kind

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "qtensor"
ENV_MODULE = PACKAGE / "backends" / "env.py"
_OS_READERS = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


# ---- one reader --------------------------------------------------------------------------------


def environment_reads(path: Path) -> list[str]:
    """`line: code` of every read of the process environment through `os` in one source file:
    os.environ / os.getenv / os.putenv (and their bytes and unset forms), under any alias of
    `os`, and the same names imported from os."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = {"os"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "os"}
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [f"{node.lineno}: from os import {a.name}" for a in node.names
                      if a.name in _OS_READERS]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in _OS_READERS
                and isinstance(node.value, ast.Name) and node.value.id in aliases):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


def test_only_env_py_reads_the_environment():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        reads = environment_reads(path)
        if reads and path != ENV_MODULE:
            offenders[str(path.relative_to(ROOT))] = reads
    assert not offenders, (
        f"only qtensor/backends/env.py reads the environment; found {offenders}. Declare the "
        "variable in env.VARIABLES and read it with env.read()."
    )


def test_the_walker_finds_reads(tmp_path):
    # The check above must be able to fail: env.py itself is found, and so is each spelling.
    assert environment_reads(ENV_MODULE)
    src = tmp_path / "m.py"
    src.write_text("import os as o\nfrom os import getenv\nx = o.environ.get('A')\n"
                   "os.putenv('B', '1')\n")
    assert environment_reads(src) == ["2: from os import getenv", "3: o.environ", "4: os.putenv"]


# ---- the one boolean parser ----------------------------------------------------------------------


@pytest.mark.parametrize("raw", [*TRUE, *FALSE])
def test_bool_accepts_every_documented_spelling_in_any_case(raw):
    expected = raw in TRUE
    for spelling in (raw, raw.upper(), raw.capitalize(), f"  {raw}\t"):
        assert env.parse_bool("QTENSOR_NVFP4_DGRAD_MXFP8", spelling) is expected


def test_bool_vocabulary_is_the_union_of_the_old_parsers():
    # The recipe took exactly 0/1, the QAT config 1/true/yes/on and 0/false/no/off.
    assert set(TRUE) == {"1", "true", "yes", "on"} and set(FALSE) == {"0", "false", "no", "off"}


@pytest.mark.parametrize("raw", ["2", "maybe", "y", "t", "enabled", "-1", "1.0"])
def test_bool_rejects_other_values_naming_variable_value_and_allowed(raw):
    with pytest.raises(ValueError) as e:
        env.parse_bool("QTENSOR_MXFP4_QAT_DIRECT", raw)
    message = str(e.value)
    assert message.startswith("QTENSOR_MXFP4_QAT_DIRECT must be a boolean")
    assert repr(raw) in message
    assert all(s in message for s in TRUE + FALSE)


# ---- each variable's validation ------------------------------------------------------------------

RUNTIME = [v for v in VARIABLES if not v.build_time]


@pytest.mark.parametrize("var", RUNTIME, ids=lambda v: v.name)
def test_each_variable_parses_its_values_and_rejects_others(var):
    if var.kind is Kind.BOOL:
        assert env.read([var.name], {var.name: "On"}) == {var.name: True}
        bad = "maybe"
    elif var.kind is Kind.INT:
        assert env.read([var.name], {var.name: " 7 "}) == {var.name: 7}
        bad = "seven"
    else:
        assert var.kind is Kind.CHOICE
        for choice_value in var.choices:
            want = None if var.none_as_none and choice_value == "none" else choice_value
            assert env.read([var.name], {var.name: choice_value.upper()}) == {var.name: want}
        bad = "not-a-choice"
    assert env.read([var.name], {var.name: "  "}) == {}  # empty counts as unset
    with pytest.raises(ValueError, match=re.escape(var.name)) as e:
        env.read([var.name], {var.name: bad})
    assert repr(bad) in str(e.value)
    if var.kind is Kind.CHOICE:
        assert all(c in str(e.value) for c in var.choices)


def test_read_takes_only_declared_variables():
    with pytest.raises(KeyError, match="QTENSOR_NOT_A_VARIABLE"):
        env.read(["QTENSOR_NOT_A_VARIABLE"], {})


def test_table_matches_the_code_that_uses_it():
    from qtensor.qat import config as qat_config
    from qtensor.qat.hosts import Host
    from qtensor.training import recipe

    assert BY_NAME["QTENSOR_GEMM_BACKEND"].choices == tuple(b.value for b in GemmBackend)
    assert BY_NAME["QTENSOR_NVFP4_4OVER6"].choices == recipe.SCOPES
    assert BY_NAME["QTENSOR_NVFP4_4OVER6_E4M3_USE_256"].choices == recipe.SCOPES
    assert BY_NAME["QTENSOR_NVFP4_4OVER6_ERR_MODE"].choices == recipe.ERR_MODES
    for name in ("QTENSOR_BACKWARD_OVERRIDE", "QTENSOR_MXFP4_QAT_BACKWARD_OVERRIDE"):
        parsed = tuple(env.parse(name, c) for c in BY_NAME[name].choices)
        assert parsed == recipe.OVERRIDES
    assert BY_NAME["QTENSOR_MXFP4_QAT_HOST"].choices == tuple(h.value for h in Host)
    readers = {"NVFP4TrainingRecipe": set(recipe.ENV_VARS),
               "MXFP4QATConfig": set(qat_config.ENV_VARS)}
    for reader, names in readers.items():
        assert names == {v.name for v in VARIABLES if v.read_by.startswith(reader)}, reader
    # setup.py is not part of the package: the table documents its settings, by name.
    setup_names = set(re.findall(r"\bQTENSOR_[A-Z0-9_]+", (ROOT / "setup.py").read_text()))
    setup_names.discard("QTENSOR_WITH_CUDA")  # a C++ macro setup.py defines, not a variable
    assert setup_names == {v.name for v in VARIABLES if v.build_time}


def test_every_qtensor_variable_named_in_the_package_is_declared():
    named = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                named |= set(re.findall(r"^QTENSOR_[A-Z0-9_]+$", node.value))
    assert named and named <= set(BY_NAME), sorted(named - set(BY_NAME))


def test_old_spellings_still_work():
    from qtensor.qat.config import MXFP4QATConfig
    from qtensor.training import NVFP4TrainingRecipe

    # The recipe's 0/1, now with the QAT config's words too; and the QAT config's words.
    assert not NVFP4TrainingRecipe.from_env({"QTENSOR_NVFP4_DISABLE_RHT": "1"}).rht
    assert not NVFP4TrainingRecipe.from_env({"QTENSOR_NVFP4_DISABLE_RHT": "TRUE"}).rht
    assert NVFP4TrainingRecipe.from_env({"QTENSOR_NVFP4_DISABLE_RHT": "0"}).rht
    assert MXFP4QATConfig.from_env({"QTENSOR_MXFP4_QAT_DIRECT": "on"}).direct
    assert not MXFP4QATConfig.from_env({"QTENSOR_MXFP4_QAT_DIRECT": ""}).direct
    assert MXFP4QATConfig.from_env({"QTENSOR_MXFP4_QAT_BACKWARD_OVERRIDE": ""}).backward_override \
        is None


# ---- docs/environment.md -----------------------------------------------------------------------


def render_table() -> str:
    rows = ["| variable | type | values | what it does | read by |", "|---|---|---|---|---|"]
    rows += [f"| `{v.name}` | {v.kind.value} | {v.allowed()} | {v.effect} | {v.read_by} |"
             for v in VARIABLES]
    return "\n".join(rows)


def test_docs_list_every_variable_of_the_table():
    text = (ROOT / "docs" / "environment.md").read_text()
    m = re.search(r"<!-- generated from .*? -->\n(.*?)\n<!-- end of generated table -->", text,
                  re.S)
    assert m, "docs/environment.md lost its generated table's markers"
    assert m.group(1) == render_table(), (
        "docs/environment.md differs from qtensor/backends/env.py VARIABLES; replace the table "
        f"between the markers with:\n{render_table()}"
    )


# ---- the policy, read once ---------------------------------------------------------------------


def test_policy_is_read_once(setenv, monkeypatch):
    setenv("QTENSOR_QUANT_BACKEND", "reference")
    calls = []
    from_env = BackendPolicy.from_env.__func__

    def counted(cls, environ=None):
        calls.append(environ)
        return from_env(cls, environ)

    monkeypatch.setattr(BackendPolicy, "from_env", classmethod(counted))
    first = backends.current_policy()
    assert first.force_quant_reference and backends.quant_backend("cpu") is QuantBackend.REFERENCE
    monkeypatch.setenv("QTENSOR_QUANT_BACKEND", "auto")  # changed without telling qtensor
    for _ in range(3):
        assert backends.current_policy() is first
        assert backends.quant_backend("cpu") is QuantBackend.REFERENCE
    assert env.read(["QTENSOR_QUANT_BACKEND"]) == {"QTENSOR_QUANT_BACKEND": "reference"}
    assert len(calls) == 1
    backends.set_policy(None)  # read again at next use
    assert not backends.current_policy().force_quant_reference and len(calls) == 2


def test_set_policy_clears_what_depends_on_it():
    try:
        backends.quant_backend("cpu"), backends.qat_quant_backend("cpu")
        assert choice._quant_backend_for.cache_info().currsize > 0
        backends.set_policy(BackendPolicy(force_quant_reference=True))
        assert choice._quant_backend_for.cache_info().currsize == 0
        assert choice._qat_backend_for.cache_info().currsize == 0
        assert backends.quant_backend("cpu") is QuantBackend.REFERENCE
        assert backends.qat_quant_backend("cpu") is QuantBackend.REFERENCE
    finally:
        backends.set_policy(None)
    with pytest.raises(TypeError, match="BackendPolicy or None"):
        backends.set_policy("reference")
    with pytest.raises(TypeError, match="GemmBackend"):
        BackendPolicy(gemm_override="triton")


# ---- scaled_mm: what it needs depends on the operands' format ----------------------------------


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0)])
def test_scaled_mm_requirement_depends_on_the_format(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    choice._choose_qat_gemm_backend.cache_clear()
    try:
        fp8 = backends.gemm_backend_problem(GemmBackend.SCALED_MM, "cuda:0",
                                            ScaledMMFormat.FP8_BLOCK128)
        mx = backends.gemm_backend_problem(GemmBackend.SCALED_MM, "cuda:0")
        assert (fp8 is None) == (capability >= (9, 0))
        assert (mx is None) == (capability >= (10, 0) and hasattr(torch, "float4_e2m1fn_x2"))
        if fp8 is not None:
            assert "sm_90+" in fp8 and f"sm_{capability[0]}{capability[1]}" in fp8
        # The QAT hosts, as before: only the FP8 block host has a native GEMM, and only on ask.
        from qtensor.qat import hosts

        cuda = torch.device("cuda", 0)
        native = hosts.gemm_backend(hosts.Host.FP8_BLOCK128, cuda, True)
        assert native is (GemmBackend.SCALED_MM if fp8 is None else GemmBackend.EMULATED)
        assert hosts.gemm_backend(hosts.Host.FP8_BLOCK128, cuda) is GemmBackend.EMULATED
        assert hosts.gemm_backend(hosts.Host.MXFP8, cuda, True) is GemmBackend.EMULATED
        assert hosts.gemm_backend(hosts.Host.FP8_BLOCK128, torch.device("cpu"), True) \
            is GemmBackend.EMULATED
    finally:
        choice._choose_qat_gemm_backend.cache_clear()
