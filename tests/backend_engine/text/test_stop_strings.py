from __future__ import annotations

import pytest

from backend_engine.text.stop_strings import StopStringMatcher


def run(stop: list[str], deltas: list[str]) -> tuple[list[str], bool, str]:
    matcher = StopStringMatcher(stop)
    emitted, stopped = [], False
    for delta in deltas:
        text, stopped = matcher.feed(delta)
        emitted.append(text)
        if stopped:
            break
    return emitted, stopped, matcher.flush()


def test_no_stop_strings_passes_everything_through() -> None:
    assert run([], ["a", "b<"]) == (["a", "b<"], False, "")


def test_stop_inside_one_delta_truncates_before_it() -> None:
    assert run(["STOP"], ["hello STOP world"]) == (["hello "], True, "")


def test_stop_spanning_several_deltas() -> None:
    emitted, stopped, tail = run(["</answer>"], ["The answer is 4", "</an", "sw", "er> junk"])
    assert emitted == ["The answer is 4", "", "", ""]
    assert stopped
    assert tail == ""


def test_partial_prefix_that_is_not_a_stop_is_released() -> None:
    emitted, stopped, tail = run(["</s>"], ["a <", "/", "x> b"])
    assert emitted == ["a ", "", "</x> b"]
    assert not stopped
    assert tail == ""


def test_held_back_text_is_flushed_at_the_end() -> None:
    emitted, stopped, tail = run(["\n\nUser:"], ["Done.\n", "\nUs"])
    assert emitted == ["Done.", ""]
    assert not stopped
    assert tail == "\n\nUs"


def test_several_stop_strings_first_occurrence_wins() -> None:
    assert run(["world", "lo w"], ["hel", "lo world"]) == (["he", "l"], True, "")
    assert run(["xyz", "b"], ["aab", "xyz"]) == (["aa"], True, "")


def test_overlapping_prefixes_hold_the_longest_candidate() -> None:
    matcher = StopStringMatcher(["abab", "abc"])
    assert matcher.feed("xab") == ("x", False)
    assert matcher.held_text == "ab"
    assert matcher.feed("a") == ("", False)  # "aba" may still become "abab"
    assert matcher.held_text == "aba"
    assert matcher.feed("c") == ("abac", False)  # neither "abab" nor "abc" any more
    assert matcher.feed("ab") == ("", False)
    assert matcher.feed("ab!") == ("", True)  # "abab" completed


def test_stop_after_a_false_start() -> None:
    # "aab" with stop "ab": the first "a" is emitted once the second "a" rules it out.
    matcher = StopStringMatcher(["ab"])
    assert matcher.feed("a") == ("", False)
    assert matcher.feed("a") == ("a", False)
    assert matcher.feed("b!") == ("", True)


def test_feed_after_stop_emits_nothing() -> None:
    matcher = StopStringMatcher(["."])
    assert matcher.feed("Hi. there") == ("Hi", True)
    assert matcher.is_stopped
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_concatenation_equals_text_before_first_stop() -> None:
    text = "one two <stop> three <stop> four"
    for chunk in range(1, 8):
        deltas = [text[i : i + chunk] for i in range(0, len(text), chunk)]
        emitted, stopped, tail = run(["<stop>"], deltas)
        assert "".join(emitted) + tail == "one two "
        assert stopped


def test_unicode_stop_string() -> None:
    assert run(["🛑"], ["go 中文 🛑 no"]) == (["go 中文 "], True, "")


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher(["ok", ""])
