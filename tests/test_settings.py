"""The one settings declaration (shoal/config.py): every field is set by its SHOAL_* variable and by
its flag in every subcommand that takes it, defaults < environment < flags; bad values name their
source; the docs table and `--help` are generated from it; a child process resolves the same settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.cli import _settings, build_parser, main
from shoal.config import Settings, declared, environ_of
from shoal.errors import ConfigError
from shoal.settings_spec import Declared, markdown_table, parse, text_of, with_table

POSITIONALS = {"encode": ["some/model"], "score": ["some/model", "a query"], "extract": ["some/model"]}
PARSER = build_parser()
DOCS = Path(__file__).resolve().parents[1] / "docs" / "operations.md"


def value_of(settings: Settings, d: Declared):
    return getattr(getattr(settings, d.section), d.name) if d.section else getattr(settings, d.name)


def samples(d: Declared) -> tuple[object, object]:
    """Two values of `d`, both other than its default and other than each other."""
    if d.kind is bool:
        return (not d.default,) * 2
    if d.many:
        items = {
            str: [("x", "y"), ("z",)],
            Path: [(Path("/a"), Path("/b")), (Path("/c"),)],
            tuple: [(("n", "m"),), (("p", "q"), ("r", "s"))],
        }[d.kind]
        return items[0], items[1]
    if d.kind is int:
        return (d.default or 0) + 1, (d.default or 0) + 2
    if d.kind is float:
        return (d.default or 0.0) + 1.5, (d.default or 0.0) + 2.5
    if d.spec.sep:  # a str whose flag repeats: given as two flags below
        return "cuda:1", "cuda:0,cuda:1"
    return {str: ("one-text", "other-text"), Path: (Path("/one"), Path("/other"))}[d.kind]


def flag_args(d: Declared, value: object, spelling: str | None = None) -> list[str]:
    flag = spelling or d.flags[0]
    if d.kind is bool:
        return [flag if value else d.negation]
    items = [text_of(d, (item,)) for item in value] if d.many else text_of(d, value).split(d.spec.sep or "\0")
    return [token for item in items for token in (flag, item)]


def resolve(command: str, args: list[str], environ: dict[str, str]) -> Settings:
    return _settings(PARSER.parse_args([command, *POSITIONALS.get(command, []), *args]), environ)


FLAGGED = [d for d in declared() if not d.spec.secret]


@pytest.mark.parametrize("d", FLAGGED, ids=lambda d: d.path)
def test_each_setting_is_set_by_its_variable_and_its_flag_and_the_flag_wins(d):
    env_value, flag_value = samples(d)
    assert d.commands, f"{d.path} is taken by no command"
    for command in d.commands:
        assert value_of(resolve(command, [], {}), d) == d.default
        assert value_of(resolve(command, [], {d.env: text_of(d, env_value)}), d) == env_value
        assert value_of(resolve(command, flag_args(d, flag_value), {}), d) == flag_value
        # Both: the flag wins (a bool's variable says the opposite of its flag); a merged list (card
        # directories, aliases) takes the flag's items after the variable's.
        env_text = text_of(d, (not flag_value) if d.kind is bool else env_value)
        both = env_value + flag_value if d.spec.merge else flag_value
        assert value_of(resolve(command, flag_args(d, flag_value), {d.env: env_text}), d) == both, command


@pytest.mark.parametrize("d", FLAGGED, ids=lambda d: d.path)
def test_a_flag_is_refused_by_the_commands_that_do_not_take_it(d, capsys):
    for command in {"serve", "gateway", "worker", "dev-cluster", "models", "encode"} - set(d.commands):
        own = {"dev-cluster": {"--stop-timeout-s"}}.get(command, set())
        if own & set(d.flags):
            continue  # that command has a flag of its own by this name
        with pytest.raises(SystemExit):
            PARSER.parse_args([command, *POSITIONALS.get(command, []), *flag_args(d, samples(d)[1])])
        assert "unrecognized arguments" in capsys.readouterr().err


def test_secrets_come_from_their_variables_and_have_no_flag():
    settings = Settings.from_env({"SHOAL_AUTH_TOKENS": "t" * 16, "SHOAL_ADMIN_TOKENS": "a" * 16})
    assert (settings.server.auth_tokens, settings.server.admin_tokens) == ("t" * 16, "a" * 16)
    assert "t" * 16 not in repr(settings)
    for command in ("serve", "gateway"):
        with pytest.raises(SystemExit):
            PARSER.parse_args([command, "--auth-tokens", "t" * 16])


def test_the_older_flag_spellings_still_set_their_settings():
    settings = resolve(
        "serve",
        [
            "--lanes",
            "1",
            "--pin",
            "a/b",
            "--pin",
            "c/d",
            "--models-dir",
            "/cards",
            "--alias",
            "small=a/b",
            "--models",
            "a/b,c/*",
        ],
        {},
    )
    assert settings.engine.device_lanes == 1 and settings.engine.pinned_models == ("a/b", "c/d")
    assert settings.models_dirs == (Path("/cards"),) and settings.aliases == (("small", "a/b"),)
    assert settings.models == ("a/b", "c/*")
    worker = resolve("worker", ["--device", "cuda:0", "--device", "cuda:1", "--memory-budget-bytes", "1000"], {})
    assert (worker.engine.device, worker.engine.memory_budget_bytes) == ("cuda:0,cuda:1", 1000)


def test_every_variable_shoal_read_before_the_declaration_is_still_read():
    before = {
        "HOST",
        "PORT",
        "MAX_BODY_BYTES",
        "MAX_ITEMS_PER_REQUEST",
        "MAX_HEADER_BYTES",
        "HEADER_READ_TIMEOUT_S",
        "BODY_READ_TIMEOUT_S",
        "KEEP_ALIVE_TIMEOUT_S",
        "MAX_CONNECTIONS",
        "LISTEN_BACKLOG",
        "AUTH_TOKENS_FILE",
        "AUTH_TOKENS",
        "ADMIN_TOKENS",
        "NO_AUTH",
        "DEFAULT_MODEL",
        "DEVICE",
        "MAX_BATCH_TOKENS",
        "MAX_BATCH_ITEMS",
        "TARGET_BATCH_S",
        "MIN_BATCH_TOKENS",
        "MAX_QUEUE_ITEMS",
        "MAX_QUEUE_TOKENS",
        "REQUEST_TIMEOUT_S",
        "MAX_RESULT_BYTES",
        "MEMORY_BUDGET_BYTES",
        "DEVICE_LANES",
        "ONEDNN_LINEAR",
        "MODELS_DIRS",
        "MODELS",
        "ALIASES",
        "NATS_URL",
        "POOL",
        "ACK_WAIT_S",
        "MAX_DELIVER",
    }
    assert {f"SHOAL_{name}" for name in before} <= {d.env for d in declared()}
    assert len({d.name for d in declared()}) == len(declared())  # one variable and one flag per name


def test_hf_hub_offline_turns_downloads_off_unless_shoal_allow_download_says():
    assert Settings.from_env({}).allow_download
    assert not Settings.from_env({"HF_HUB_OFFLINE": "1"}).allow_download
    assert Settings.from_env({"HF_HUB_OFFLINE": "0"}).allow_download
    assert Settings.from_env({"HF_HUB_OFFLINE": "1", "SHOAL_ALLOW_DOWNLOAD": "yes"}).allow_download


def test_none_empty_and_lists_in_variables():
    env = {
        "SHOAL_TARGET_BATCH_S": "none",
        "SHOAL_WATCH_INTERVAL_S": "None",
        "SHOAL_DEVICE_LANES": "",
        "SHOAL_ALIASES": " a = x/y ,, b=z ",
        "SHOAL_MODELS": "x/y,,z/*",
        "SHOAL_MODELS_DIRS": "/a:/b",
    }
    settings = Settings.from_env(env)
    assert settings.engine.target_batch_s is None and settings.engine.watch_interval_s is None
    assert settings.engine.device_lanes is None  # empty: unset
    assert settings.aliases == (("a", "x/y"), ("b", "z")) and settings.models == ("x/y", "z/*")
    assert settings.models_dirs == (Path("/a"), Path("/b"))


@pytest.mark.parametrize(
    "environ, flags, message",
    [
        (
            {"SHOAL_MAX_BATCH_TOKENS": "lots"},
            {},
            "SHOAL_MAX_BATCH_TOKENS='lots': engine.max_batch_tokens takes a whole number >= 0",
        ),
        ({"SHOAL_PORT": "-1"}, {}, "SHOAL_PORT='-1': server.port takes a whole number >= 0"),
        ({"SHOAL_ACK_WAIT_S": "inf"}, {}, "SHOAL_ACK_WAIT_S='inf': cluster.ack_wait_s takes a number >= 0"),
        (
            {"SHOAL_NO_AUTH": "maybe"},
            {},
            "SHOAL_NO_AUTH='maybe': server.no_auth takes one of 1, true, yes, on, 0, false",
        ),
        ({"SHOAL_ALIASES": "a=b,c"}, {}, "SHOAL_ALIASES='a=b,c': aliases takes NAME=MODEL items separated by ','"),
        (
            {},
            {"device_lanes": "two"},
            "--device-lanes/--lanes 'two': engine.device_lanes takes a whole number >= 0, or none",
        ),
        ({"SHOAL_TARGET_BATCH_S": "0.2"}, {"target_batch_s": "nan"}, "--target-batch-s 'nan'"),
    ],
)
def test_a_value_that_does_not_parse_names_its_variable_or_flag_and_what_it_takes(environ, flags, message):
    with pytest.raises(ConfigError) as raised:
        Settings.resolve(environ, flags)
    assert message in raised.value.message


def test_the_command_line_reports_a_bad_flag_in_one_line(capsys):
    assert main(["models", "--models-dir", "/nowhere", "--allow-download", "--models", "a", "--aliases", "x"]) == 2
    assert capsys.readouterr().err.strip() == (
        "shoal: --aliases/--alias 'x': aliases takes NAME=MODEL items separated by ','"
    )


@pytest.mark.parametrize("d", declared(), ids=lambda d: d.path)
def test_text_of_a_value_parses_back_to_it(d):
    for value in (d.default, *samples(d)):
        if text_of(d, value):  # empty text is "not given"
            assert parse(d, text_of(d, value), d.env) == value


def test_a_child_given_the_environ_of_settings_resolves_the_same_settings():
    flags = [token for d in FLAGGED if "dev-cluster" in d.commands for token in flag_args(d, samples(d)[1])]
    settings = resolve("dev-cluster", flags, {"SHOAL_AUTH_TOKENS": "t" * 16})
    assert settings.engine.max_batch_tokens != Settings().engine.max_batch_tokens  # the flags took
    assert Settings.from_env(environ_of(settings)) == settings
    assert Settings.from_env(environ_of(Settings())) == Settings()


def test_serve_help_shows_every_engine_and_server_setting_with_its_variable_and_default():
    [serve] = [p for name, p in PARSER._subparsers._group_actions[0].choices.items() if name == "serve"]
    text = " ".join(serve.format_help().split())
    for d in declared():
        if d.section in ("engine", "server") and not d.spec.secret:
            assert f"{d.flags[0]} " in text and f"[{d.env}; default {text_of(d, d.default) or 'none'}]" in text, d.path


def test_the_docs_table_is_the_generated_one():
    doc = DOCS.read_text()
    assert with_table(doc, markdown_table(declared())) == doc, "run: python -m shoal.settings_spec docs/operations.md"


def test_values_read_as_before_the_declaration_and_as_huggingface_hub_reads_its_switch():
    assert Settings.from_env({"SHOAL_TARGET_BATCH_S": "off"}).engine.target_batch_s is None
    for text in ("no", "off", "False", ""):
        assert Settings.from_env({"HF_HUB_OFFLINE": text}).allow_download, text
    for text in ("1", "ON", "yes", "true"):
        assert not Settings.from_env({"HF_HUB_OFFLINE": text}).allow_download, text
