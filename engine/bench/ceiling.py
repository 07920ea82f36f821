"""`kvpilot bench throughput --ceiling`: the workload's floating-point work over this host's
measured float32 matmul rates, an upper bound on the output tokens/s a float32 engine
reaches here.

Counting (a multiply-add is 2 FLOPs), per request of P prompt and O output tokens:
forward passes run over P + O - 1 positions (the prompt, then every generated token but
the last, which is sampled and never fed back): P at the prefill rate, O - 1 at the decode
rate. Logits are needed at O positions (the prompt's last, then one per decode step).
Attention (QK^T and PV) at position p reads p + 1 keys; it is charged at the prefill
matmul rate, which is optimistic (it runs slower in practice), so the bound stays a bound.
Norms, RoPE, activations and sampling are free here for the same reason."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from ..worker.cpu_linear import PackedLinear, packed_linear_available
from ..worker.device import pick_device, pick_dtype
from ..config.model import ModelConfig

MIN_TIME_S = 0.1  # each timing repeats a shape's matmuls for at least this long
REPEATS = 3  # timings per shape; the fastest counts (the ceiling stays optimistic)


@dataclass(frozen=True)
class Work:
    """FLOPs of a workload's forward passes, by the rate each is charged at."""
    prefill_layers: int  # decoder linears over prompt tokens
    decode_layers: int  # decoder linears over generated tokens fed back
    lm_head: int
    attention: int

    @property
    def layers(self) -> int:
        return self.prefill_layers + self.decode_layers

    @property
    def total(self) -> int:
        return self.layers + self.lm_head + self.attention


@dataclass(frozen=True)
class MatmulRates:
    """Measured FLOP/s of float32 linears on this host."""
    prefill: float  # one decoder layer's linears at prefill_rows rows
    decode: float  # the same at decode_rows rows
    lm_head: float  # hidden -> vocab at decode_rows rows
    prefill_rows: int
    decode_rows: int


@dataclass(frozen=True)
class Ceiling:
    work: Work
    rates: MatmulRates
    output_tokens: int

    @property
    def seconds(self) -> float:
        w, r = self.work, self.rates
        return (w.prefill_layers / r.prefill + w.decode_layers / r.decode + w.lm_head / r.lm_head
                + w.attention / r.prefill)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def as_dict(self) -> dict:
        return {"work_flop": asdict(self.work) | {"total": self.work.total},
                "matmul_flop_per_s": asdict(self.rates), "output_tokens": self.output_tokens,
                "seconds": self.seconds, "output_tokens_per_s": self.output_tokens_per_s}


def layer_linear_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's linears as the engine fuses them: qkv, o, gate_up, down."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)]


def layer_flops_per_token(cfg: ModelConfig) -> int:
    """All decoder layers' linears for one token."""
    return cfg.num_hidden_layers * sum(2 * i * o for i, o in layer_linear_shapes(cfg))


def attention_flops(cfg: ModelConfig, positions: int) -> int:
    """QK^T and PV, all layers, of positions 0..positions-1 (position p attends to p + 1)."""
    per_key = 2 * 2 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    return per_key * positions * (positions + 1) // 2


def workload_flops(cfg: ModelConfig, requests: list[tuple[int, int]]) -> Work:
    """requests: (prompt tokens, output tokens) each."""
    per_token = layer_flops_per_token(cfg)
    fed = [(p, max(o - 1, 0)) for p, o in requests]  # positions through the model
    return Work(prefill_layers=per_token * sum(p for p, _ in fed),
                decode_layers=per_token * sum(d for _, d in fed),
                lm_head=2 * cfg.hidden_size * cfg.vocab_size * sum(o for _, o in requests),
                attention=sum(attention_flops(cfg, p + d) for p, d in fed))


def time_linears(shapes: list[tuple[int, int]], rows: int, min_time_s: float = MIN_TIME_S,
                 repeats: int = REPEATS) -> float:
    """FLOP/s of `rows` rows through float32 linears of `shapes` (in, out) in turn, through
    the engine's packed oneDNN linear where it has one (else F.linear): the fastest repeat."""
    packed = packed_linear_available(torch.float32, torch.device("cpu"))
    layers = []
    for i, o in shapes:
        linear = torch.nn.utils.skip_init(torch.nn.Linear, i, o, bias=False)
        torch.nn.init.uniform_(linear.weight, -0.05, 0.05)  # [out, in]
        layers.append(PackedLinear(linear) if packed else linear)
    xs = [torch.randn(rows, i) for i, _ in shapes]  # [rows, in] each
    best = float("inf")
    with torch.inference_mode():
        for layer, x in zip(layers, xs):  # warm-up: oneDNN builds its primitive per row count
            layer(x)  # [rows, out]
        for _ in range(repeats):
            n, start = 0, time.perf_counter()
            while True:
                for layer, x in zip(layers, xs):
                    layer(x)
                n += 1
                elapsed = time.perf_counter() - start
                if elapsed >= min_time_s:
                    break
            best = min(best, elapsed / n)
    return sum(2 * rows * i * o for i, o in shapes) / best


def measure_rates(cfg: ModelConfig, prefill_rows: int, decode_rows: int, threads: int | None = None,
                  min_time_s: float = MIN_TIME_S) -> MatmulRates:
    """threads: torch's intra-op threads while timing (the engine's --cpu-threads; None: as set)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        layer = layer_linear_shapes(cfg)
        return MatmulRates(prefill=time_linears(layer, prefill_rows, min_time_s),
                           decode=time_linears(layer, decode_rows, min_time_s),
                           lm_head=time_linears([(cfg.hidden_size, cfg.vocab_size)], decode_rows, min_time_s),
                           prefill_rows=prefill_rows, decode_rows=decode_rows)
    finally:
        torch.set_num_threads(before)


def check_ceiling_config(config, model_cfg: ModelConfig) -> None:
    """--ceiling bounds the real float32 engine on the CPU: refuse any other run early."""
    if config.device not in ("auto", "cpu") or pick_device(config.device).type != "cpu":
        raise ValueError("--ceiling times float32 matmuls on this host's CPU; this run would use "
                         f"{'cuda' if config.device == 'auto' else config.device} (give --device cpu)")
    dtype = pick_dtype(config.dtype, model_cfg, torch.device("cpu"))
    if dtype != torch.float32:
        raise ValueError(f"--ceiling bounds float32 engines; this run's dtype is {dtype} "
                         "(give --dtype float32)")
    if config.quantization or model_cfg.checkpoint_quantization is not None:
        raise ValueError("--ceiling bounds float32 weights; this run's are quantized")


def ceiling_for(config, model_cfg: ModelConfig, workload: list[tuple[list[int], int]]) -> Ceiling:
    """The ceiling of `bench throughput`'s workload under `config` (an EngineConfig)."""
    requests = [(len(prompt), out) for prompt, out in workload]
    prefill_rows = min(config.max_num_batched_tokens, sum(p for p, _ in requests))
    decode_rows = min(len(requests), config.max_num_seqs)
    rates = measure_rates(model_cfg, prefill_rows, decode_rows, config.cpu_threads)
    return Ceiling(workload_flops(model_cfg, requests), rates, sum(o for _, o in requests))


def print_ceiling(c: Ceiling, results) -> None:
    """After the benchmark's result blocks; results: ThroughputResult each."""
    w, r = c.work, c.rates
    print(f"{'=' * 16} Arithmetic Ceiling (float32 matmuls) {'=' * 16}")
    print(f"{'Work (TFLOP):':<40}{w.total / 1e12:.4g} (layer matmuls {w.layers / 1e12:.4g}, "
          f"LM head {w.lm_head / 1e12:.4g}, attention {w.attention / 1e12:.4g})")
    print(f"{'Matmul GFLOP/s:':<40}prefill {r.prefill / 1e9:.0f} at {r.prefill_rows} rows, "
          f"decode {r.decode / 1e9:.0f} at {r.decode_rows} rows, LM head {r.lm_head / 1e9:.0f}")
    print(f"{'Ceiling output tok/s:':<40}{c.output_tokens_per_s:<10.1f}")
    for res in results:
        print(f"{res.backend} at {100 * res.output_tokens_per_s / c.output_tokens_per_s:.0f}% of the ceiling")
    print("=" * 70)
