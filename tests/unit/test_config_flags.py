"""The flags of `node join` and `doctor` are made from NodeConfig (node/cli/config_flags.py): one per
field, with its description; the spellings volunteers use keep working; a flag not given leaves the
file's value; and the command-line modules stay light to import."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from locoswarm.cli import parse_args
from node.cli.config_flags import add_config_flags, config_overrides, flag_of
from node.config import SECTIONS, NodeConfig, load_node_config

REPO = Path(__file__).resolve().parents[2]

# Every flag `node join` took before the flags were made from the model, with a value, and the
# dotted key it sets.
FLAGS_IN_USE = [
    (["--coordinator", "http://c:1"], "coordinator", "http://c:1"),
    (["--run", "r1"], "run_id", "r1"),
    (["--token", "long-enough-token"], "join_token", "long-enough-token"),
    (["--device", "cpu"], "training.device", "cpu"),
    (["--data", "/srv/text"], "training.data", "/srv/text"),
    (["--key", "/tmp/k.key"], "key_path", Path("/tmp/k.key")),
    (
        ["--host-maddrs", "/ip4/0.0.0.0/tcp/1", "/ip6/::/tcp/1"],
        "network.host_maddrs",
        ("/ip4/0.0.0.0/tcp/1", "/ip6/::/tcp/1"),
    ),
    (["--announce-maddrs", "/ip4/8.8.8.8/tcp/1"], "network.announce_maddrs", ("/ip4/8.8.8.8/tcp/1",)),
    (["--initial-peers"], "network.initial_peers", ()),
    (["--client-mode"], "network.client_mode", True),
    (["--no-client-mode"], "network.client_mode", False),
    (["--auto-relay"], "network.use_auto_relay", True),
    (["--threads", "2"], "training.threads", 2),
    (["--ranks", "2"], "training.ranks", 2),
    (["--uplink-mbps", "12.5"], "network.uplink_mbps", 12.5),
    (["--max-rounds", "3"], "training.max_rounds", 3),
    (["--fetch-timeout", "5"], "network.fetch_timeout_s", 5.0),
    (["--checkpoint-dir", "/tmp/ckpt"], "checkpoints.checkpoint_dir", Path("/tmp/ckpt")),
    (["--checkpoint-every", "4"], "checkpoints.checkpoint_every_rounds", 4),
    (["--no-progress"], "debug.progress", False),
    (["--eval-every", "0"], "training.eval_every_rounds", 0),
    (
        ["--inject", "crash@round=1", "--inject", "lie@from_round=2"],
        "debug.inject",
        ("crash@round=1", "lie@from_round=2"),
    ),
    (["--state-placement", "device"], "memory.state_placement", "device"),
    (["--micro-batch-size", "2"], "memory.micro_batch_size", 2),
    (["--packets-in-memory"], "network.packets_in_memory", True),
]


def _value(config: NodeConfig, dotted: str):
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


@pytest.mark.parametrize("command", [["node", "join"], ["doctor"]])
@pytest.mark.parametrize("flags, key, value", FLAGS_IN_USE)
def test_the_flags_in_use_set_their_field(command, flags, key, value):
    argv = [*command, *(["--coordinator", "http://c:1"] if key != "coordinator" else []), *flags]
    overrides = config_overrides(parse_args(argv), NodeConfig)
    config = load_node_config(None, overrides)
    assert _value(config, key) == value


def test_every_field_has_one_flag_with_its_description():
    parser = argparse.ArgumentParser()
    add_config_flags(parser, NodeConfig)
    by_dest = {action.dest: action for action in parser._actions if action.dest != "help"}
    fields = {
        **{n: f for n, f in NodeConfig.model_fields.items() if n not in SECTIONS},
        **{n: f for s in SECTIONS for n, f in NodeConfig.model_fields[s].annotation.model_fields.items()},
    }
    assert set(by_dest) == set(fields)
    for name, field in fields.items():
        action = by_dest[name]
        assert flag_of(name, field) in action.option_strings and action.default is None
        assert action.help.startswith(field.description), name


def test_flags_not_given_leave_the_file_alone(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('coordinator = "http://c:8000"\n[training]\nthreads = 4\n[debug]\nprogress = false\n')
    overrides = config_overrides(parse_args(["node", "join", "--config", str(path)]), NodeConfig)
    assert set(overrides.values()) == {None}
    config = load_node_config(path, overrides)
    assert (config.training.threads, config.debug.progress) == (4, False)


def test_the_command_line_modules_import_neither_torch_nor_hivemind():
    """`locoswarm --help` builds every parser: the node's command modules must stay light."""
    code = (
        "import sys; import node.cli.join, node.cli.doctor, node.cli.demo, node.cli.config_flags, node.config; "
        "print(sorted(m for m in ('torch', 'hivemind') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
