"""deepinfer/envs.py: the one declaration of every environment variable.

(a) README's configuration tables are what `python -m deepinfer.envs --markdown` prints;
(b) nothing in deepinfer/ or benchmarks/ reads a declared or DEEPINFER_* variable from os.environ
    itself (an AST scan; writes and pops, as benchmarks' A/B runs do, are allowed);
(c) every DEEPINFER_* name written as a string anywhere in deepinfer/, benchmarks/, tests/ and .ci/run
    is declared;
(d) parsing: bad values name the variable and what it accepts, unset gives the default, and every
    get() reads the environment at call time.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from deepinfer import envs
from deepinfer.config import EngineConfig
from deepinfer.errors import BackendError, ConfigError

ROOT = Path(__file__).resolve().parents[1]
NAME_RE = re.compile(r"DEEPINFER_[A-Z0-9_]+")
# Names this file builds on purpose (an undeclared variable for the registry's own checks).
BUILT_ON_PURPOSE = {"DEEPINFER_TEST_ENVS_KNOB"}


def py_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)


# ---------------------------------------------------------------- (a) README


def readme_configuration_section() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("## Configuration\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]  # up to the blank line before the next heading


def test_readme_tables_are_generated_from_envs():
    section, table = readme_configuration_section(), envs.markdown_table()
    first = table.splitlines()[0]
    assert first in section, "README.md's ## Configuration lacks the generated tables: paste " \
                             "`python -m deepinfer.envs --markdown` there"
    head, generated = section[:section.index(first)], section[section.index(first):]
    assert generated == table, "README.md's configuration tables differ from `python -m deepinfer.envs --markdown`"
    assert not [line for line in head.splitlines() if line.startswith("|")], "a hand-written table row above"
    assert "deepinfer/envs.py" in head and "tests/test_envs.py" in head  # the prose says where it comes from


def test_markdown_lists_every_variable_once_and_the_cli_prints_it(capsys):
    table = envs.markdown_table()
    for var in envs.ALL:
        assert table.count(f"| `{var.name}` |") == 1
    assert envs.main(["--markdown"]) == 0
    assert capsys.readouterr().out == table
    assert envs.main([]) == 2


# ---------------------------------------------------------------- (b) no direct reads


def _guarded(name) -> bool:
    return isinstance(name, str) and (name.startswith("DEEPINFER_") or name in envs.BY_NAME)


def _is_environ(node: ast.AST) -> bool:
    """os.environ, or environ imported from os."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
            and node.value.id == "os") or (isinstance(node, ast.Name) and node.id == "environ")


def _is_getenv(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "getenv" and isinstance(node.value, ast.Name)
            and node.value.id == "os") or (isinstance(node, ast.Name) and node.id == "getenv")


def _key(node: ast.AST | None):
    """The literal key, or ... for an expression the checker cannot see through."""
    return node.value if isinstance(node, ast.Constant) else ...


def direct_env_reads(source: str, filename: str = "<snippet>") -> list[str]:
    """Reads of a declared / DEEPINFER_* variable that bypass deepinfer.envs: os.environ.get(NAME),
    os.environ[NAME] (a load), os.getenv(NAME), NAME in os.environ, anything.get(NAME) (an alias of
    os.environ); and the os.environ forms with a key that is not a literal (the checker cannot tell which
    variable it is). Writes, pops and setdefault pass."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        key, what = None, None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "get" and _is_environ(func.value):
                key, what = _key(node.args[0]), "os.environ.get"
            elif isinstance(func, ast.Attribute) and func.attr == "get" and _guarded(_key(node.args[0])):
                key, what = _key(node.args[0]), "<an alias of os.environ?>.get"  # env = os.environ; env.get(NAME)
            elif _is_getenv(func):
                key, what = _key(node.args[0]), "os.getenv"
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            key, what = _key(node.slice), "os.environ[...]"
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(_is_environ(c) for c in node.comparators):
            key, what = _key(node.left), "... in os.environ"
        if what is not None and (key is ... or _guarded(key)):
            found.append(f"{filename}:{node.lineno}: {what} {'<expression>' if key is ... else repr(key)}")
    return found


def test_the_checker_catches_each_kind_of_direct_read():
    bad = '''
import os
from os import environ, getenv
a = os.environ.get("DEEPINFER_DEVICE")
b = os.environ["DEEPINFER_API_KEY"]
c = os.getenv("DEEPINFER_CACHE_DIR", "x")
d = "DEEPINFER_COMMIT" in os.environ
e = environ.get("TRITON_INTERPRET") == "1"
f = getenv("DEEPINFER_MOE_TILE")
g = os.environ.get(name)
h = "DEEPINFER_COMMIT" not in environ
env = os.environ
i = env.get("DEEPINFER_BATCH_INVARIANT")
'''
    found = direct_env_reads(bad)
    assert sorted(int(f.split(":")[1]) for f in found) == [*range(4, 12), 13], found  # lines a .. i
    assert "<snippet>:4: os.environ.get 'DEEPINFER_DEVICE'" in found and "<snippet>:10: os.environ.get <expression>" in found
    allowed = '''
import os
os.environ["DEEPINFER_ROUTER_GEMV"] = "4,128,2"
os.environ.pop("DEEPINFER_ROUTER_GEMV", None)
del os.environ["DEEPINFER_MLA_FUSED_MERGE"]
os.environ.setdefault("TRITON_INTERPRET", "1")
cuda = os.environ.get("CUDA_VISIBLE_DEVICES")
'''
    assert direct_env_reads(allowed) == []


def test_no_direct_reads_outside_envs():
    found = []
    for path in py_files("deepinfer", "benchmarks"):
        if path == ROOT / "deepinfer" / "envs.py":
            continue
        found += direct_env_reads(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert not found, "read these through deepinfer.envs:\n" + "\n".join(found)


# ---------------------------------------------------------------- (c) every name is declared


def test_every_deepinfer_name_in_the_tree_is_declared():
    used: dict[str, str] = {}
    for path in py_files("deepinfer", "benchmarks", "tests"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for name in NAME_RE.findall(node.value):
                    used.setdefault(name, f"{path.relative_to(ROOT)}:{node.lineno}")
    for name in NAME_RE.findall((ROOT / ".ci" / "run").read_text(encoding="utf-8")):
        used.setdefault(name, ".ci/run")
    undeclared = {n: where for n, where in used.items() if n not in envs.BY_NAME and n not in BUILT_ON_PURPOSE}
    assert not undeclared, f"declare these in deepinfer/envs.py: {undeclared}"
    assert "DEEPINFER_CI_VENV" in used and "DEEPINFER_DEVICE" in used  # the scan does see .ci/run and the package


def test_the_registry_itself_is_consistent():
    constants = {name: v for name, v in vars(envs).items() if isinstance(v, envs.EnvVar)}
    assert set(constants.values()) == set(envs.ALL) and len(envs.BY_NAME) == len(envs.ALL)
    for var in envs.ALL:
        assert var.name.startswith("DEEPINFER_") or var.group == "vendor", var.name
        assert var.meaning and "|" not in var.meaning and "\n" not in var.meaning, var.name
    assert envs.TRITON_INTERPRET in envs.ALL and not envs.TRITON_INTERPRET.name.startswith("DEEPINFER_")


def test_documented_defaults_match_the_backend_constants():
    """NVIDIA tuning integers leave their default to the backend; the table's text must show that value."""
    pytest.importorskip("triton")
    from deepinfer.backends.nvidia import fused_moe, moe_routing

    assert envs.MOE_FUSED_ROUTER_MAX_TOKENS.default_text == f"`{moe_routing.FUSED_ROUTER_MAX_TOKENS}`"
    assert envs.MOE_FUSED_ROUTER_MAX_TOKENS.maximum == moe_routing.ROUTER_GEMV_MAX_TOKENS
    assert envs.ROUTER_GEMV_MAX_TOKENS.default_text == (
        f"`{moe_routing.ROUTER_LOGITS_GEMV_MAX_TOKENS_SMALL_GATE}` for gates of <= 64 x 2048 (V2-Lite), else "
        f"`{moe_routing.ROUTER_LOGITS_GEMV_MAX_TOKENS}`")
    assert moe_routing.SMALL_GATE_ELEMENTS == 64 * 2048
    assert envs.MOE_DIRECT_MAX_PAIRS.default_text == f"`{fused_moe.DIRECT_MAX_PAIRS}`"


# ---------------------------------------------------------------- (d) parsing


@pytest.fixture
def clean(monkeypatch):
    for var in envs.ALL:
        monkeypatch.delenv(var.name, raising=False)
    return monkeypatch


def test_unset_or_blank_gives_the_default(clean):
    for var in envs.ALL:
        assert var.get() == var.default and not var.is_set(), var.name
    for var in envs.ALL:
        if not var.empty_is_error:
            clean.setenv(var.name, "  ")
            assert var.get() == var.default and not var.is_set(), var.name


@pytest.mark.parametrize("raw,value", [("1", True), ("0", False), ("true", True), ("False", False), ("yes", True),
                                       ("no", False), ("ON", True), ("off", False), (" 1 ", True)])
def test_bool_values(clean, raw, value):
    clean.setenv("DEEPINFER_BATCH_INVARIANT", raw)
    assert envs.BATCH_INVARIANT.get() is value


@pytest.mark.parametrize(
    "var,raw,error,match",
    [
        (envs.BATCH_INVARIANT, "maybe", ConfigError, r"DEEPINFER_BATCH_INVARIANT='maybe' is not a boolean: use 0 or 1"),
        (envs.MOE_SHARED_STREAM, "2", ConfigError, r"DEEPINFER_MOE_SHARED_STREAM='2' is not a boolean"),
        (envs.NVIDIA_CUDA_EXT, "auto", ConfigError, r"DEEPINFER_NVIDIA_CUDA_EXT='auto' is not a boolean"),
        (envs.USE_NEXTN_DECODE, "x", ConfigError, r"DEEPINFER_USE_NEXTN_DECODE='x' is not an integer: use an integer >= 0"),
        (envs.USE_NEXTN_DECODE, "-2", ConfigError, r"DEEPINFER_USE_NEXTN_DECODE='-2' must be >= 0"),
        (envs.TEST_THREADS, "many", ConfigError, r"DEEPINFER_TEST_THREADS='many' is not an integer"),
        (envs.MLA_BLOCK_N, "48", ConfigError, r"DEEPINFER_MLA_BLOCK_N='48' must be a power of two >= 16"),
        (envs.MLA_BLOCK_N, "8", ConfigError, r"DEEPINFER_MLA_BLOCK_N='8' must be >= 16"),
        (envs.MLA_SPLITS, "0", ConfigError, r"DEEPINFER_MLA_SPLITS='0' must be >= 1"),
        (envs.MOE_FUSED_ROUTER_MAX_TOKENS, "65", BackendError,
         r"DEEPINFER_MOE_FUSED_ROUTER_MAX_TOKENS='65' must be an integer in \[0, 64\]"),
        (envs.MOE_FUSED_ROUTER_MAX_TOKENS, "-1", BackendError, r"DEEPINFER_MOE_FUSED_ROUTER_MAX_TOKENS='-1' must be"),
        (envs.MOE_DIRECT_MAX_PAIRS, "many", BackendError, r"DEEPINFER_MOE_DIRECT_MAX_PAIRS='many' is not an integer"),
        (envs.MOE_BLOCK_M, "8", BackendError, r"DEEPINFER_MOE_BLOCK_M='8' must be 16, 32, 64 or 128"),
        (envs.MOE_BLOCK_M, "wide", BackendError, r"DEEPINFER_MOE_BLOCK_M='wide' is not an integer: use 16, 32, 64 or 128"),
        (envs.DEVICE, " ", ConfigError, r"DEEPINFER_DEVICE is empty: set auto, cpu, cuda, npu or a backend name"),
    ],
)
def test_bad_values_name_the_variable_and_what_it_accepts(clean, var, raw, error, match):
    clean.setenv(var.name, raw)
    with pytest.raises(error, match=match):
        var.get()


def test_good_typed_values(clean):
    clean.setenv("DEEPINFER_MOE_BLOCK_M", "32")
    clean.setenv("DEEPINFER_MLA_BLOCK_N", "64")
    clean.setenv("DEEPINFER_MOE_FUSED_ROUTER_MAX_TOKENS", "0")
    clean.setenv("DEEPINFER_MOE_DIRECT_MAX_PAIRS", "-3")  # any integer, as before (<= 0: direct mode off)
    clean.setenv("DEEPINFER_API_KEY", " sekret ")  # strings are kept as given
    assert (envs.MOE_BLOCK_M.get(), envs.MLA_BLOCK_N.get(), envs.MOE_FUSED_ROUTER_MAX_TOKENS.get()) == (32, 64, 0)
    assert envs.MOE_DIRECT_MAX_PAIRS.get() == -3 and envs.API_KEY.get() == " sekret "
    assert envs.CACHE_DIR.get() == "~/.cache/deepinfer"


def test_get_reads_the_environment_at_call_time(clean):
    assert envs.MLA_FUSED_MERGE.get() is None  # auto
    clean.setenv("DEEPINFER_MLA_FUSED_MERGE", "0")
    assert envs.MLA_FUSED_MERGE.get() is False
    clean.setenv("DEEPINFER_MLA_FUSED_MERGE", "1")
    assert envs.MLA_FUSED_MERGE.get() is True and envs.MLA_FUSED_MERGE.is_set()
    clean.delenv("DEEPINFER_MLA_FUSED_MERGE")
    assert envs.MLA_FUSED_MERGE.get() is None
    clean.setenv("DEEPINFER_ROUTER_GEMV", "4,128,2")
    assert envs.ROUTER_GEMV.get() == "4,128,2"  # tile strings stay raw: the backend parses them


def test_an_explicit_mapping_replaces_os_environ(clean):
    clean.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert envs.BATCH_INVARIANT.get({}) is False and envs.BATCH_INVARIANT.get({"DEEPINFER_BATCH_INVARIANT": "no"}) is False
    cfg = EngineConfig(model_name_or_path="/x").with_env({"DEEPINFER_DEVICE": " cpu ", "DEEPINFER_USE_NEXTN_DECODE": "2"})
    assert (cfg.device, cfg.use_nextn_decode, cfg.batch_invariant) == ("cpu", 2, False)
    with pytest.raises(ConfigError, match="DEEPINFER_ASYNC_SCHEDULING='sometimes' is not a boolean"):
        EngineConfig(model_name_or_path="/x").with_env({"DEEPINFER_ASYNC_SCHEDULING": "sometimes"})
    # an explicit field wins, and then the variable is not even parsed (as before)
    cfg = EngineConfig(model_name_or_path="/x", async_scheduling=False)
    assert cfg.with_env({"DEEPINFER_ASYNC_SCHEDULING": "sometimes"}).async_scheduling is False


def test_a_declaration_is_checked_and_parses_on_its_own():
    knob = envs.EnvVar("DEEPINFER_TEST_ENVS_KNOB", "int", 7, "a test-only knob", "dev", minimum=1, maximum=9)
    assert knob.get({}) == 7 and knob.get({"DEEPINFER_TEST_ENVS_KNOB": "9"}) == 9
    with pytest.raises(ConfigError, match=r"DEEPINFER_TEST_ENVS_KNOB='10' must be an integer in \[1, 9\]"):
        knob.get({"DEEPINFER_TEST_ENVS_KNOB": "10"})
    assert knob not in envs.ALL
    with pytest.raises(ValueError, match="kind"):
        envs.EnvVar("DEEPINFER_TEST_ENVS_KNOB", "float", 1.0, "x", "dev")
    with pytest.raises(ValueError, match="group"):
        envs.EnvVar("DEEPINFER_TEST_ENVS_KNOB", "int", 1, "x", "nowhere")
