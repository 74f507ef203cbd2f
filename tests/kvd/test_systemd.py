"""`systemd-analyze verify` on the units in systemd/, plus the settings we rely on.

verify checks that ExecStart's binary exists and is executable. The units
name the production path /opt/kvd/.venv/bin/kvd, which does not exist on a
build machine, so each unit is copied to a tmp dir with ExecStart pointing at
a stub executable there; nothing else is changed. The template
kvd-node@.service is verified as an instance (kvd-node@n1.service), which is
how systemd loads it and how `%i` gets expanded.

verify exits 0 on unknown keys and unparsable values (it only warns,
"ignoring"), so a test also fails on any message that names our unit files.

systemd-analyze comes from Debian's `systemd` package (.ci/run installs it).
Under CI=true a missing systemd-analyze fails the test; elsewhere it skips.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from kvd.config import ServerConfig
from kvd.coordinator.daemon import END_GRACE_S, HTTP_CLOSE_S
from kvd.node.heartbeat import GOODBYE_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "systemd"
PROD_EXEC = "/opt/kvd/.venv/bin/kvd"


@pytest.fixture(scope="module")
def analyze() -> str:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail("systemd-analyze is missing under CI: install Debian's systemd (.ci/run does)")
        pytest.skip("systemd-analyze not installed (apt-get install systemd)")
    return exe


def verify(analyze: str, tmp: Path, template: str, unit: str | None = None,
           text: str | None = None) -> tuple[int, str]:
    """Copy `template` into tmp with a stub ExecStart, verify `unit` (default: itself)."""
    stub = tmp / "bin" / "kvd"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    text = (UNITS / template).read_text() if text is None else text
    assert PROD_EXEC in text
    (tmp / template).write_text(text.replace(PROD_EXEC, str(stub)))
    proc = subprocess.run([analyze, "verify", "--man=no", str(tmp / (unit or template))],
                          capture_output=True, text=True, timeout=120, cwd=tmp)
    return proc.returncode, proc.stdout + proc.stderr


def problems(output: str, *names: str) -> list[str]:
    return [line for line in output.splitlines() if any(n in line for n in names)]


def test_coordinator_unit_verifies(analyze, tmp_path):
    rc, out = verify(analyze, tmp_path, "kvd-coordinator.service")
    assert rc == 0, out
    assert problems(out, "kvd-coordinator") == []


def test_node_unit_verifies_as_an_instance(analyze, tmp_path):
    rc, out = verify(analyze, tmp_path, "kvd-node@.service", "kvd-node@n1.service")
    assert rc == 0, out
    assert problems(out, "kvd-node@") == []


def test_verify_catches_what_we_guard_against(analyze, tmp_path):
    """The checker itself: a typo'd key and a missing binary are both caught."""
    text = (UNITS / "kvd-coordinator.service").read_text().replace("WatchdogSec=", "WatchDogSec=")
    rc, out = verify(analyze, tmp_path, "kvd-coordinator.service", text=text)
    assert problems(out, "kvd-coordinator"), out
    (tmp_path / "x.service").write_text((UNITS / "kvd-coordinator.service").read_text())
    proc = subprocess.run([analyze, "verify", "--man=no", str(tmp_path / "x.service")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "not executable" in proc.stdout + proc.stderr


# TimeoutStopSec >= drain_timeout + this (the units, etc/kvd.toml and
# docs/operations.md "Shutdown" say so)
STOP_HEADROOM_S = 15


@pytest.mark.parametrize("name", ["kvd-coordinator.service", "kvd-node@.service"])
def test_stop_timeout_outlasts_the_whole_shutdown(name):
    """systemd's SIGKILL comes after the shutdown's last step: the shipped
    drain_timeout, then what follows it (the coordinator: END_GRACE_S for the
    requests it ends, aiohttp's two HTTP_CLOSE_S phases; a node: its Goodbye),
    with as much again for the engine's last step and the process's exit."""
    stop = int(re.fullmatch(r"(\d+)s", settings(name)["TimeoutStopSec"][-1]).group(1))
    drain = tomllib.loads((ROOT / "etc" / "kvd.toml").read_text())["server"]["drain_timeout"]
    assert drain == ServerConfig().drain_timeout
    assert stop >= drain + STOP_HEADROOM_S
    after_drain = END_GRACE_S + 2 * HTTP_CLOSE_S if "coordinator" in name else GOODBYE_TIMEOUT_S
    assert 2 * after_drain <= STOP_HEADROOM_S


def settings(name: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in (UNITS / name).read_text().splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


@pytest.mark.parametrize("name", ["kvd-coordinator.service", "kvd-node@.service"])
def test_unit_contract(name):
    s = settings(name)
    one = {k: v[-1] for k, v in s.items()}
    assert one["Type"] == "notify" and one["NotifyAccess"] == "main"
    assert one["Restart"] == "on-failure" and one["KillSignal"] == "SIGTERM"
    assert one["RuntimeDirectory"] == "kvd" and one["RuntimeDirectoryMode"] == "0750"
    # Both units share /run/kvd: stopping one must not delete the other's socket.
    assert one["RuntimeDirectoryPreserve"] == "yes"
    watchdog = int(re.fullmatch(r"(\d+)s", one["WatchdogSec"]).group(1))
    assert 10 <= watchdog <= 120
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "ProtectKernelTunables",
                "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups",
                "RestrictNamespaces", "LockPersonality", "RestrictRealtime"):
        assert one[key] == "yes", key
    assert one["ProtectSystem"] == "strict"
    assert one["SystemCallArchitectures"] == "native"
    assert set(one["RestrictAddressFamilies"].split()) == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    # torch generates code at run time: W^X would break it.
    assert "MemoryDenyWriteExecute" not in s
    assert one["User"] == "kvd" and "DynamicUser" not in s
    exec_start = one["ExecStart"].split()
    assert exec_start[:2] == [PROD_EXEC, "coordinator" if "coordinator" in name else "node"]
    assert exec_start[2:4] == ["-c", "/etc/kvd/kvd.toml"]
    if "node@" in name:
        assert exec_start[4:] == ["--name", "%i"]
