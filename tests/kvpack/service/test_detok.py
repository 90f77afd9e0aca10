"""TextStream: incremental detokenizing (split UTF-8 characters) and stop strings."""

from __future__ import annotations

from kvpack.service.detok import TextStream


def decode(ids) -> str:  # a byte tokenizer, as the tiny model has
    return bytes(ids).decode("utf-8", errors="replace")


def feed(stream: TextStream, text: str) -> list[str]:
    return [stream.push(b) for b in text.encode()]


def test_a_character_split_over_tokens_is_emitted_whole():
    """An incomplete UTF-8 tail (U+FFFD) is held back until its last byte arrives."""
    s = TextStream(decode)
    assert feed(s, "é€") == ["", "é", "", "", "€"]
    assert s.finish() == "" and s.text == "é€"


def test_stop_string_cuts_the_text_and_stops():
    """The output ends before the stop string; `stopped` is set; later tokens add nothing."""
    s = TextStream(decode, stops=["END"])
    out = "".join(feed(s, "abc ENDxyz"))
    assert out == "abc " and s.stopped and s.text == "abc "
    assert s.finish() == ""


def test_a_possible_stop_prefix_is_held_back_then_released():
    """Text that may begin a stop string waits; when it turns out not to, it is emitted."""
    s = TextStream(decode, stops=["STOP"])
    assert feed(s, "xST") == ["x", "", ""]
    assert feed(s, "AY") == ["STA", "Y"]
    assert not s.stopped
    s2 = TextStream(decode, stops=["STOP"])
    feed(s2, "xST")
    assert s2.finish() == "ST"  # generation ended: the held-back rest is released


def test_earliest_of_several_stop_strings_wins():
    """With several stop strings, the text ends at the first one to occur."""
    s = TextStream(decode, stops=["zz", "b"])
    assert "".join(feed(s, "aabzz")) == "aa"
