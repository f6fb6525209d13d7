"""The deploy files and the configuration front-ends agree with the code they drive.

Docker and systemd are not run here (no engine, no init): every command line in deploy/compose.yaml,
the systemd units, the Dockerfile and the README's shell blocks is parsed by the real `locoswarm`
argparse parser; the sample configs load with their real loaders and name every field; bad node
config keys and values are refused with the key's name; `locoswarm doctor` runs for real (its
libp2p check starts and stops a p2pd daemon on 127.0.0.1).
"""

from __future__ import annotations

import configparser
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from pydantic import BaseModel

from locoswarm.cli import main, parse_args
from node.config import SECTIONS, NodeConfig, format_node_config, load_node_config
from protocol.config_file import ConfigError
from protocol.run_config import FixedDeadline, RunConfig, load_run_config
from tests.fixtures.coordinator import json_server

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def parses(argv: list[str]):
    """The namespace `locoswarm ARGV` parses to; a refusal fails the test with the command line."""
    try:
        args = parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"`locoswarm {shlex.join(argv)}` is refused by the CLI parser (exit {e.code})")
    assert hasattr(args, "func"), f"`locoswarm {shlex.join(argv)}` names no command"
    return args


# -- compose ---------------------------------------------------------------------------------------


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def locoswarm_services(spec: dict) -> dict:
    """The services that run our image (the others: the database and the balancer)."""
    return {name: s for name, s in spec["services"].items() if s.get("image") == "locoswarm:latest"}


def test_compose_commands_parse_with_the_real_cli():
    services = locoswarm_services(compose())
    nodes = {name: s for name, s in services.items() if s["command"][:2] == ["node", "join"]}
    assert len(nodes) >= 2, "the compose file brings up several nodes"
    for name, service in services.items():
        assert isinstance(service["command"], list), f"{name}: use the exec (list) form"
        parses(service["command"])
    keys = set()
    for name, service in nodes.items():
        args = parses(service["command"])
        assert args.coordinator == "http://coordinator:8000", f"{name}: nodes talk to the balancer"
        assert any(v.endswith(":/keys") for v in service["volumes"]), f"{name}: keys on a volume"
        assert args.key_path.startswith("/keys/"), name
        keys.add(args.key_path)
    assert len(keys) == len(nodes), "every node has its own key file"


def test_compose_runs_coordinator_replicas_on_postgres_behind_a_balancer():
    spec = compose()
    services = spec["services"]
    replicas = {n: s for n, s in locoswarm_services(spec).items() if s["command"][:2] == ["coordinator", "serve"]}
    assert len(replicas) >= 2, "at least two coordinator replicas"
    serves = [parses(s["command"]) for s in replicas.values()]
    assert len({a.db for a in serves}) == 1, "every replica serves the same database"
    database = urlsplit(serves[0].db)
    assert database.scheme == "postgresql" and database.hostname in services, "the replicas share PostgreSQL"
    assert database.password is None, "the password comes from PGPASSWORD, not the command line"
    assert services[database.hostname]["image"].startswith("postgres:")
    assert any(v.endswith(":/var/lib/postgresql/data") for v in services[database.hostname]["volumes"])
    for name, service in replicas.items():
        assert {"LOCOSWARM_ADMIN_TOKEN", "PGPASSWORD"} <= set(service["environment"]), name
        assert database.hostname in service["depends_on"], name
        assert "/readyz" in " ".join(service["healthcheck"]["test"]), f"{name}: healthy means its database works"
    assert all(a.host == "0.0.0.0" and a.port == 8000 for a in serves)
    # The balancer is `coordinator`, the name the nodes use; its upstream lists every replica.
    balancer = services["coordinator"]
    assert balancer["image"].startswith("nginx:") and set(balancer["depends_on"]) == set(replicas)
    config_file = next(v.split(":")[0] for v in balancer["volumes"] if v.endswith("default.conf:ro"))
    upstream = re.findall(r"^\s*server\s+([\w.-]+:[0-9]+)", (DEPLOY / config_file).read_text(), re.M)
    assert sorted(upstream) == sorted(f"{name}:8000" for name in replicas)
    assert re.search(r"listen\s+8000;", (DEPLOY / config_file).read_text())
    # The database is on a network of its own, which the nodes (strangers' code) are not on.
    db_network = set(services[database.hostname]["networks"])
    for name, service in locoswarm_services(spec).items():
        if name not in replicas:
            assert not db_network & set(service.get("networks", [])), f"{name} can reach the database"


def test_compose_references_are_declared():
    spec = compose()
    declared = set(spec.get("volumes", {}))
    for name, service in spec["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in declared, f"{name}: volume {source} is not declared"
            else:
                assert (DEPLOY / source).exists(), f"{name}: {source} does not exist beside compose.yaml"
        for network in service.get("networks", []):
            assert network in spec["networks"], f"{name}: network {network} is not declared"
        for dependency in service.get("depends_on", {}):
            assert dependency in spec["services"], f"{name}: depends on unknown {dependency}"
        build = service.get("build")
        if build:
            assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    run = spec["services"]["create-run"]
    assert parses(run["command"]).config == "/etc/locoswarm/run.toml"


# -- systemd ---------------------------------------------------------------------------------------


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, comment_prefixes=("#", ";"))
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string((DEPLOY / name).read_text())
    return parser


@pytest.mark.parametrize(
    "name, command",
    [("locoswarm-coordinator.service", ["coordinator", "serve"]), ("locoswarm-node.service", ["node", "join"])],
)
def test_systemd_exec_start_parses_with_the_real_cli(name, command):
    parsed = unit(name)
    assert {"Unit", "Service", "Install"} <= set(parsed.sections())
    argv = shlex.split(parsed["Service"]["ExecStart"])
    assert argv[0].startswith("/") and argv[0].endswith("/locoswarm"), "ExecStart needs an absolute path"
    assert argv[1:3] == command
    args = parses(argv[1:])
    if command == ["node", "join"]:
        assert args.config and args.key_path
    else:
        assert args.db.startswith(("sqlite:///", "postgresql://")) and args.admin_token_file


# -- Dockerfile ------------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_dockerfile_entrypoint_and_cmd_are_real_commands():
    instructions = dockerfile_instructions()
    by_name = {}
    for name, value in instructions:
        by_name.setdefault(name, []).append(value)
    assert by_name["FROM"] == ["python:3.11-slim"]
    assert 'TORCH_SPEC="torch==2.13.0"' in by_name["ARG"]
    assert json.loads(by_name["ENTRYPOINT"][-1]) == ["locoswarm"]
    parses(json.loads(by_name["CMD"][-1]))
    assert any("$TORCH_SPEC" in run for run in by_name["RUN"]), "torch is installed from TORCH_SPEC"
    for copy in by_name["COPY"]:
        for source in copy.split()[:-1]:
            assert (REPO / source).exists(), f"COPY {source}: no such path in the repository"
    copied = {c.split()[0] for c in by_name["COPY"]}
    assert {"kernels", "protocol", "node", "coordinator", "pyproject.toml"} <= copied


# -- README ----------------------------------------------------------------------------------------


def readme_commands() -> list[list[str]]:
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for segment in line.split(" #")[0].split("&&"):
                segment = segment.strip()
                for prefix in (".venv/bin/locoswarm ", "locoswarm "):
                    if segment.startswith(prefix):
                        commands.append(shlex.split(segment[len(prefix) :]))
    return commands


def test_readme_commands_parse_with_the_real_cli():
    commands = readme_commands()
    assert len(commands) >= 5
    for argv in commands:
        parses(argv)


def test_network_lab_commands_in_the_docs_parse():
    """Every `python -m tools.netlab ...` line in README.md and tools/netlab/README.md parses with the lab's parser."""
    from tools.netlab.lab import build_parser

    found = 0
    for doc in ("README.md", "tools/netlab/README.md"):
        text = (REPO / doc).read_text().replace("\\\n", " ")
        for line in text.splitlines():
            command = line.split(" #")[0].strip()
            marker = "-m tools.netlab "
            if marker in command and command.lstrip("`").startswith(("sudo ", ".venv/", "python")):
                build_parser().parse_args(shlex.split(command.split(marker, 1)[1]))
                found += 1
    assert found >= 4


# -- run.toml --------------------------------------------------------------------------------------


def sample_sections(text: str) -> dict[str, set[str]]:
    """The keys run.toml mentions in each section, commented-out ones included ("" is the top level)."""
    sections: dict[str, set[str]] = {"": set()}
    current = ""
    for line in text.splitlines():
        if header := re.match(r"^\[(\w+)\]$", line):
            current = header[1]
            sections[current] = set()
        elif key := re.match(r"^(?:# )?(\w+) =", line):
            sections[current].add(key[1])
    return sections


def test_sample_run_config_loads_and_names_every_field():
    config = load_run_config(DEPLOY / "run.toml")
    assert config.outer.strategy == "sparseloco"
    sections = sample_sections((DEPLOY / "run.toml").read_text())
    for name, field in RunConfig.model_fields.items():
        if name == "deadline":
            assert set(FixedDeadline.model_fields) <= sections.get(name, set()), "run.toml: [deadline]"
        elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            missing = set(field.annotation.model_fields) - sections.get(name, set())
            assert not missing, f"run.toml: [{name}] does not mention {sorted(missing)}"
        else:
            assert name in sections[""], f"run.toml does not mention {name} at the top level"


def test_run_config_names_a_bad_key(tmp_path):
    text = (DEPLOY / "run.toml").read_text().replace("\nsteps = 15\n", "\nsteps = 0\n")
    (tmp_path / "run.toml").write_text(text)
    with pytest.raises(ConfigError, match=r"inner\.steps: Input should be greater than or equal to 1"):
        load_run_config(tmp_path / "run.toml")


# -- node.toml and node/config.py -------------------------------------------------------------


def test_sample_node_config_loads_and_names_every_field(caplog):
    config = load_node_config(DEPLOY / "node.toml")
    assert not caplog.records, "the sample uses the sections: no key is read from an old place"
    assert config.coordinator == "http://127.0.0.1:8000" and config.training.device in ("cpu", "cuda")
    assert config.key_path == Path.home() / ".locoswarm" / "peer.key"
    text = (DEPLOY / "node.toml").read_text()
    tables = re.split(r"^\[(\w+)\]$", text, flags=re.M)  # top level, then name, body, name, body...
    bodies = {None: tables[0], **dict(zip(tables[1::2], tables[2::2]))}
    assert list(bodies)[1:] == list(SECTIONS), "the tables, in the model's order"
    for section, body in bodies.items():
        model = NodeConfig if section is None else NodeConfig.model_fields[section].annotation
        for name in model.model_fields:
            if name not in SECTIONS:
                assert re.search(rf"^(# )?{name} =", body, re.M), f"node.toml's [{section}] does not mention {name}"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "line, key",
    [
        ("[network]\nfetch_timeout = 3.0", "network.fetch_timeout"),  # unknown key (the field is fetch_timeout_s)
        ("fetch_timeout = 3.0", "fetch_timeout"),
        ("[training]\nthreads = -1", "training.threads"),  # out of range
        ("threads = -1", "training.threads"),  # a key from before the sections, in its new place
        ("[network]\nfetch_timeout_s = 0.0", "network.fetch_timeout_s"),
        ("[training]\nmax_rounds = 0", "training.max_rounds"),
        ('[training]\ndevice = "gpu"', "training.device"),
        ('[network]\nclient_mode = "yes"', "network.client_mode"),  # wrong type
        ("[training]\nthreads = 2.5", "training.threads"),
        ("[network]\nhost_maddrs = []", "network.host_maddrs"),
        ('[network]\ninitial_peers = "/ip4/1.2.3.4/tcp/1"', "network.initial_peers"),
        ('join_token = "short"', "join_token"),
        ('[memory]\nstate_placement = "disk"', "memory.state_placement"),
        ("training = 3", "training"),
    ],
)
def test_bad_node_config_is_refused_naming_the_key(tmp_path, line, key):
    path = write(tmp_path, f'coordinator = "http://c:8000"\n{line}\n')
    with pytest.raises(ConfigError, match=rf"node.toml: {key}: "):
        load_node_config(path)


def test_node_config_needs_a_coordinator_and_a_url(tmp_path):
    with pytest.raises(ConfigError, match="coordinator: required"):
        load_node_config(write(tmp_path, "threads = 1\n"))
    with pytest.raises(ConfigError, match="coordinator: must be an http"):
        load_node_config(write(tmp_path, 'coordinator = "c:8000"\n'))
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_node_config(write(tmp_path, "coordinator = \n"))


def test_flags_override_the_file_and_are_checked_too(tmp_path):
    path = write(
        tmp_path,
        'coordinator = "http://c:8000"\nkey_path = "~/k.key"\n[training]\nthreads = 4\n'
        'device = "cpu"\n[network]\nclient_mode = true\n',
    )
    config = load_node_config(path, {"training.threads": 1, "network.client_mode": False, "training.max_rounds": None})
    assert (config.training.threads, config.network.client_mode, config.training.max_rounds) == (1, False, None)
    assert config.key_path == Path.home() / "k.key" and config.coordinator == "http://c:8000"
    with pytest.raises(ConfigError, match="network.fetch_timeout_s"):
        load_node_config(path, {"network.fetch_timeout_s": -1.0})
    printed = json.loads(
        format_node_config(load_node_config(path, {"join_token": "secret-token"})).removeprefix("node config: ")
    )
    assert printed["join_token"] == "<hidden>" and printed["training"]["threads"] == 4


def test_node_join_flags_reach_the_config(tmp_path):
    from node.cli.config_flags import config_overrides

    path = write(tmp_path, 'coordinator = "http://c:8000"\n[debug]\nprogress = true\n')
    args = parses(
        [
            "node",
            "join",
            "--config",
            str(path),
            "--no-progress",
            "--fetch-timeout",
            "5",
            "--auto-relay",
            "--run",
            "r1",
            "--key",
            str(tmp_path / "k"),
            "--state-placement",
            "device",
        ]
    )
    config = load_node_config(path, config_overrides(args, NodeConfig))
    assert (
        config.debug.progress,
        config.network.fetch_timeout_s,
        config.network.use_auto_relay,
        config.run_id,
        config.memory.state_placement,
    ) == (False, 5.0, True, "r1", "device")


def test_node_join_with_a_bad_config_exits_2_naming_the_key(tmp_path, capsys):
    path = write(tmp_path, 'coordinator = "http://c:8000"\nthreds = 2\n')
    assert main(["node", "join", "--config", str(path)]) == 2
    assert "threds: unknown key" in capsys.readouterr().err


# -- doctor ----------------------------------------------------------------------------------------


def test_doctor_runs_and_prints_its_checks(tmp_path):
    closed_port = _free_port()  # nothing listens there: the coordinator check must FAIL
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "locoswarm",
            "doctor",
            "--coordinator",
            f"http://127.0.0.1:{closed_port}",
            "--key",
            str(tmp_path / "keys" / "peer.key"),
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    lines = result.stdout.splitlines()
    status = {line.split()[1]: line.split()[0] for line in lines if line.split()[0] in ("OK", "WARN", "FAIL")}
    assert set(status) == {
        "python",
        "torch",
        "device",
        "libp2p",
        "coordinator",
        "clock",
        "reachability",
        "disk",
        "key",
    }, result.stdout + result.stderr
    assert status["libp2p"] == "OK" and status["python"] == "OK" and status["key"] == "OK"
    assert status["coordinator"] == "FAIL" and status["clock"] == "WARN" and result.returncode == 1
    assert "->" in next(line for line in lines if " coordinator " in line), "a FAIL says what to fix"
    assert not (tmp_path / "keys").exists(), "the doctor creates nothing"


def test_doctor_coordinator_check_reads_healthz_and_runs():
    from node.cli.doctor import OK, WARN, check_coordinator

    runs = {"runs": []}
    answer = lambda path: (
        (200, {"status": "ok"} if path == "/healthz" else runs) if path in ("/healthz", "/v1/runs") else (404, {})
    )
    with json_server(answer) as url:
        assert check_coordinator(url).status == WARN  # healthy, but no open run
        runs["runs"] = [{"run_id": "r1", "name": "demo", "state": "running"}]
        checked = check_coordinator(url)
        assert checked.status == OK and "r1 (demo)" in checked.detail


def test_doctor_reachability():
    from node.cli.doctor import OK, WARN, check_reachability

    loopback = load_node_config(None, {"coordinator": "http://c:1", "training.device": "cpu"})
    assert check_reachability(loopback.network).status == WARN
    public = load_node_config(
        None,
        {"coordinator": "http://c:1", "training.device": "cpu", "network.announce_maddrs": ("/ip4/8.8.8.8/tcp/31337",)},
    )
    assert check_reachability(public.network).status == OK
    client = load_node_config(
        None, {"coordinator": "http://c:1", "training.device": "cpu", "network.client_mode": True}
    )
    assert check_reachability(client.network).status == OK


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
