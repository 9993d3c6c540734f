"""`tandem generate --model` (in-process): without --json the first prompt's text streams to the
terminal as it is generated, as its --help says and as with --server; LLM.generate's on_text."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from client import cli
from client.defaults import DEFAULT_MODEL
from client.llm import LLM
from scheduler_service.engine import LLMEngine
from scheduler_service.sampling_params import SamplingParams

PROMPT = "The list type"
ARGS = ["--max-tokens", "12", "--ignore-eos", "--dtype", "float32"]


@pytest.fixture(scope="module")
def expected() -> list[str]:
    """The texts of PROMPT and of a second prompt, generated in one batch without streaming."""
    llm = LLM(str(DEFAULT_MODEL), dtype="float32")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    return [out.text for out in llm.generate([PROMPT, "A dict"], params, use_tqdm=False)]


@pytest.fixture
def terminal(monkeypatch, capsys) -> list[str]:
    """What reached stdout by each engine step's start, then after the last, one item each."""
    seen: list[str] = []
    step = LLMEngine.step

    def watched_step(self):
        seen.append(capsys.readouterr().out)
        return step(self)

    monkeypatch.setattr(LLMEngine, "step", watched_step)
    return seen


def _generate(seen: list[str], capsys, *argv: str) -> str:
    """Run `tandem generate --model ...`: all it printed."""
    assert cli.main(["generate", "--model", str(DEFAULT_MODEL), *argv, *ARGS]) == 0
    seen.append(capsys.readouterr().out)
    return "".join(seen)


def test_in_process_generate_streams_the_first_prompts_text(terminal, capsys, expected):
    """It printed everything at the end: nothing was on the terminal until the last step."""
    assert _generate(terminal, capsys, PROMPT, "--prompt", "A dict") == f"{expected[0]}\n{expected[1]}\n"
    # The first prompt's text came out piece by piece while the engine stepped, the second's after.
    during = terminal[:-1]
    assert sum(1 for piece in during if piece) >= 3, terminal
    assert expected[0].startswith("".join(during))
    assert terminal[-1].endswith(f"\n{expected[1]}\n")


def test_in_process_json_is_printed_whole(terminal, capsys):
    printed = _generate(terminal, capsys, PROMPT, "--json")
    assert not any(terminal[:-1]) and '"text": ' in printed


def test_on_text_pieces_add_up_to_the_first_text(expected):
    llm = LLM(str(DEFAULT_MODEL), dtype="float32")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    pieces: list[str] = []
    outs = llm.generate([PROMPT, "A dict"], params, use_tqdm=False, on_text=pieces.append)
    assert [o.text for o in outs] == expected
    assert len(pieces) > 1 and "".join(pieces) == expected[0]

    def broken(text):
        raise BrokenPipeError

    with pytest.raises(BrokenPipeError):  # e.g. `| head` closed the pipe
        llm.generate([PROMPT, "A dict"], params, use_tqdm=False, on_text=broken)
    # Nothing of that call runs on into the next.
    assert [o.text for o in llm.generate([PROMPT, "A dict"], params, use_tqdm=False)] == expected
    assert not llm.engine.has_unfinished_requests()


def _generate_into_a_closed_pipe(source: list[str]) -> None:
    """`tandem generate <source> PROMPT | head -c 5`: the reader goes away after 5 bytes; the command
    exits 1 without a traceback."""
    argv = [
        sys.executable,
        "-m",
        "client.cli",
        "generate",
        *source,
        PROMPT,
        "--max-tokens",
        "1000",
        "--ignore-eos",
    ]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(argv, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(5)
    proc.stdout.close()
    assert proc.wait(timeout=300) == 1
    assert b"Traceback" not in proc.stderr.read()


@pytest.mark.slow  # a process of its own
def test_a_reader_that_goes_away_stops_it_without_a_traceback():
    """`tandem generate --model ... | head -c 5`: the streamed text meets a closed pipe."""
    _generate_into_a_closed_pipe(["--model", str(DEFAULT_MODEL)])


@pytest.mark.slow  # a process of its own
def test_a_reader_that_goes_away_stops_the_server_path_without_a_traceback():
    """`tandem generate --server ... | head -c 5`: the same for text streamed from the services."""
    from helpers.scheduler_server import ServerThread, make_server

    with ServerThread(make_server(DEFAULT_MODEL)) as server:
        _generate_into_a_closed_pipe(["--server", f"127.0.0.1:{server.port}"])
