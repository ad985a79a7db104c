"""Worker flags and their environment twins reach the engine's keyword arguments; bad values are
one clear line."""

import socket

import pytest

from pagedserve.kernels.ops import BACKENDS
from pagedserve.runtime.env import cache_dir
from pagedserve.worker.serve.settings import worker_parser, worker_settings
from pagedserve.worker.setup.engine_config import SERVED_STEP_MS, EngineConfig
from pagedserve.worker.setup.engine_flags import declared_flags, engine_argv


def test_the_attention_backend_flag_offers_what_the_kernels_offer():
    [choices] = [a.choices for a in worker_parser({})._actions if a.dest == "attention_backend"]
    assert tuple(choices) == BACKENDS


def test_the_engine_flags_default_to_the_config_and_follow_their_environment_variables():
    """Declared once on EngineConfig: with no flags the engine gets EngineConfig's own defaults, but
    where a server's differs from the library's (the step target: on for a server, off for LLM);
    each flag's PAGEDSERVE_ variable sets it."""
    defaults = EngineConfig(model="m")
    engine = worker_settings([], {}).engine
    served = {"max_step_ms": SERVED_STEP_MS}
    assert defaults.max_step_ms is None and SERVED_STEP_MS == 300
    assert engine and all(engine[name] == served.get(name, getattr(defaults, name)) for name in engine)
    assert worker_settings(["--max-step-ms", "0"], {}).engine["max_step_ms"] == 0  # off
    assert engine_argv(worker_parser({}).parse_args(["--max-step-ms", "0"])) == ["--max-step-ms", "0.0"]
    assert set(engine) == {name for name, _, _ in declared_flags()}
    env = worker_settings([], {"PAGEDSERVE_MAX_NUM_SEQS": "7", "PAGEDSERVE_ENFORCE_EAGER": "yes",
                               "PAGEDSERVE_SWAP_SPACE": "2", "PAGEDSERVE_ENABLE_PREFIX_CACHING": "0"}).engine
    assert (env["max_num_seqs"], env["enforce_eager"], env["swap_space"], env["enable_prefix_caching"]) == (7, True, 2 << 30, False)
    helps = {a.dest: a.help for a in worker_parser({})._actions}
    assert helps["max_num_seqs"] == "sequences in one running batch at most (default: %(default)s; env PAGEDSERVE_MAX_NUM_SEQS)"


def test_the_attention_backend_comes_from_the_flag_or_the_environment():
    assert worker_settings([], {}).engine["attention_backend"] == "auto"
    assert worker_settings(["--attention-backend", "torch"], {}).engine["attention_backend"] == "torch"
    assert worker_settings([], {"PAGEDSERVE_ATTENTION_BACKEND": "native"}).engine["attention_backend"] == "native"


def test_an_unknown_attention_backend_is_refused(capsys):
    with pytest.raises(SystemExit):
        worker_settings(["--attention-backend", "cuda"], {})
    assert "invalid choice: 'cuda'" in capsys.readouterr().err


def test_the_cache_directory_follows_the_environment(tmp_path):
    assert cache_dir({"PAGEDSERVE_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "pagedserve"


def test_engine_flags_pass_on_to_a_worker_unchanged():
    """``serve`` starts workers with ``engine_argv`` of its own flags: they must parse back to the
    same engine settings."""
    given = ["--dtype", "float32", "--max-model-len", "512", "--no-enable-prefix-caching", "--enforce-eager",
             "--swap-space", "0.5", "--block-size", "8", "--attention-backend", "torch", "--enable-lora",
             "--lora-modules", "sql=/a/sql", "chat=/b/chat", "--max-loras", "2"]
    args = worker_parser({}).parse_args(given)
    again = worker_parser({}).parse_args(engine_argv(args))
    assert worker_settings(engine_argv(args), {}).engine == worker_settings(given, {}).engine
    assert again.enable_prefix_caching is False and worker_settings(given, {}).engine["swap_space"] == 1 << 29
    assert engine_argv(worker_parser({}).parse_args([])) == []
    assert worker_settings(given, {}).engine["lora_modules"] == ("sql=/a/sql", "chat=/b/chat")


def test_lora_modules_come_as_several_values_or_a_spaced_environment_variable():
    assert worker_settings([], {}).engine["lora_modules"] == ()
    env = {"PAGEDSERVE_LORA_MODULES": "sql=/a/sql chat=/b/chat", "PAGEDSERVE_ENABLE_LORA": "1"}
    assert worker_settings([], env).engine["lora_modules"] == ("sql=/a/sql", "chat=/b/chat")
    with pytest.raises(ValueError, match="NAME=PATH"):
        EngineConfig(model="m", enable_lora=True, lora_modules=["sql"])
    with pytest.raises(ValueError, match="needs enable_lora"):
        EngineConfig(model="m", lora_modules=["sql=/a"])


def test_serve_takes_the_model_positionally_and_shows_defaults_and_variables(capsys):
    from pagedserve.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "some/model", "--max-model-len", "1024", "--port", "9000"])
    assert (args.model, args.max_model_len, args.port) == ("some/model", 1024, 9000)
    assert parser.parse_args(["up", "--model", "m"]).model_option == "m"  # the old spelling still works
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--max-model-len", "--dtype", "--port", "--served-model-name", "--enable-prefix-caching", "--swap-space"):
        assert flag in text
    assert "env PAGEDSERVE_MAX_MODEL_LEN" in text and "(default: 8000; env PAGEDSERVE_PORT)" in text
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--port", "70000"])


WORKER_FLAGS = [  # flag, its default, a value as typed, that value parsed (the worker's own flags, not the engine's)
    ("--model", None, "m1", "m1"),
    ("--redis-url", "redis://127.0.0.1:6379/0", "redis://h:7/1", "redis://h:7/1"),
    ("--served-model-name", None, "s1", "s1"),
    ("--consumer", socket.gethostname(), "w9", "w9"),
    ("--max-inflight", None, "5", 5),
    ("--read-ahead", 16, "3", 3),
    ("--claim-idle-ms", 30_000, "40000", 40_000),
    ("--heartbeat", 1.0, "0.5", 0.5),
    ("--max-deliveries", 3, "4", 4),
    ("--drain-timeout", 30.0, "2.5", 2.5),
    ("--key-prefix", "pagedserve", "k1", "k1"),
    ("--metrics-port", 0, "9100", 9100),
    ("--metrics-host", "127.0.0.1", "0.0.0.0", "0.0.0.0"),
    ("--log-stats-interval", 10.0, "0", 0.0),
]
POSITIVE = ["--max-inflight", "--read-ahead", "--claim-idle-ms", "--heartbeat", "--max-deliveries", "--drain-timeout"]


@pytest.mark.parametrize("flag,default,typed,parsed", WORKER_FLAGS)
def test_each_worker_flag_has_its_default_its_type_and_its_environment_twin(flag, default, typed, parsed, capsys):
    dest = flag[2:].replace("-", "_")
    parser = worker_parser({})
    assert getattr(parser.parse_args([]), dest) == default
    assert getattr(parser.parse_args([flag, typed]), dest) == parsed
    variable = "REDIS_URL" if dest == "redis_url" else f"PAGEDSERVE_{dest.upper()}"  # REDIS_URL as every Redis tool reads it
    assert getattr(worker_parser({variable: typed}).parse_args([]), dest) == parsed
    help_text = next(a.help for a in parser._actions if a.dest == dest)
    assert help_text.endswith(f"env {variable})") and len(help_text) > 30
    if flag in POSITIVE:
        with pytest.raises(SystemExit):
            parser.parse_args([flag, "0"])
        assert "> 0" in capsys.readouterr().err
    if flag == "--log-stats-interval":
        with pytest.raises(SystemExit):
            parser.parse_args([flag, "-1"])


def test_the_settings_are_what_the_flags_say():
    settings = worker_settings(["--model", "m1", "--consumer", "w9", "--read-ahead", "3", "--claim-idle-ms", "40000",
                                "--heartbeat", "0.5", "--max-deliveries", "4", "--drain-timeout", "2.5",
                                "--key-prefix", "k1", "--metrics-port", "9100", "--metrics-host", "0.0.0.0",
                                "--log-stats-interval", "0", "--redis-url", "redis://h:7/1", "--max-num-seqs", "6"], {})
    assert (settings.model, settings.redis_url, settings.served_model_name, settings.consumer, settings.max_inflight,
            settings.read_ahead, settings.claim_idle_ms, settings.heartbeat_s, settings.max_deliveries,
            settings.drain_timeout_s, settings.key_prefix, settings.metrics_port, settings.metrics_host,
            settings.log_stats_interval_s, settings.liveness_s) == (
        "m1", "redis://h:7/1", "m1", "w9", 6, 3, 40_000, 0.5, 4, 2.5, "k1", 9100, "0.0.0.0", 0.0, 1.5)
    assert worker_settings(["--max-inflight", "2", "--served-model-name", "s1"], {}).max_inflight == 2
    assert worker_settings(["--served-model-name", "s1"], {}).served_model_name == "s1"
    assert worker_parser({}).prog == "pagedserve worker"
    with pytest.raises(SystemExit) as refused:
        worker_settings(["--heartbeat", "2", "--claim-idle-ms", "2000"], {})
    assert str(refused.value) == "pagedserve: --heartbeat must be shorter than --claim-idle-ms, or live work gets reclaimed"
    assert worker_settings(["--heartbeat", "1.999", "--claim-idle-ms", "2000"], {}).heartbeat_s == 1.999  # 1,999 ms < 2,000


def test_without_a_mapping_the_process_environment_is_read(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_READ_AHEAD", "5")
    assert worker_parser().parse_args([]).read_ahead == 5
    assert worker_settings([]).read_ahead == 5
