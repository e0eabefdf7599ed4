"""Stop strings: text is cut at the first stop string, even one split across deltas, and no
character of a possible stop string is sent before it is ruled out."""

from __future__ import annotations

from actorserve.actors.engine.stop_strings import StopStrings


def feed_all(stops, pieces, include=False):
    checker = StopStrings(stops, include)
    sent, matched = [], False
    for i, piece in enumerate(pieces):
        out, matched = checker.feed(piece, final=i == len(pieces) - 1)
        sent.append(out)
        if matched:
            break
    return sent, matched


def test_text_is_cut_before_a_stop_string_split_across_deltas():
    sent, matched = feed_all(["STOP"], ["hello S", "TO", "P and more"])
    assert matched and "".join(sent) == "hello "
    assert "S" not in sent[0]  # held back: it could have been the start of STOP


def test_include_stop_str_in_output_keeps_the_stop_string():
    sent, matched = feed_all(["\n\n"], ["a\n", "\nb"], include=True)
    assert matched and "".join(sent) == "a\n\n"


def test_the_earliest_of_several_stop_strings_wins():
    sent, matched = feed_all(["world", "lo"], ["hello world"])
    assert matched and "".join(sent) == "hel"


def test_without_a_match_everything_is_sent_by_the_end():
    sent, matched = feed_all(["xyz"], ["ab", "cx", "y"])
    assert not matched and "".join(sent) == "abcxy"
