"""Incremental detokenization: no broken UTF-8 on the wire, stop strings across tokens."""

from __future__ import annotations

import pytest
from checkpoints import EOS_TEXT, train_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_service.detokenizer import IncrementalDetokenizer, decode_after, prompt_context
from scheduler_service.tokenizer import Tokenizer

MIXED = "héllo 😀 中文 🎉 def x"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer(train_tokenizer(tmp_path_factory.mktemp("tok")))


def stream(tok: Tokenizer, ids: list[int], stop=(), batch: int = 1) -> tuple[list[str], str, str | None, int]:
    """Feed ids `batch` at a time; returns (deltas, full text, stop string, tokens consumed)."""
    detok = IncrementalDetokenizer(tok, stop)
    deltas, consumed = [], 0
    for i in range(0, len(ids), batch):
        update = detok.add(ids[i : i + batch])
        deltas.append(update.text)
        consumed += update.num_tokens
        if update.stop_string is not None:
            return deltas, "".join(deltas), update.stop_string, consumed
    deltas.append(detok.flush())
    return deltas, "".join(deltas), None, consumed


def test_multibyte_characters_split_across_tokens_are_never_emitted_broken(tokenizer):
    ids = tokenizer.encode(MIXED)
    # The emoji and CJK characters are several byte-level tokens each, none decodable alone.
    assert sum(tokenizer.decode([i]) == "\ufffd" for i in ids) >= 8
    deltas, text, _, _ = stream(tokenizer, ids)
    assert text == MIXED
    assert all("\ufffd" not in d for d in deltas)
    assert "😀" in deltas and "中" in deltas  # each released whole, by the token completing it


def test_held_back_tail_is_released_by_flush(tokenizer):
    # A lone first byte of an emoji: held while it may complete, released when the request ends.
    emoji = tokenizer.encode("😀")
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(tokenizer.encode("ab") + emoji[:1]).text == "ab"
    assert detok.flush() == tokenizer.decode(emoji[:1]) == "\ufffd"


def test_eos_is_not_in_the_text(tokenizer):
    eos = tokenizer.token_to_id(EOS_TEXT)
    ids = tokenizer.encode("return x") + [eos]
    _, text, _, _ = stream(tokenizer, ids)
    assert text == "return x"


@pytest.mark.parametrize("batch", [1, 3, 100])
def test_stop_string_spanning_tokens_ends_the_output_before_it(tokenizer, batch):
    text = "def foo():\n    return 1\n\nclass Bar:\n    pass"
    ids = tokenizer.encode(text)
    _, out, stop, consumed = stream(tokenizer, ids, stop=["\n\nclass"], batch=batch)
    assert (out, stop) == ("def foo():\n    return 1", "\n\nclass")
    # Output ends at the token that completed the stop string.
    assert "\n\nclass" in tokenizer.decode(ids[:consumed])
    assert "\n\nclass" not in tokenizer.decode(ids[: consumed - 1])


def test_possible_stop_prefix_is_held_until_ruled_out(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, ["xyz"])
    assert detok.add(tokenizer.encode("ab xy")).text == "ab "
    assert detok.add(tokenizer.encode("q")).text == "xyq"
    assert detok.add(tokenizer.encode(" x")).text == " "
    assert detok.flush() == "x"


def test_earliest_stop_string_wins_and_emoji_stop(tokenizer):
    ids = tokenizer.encode("one two 😀 three")
    _, out, stop, _ = stream(tokenizer, ids, stop=["three", "😀"])
    assert (out, stop) == ("one two ", "😀")


def test_text_after_a_stop_is_ignored(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, ["END"])
    update = detok.add(tokenizer.encode("a END b"))
    assert (update.text, update.stop_string) == ("a ", "END")
    assert detok.add(tokenizer.encode("more")).text == ""
    assert detok.flush() == ""


TEXT = st.text(
    alphabet=st.sampled_from(list("abc xyz\n()_:=") + ["é", "ß", "中", "文", "😀", "🎉", "🏽", "\u0301"]),
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 399), max_size=40), batch=st.integers(1, 5))
def test_deltas_concatenate_to_decode_of_any_ids(tokenizer, ids, batch):
    """Even ids that make invalid UTF-8: the stream's text is exactly decode(all ids)."""
    deltas, text, _, _ = stream(tokenizer, ids, batch=batch)
    assert text == tokenizer.decode(ids)
    # Nothing but the final flush may end in a replacement character.
    assert all(not d.endswith("\ufffd") for d in deltas[:-1])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT, stop=st.text(alphabet=st.sampled_from(list("xyz 中😀")), min_size=1, max_size=4))
def test_single_stop_string_cuts_at_its_first_occurrence(tokenizer, text, stop):
    ids = tokenizer.encode(text)
    _, out, hit, _ = stream(tokenizer, ids, stop=[stop])
    index = text.find(stop)
    if index < 0:
        assert (out, hit) == (text, None)
    else:
        assert (out, hit) == (text[:index], stop)


@pytest.mark.parametrize("batch", [1, 100])
def test_a_stop_string_begun_within_min_tokens_ends_the_output_when_a_later_token_completes_it(
    tokenizer, batch
):
    """min_tokens keeps stop strings that its tokens complete from counting, not one that begins
    among them and ends after: the text of the first min_tokens tokens was released whole, so
    "\\n\\nclass" completed by the token right after them never stopped the request."""
    text = "def foo():\n    return 1\n\nclass Bar:\n    pass"
    stop = "\n\nclass"
    ids = tokenizer.encode(text)
    completes = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))
    assert len(tokenizer.decode(ids[: completes - 1])) > text.index(stop)  # it begins before
    for min_tokens, expected in (
        (completes - 1, ("def foo():\n    return 1", stop)),
        (completes, (text, None)),
    ):
        detok = IncrementalDetokenizer(tokenizer, [stop], min_tokens=min_tokens)
        out, consumed, hit = "", 0, None
        for i in range(0, len(ids), batch):
            update = detok.add(ids[i : i + batch])
            out, consumed, hit = out + update.text, consumed + update.num_tokens, update.stop_string
            if hit is not None:
                break
        assert (out + detok.flush(), hit) == expected
        assert consumed == (completes if hit else len(ids))


@pytest.fixture(scope="module")
def metaspace_tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer(train_tokenizer(tmp_path_factory.mktemp("metaspace"), metaspace=True))


@pytest.mark.parametrize("stop", [(), ("zzz",)])
@pytest.mark.parametrize("batch", [1, 100])
def test_text_decoded_after_the_prompt_keeps_its_first_space(metaspace_tokenizer, stop, batch):
    """A SentencePiece-style decoder drops the space that begins a text: decoded alone, the first
    generated word lost its own (" the object" came out "the object", so prompt + text ran two
    words together), where the prompt's continuation has it."""
    tok = metaspace_tokenizer
    prompt, ids = tok.encode("The list type is"), tok.encode("The list type is the object")
    generated = ids[len(prompt) :]
    assert prompt == ids[: len(prompt)] and tok.decode(ids) == "The list type is the object"
    assert tok.decode(generated) == "the object"  # (decoded alone)
    context = prompt_context(tok, prompt)
    assert decode_after(tok, context, generated) == " the object"
    detok = IncrementalDetokenizer(tok, stop, context=context)
    deltas = [detok.add(generated[i : i + batch]).text for i in range(0, len(generated), batch)]
    assert "".join(deltas) + detok.flush() == " the object"


SPECIALS = ("<|im_start|>", "<|im_end|>")


def with_special_tokens(path) -> Tokenizer:
    """The tokenizer at `path` with SPECIALS added as special tokens (ids 400 and 401, after the
    trained vocabulary and <|endoftext|>, id 0)."""
    from tokenizers import Tokenizer as HFTokenizer

    raw = HFTokenizer.from_file(str(path))
    raw.add_special_tokens(list(SPECIALS))
    raw.save(str(path))
    return Tokenizer(path)


@pytest.fixture(scope="module", params=["byte-level", "metaspace"])
def special_tokenizer(request, tmp_path_factory) -> tuple[Tokenizer, object]:
    """A tokenizer with special tokens beside the ordinary ones, and transformers' fast tokenizer
    of the same file (what `tokenizer.decode(ids, skip_special_tokens=False)` means to a user)."""
    from transformers import PreTrainedTokenizerFast

    path = train_tokenizer(tmp_path_factory.mktemp(request.param), metaspace=request.param == "metaspace")
    tok = with_special_tokens(path)
    assert [tok.token_to_id(s) for s in SPECIALS] == [400, 401]
    return tok, PreTrainedTokenizerFast(tokenizer_file=str(path))


def hf_after(hf, context: list[int], ids: list[int]) -> str:
    """transformers' text of `ids` following `context`, special tokens written."""
    return hf.decode(context + ids, skip_special_tokens=False)[
        len(hf.decode(context, skip_special_tokens=False)) :
    ]


SPECIAL_IDS = st.lists(st.one_of(st.integers(1, 399), st.sampled_from([0, 400, 401])), max_size=30)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=SPECIAL_IDS, ids=SPECIAL_IDS, batch=st.integers(1, 5))
def test_skip_special_tokens_off_writes_them_as_transformers_decode_does(
    special_tokenizer, prompt, ids, batch
):
    """With skip_special_tokens off the streamed pieces add up to transformers' decode(ids,
    skip_special_tokens=False), as the prompt's continuation (the decode of the whole, cut after the
    prompt's context) and, after a prompt that ends on whole characters, decoded alone too; the
    default leaves the special tokens out, as it did."""
    tok, hf = special_tokenizer
    context = prompt_context(tok, prompt, skip_special_tokens=False)
    detok = IncrementalDetokenizer(tok, context=context, skip_special_tokens=False)
    deltas = [detok.add(ids[i : i + batch]).text for i in range(0, len(ids), batch)]
    text = "".join(deltas) + detok.flush()
    assert text == decode_after(tok, context, ids, skip_special_tokens=False) == hf_after(hf, context, ids)
    if not context:
        assert text == hf.decode(ids, skip_special_tokens=False)
    assert all(not d.endswith("\ufffd") for d in deltas)
    skipped = IncrementalDetokenizer(tok, context=prompt_context(tok, prompt))
    assert skipped.add(ids).text + skipped.flush() == decode_after(tok, prompt_context(tok, prompt), ids)


@pytest.mark.parametrize("batch", [1, 100])
@pytest.mark.parametrize("min_tokens", [0, 3])
def test_a_stop_string_may_be_a_special_tokens_text_when_they_are_written(
    special_tokenizer, batch, min_tokens
):
    """Special tokens written into the text are text like any other: a stop string that is one's
    text ends the output there (and can not match while they are skipped); min_tokens holds as ever."""
    tok, hf = special_tokenizer
    ids = tok.encode("def x") + [400] + tok.encode(" return") + [401] + tok.encode(" y") + [401]
    for skip, expected in (
        (False, hf.decode(ids[: ids.index(401)], skip_special_tokens=False)),
        (True, None),
    ):
        detok = IncrementalDetokenizer(tok, ["<|im_end|>"], min_tokens=min_tokens, skip_special_tokens=skip)
        out, hit = "", None
        for i in range(0, len(ids), batch):
            update = detok.add(ids[i : i + batch])
            out, hit = out + update.text, update.stop_string
            if hit:
                break
        if expected is None:
            assert (out + detok.flush(), hit) == (tok.decode(ids), None)
        else:
            assert (out, hit) == (expected, "<|im_end|>") and "<|im_start|>" in out
