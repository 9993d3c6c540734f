"""A `vllm serve MODEL ...` command line given to `tandem up`, `tandem scheduler` or `tandem executor`:
vLLM's flags of the same meaning are taken under vLLM's names and reach the service that serves
them, and those whose meaning tandem does not serve stop the command, naming the flag and what to
use instead (protos/vllm_flags.py); none is taken without a word."""

from __future__ import annotations

import argparse

import pytest

from client import cli, up
from client.defaults import DEFAULT_MODEL
from executor_service import cli as executor_cli
from scheduler_service import cli as scheduler_cli

CLIS = {"executor": executor_cli, "scheduler": scheduler_cli}


@pytest.fixture(autouse=True)
def no_twins(monkeypatch):
    """No TANDEM_* variable of any service reaches the parsers."""
    for module in (executor_cli, scheduler_cli, up):
        for f in module.FLAGS:
            for name in f.env_names:
                monkeypatch.delenv(name, raising=False)
    for name in ("TANDEM_MODEL", "TANDEM_REVISION", "TANDEM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TANDEM_EXECUTOR_ADDRESS", "127.0.0.1:50052")


def _up(*argv: str) -> argparse.Namespace:
    return cli.build_parser(["up", *argv]).parse_args(["up", *argv])


def _service(verb: str, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    CLIS[verb].add_parser(parser.add_subparsers())
    return parser.parse_args([verb, *argv])


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


# --- what `tandem up` passes on -----------------------------------------------------------------


def test_up_takes_the_model_where_vllm_serve_does():
    """`tandem up Qwen/Qwen3-0.6B` was "unrecognized arguments": vLLM's model is positional."""
    executor, scheduler = up.service_argv(_up(str(DEFAULT_MODEL)))
    assert _value(executor, "--model") == str(DEFAULT_MODEL)
    assert _value(scheduler, "--tokenizer") == str(DEFAULT_MODEL)
    executor, _ = up.service_argv(_up(str(DEFAULT_MODEL), "--model", str(DEFAULT_MODEL)))
    assert _value(executor, "--model") == str(DEFAULT_MODEL)


def test_up_refuses_two_different_models(capsys):
    args = _up("org/one", "--model", "org/two")
    assert up.run_up(args) == 2
    assert "the model is given twice: 'org/one' and --model 'org/two'" in capsys.readouterr().err


def test_up_passes_vllms_engine_and_frontend_flags_to_the_service_that_serves_them():
    """They were "unrecognized arguments", or needed --executor-arg=/--scheduler-arg= spelled out;
    each service's own parser takes what it is given, meaning what vLLM's flag means."""
    args = _up(
        "--max-model-len", "4096", "--gpu-memory-utilization", "0.8", "-tp", "2",
        "--kv-cache-dtype", "fp8", "--quantization", "fp8", "--block-size", "32", "--seed", "3",
        "--served-model-name", "my-model", "--revision", "v1", "--enforce-eager",
        "--max-num-batched-tokens", "4096", "--max-logprobs", "5", "--api-key", "k",
        "--allowed-origins", "https://a.example", "--tool-call-parser", "hermes",
        "--no-enable-prefix-caching",
    )  # fmt: skip
    executor, scheduler = up.service_argv(args)
    e = _service("executor", *executor[3:])
    assert (e.max_model_len, e.gpu_memory_utilization, e.tensor_parallel_size) == (4096, 0.8, 2)
    assert (e.kv_cache_dtype, e.quantization, e.block_size, e.seed) == ("fp8", "fp8", 32, 3)
    assert (e.served_model_name, e.revision, e.enforce_eager) == ("my-model", "v1", True)
    assert e.max_num_batched_tokens == 4096
    s = _service("scheduler", *scheduler[3:])
    assert (s.max_num_batched_tokens, s.max_logprobs, s.api_key) == (4096, 5, "k")
    assert (s.allowed_origins, s.tool_call_parser) == ("https://a.example", "hermes")
    assert s.enable_prefix_caching is False


def test_up_passes_nothing_it_was_not_given():
    """Not given, the services' own defaults (and TANDEM_* twins, which they inherit) apply."""
    executor, scheduler = up.service_argv(_up())
    for flag in ("--max-model-len", "--seed", "--served-model-name", "--enforce-eager", "--revision"):
        assert flag not in executor
    for flag in ("--api-key", "--max-logprobs", "--enable-prefix-caching", "--no-enable-prefix-caching"):
        assert flag not in scheduler


# --- refused, naming what to use instead --------------------------------------------------------

REFUSED = [
    (["--enable-lora"], "there are no LoRA adapters"),
    (["--speculative-config", '{"method": "ngram"}'], "there is no speculative decoding"),
    (["--pipeline-parallel-size", "2"], "use --tensor-parallel-size"),
    (["-pp", "2"], "use --tensor-parallel-size"),
    (["--data-parallel-size", "2"], "run several scheduler and executor pairs"),
    (["--download-dir", "/data"], "set HF_HUB_CACHE or HF_HOME"),
]
REFUSED_FRONTEND = [
    (["--lora-modules", "a=/x", "b=/y"], "there are no LoRA adapters"),
    (["--limit-mm-per-prompt", '{"image": 1}'], "there are no multimodal inputs"),
    (["--chat-template", "t.jinja"], "put yours there as chat_template.jinja"),
    (["--response-role", "user"], "always have the role assistant"),
    (["--generation-config", "auto"], "generation_config.json is not read"),
    (["--reasoning-parser", "deepseek_r1"], "no other parser is served"),
    (["--no-enable-chunked-prefill"], "prefills are always chunked"),
]


def _refused(parse, argv, reason, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{' '.join(argv)}: not served by tandem: " in err and reason in err


@pytest.mark.parametrize(("argv", "reason"), REFUSED + REFUSED_FRONTEND)
def test_up_refuses_vllm_flags_it_does_not_serve(argv, reason, capsys):
    _refused(_up, argv, reason, capsys)


@pytest.mark.parametrize(("argv", "reason"), REFUSED)
def test_the_executor_refuses_vllm_engine_flags_it_does_not_serve(argv, reason, capsys):
    _refused(lambda *a: _service("executor", *a), argv, reason, capsys)


@pytest.mark.parametrize(("argv", "reason"), REFUSED_FRONTEND)
def test_the_scheduler_refuses_vllm_frontend_flags_it_does_not_serve(argv, reason, capsys):
    _refused(lambda *a: _service("scheduler", *a), argv, reason, capsys)


def test_up_refuses_vllms_tls_flags_naming_the_schedulers(capsys):
    """`up` waits for its services on plaintext: TLS is the scheduler's, under vLLM's names too."""
    _refused(_up, ["--ssl-certfile", "c.pem"], "run tandem scheduler with --ssl-certfile", capsys)


# --- accepted: what tandem does anyway, or nothing a request can see ----------------------------

ACCEPTED = [
    ["--pipeline-parallel-size", "1"],
    ["-dp", "1"],
    ["--trust-remote-code"],
    ["--swap-space", "4"],
]
ACCEPTED_FRONTEND = [
    ["--response-role", "assistant"],
    ["--generation-config", "vllm"],
    ["--reasoning-parser", "qwen3"],
    ["--enable-auto-tool-choice"],
    ["--enable-chunked-prefill"],
    ["--disable-log-requests"],
    ["--disable-log-stats"],
    ["--uvicorn-log-level", "warning"],
]


@pytest.mark.parametrize("argv", ACCEPTED + ACCEPTED_FRONTEND)
def test_up_accepts_vllm_flags_that_change_nothing_here_with_a_note(argv, capsys):
    executor, scheduler = up.service_argv(_up(*argv))
    assert f"note: vLLM's {' '.join(argv)} changes nothing here: " in capsys.readouterr().err
    assert argv[0] not in executor + scheduler


@pytest.mark.parametrize(
    ("verb", "argv"), [("executor", a) for a in ACCEPTED] + [("scheduler", a) for a in ACCEPTED_FRONTEND]
)
def test_the_services_accept_vllm_flags_that_change_nothing_here_with_a_note(verb, argv, capsys):
    _service(verb, *argv)
    assert f"note: vLLM's {' '.join(argv)} changes nothing here: " in capsys.readouterr().err


# --- the services' own flags under vLLM's names -------------------------------------------------


def test_the_scheduler_takes_vllms_tls_flags_as_its_own():
    args = _service("scheduler", "--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem")
    assert (args.tls_cert, args.tls_key) == ("c.pem", "k.pem")


def test_the_scheduler_turns_prefix_caching_off_as_vllm_does(monkeypatch):
    """SchedulerConfig had enable_prefix_caching, but no flag reached it."""
    import scheduler_service.server as server

    seen = {}

    class Server:
        def __init__(self, executor, options, **kwargs):
            seen["config"] = options.config

    async def serve(server, grace):
        return None

    monkeypatch.setattr(server, "SchedulerServer", Server)
    monkeypatch.setattr(server, "serve_until_signal", serve)
    for argv, expected in (
        ([], True),
        (["--no-enable-prefix-caching"], False),
        (["--enable-prefix-caching"], True),
    ):
        args = _service("scheduler", "--api-server-count", "0", *argv)
        assert scheduler_cli.run(args) == 0
        assert seen["config"].enable_prefix_caching is expected


@pytest.fixture
def executor_config(monkeypatch):
    """run(*ARGV): the ExecutorConfig that `tandem executor ARGV` would serve."""
    import executor_service.server as server

    seen = {}

    def serve(config, *args, **kwargs):
        seen["config"] = config
        return 0

    monkeypatch.setattr(server, "serve", serve)

    def run(*argv: str):
        assert executor_cli.run(_service("executor", *argv)) == 0
        return seen["config"]

    return run


def test_the_executor_takes_dtype_auto_as_the_checkpoints(executor_config):
    """`--dtype auto`, vLLM's default and in most pasted command lines, was "dtype 'auto' is not
    one of float32, ..."."""
    assert executor_config("--dtype", "auto").dtype == executor_config().dtype


def test_the_executor_serves_the_model_under_served_model_name(executor_config):
    assert executor_config().model_name == DEFAULT_MODEL.name
    assert executor_config("--served-model-name", "my-model").model_name == "my-model"


def test_the_executor_seeds_its_sampler_with_seed(executor_config):
    """vLLM's --seed: the generator of requests without a seed of their own (0 by default, as vLLM)."""
    assert executor_config().seed == 0
    assert executor_config("--seed", "7").seed == 7
