"""kvd.config: etc/kvd.toml is the defaults, bad files fail loudly, flags win.

etc/kvd.toml documents every option; these tests keep it equal to the
defaults in code, so the documentation cannot drift from the dataclasses.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from engine.engine import EngineConfig
from kvd import cli
from kvd.config import _SECTIONS, _SERVER_FROM_MODEL, ConfigError, KvdConfig, ServerConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
KVD_TOML = ROOT / "etc" / "kvd.toml"


def write(tmp_path: Path, text: str, name: str = "kvd.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def documented_fields() -> dict[str, set[str]]:
    """{"engine": {...}, "server": {...}}: the dataclass fields etc/kvd.toml sets."""
    data = tomllib.loads(KVD_TOML.read_text())
    out: dict[str, set[str]] = {"engine": set(), "server": set()}
    for section, table in data.items():
        target, rename = _SECTIONS[section]
        for key in table:
            if section == "model" and key in _SERVER_FROM_MODEL:
                out["server"].add(_SERVER_FROM_MODEL[key])
            else:
                out[target].add(rename[key] if rename else key)
    return out


# ------------------------------------------------------------ etc/kvd.toml

def test_shipped_config_equals_builtin_defaults():
    assert load_config(KVD_TOML) == KvdConfig()


def test_shipped_config_documents_every_option():
    documented = documented_fields()
    for cls, target in ((EngineConfig, "engine"), (ServerConfig, "server")):
        missing = {f.name for f in dataclasses.fields(cls)} - documented[target]
        assert not missing, f"etc/kvd.toml lacks {target} options {sorted(missing)}"


def test_every_option_has_a_cli_flag():
    dests = set(vars(cli.build_parser().parse_args(["serve"])))
    for cls in (EngineConfig, ServerConfig):
        missing = {f.name for f in dataclasses.fields(cls)} - dests
        assert not missing, f"{cls.__name__} fields without a kvd serve flag: {sorted(missing)}"


def test_no_config_file_means_defaults():
    assert load_config() == KvdConfig()
    assert load_config(None, {"engine": {"kv_blocks": None}, "server": {"port": None}}) == KvdConfig()


# ------------------------------------------------------------ good files

def test_sections_map_onto_the_dataclasses(tmp_path):
    path = write(tmp_path, """
[model]
name = "tiny:3"
dtype = "fp32"
served_name = "gpt-x"
[engine]
kv_blocks = 64
host_kv_blocks = 0
max_model_len = 512
preemption_mode = "recompute"
enable_prefix_caching = false
[server]
port = 0
drain_timeout = 5
api_key = "k"
[cluster]
anything = "is left to the cluster daemons"
""")
    cfg = load_config(path)
    assert cfg.engine == dataclasses.replace(
        EngineConfig(), model="tiny:3", dtype="fp32", kv_blocks=64, host_kv_blocks=0,
        max_model_len=512, preemption_mode="recompute", enable_prefix_caching=False)
    assert cfg.server == dataclasses.replace(
        ServerConfig(), served_model_name="gpt-x", port=0, drain_timeout=5.0, api_key="k")
    assert isinstance(cfg.server.drain_timeout, float)


def test_caching_cost_options(tmp_path):
    path = write(tmp_path, '[engine]\nhost_hit_policy = "recompute"\ncost_token_s = 2e-3\n'
                           'cost_swap_block_s = 1\n')
    cfg = load_config(path).engine
    assert (cfg.host_hit_policy, cfg.cost_token_s, cfg.cost_swap_block_s) == ("recompute", 2e-3, 1.0)
    assert isinstance(cfg.cost_swap_block_s, float)
    assert cfg.scheduler_config(0).caching_cost is None          # only "cost" consults it
    assert load_config(path, {"engine": {"host_hit_policy": "cost"}}).engine.scheduler_config(0).caching_cost \
        == cfg.caching_cost()


def test_zero_and_empty_mean_unset_for_optional_options(tmp_path):
    path = write(tmp_path, '[engine]\nmax_model_len = 0\nnum_threads = 0\n'
                           '[server]\napi_key = ""\napi_key_file = ""\n')
    cfg = load_config(path)
    assert cfg.engine.max_model_len is None and cfg.engine.num_threads is None
    assert cfg.server.api_key is None and cfg.server.api_key_file is None


# ------------------------------------------------------------ overrides (CLI flags)

def test_flags_override_the_file(tmp_path):
    path = write(tmp_path, '[model]\nname = "tiny"\n[engine]\nkv_blocks = 64\nmax_num_seqs = 8\n'
                           '[server]\nport = 9000\nlog_level = "debug"\n')
    cfg = load_config(path, {"engine": {"kv_blocks": 128, "max_num_seqs": None,
                                        "enable_prefix_caching": False},
                             "server": {"port": 0, "log_level": None}})
    assert cfg.engine.kv_blocks == 128              # flag wins
    assert cfg.engine.max_num_seqs == 8             # flag not given (None): the file's value
    assert cfg.engine.model == "tiny"
    assert cfg.engine.enable_prefix_caching is False
    assert cfg.server.port == 0                     # 0 is a value, not "unset"
    assert cfg.server.log_level == "debug"


def test_parsed_flags_reach_the_config(tmp_path):
    """The same path `kvd serve` takes: argparse namespace -> overrides -> config."""
    path = write(tmp_path, '[engine]\nblock_size = 32\n[server]\nport = 9000\n')
    args = cli.build_parser().parse_args(
        ["serve", "-c", str(path), "--port", "9100", "--kv-blocks", "10", "--no-prefix-caching"])
    engine = {d: getattr(args, d) for d, _, _ in cli.ENGINE_FLAGS.values()}
    engine["enable_prefix_caching"] = args.enable_prefix_caching
    server = {d: getattr(args, d) for d, _, _ in cli.SERVER_FLAGS.values()}
    cfg = load_config(args.config, {"engine": engine, "server": server})
    assert (cfg.engine.block_size, cfg.engine.kv_blocks, cfg.engine.enable_prefix_caching) == (32, 10, False)
    assert cfg.server.port == 9100


def test_bad_flag_value_is_a_config_error():
    with pytest.raises(ConfigError, match="--port"):
        load_config(None, {"server": {"port": "x"}})
    with pytest.raises(ConfigError, match="port"):
        load_config(None, {"server": {"port": 70000}})


def test_compute_threads():
    """One per physical core (torch's default) less reserved_cpus, only where that default
    would take every usable CPU of a host of 8 or more; num_threads as it is, always."""
    default = EngineConfig()
    assert default.compute_threads(16, 16) == 15            # every CPU: one left to the serving threads
    assert default.compute_threads(8, 8) == 7
    assert default.compute_threads(8, 16) == 8              # SMT siblings left free already
    assert default.compute_threads(2, 2) == 2               # too few CPUs to give one up
    assert default.compute_threads(7, 7) == 7
    assert default.compute_threads(15, 16) == 15            # already below: unchanged (idempotent)
    assert EngineConfig(reserved_cpus=0).compute_threads(16, 16) == 16
    assert EngineConfig(reserved_cpus=4).compute_threads(16, 16) == 12
    assert EngineConfig(reserved_cpus=99).compute_threads(16, 16) == 1
    assert EngineConfig(num_threads=16).compute_threads(16, 16) == 16
    assert EngineConfig(num_threads=3).compute_threads(16, 16) == 3


# ------------------------------------------------------------ bad files

@pytest.mark.parametrize("text, names", [
    ("[modle]\nname = 'tiny'\n", ["[modle]"]),
    ("[engine]\nkv_block = 10\n", ["engine.kv_block"]),
    ("[model]\npath = 'x.gguf'\n", ["model.path"]),
    ("[server]\nprot = 8000\n", ["server.prot"]),
    ("[server]\nport = \"x\"\n", ["server.port", "int"]),
    ("[server]\nport = 8000.0\n", ["server.port", "int"]),
    ("[engine]\nmax_num_seqs = true\n", ["engine.max_num_seqs", "int"]),
    ("[engine]\nenable_prefix_caching = 1\n", ["engine.enable_prefix_caching", "bool"]),
    ("[server]\ndrain_timeout = \"30s\"\n", ["server.drain_timeout", "float"]),
    ("[model]\nname = 7\n", ["model.name", "str"]),
    ("[server]\nport = 70000\n", ["port", "70000"]),
    ("[server]\nport = -1\n", ["port"]),
    ("[server]\ndrain_timeout = -1.0\n", ["drain_timeout"]),
    ("[server]\nlog_level = \"loud\"\n", ["log_level", "loud"]),
    ("[model]\ndtype = \"fp16\"\n", ["dtype", "fp16"]),
    ("[engine]\npreemption_mode = \"drop\"\n", ["preemption_mode", "drop"]),
    ("[engine]\nmax_num_seqs = 0\n", ["max_num_seqs"]),
    ("[engine]\nmax_num_batched_tokens = 0\n", ["max_num_batched_tokens"]),
    ("[engine]\nkv_blocks = 0\n", ["kv_blocks"]),
    ("[engine]\nmax_model_len = 1\n", ["max_model_len"]),
    ("[engine]\nnum_threads = -2\n", ["num_threads"]),
    ("[engine]\nreserved_cpus = -1\n", ["reserved_cpus"]),
    ("[engine]\ndecode_threads = -2\n", ["decode_threads"]),
    ("[engine]\nreserved_cpus = 1.5\n", ["engine.reserved_cpus", "int"]),
    ("[engine]\nhost_hit_policy = \"never\"\n", ["host_hit_policy", "never"]),
    ("[engine]\ncost_swap_block_s = -1.0\n", ["cost_swap_block_s", ">= 0"]),
    ("[engine]\ncost_token_s = nan\n", ["cost_token_s", "finite"]),
    ("[engine]\ncost_attention_s = inf\n", ["cost_attention_s", "finite"]),
    ("[engine]\ncost_fixed_s = \"1ms\"\n", ["engine.cost_fixed_s", "float"]),
    ("[engine]\ncpus = \"0-\"\n", ["cpus", "not a CPU list"]),
    ("[engine]\ncpus = 3\n", ["engine.cpus", "str"]),
])
def test_bad_file_names_the_key(tmp_path, text, names):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    for name in names:
        assert name in str(err.value)


def test_invalid_toml(tmp_path):
    path = write(tmp_path, "[server]\nport = \n")
    with pytest.raises(ConfigError, match="invalid TOML") as err:
        load_config(path)
    assert str(path) in str(err.value)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="not found") as err:
        load_config(path)
    assert str(path) in str(err.value)


def test_unknown_key_error_names_the_file(tmp_path):
    path = write(tmp_path, "[engine]\nkv_block = 10\n")
    with pytest.raises(ConfigError, match=str(path)):
        load_config(path)


@pytest.mark.parametrize("kind", ["directory", "not-utf8"])
def test_unreadable_file_is_a_config_error(tmp_path, kind):
    if kind == "directory":
        path = tmp_path / "conf.toml"
        path.mkdir()
    else:
        path = tmp_path / "conf.toml"
        path.write_bytes(b"\xff\xfe[server]\n")
    with pytest.raises(ConfigError):
        load_config(path)


# ------------------------------------------------------------ the command line

def test_serve_with_bad_config_exits_2_with_one_line(tmp_path):
    path = write(tmp_path, "[server]\nport = 70000\n", name="bad.toml")
    proc = subprocess.run([sys.executable, "-m", "kvd.cli", "serve", "-c", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvd: error: ") and "port" in lines[0]
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("nodes", [[], ["--nodes", "2"], ["node", "--name", "n1"]])
def test_cpus_this_process_may_not_use_exit_2_with_one_line(nodes):
    """kvd serve (and with --nodes, whose nodes would take them), and kvd node: before
    anything starts or loads."""
    outside = str(max(os.sched_getaffinity(0)) + 1)
    argv = ["node", *nodes[1:], "--insecure", "--cpus", outside] if nodes and nodes[0] == "node" \
        else ["serve", *nodes, "--cpus", outside]
    proc = subprocess.run([sys.executable, "-m", "kvd.cli", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvd: error: cpus"), proc.stderr
    assert f"CPUs {outside} are not among those this process may use" in lines[0]


def test_serve_with_missing_config_exits_2(tmp_path):
    assert cli.main(["serve", "-c", str(tmp_path / "missing.toml")]) == 2
