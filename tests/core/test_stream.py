"""Stream.emit: which of a step's tokens a stream keeps, and when it finishes."""

from __future__ import annotations

from ddserve.engine.stream import StepOutput, Stream
from ddserve.sampling import SamplingParams


def _stream(max_tokens: int, stops=(), output=()) -> Stream:
    return Stream(0, [1, 2], SamplingParams(max_tokens=max_tokens), 0, 0, frozenset(stops),
                  output=list(output))  # fmt: skip


def test_tokens_are_kept_up_to_and_including_the_first_stop_token() -> None:
    st = _stream(100, stops={7, 9})
    assert st.emit([3, 7, 9, 4], accepted_rows=(2, 5)) == StepOutput([3, 7], "stop", (2, 5))
    assert st.output == [3, 7]


def test_tokens_are_kept_up_to_max_tokens() -> None:
    st = _stream(5, output=[1, 1])
    assert st.emit([3, 4, 5, 6]) == StepOutput([3, 4, 5], "length")
    assert st.output == [1, 1, 3, 4, 5]


def test_a_stop_token_at_max_tokens_finishes_with_stop() -> None:
    st = _stream(3, stops={5}, output=[1])
    assert st.emit([4, 5, 6]) == StepOutput([4, 5], "stop")


def test_a_step_short_of_both_limits_leaves_the_stream_running() -> None:
    st = _stream(10, stops={9})
    assert st.emit([1, 2]) == StepOutput([1, 2], None)
    assert st.emit([]) == StepOutput([], None)
    assert st.output == [1, 2] and st.finished is None
