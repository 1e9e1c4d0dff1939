"""common.config: one tree, YAML < environment < -o overrides, and errors that name the field."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from common.config import ConfigError, check_model_path, load_config, mask_url, write_resolved


def test_defaults_are_the_cpu_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(env={})
    assert (cfg.run.name, cfg.run.actors, cfg.learner.loss_type, cfg.learner.beta) == ("default", 2, "dapo", 0.0)
    assert (cfg.learner.epsilon_low, cfg.learner.epsilon_high) == (0.2, 0.28)
    assert cfg.run.dir == str(tmp_path / "runs" / "default")
    assert cfg.weights.dir == str(tmp_path / "runs" / "default" / "weights")
    assert cfg.actor.max_stream_groups == 2 * cfg.learner.batch_groups


def test_yaml_then_env_then_overrides(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("run:\n  name: yaml\n  steps: 7\nlearner:\n  lr: 0.5\n  betas: [0.8, 0.9]\n")
    env = {"GRPO_RUN_NAME": "env", "GRPO_REDIS_URL": "redis://127.0.0.1:1/0", "GRPO_REDIS_PASSWORD": "s3cret"}
    cfg = load_config(f, ["learner.lr=1e-3", "actor.filter_zero_std=false", "run.dir=" + str(tmp_path / "r")], env)
    assert cfg.run.name == "env" and cfg.run.steps == 7
    assert cfg.learner.lr == 1e-3 and cfg.learner.betas == (0.8, 0.9)
    assert cfg.actor.filter_zero_std is False
    assert cfg.redis.url == "redis://127.0.0.1:1/0" and cfg.redis.password.get_secret_value() == "s3cret"


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("learner.lr=-1", "learner.lr"),
        ("learner.lrr=1", "learner.lrr"),
        ("sampling.group_size=1", "sampling.group_size"),
        ("learner.loss_type=ppo", "learner.loss_type"),
        ("sampling.top_p=0.9", "sampling"),
        ("run.name=has space", "run.name"),
        ("grader.name=nope", "grader.name"),
        ("actor.max_stream_groups=-1", "actor.max_stream_groups"),
        ("run.steps=many", "run.steps"),
        ("learner.lr.x=1", "learner.lr"),
        ("nonsense", "override"),
    ],
)
def test_invalid_values_name_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override], env={})
    message = str(e.value)
    assert field in message and message.startswith("config error")
    assert "Traceback" not in message


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent.yaml", env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, env={})
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad, env={})


def test_resolved_config_has_no_secrets(tmp_path: Path) -> None:
    cfg = load_config(overrides=["redis.url=redis://user:hunter2@10.0.0.1:6380/1", "redis.password=hunter2"], env={})
    write_resolved(cfg, tmp_path / "config.json")
    text = (tmp_path / "config.json").read_text()
    assert "hunter2" not in text
    tree = json.loads(text)
    assert tree["redis"]["url"] == "redis://user:***@10.0.0.1:6380/1" and tree["redis"]["password"] is None
    assert tree["learner"]["lr"] == cfg.learner.lr
    assert mask_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_model_path_checks(tmp_path: Path) -> None:
    check_model_path("Qwen/Qwen2.5-0.5B")  # a hub name passes through
    (tmp_path / "m").mkdir()
    with pytest.raises(ConfigError, match=r"no config\.json"):
        check_model_path(str(tmp_path / "m"))
    with pytest.raises(ConfigError, match="no such directory"):
        check_model_path(str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="empty"):
        check_model_path("")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["learner", "-o", "learner.lr=-1"], "learner.lr"),
        (["actor", "-o", "redis.url=redis://127.0.0.1:1/0", "-o", "model.path=/nonexistent/model"], "model.path"),
        (
            ["actor", "-o", "redis.url=redis://127.0.0.1:1/0", "-o", "redis.retries=0", "-o", "model.path=MODEL"],
            "unreachable",
        ),
        (["run", "--config", "/nonexistent.yaml"], "no such file"),
        (["nonsense"], "unknown command"),
    ],
)
def test_cli_user_mistakes_are_one_line_and_exit_2(args: list[str], needle: str, tmp_path: Path) -> None:
    # MODEL: a directory that passes the model path's checks, so that the next check (Redis) is the one that fails.
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    args = [a.replace("=MODEL", f"={tmp_path / 'model'}") for a in args]
    r = subprocess.run(
        [sys.executable, "-m", "common.cli", *args, *(["-o", f"run.dir={tmp_path}"] if args[0] != "nonsense" else [])],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip() and " WARNING " not in line]
    assert len(lines) == 1 and needle in lines[0], r.stderr


def test_every_option_is_documented_and_the_reference_is_current() -> None:
    from common.config import Config, reference_markdown

    def fields(model):  # type: ignore[no-untyped-def]
        for name, f in model.model_fields.items():
            sub = f.annotation
            if isinstance(sub, type) and hasattr(sub, "model_fields"):
                yield from fields(sub)
            else:
                yield name, f

    undocumented = [name for name, f in fields(Config) if not f.description]
    assert undocumented == []
    doc = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
    assert doc.read_text() == reference_markdown() + "\n", "run: python -m common.config > docs/configuration.md"


def test_text_overrides_are_taken_as_written() -> None:
    """YAML would read a template as a mapping ({question: ...}) or cut it at ' #': text keys keep the text."""
    cfg = load_config(
        overrides=["task.prompt_template={question:.40} #### {answer}", 'task.subset="main"', "run.name=2024"], env={}
    )
    assert cfg.task.prompt_template == "{question:.40} #### {answer}"
    assert (cfg.task.subset, cfg.run.name) == ("main", "2024")
    assert load_config(overrides=["learner.betas=[0.9, 0.95]"], env={}).learner.betas == (0.9, 0.95)


def test_a_synchronous_actor_needs_rounds_that_fill_a_batch() -> None:
    with pytest.raises(ConfigError, match=r"actor\.synchronous: each round must fill a batch"):
        load_config(overrides=["actor.synchronous=true"], env={})  # 16 prompts a round, batches of 32, filtering
    ok = ["actor.synchronous=true", "actor.prompts_per_round=32", "actor.filter_zero_std=false"]
    assert load_config(overrides=ok, env={}).actor.synchronous


def _literal_fields() -> list[tuple[str, tuple[str, ...]]]:
    """Every key typed as a choice of words, with its words (run.trackers' items too)."""
    from typing import Literal, get_args, get_origin

    from common.config import Config

    found = []

    def walk(prefix: str, model: type) -> None:
        for name, f in model.model_fields.items():  # type: ignore[attr-defined]
            kind = f.annotation
            if isinstance(kind, type) and hasattr(kind, "model_fields"):
                walk(f"{prefix}{name}.", kind)
            elif get_origin(kind) is Literal:
                found.append((f"{prefix}{name}", get_args(kind)))

    walk("", Config)
    return found


# The words YAML 1.1 (PyYAML's safe_load) reads as booleans: a choice spelt with one of them was refused as written.
def _yaml11_boolean(word: str) -> bool:
    try:
        return isinstance(yaml.safe_load(word), bool)
    except yaml.YAMLError:  # "*" is no YAML scalar at all; written as -o task.operation=* it is taken as text
        return False


_YAML11_BOOLEANS = [
    (key, word) for key, words in _literal_fields() for word in words if isinstance(word, str) and _yaml11_boolean(word)
]


def test_the_documented_choices_that_yaml_1_1_reads_as_booleans_are_found() -> None:
    keys = {key for key, _ in _YAML11_BOOLEANS}
    assert {"task.chat_template", "learner.autocast"} <= keys


@pytest.mark.parametrize(("key", "word"), _YAML11_BOOLEANS)
def test_every_choice_is_accepted_as_documented_in_a_file_and_in_o(key: str, word: str, tmp_path: Path) -> None:
    section, name = key.split(".")
    f = tmp_path / "c.yaml"
    f.write_text(f"{section}:\n  {name}: {word}\n")
    from_file = load_config(f, env={})
    from_o = load_config(overrides=[f"{key}={word}"], env={})
    assert getattr(getattr(from_file, section), name) == word
    assert getattr(getattr(from_o, section), name) == word


@pytest.mark.parametrize(("word", "value"), [("yes", True), ("on", True), ("no", False), ("off", False)])
def test_boolean_keys_still_take_yes_no_on_off(word: str, value: bool, tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(f"task:\n  require_stop: {word}\n")
    assert load_config(f, env={}).task.require_stop is value
    assert load_config(overrides=[f"actor.filter_zero_std={word}"], env={}).actor.filter_zero_std is value


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("learner.lrr=1", "config error: learner.lrr: unknown key; did you mean learner.lr?"),
        ("lerner.lr=1", "config error: lerner: unknown key; did you mean learner?"),
        ("grader.components=[{nme: exact}]", "config error: grader.components.0.nme: unknown key; did you mean "
         "grader.components.0.name?"),
        ("learner.zzzzzz=1", "config error: learner.zzzzzz: unknown key; see grpo config --keys"),
    ],
)  # fmt: skip
def test_a_mistyped_key_suggests_the_nearest(override: str, line: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override], env={})
    assert line in str(e.value).splitlines()


def test_a_mistyped_key_in_a_file_suggests_the_nearest(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("learner:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"^config error: learner\.lrr: unknown key; did you mean learner\.lr\?$"):
        load_config(f, env={})


def test_config_files_merge_left_to_right(tmp_path: Path) -> None:
    base, local = tmp_path / "base.yaml", tmp_path / "local.yaml"
    base.write_text("run:\n  steps: 50\n  name: base\nlearner:\n  lr: 0.5\n  betas: [0.8, 0.9]\n")
    local.write_text("run:\n  name: local\nlearner:\n  betas: [0.7, 0.95]\n")
    cfg = load_config([base, local], ["run.steps=60"], env={})
    assert (cfg.run.name, cfg.run.steps) == ("local", 60)  # the later file wins key by key, -o over both
    assert (cfg.learner.lr, cfg.learner.betas) == (0.5, (0.7, 0.95))  # a list is replaced whole
    assert load_config([local, base], env={}).run.name == "base"
    with pytest.raises(ConfigError, match="no such file"):
        load_config([base, tmp_path / "absent.yaml"], env={})


@pytest.mark.parametrize(
    ("device", "needle"),
    [("gpu", "'gpu' is not a torch device"), ("cuda:99", "model.device: cuda:99: "), ("meta", "no meta device")],
)
def test_a_device_this_machine_lacks_is_a_config_error(device: str, needle: str) -> None:
    from common.config import check_device

    check_device("cpu")
    with pytest.raises(ConfigError, match=r"^config error: model\.device: ") as e:
        check_device(device)
    assert needle in str(e.value)


def test_a_hub_name_that_cannot_be_fetched_fails_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub is asked once, with no retries: here a closed loopback port stands in for an unreachable hub."""
    import socket
    import time

    from common.model.importing import check_hub_model

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", f"http://127.0.0.1:{closed}")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"^config error: model\.path: cannot fetch no-such-org/no-such-model from"):
        check_hub_model("no-such-org/no-such-model")
    assert time.monotonic() - started < 15
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE is set"):
        check_hub_model("no-such-org/no-such-model")


class _Hub(http.server.BaseHTTPRequestHandler):
    """A stand-in for the hub's model API on loopback: one model with a config.json, one without, none else."""

    def do_GET(self) -> None:
        files = {
            "/api/models/org/model": ["config.json", "model.safetensors"],
            "/api/models/org/weights-only": ["a.gguf"],
        }
        path = self.path.split("?")[0].removesuffix("/revision/main")
        if path not in files:
            self.send_response(401)  # as the hub answers for a missing (or private) model
            self.send_header("X-Error-Code", "RepoNotFound")
            self.end_headers()
            return
        body = json.dumps(
            {"id": path.removeprefix("/api/models/"), "siblings": [{"rfilename": f} for f in files[path]]}
        )
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: object) -> None:
        pass


def test_a_hub_name_is_checked_against_what_the_hub_has(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from common.model.importing import check_hub_model

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
        check_hub_model("org/model")
        with pytest.raises(ConfigError, match=r"^config error: model\.path: org/absent: no such model on the Hugging"):
            check_hub_model("org/absent")
        with pytest.raises(
            ConfigError, match=r"^config error: model\.path: org/weights-only on the .* no config\.json"
        ):
            check_hub_model("org/weights-only")
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("old", "new"), [("actor.group_size", "sampling.group_size"),
                                          ("actor.heartbeat_ttl_s", "run.heartbeat_ttl_s")])  # fmt: skip
def test_a_key_that_moved_names_its_new_place(old: str, new: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{old}=4"], env={})
    assert str(e.value) == f"config error: {old}: unknown key; it is {new} now"
    assert getattr(getattr(load_config(None, [f"{new}=4"], env={}), new.split(".")[0]), new.split(".")[1]) == 4
