"""Per-request sampling settings, validated once where they enter the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20
OUTPUT_KINDS = ("cumulative", "final_only")  # vLLM's RequestOutputKind names

# Bounds every value must keep to go into the step's tensors (float32 and int64 columns)
# and to mean something; the server's request models take the same numbers.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # smallest normal float32: below it a value becomes 0
INT32_MAX = 2**31 - 1  # token counts, top_k and token ids
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds
MAX_TEMPERATURE = 100.0  # logits / 100 is already uniform for any model's logits
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


def _require_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _require_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if abs(value) > FLOAT32_MAX or (value != 0 and abs(value) < FLOAT32_TINY):
        raise ValueError(f"{name} must be 0 or between {FLOAT32_TINY:g} and {FLOAT32_MAX:g} in "
                         f"magnitude (float32), got {value!r}")
    return float(value)


def _require_int_in(name: str, value: object, low: int, high: int) -> int:
    if not low <= _require_int(name, value) <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


@dataclass
class SamplingParams:
    """vLLM-shaped sampling parameters. temperature 0 means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or vLLM's -1) disables top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives per generated token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (the simulator's default; no stop strings)
    output_kind: str = "cumulative"  # final_only: a RequestOutput only when the request ends
    stop_strings: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        if _require_int("n", self.n) < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if not 0 <= _require_number("temperature", self.temperature) <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        top_p = _require_number("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if _require_int("top_k", self.top_k) == -1:
            self.top_k = 0
        if not 0 <= self.top_k <= INT32_MAX:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or in [1, {INT32_MAX}], got {self.top_k}")
        if not 0.0 <= _require_number("min_p", self.min_p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= _require_number(name, getattr(self, name)) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (MIN_REPETITION_PENALTY <= _require_number("repetition_penalty", self.repetition_penalty)
                <= MAX_REPETITION_PENALTY):
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                             f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        if self.seed is not None:
            _require_int_in("seed", self.seed, INT64_MIN, INT64_MAX)
        if self.max_tokens is not None:
            _require_int_in("max_tokens", self.max_tokens, 1, INT32_MAX)
        _require_int_in("min_tokens", self.min_tokens, 0, INT32_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.logprobs is not None:
            if not 0 <= _require_int("logprobs", self.logprobs) <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        self.stop_strings = tuple(stops)
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {self.output_kind!r}")
        if stops and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")
        ids = list(self.stop_token_ids or [])
        for t in ids:
            _require_int_in("stop_token_ids", t, 0, INT32_MAX)
        self.stop_token_ids = ids

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
