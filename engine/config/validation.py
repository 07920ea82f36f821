"""The engine's one check of a positive integer setting (configs, live limits, simulator
arguments and model shapes alike: `True` is refused although Python counts it as an int,
and the message names the field), and its one check of a token-id prompt."""

from __future__ import annotations


def positive_int(name: str, value: object, where: str = "") -> int:
    """`value` when it is an integer >= 1; ValueError naming `where` + `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}{name} must be a positive integer, got {value!r}")
    return value


def token_ids(name: str, ids: list, vocab_size: int) -> list[int]:
    """`ids` when it is a non-empty list of integers in [0, vocab_size); ValueError naming
    `name` and the first bad id otherwise."""
    if not ids:
        raise ValueError(f"{name} must not be empty")
    # The exact types in one C-level pass (bool is an int subclass), then min/max.
    if set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= vocab_size:
        bad = next(t for t in ids if type(t) is not int or not 0 <= t < vocab_size)
        raise ValueError(f"{name} must be integers in [0, {vocab_size}), got {bad!r}")
    return ids


class RequestError(ValueError):
    """A request the engine refuses at its edge (add_request); `param` names the field the
    client sent (prompt, max_tokens, service_tier, request_id), so the server reports it
    without checking again."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class LengthError(RequestError):
    """The prompt and max_tokens do not fit max_model_len: the refusal the autotuner reads
    (kvpilot:request_length_refusals_total) as the signal to raise max_model_len."""
