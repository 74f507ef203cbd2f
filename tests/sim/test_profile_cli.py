"""``kvd profile --quick`` writes a profile the simulator and ``[engine].profile``
read; bad profiles, configs and flags are one line and exit 2."""

from __future__ import annotations

import json

import pytest

from tools.kvd_command import main
from kvd.config import ConfigError, load_config
from kvd.sim.profile_file import ProfileError, load_profile


def test_quick_profile_of_the_tiny_model_is_valid_and_fits(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["profile", "--model", "tiny", "--quick", "--output", str(out)]) == 0
    prof = load_profile(out, model="tiny")                  # this CPU, this model
    assert prof.fingerprint.startswith("fp_") and prof.num_layers >= 1 and prof.kv_bytes_per_token > 0
    doc = json.loads(out.read_text())
    assert len(doc["samples"]["prefill"]) >= 4 and len(doc["samples"]["decode"]) >= 2
    assert len(doc["samples"]["transfer"]) >= 2 and doc["samples"]["swap"]
    # the fitted model predicts a longer prefill for more tokens, a transfer grows with bytes
    c = prof.costs
    assert c.prefill_seconds([(256, 0)]) >= c.prefill_seconds([(16, 0)]) > 0
    assert c.transfer_seconds(8 << 20) >= c.transfer_seconds(4096) > 0
    err = capsys.readouterr().err
    assert "kvd profile:" in err and str(out) in err


def test_engine_profile_option_supplies_the_cost_coefficients(write_profile, tmp_path):
    path = write_profile()
    cfg = tmp_path / "kvd.toml"
    cfg.write_text(f'[engine]\nmodel = "tiny"\nprofile = "{path}"\ncost_fixed_s = 0.5\n')
    engine = load_config(cfg).engine
    assert engine.cost_token_s == pytest.approx(2e-4)            # from the profile
    assert engine.cost_swap_block_s == pytest.approx(1e-5)
    assert engine.cost_fixed_s == 0.5                            # set explicitly: it wins


@pytest.mark.parametrize("changes, why", [
    (dict(model="smollm2"), "model 'smollm2'"),
    (dict(cpu="Some Other CPU 9000"), "measured on 'Some Other CPU 9000'"),
    (dict(kind="other"), "not a kvd profile"),
    (dict(version=99), "version 99"),
    (dict(costs={"prefill_fixed_s": 1.0}), "costs lacks"),
    (dict(block_size=0), "block_size"),
])
def test_a_profile_of_another_model_or_cpu_or_a_bad_one_is_refused(write_profile, tmp_path, changes, why):
    path = write_profile(**changes)
    with pytest.raises(ProfileError, match=why):
        load_profile(path, model="tiny")
    cfg = tmp_path / "kvd.toml"
    cfg.write_text(f'[engine]\nmodel = "tiny"\nprofile = "{path}"\n')
    with pytest.raises(ConfigError, match="engine.profile"):
        load_config(cfg)


def test_serve_refuses_a_bad_profile_with_exit_2(write_profile, tmp_path, capsys):
    path = write_profile(model="smollm2")
    assert main(["serve", "--model", "tiny", "-c", str(_config(tmp_path, path))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "measured with model 'smollm2'" in err[0]


def test_profile_file_not_json_or_missing(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ProfileError, match="not JSON"):
        load_profile(bad)
    with pytest.raises(ProfileError, match="not found"):
        load_profile(tmp_path / "missing.json")
    bad.write_text('{"kind": "kvd-profile", "version": 1, "costs": {"prefill_fixed_s": NaN}}')
    with pytest.raises(ProfileError):
        load_profile(bad)


def test_profile_flags_are_checked(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["profile", "--model", "tiny"])                     # no --output
    assert exc.value.code == 2
    assert main(["profile", "--model", "tiny", "--output", str(tmp_path / "p.json"),
                 "-c", str(tmp_path / "missing.toml")]) == 2
    assert "not found" in capsys.readouterr().err


def _config(tmp_path, profile):
    cfg = tmp_path / "serve.toml"
    cfg.write_text(f'[engine]\nprofile = "{profile}"\n')
    return cfg
