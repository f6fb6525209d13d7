"""The config files: the run config's sections, the upgrade of configs stored flat, messages that
name the dotted key, the node config's bounds, and the builder from a run config to the training
objects' configs."""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from node.config import FLAT_KEYS as FLAT_NODE_KEYS
from node.config import SECTIONS, NodeConfig, format_node_config, load_node_config
from protocol.config_file import ConfigError, load_config, with_overrides
from protocol.run_config import FLAT_KEYS, AdaptiveDeadline, RunConfig, load_run_config, nest_flat
from tests.fixtures.coordinator import ADMIN_HEADERS, ADMIN_TOKEN, SignedPeer, create_run

# What a coordinator stored before the sections: RunConfig.redacted().model_dump_json() of the
# flat model, every field present.
FLAT_STORED = (
    '{"name":"old-run","preset":"tiny","strategy":"sparseloco","inner_steps":20,"inner_lr":0.001,'
    '"inner_betas":[0.9,0.95],"inner_weight_decay":0.1,"grad_clip":1.0,"warmup_steps":100,"total_steps":10000,'
    '"min_lr_ratio":0.1,"batch_size":8,"seq_len":1024,"outer_lr":0.7,"outer_momentum":0.0,"nesterov":false,'
    '"top_k":64,"chunk_size":64,"error_decay":0.95,"clip_to_median_norm":false,"seed":0,'
    '"max_packet_bytes":67108864,"deadline_policy":{"kind":"adaptive","initial_s":120.0,"quantile":0.9,'
    '"margin":1.5,"min_s":5.0,"max_s":3600.0,"window_rounds":5},"overlap":false,"tree_fanout":2,"min_peers":2,'
    '"max_rounds":null,"heartbeat_timeout_s":60.0,"num_data_shards":3,'
    '"dht_bootstrap":["/ip4/127.0.0.1/tcp/4001/p2p/QmBootstrap"],"join_policy":"token","join_tokens":[],'
    '"data":null}'
)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- the run config's sections ---------------------------------------------------------------------


def test_sections_defaults_and_redaction():
    config = RunConfig.model_validate(
        {
            "name": "a",
            "model": {"preset": "tiny"},
            "membership": {"join_policy": "token", "join_tokens": ["secret-token"]},
        }
    )
    assert (config.inner.steps, config.inner.lr, config.outer.lr, config.outer.top_k) == (15, 1e-3, 1.0, 64)
    assert (config.exchange.tree_fanout, config.membership.min_peers, config.deadline.round_timeout_s) == (2, 1, 120.0)
    redacted = config.redacted()
    assert redacted.membership.join_tokens == [] and redacted.membership.join_policy == "token"
    assert config.membership.join_tokens == ["secret-token"], "redacted() copies, it does not change the config"


def test_an_integer_where_a_float_goes_is_read_as_the_float(tmp_path):
    path = write(tmp_path, "run.toml", 'name = "a"\n[model]\npreset = "tiny"\n[outer]\nlr = 1\n')
    assert load_run_config(path).outer.lr == 1.0
    with pytest.raises(ConfigError, match=r"inner\.steps: Input should be a valid integer"):
        load_run_config(write(tmp_path, "run.toml", 'name = "a"\n[model]\npreset = "tiny"\n[inner]\nsteps = 15.0\n'))


@pytest.mark.parametrize(
    "text, message",
    [
        ("[inner]\nlr = 0.0\n", "inner.lr: Input should be greater than 0"),
        ("[inner]\nbetas = [0.9, 1.0]\n", "inner.betas.1: Input should be less than 1"),
        ('[outer]\nstrategy = "adam"\n', "outer.strategy: Input should be 'sparseloco', 'diloco' or 'ddp'"),
        ('[exchange]\ndht_bootstrap = ["not an address"]\n', "exchange.dht_bootstrap.0: String should match"),
        ("[membership]\nmin_peer = 2\n", "membership.min_peer: unknown key (did you mean membership.min_peers?)"),
        ('[deadline]\nkind = "fixed"\nround_timeout_s = 0.0\n', "deadline.round_timeout_s: Input should be greater"),
        ('[deadline]\nkind = "adaptive"\nmargin = 0.5\n', "deadline.margin: Input should be greater than or equal"),
    ],
)
def test_errors_name_the_dotted_key(tmp_path, text, message):
    path = write(tmp_path, "run.toml", 'name = "a"\n[model]\npreset = "tiny"\n' + text)
    with pytest.raises(ConfigError) as refused:
        load_run_config(path)
    assert str(refused.value).startswith(f"{path}: ") and message in str(refused.value)


def test_a_flat_file_is_refused_naming_each_keys_new_place(tmp_path):
    path = write(
        tmp_path, "run.toml", 'name = "a"\npreset = "tiny"\ninner_lr = 1e-3\n[deadline_policy]\nkind = "fixed"\n'
    )
    with pytest.raises(ConfigError) as refused:
        load_run_config(path)
    message = str(refused.value)
    for old, new in [("preset", "model.preset"), ("inner_lr", "inner.lr"), ("deadline_policy", "deadline")]:
        assert f"{old}: unknown key (it is now {new})" in message


def test_overrides_by_dotted_key(tmp_path):
    path = write(tmp_path, "run.toml", 'name = "a"\n[model]\npreset = "tiny"\n[inner]\nlr = 1e-3\n')
    config = load_run_config(
        path,
        {
            "inner.lr": 3e-4,
            "outer.overlap": True,
            "max_rounds": 7,
            "model.seed": None,
            "deadline": {"kind": "adaptive"},
        },
    )
    assert (config.inner.lr, config.outer.overlap, config.max_rounds, config.model.seed) == (3e-4, True, 7, 0)
    assert isinstance(config.deadline, AdaptiveDeadline)
    with pytest.raises(ConfigError, match=r"inner\.lr: Input should be less than or equal to 1"):
        load_run_config(path, {"inner.lr": 2.0})
    with pytest.raises(ConfigError, match=r"name\.x: name is not a table"):
        with_overrides({"name": "a"}, {"name.x": 1})
    assert with_overrides({"a": {"b": 1}}, {"a.c": 2}) == {"a": {"b": 1, "c": 2}}


def test_json_files_load_like_toml(tmp_path):
    toml = load_run_config(
        write(tmp_path, "run.toml", 'name = "a"\n[model]\npreset = "mini"\n[inner]\nbetas = [0.8, 0.9]\n')
    )
    assert load_run_config(write(tmp_path, "run.json", toml.model_dump_json())) == toml
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_run_config(write(tmp_path, "bad.json", "{"))
    with pytest.raises(ConfigError, match="cannot read"):
        load_run_config(tmp_path / "missing.toml")


# -- configs stored flat, before the sections --------------------------------------------------------


def test_from_stored_nests_a_flat_config():
    flat = json.loads(FLAT_STORED)
    assert set(flat) == set(FLAT_KEYS) | {"name", "max_rounds"}, "FLAT_KEYS names every flat field"
    config = RunConfig.from_stored(FLAT_STORED)
    assert (config.name, config.model.preset, config.model.num_data_shards) == ("old-run", "tiny", 3)
    assert (config.inner.steps, config.inner.betas, config.outer.lr) == (20, (0.9, 0.95), 0.7)
    assert config.exchange.dht_bootstrap == ["/ip4/127.0.0.1/tcp/4001/p2p/QmBootstrap"]
    assert (config.membership.min_peers, config.membership.join_policy) == (2, "token")
    assert isinstance(config.deadline, AdaptiveDeadline) and config.max_rounds is None
    for old, new in FLAT_KEYS.items():  # every value landed where FLAT_KEYS says
        if old == "clip_to_median_norm":  # the old flag is read as the aggregation it meant
            assert config.outer.aggregation == ("median_clip" if flat[old] else "mean")
            continue
        value = config
        for part in new.split("."):
            value = getattr(value, part)
        value = value.model_dump() if hasattr(value, "model_dump") else value
        assert value == (tuple(flat[old]) if old == "inner_betas" else flat[old]), old
    # A sectioned config is read as it is.
    assert RunConfig.from_stored(config.model_dump_json()) == config
    assert nest_flat({"name": "x", "top_k": 8}) == {"name": "x", "outer": {"top_k": 8}}


def test_a_database_written_before_the_sections_still_serves_its_run(tmp_path, fake_clock):
    from coordinator.app import create_app
    from coordinator.storage import open_storage

    url = f"sqlite:///{tmp_path / 'c.db'}"
    with TestClient(create_app(open_storage(url), ADMIN_TOKEN, clock=fake_clock, tick_s=None)) as client:
        run_id = create_run(client)
    flat_open = json.dumps(json.loads(FLAT_STORED) | {"join_policy": "open"})
    with sqlite3.connect(tmp_path / "c.db") as db:  # as the coordinator stored it before the sections
        db.execute("UPDATE runs SET config_json = ? WHERE run_id = ?", (flat_open, run_id))
    with TestClient(create_app(open_storage(url), ADMIN_TOKEN, clock=fake_clock, tick_s=None)) as client:
        info = client.get(f"/v1/runs/{run_id}", headers=ADMIN_HEADERS).json()
        assert info["config"]["inner"]["steps"] == 20 and info["config"]["model"]["preset"] == "tiny"
        joined = SignedPeer(client, clock=fake_clock).join(run_id)
        assert joined.status_code == 200, joined.text
        assert joined.json()["num_shards"] == 3 and joined.json()["config"]["outer"]["lr"] == 0.7


# -- the node config --------------------------------------------------------------------------------


def test_node_config_defaults_bounds_and_descriptions():
    config = load_node_config(None, {"coordinator": "http://c:1", "training.device": "cpu"})
    assert config.key_path == Path.home() / ".locoswarm" / "peer.key"
    assert config.network.host_maddrs == ("/ip4/127.0.0.1/tcp/0",)
    for model in (NodeConfig, *(NodeConfig.model_fields[name].annotation for name in SECTIONS)):
        assert all(field.description for field in model.model_fields.values()), model
    with pytest.raises(ValidationError):  # frozen
        config.training.threads = 2
    auto = load_node_config(None, {"coordinator": "http://c:1"})
    assert auto.training.device in ("cpu", "cuda")
    for key, value, message in [
        ("training.threads", 1025, "training.threads: Input should be less than or equal to 1024"),
        # a node uploads at nine tenths of what it states: 0.5 is a 500 Mbps link given in Gbps
        ("network.uplink_mbps", 0.5, "network.uplink_mbps: Input should be greater than or equal to 1"),
        ("network.uplink_mbps", float("nan"), "network.uplink_mbps: Input should be a finite number"),
        # a node fetches no faster than it states: 0.1 is a 100 Mbps link given in Gbps
        ("network.downlink_mbps", 0.1, "network.downlink_mbps: Input should be greater than or equal to 1"),
        ("network.downlink_mbps", float("inf"), "network.downlink_mbps: Input should be a finite number"),
        ("network.fetch_timeout_s", 86_401.0, "network.fetch_timeout_s: Input should be less than or equal to 86400"),
        ("training.device", "cuda:x", "training.device: must be auto, cpu, mps, cuda or cuda:N, got 'cuda:x'"),
        ("run_id", "a/b", "run_id: String should match pattern"),
        ("key_path", "", "key_path: must be a path"),
        ("network.announce_maddrs", ["ip4/1.2.3.4"], "network.announce_maddrs: not multiaddrs"),
        ("debug.inject", "crash@round=1", "debug.inject: Input should be a valid tuple"),
        ("memory.state_placement", "disk", "memory.state_placement: Input should be 'host' or 'device'"),
    ]:
        with pytest.raises(ConfigError) as refused:
            load_node_config(None, {"coordinator": "http://c:1", key: value})
        assert str(refused.value).startswith(f"command line: {message}"), str(refused.value)


def test_node_config_file_then_flags(tmp_path):
    path = write(
        tmp_path,
        "node.toml",
        'coordinator = "http://c:8000"\n[checkpoints]\ncheckpoint_dir = "~/ckpt"\n'
        '[network]\nhost_maddrs = ["/ip4/0.0.0.0/tcp/31337"]\n'
        '[training]\ndevice = "cpu"\n',
    )
    config = load_node_config(
        path, {"network.host_maddrs": None, "debug.inject": ["crash@round=1"], "network.uplink_mbps": 50.0}
    )
    assert config.checkpoints.checkpoint_dir == Path.home() / "ckpt"
    assert config.network.host_maddrs == ("/ip4/0.0.0.0/tcp/31337",)
    assert config.debug.inject == ("crash@round=1",) and config.network.uplink_mbps == 50.0
    printed = json.loads(format_node_config(config).removeprefix("node config: "))
    assert printed["checkpoints"]["checkpoint_dir"] == str(Path.home() / "ckpt") and printed["join_token"] is None
    assert load_config(NodeConfig, path) == load_node_config(path), "the same loader as the run config's"


def test_a_flat_node_config_loads_with_a_warning_per_moved_key(tmp_path, caplog):
    """A node.toml written before the sections: every key at the top level, outer_state_device
    under its old name. It loads as the sectioned file does, saying where each key went."""
    flat = write(
        tmp_path,
        "flat.toml",
        'coordinator = "http://c:8000"\nthreads = 3\nfetch_timeout_s = 5.0\n'
        'outer_state_device = "device"\nprogress = false\ndevice = "cpu"\n',
    )
    sectioned = write(
        tmp_path,
        "sectioned.toml",
        'coordinator = "http://c:8000"\n[training]\nthreads = 3\ndevice = "cpu"\n'
        '[network]\nfetch_timeout_s = 5.0\n[memory]\nstate_placement = "device"\n'
        "[debug]\nprogress = false\n",
    )
    with caplog.at_level(logging.WARNING, logger="node.config"):
        config = load_node_config(flat, {"training.threads": None})
    assert config == load_node_config(sectioned)
    lines = [record.getMessage() for record in caplog.records]
    assert f"{flat}: outer_state_device is now memory.state_placement (read as that; move it into [memory])" in lines
    assert f"{flat}: threads is now training.threads (read as that; move it into [training])" in lines
    assert len(lines) == 5, lines
    assert set(FLAT_NODE_KEYS.values()) <= {
        f"{s}.{n}" for s in SECTIONS for n in NodeConfig.model_fields[s].annotation.model_fields
    }
    assert load_node_config(flat, {"training.threads": 1}).training.threads == 1, "flags override a flat key"
    both = write(tmp_path, "both.toml", 'coordinator = "http://c:8000"\nthreads = 3\n[training]\nthreads = 4\n')
    with pytest.raises(ConfigError, match="threads and training.threads both given: keep training.threads"):
        load_node_config(both)
    misspelt = write(tmp_path, "misspelt.toml", 'coordinator = "http://c:8000"\nthreds = 3\n')
    with pytest.raises(ConfigError, match=r"threds: unknown key \(did you mean training.threads\?\)"):
        load_node_config(misspelt)


# -- the run's sections reach the training ----------------------------------------------------------


def test_the_training_takes_the_run_sections_as_they_are():
    from node.training.inner import lr_at, make_inner_optimizer
    from node.training.model import build_model, model_config
    from node.training.outer import make_outer
    from node.training.params import flat_named_params

    run = RunConfig.model_validate(
        {
            "name": "a",
            "model": {"preset": "tiny"},
            "inner": {
                "lr": 5e-4,
                "betas": [0.8, 0.9],
                "weight_decay": 0.01,
                "grad_clip": 0.5,
                "warmup_steps": 3,
                "total_steps": 30,
                "min_lr_ratio": 0.2,
                "batch_size": 2,
                "seq_len": 16,
            },
            "outer": {
                "strategy": "diloco",
                "lr": 0.7,
                "momentum": 0.9,
                "nesterov": True,
                "top_k": 8,
                "chunk_size": 16,
                "error_decay": 0.5,
                "aggregation": "mean",
                "max_abs_value": 5.0,
                "overlap": True,
            },
            "exchange": {"max_packet_bytes": 4096},
        }
    )
    model = build_model(model_config(run), run.model.seed)
    group = make_inner_optimizer(model, run.inner).param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (lr_at(0, run.inner), (0.8, 0.9), 0.01)
    assert lr_at(3, run.inner) == 5e-4 and lr_at(30, run.inner) == 0.2 * 5e-4
    outer = make_outer(flat_named_params(model), run.outer, max_packet_bytes=run.exchange.max_packet_bytes)
    assert type(outer).__name__ == "DiLoCoOuter" and outer.cfg is run.outer and outer.max_packet_bytes == 4096
    with pytest.raises(ValueError, match="ddp"):
        make_outer(flat_named_params(model), run.outer.model_copy(update={"strategy": "ddp"}))
