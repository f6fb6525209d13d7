"""Coordinator command line: config loading, one-line operator errors (exit code 2), the
terminal status table, and the wiring into `locoswarm`."""

from __future__ import annotations

import re
import socket

import pytest

from coordinator.cli import main
from coordinator.terminal import render_status
from protocol.run_config import ConfigError, load_run_config

pytestmark = pytest.mark.timeout(30)


def test_load_run_config_toml_and_json(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        'name = "a"\n[model]\npreset = "1b"\n[outer]\nstrategy = "diloco"\nmomentum = 0.9\n'
        'nesterov = true\n[membership]\njoin_policy = "token"\njoin_tokens = ["long-enough-token"]\n'
    )
    config = load_run_config(toml)
    assert (config.model.preset, config.outer.strategy, config.outer.nesterov) == ("1b", "diloco", True)
    assert config.deadline.round_timeout_s == 120.0 and config.inner.steps == 15
    as_json = tmp_path / "run.json"
    as_json.write_text(config.model_dump_json())
    assert load_run_config(as_json) == config


@pytest.mark.parametrize(
    "text, key",
    [
        ('name = "a"\n[model]\npreset = "tiny"\n[inner]\nlr = 0\n', "inner.lr: Input should be greater than 0"),
        ('name = "a"\n[model]\npreset = "tiny"\n[outer]\ntop_k = "64"\n', "outer.top_k"),
        ('name = "a"\n[model]\npreset = "tiny"\n[inner]\nstepz = 15\n', "inner.stepz: unknown key"),
        ('name = "a"\n', "model: required"),
        ('name = "a"\n[model]\n', "model.preset: required"),
        ('name = "a"\n[model]\npreset = "tiny"\n[deadline]\nround_timeout_s = -1\n', "deadline.round_timeout_s"),
        ('name = "a"\n[model]\npreset = "tiny"\n[deadline]\nkind = "adaptive"\nquantile = 2.0\n', "deadline.quantile"),
        ('name = "a"\npreset = "tiny"\ninner_lr = 0.1\n', "inner_lr: unknown key (it is now inner.lr)"),
        ('name = "a"\n[model]\npreset = \n', "not valid TOML"),
    ],
)
def test_bad_config_files_name_the_bad_key(tmp_path, capsys, text, key):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_run_config(path)
    code = main(
        ["run", "create", "--coordinator", "http://127.0.0.1:9", "--config", str(path), "--admin-token", "x" * 20]
    )
    err = capsys.readouterr().err
    assert code == 2 and key in err and err.count("\n") == 1


def test_missing_config_file_and_unreachable_coordinator(tmp_path, capsys):
    assert (
        main(
            [
                "run",
                "create",
                "--coordinator",
                "http://127.0.0.1:9",
                "--config",
                str(tmp_path / "nope.toml"),
                "--admin-token",
                "x" * 20,
            ]
        )
        == 2
    )
    assert "cannot read" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]  # closed again below: nothing listens there
    assert main(["status", "--coordinator", f"http://127.0.0.1:{dead_port}"]) == 2
    assert "cannot reach the coordinator" in capsys.readouterr().err


def test_serve_refuses_bad_database_and_busy_port(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LOCOSWARM_ADMIN_TOKEN", "t" * 32)
    assert main(["coordinator", "serve", "--db", f"sqlite:///{tmp_path}/no/such/dir.db", "--port", "0"]) == 2
    assert "cannot open SQLite database" in capsys.readouterr().err
    assert (
        main(
            ["coordinator", "serve", "--db", "postgresql://x@/y?host=/nonexistent-dir&connect_timeout=2", "--port", "0"]
        )
        == 2
    )
    assert "cannot connect to PostgreSQL" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["coordinator", "serve", "--db", f"sqlite:///{tmp_path}/c.db", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}: address already in use" in capsys.readouterr().err


def test_generated_admin_token_is_private_and_reused(tmp_path, capsys, monkeypatch):
    import argparse

    from coordinator.cli import _admin_token_for_server

    monkeypatch.delenv("LOCOSWARM_ADMIN_TOKEN", raising=False)
    args = argparse.Namespace(db=f"sqlite:///{tmp_path}/c.db", admin_token_file=None)
    token = _admin_token_for_server(args)
    token_path = tmp_path / "c.db.admin-token"
    assert token_path.stat().st_mode & 0o777 == 0o600
    assert str(token_path) in capsys.readouterr().out
    assert _admin_token_for_server(args) == token and len(token) >= 32


def test_locoswarm_wires_the_coordinator_commands():
    import locoswarm.cli

    parser = locoswarm.cli.build_parser()
    from coordinator import cli

    assert parser.parse_args(["coordinator", "serve", "--port", "0"]).func is cli._serve
    assert parser.parse_args(["run", "create", "--coordinator", "u", "--config", "c"]).func is (cli._run_create)
    assert parser.parse_args(["status", "--coordinator", "u"]).func is cli._status


def test_terminal_status_table():
    status = {
        "now": 100.0,
        "run": {
            "run_id": "run-1",
            "name": "demo",
            "state": "running",
            "config": {
                "model": {"preset": "tiny"},
                "outer": {"strategy": "sparseloco"},
                "inner": {"steps": 15},
                "membership": {"min_peers": 2},
            },
        },
        "current_round": {
            "round": 3,
            "state": "open",
            "deadline": 130.0,
            "num_submitted": 1,
            "num_expected": 2,
            "opened_at": 90.0,
        },
        "peers": [
            {
                "peer_id": "p" + "1" * 16,
                "peer_index": 0,
                "status": "live",
                "activity": "training",
                "last_loss": 2.5,
                "bandwidth_mbps": 950.0,
                "uplink_mbps": 100.0,
                "lag_rounds": 0,
                "flags": [],
                "reason": None,
            },
            {
                "peer_id": "p" + "2" * 16,
                "peer_index": 1,
                "status": "gone",
                "activity": "training",
                "last_loss": None,
                "bandwidth_mbps": None,
                "lag_rounds": 2,
                "flags": ["params_mismatch"],
                "reason": "no heartbeat for 70 s",
            },
        ],
        "history": [
            {
                "round": 2,
                "num_contributors": 2,
                "mean_loss": 2.75,
                "round_time_s": 12.5,
                "num_applied": 2,
                "majority_digest": "ab" * 32,
            }
        ],
    }
    text = render_status(status)
    assert "round 3 open: 1/2 submitted, deadline in 30 s" in text
    assert "950 Mbps, up 100" in text and "params_mismatch; no heartbeat for 70 s" in text
    assert "2.7500" in text and "12.5 s" in text


def test_status_without_run_shows_the_live_run(monkeypatch, capsys):
    from coordinator import cli

    runs = [
        {"run_id": "run-long", "name": "long", "state": "running"},
        {"run_id": "run-quick", "name": "quick", "state": "closed"},
    ]
    asked = []

    def fake_request(method, url, **kwargs):
        asked.append(url)
        if url.endswith("/v1/runs"):
            return {"runs": runs}
        run_id = url.split("/")[-2]
        return {
            "run": {
                "run_id": run_id,
                "name": run_id,
                "state": "running",
                "config": {
                    "model": {"preset": "tiny"},
                    "outer": {"strategy": "sparseloco"},
                    "inner": {"steps": 15},
                    "membership": {"min_peers": 2},
                },
            },
            "current_round": None,
            "peers": [],
            "history": [],
            "now": 0.0,
        }

    monkeypatch.setattr(cli, "_request", fake_request)
    assert main(["status", "--coordinator", "http://c"]) == 0
    assert asked[-1] == "http://c/v1/runs/run-long/status" and "run run-long" in capsys.readouterr().out
    runs[0]["state"] = "finished"
    assert main(["status", "--coordinator", "http://c"]) == 0
    assert asked[-1] == "http://c/v1/runs/run-quick/status", "with none live: the newest"
    assert main(["status", "--coordinator", "http://c", "--run", "run-long"]) == 0
    assert asked[-1] == "http://c/v1/runs/run-long/status"


def test_terminal_status_shows_inner_steps_and_a_stalled_round():
    from coordinator.terminal import pick_run

    status = {
        "now": 200.0,
        "run": {
            "run_id": "run-1",
            "name": "demo",
            "state": "running",
            "config": {
                "model": {"preset": "tiny"},
                "outer": {"strategy": "sparseloco"},
                "inner": {"steps": 10},
                "membership": {"min_peers": 2},
            },
        },
        "current_round": {
            "round": 3,
            "state": "open",
            "deadline": 130.0,
            "num_submitted": 0,
            "num_expected": 2,
            "opened_at": 90.0,
        },
        "peers": [
            {
                "peer_id": "p" + str(i) * 16,
                "peer_index": i,
                "status": "live",
                "activity": "training",
                "inner_step": step,
                "last_loss": None,
                "bandwidth_mbps": None,
                "lag_rounds": 0,
                "flags": [],
                "reason": None,
            }
            for i, step in enumerate([4, 12])
        ],
        "history": [],
    }
    text = render_status(status)
    assert "STALLED: 70 s past its deadline, 70% of the inner steps trained" in text
    assert "training 4/10" in text and "training 12/10" in text
    assert pick_run([{"run_id": "a", "state": "waiting"}, {"run_id": "b", "state": "closed"}]) == "a"
