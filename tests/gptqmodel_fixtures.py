"""GPTQ and AWQ checkpoints of a float model, made by GPTQModel (the reference tool, from
PyPI) on this CPU, and GPTQModel's own reading of each: run as a script, in a subprocess
(GPTQModel starts thread pools and patches torch on import, which the test process keeps
out of). tests/engine/quant/test_gptq_awq.py caches the result per source model.

    python gptqmodel_fixtures.py SRC OUT PROMPTS.json

writes, for each of KINDS, OUT/<kind>/ (config.json, model.safetensors, tokenizer) and
OUT/<kind>/reference.safetensors holding, from GPTQModel loading that checkpoint:
    weight.<module>   float32 [N, K]   each quantized linear's dequantized weight
    logits.<i>        float32 [vocab]  the next-token logits after prompt i (GPTQModel's torch
                                       kernels take only float16 and bfloat16: bfloat16)
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import time
from pathlib import Path

# GPTQModel sizes a model-loader pool of 2 under a CPU pool of (cores + 1) // 2 workers and
# refuses to start when the second is smaller (1 on a 2-core machine).
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

# sym False with 8 bits: GPTQ's zero points span the whole range, so v1's "stored minus one"
# wraps; the engine must read that as AutoGPTQ and vLLM do. AWQ's group 16: AWQ needs groups
# that divide in_features, and the tiny Llama's down_proj has 688 = 16 * 43.
KINDS = {
    "gptq-w4-g128": dict(method="gptq", bits=4, group_size=128, sym=True),
    "gptq-w8-channel-asym": dict(method="gptq", bits=8, group_size=-1, sym=False),
    # act-order: rows quantized in the order of the Hessian's diagonal; g_idx records it.
    "gptq-w4-g128-act-order": dict(method="gptq", bits=4, group_size=128, sym=True, desc_act=True),
    "awq-w4-g16": dict(method="awq", bits=4, group_size=16, sym=False),
    "awq-w4-g16-sym": dict(method="awq", bits=4, group_size=16, sym=True),
}


def calibration_texts(count: int = 32, chars: int = 600) -> list[str]:
    """Slices of the Python standard library's sources: on every machine, deterministic."""
    text = "".join(Path(sysconfig.get_paths()["stdlib"], name).read_text()
                   for name in ("json/decoder.py", "textwrap.py", "functools.py"))
    return [text[i * chars:(i + 1) * chars] for i in range(count)]


def _no_awq_clip_search() -> None:
    # AWQ's clipping search needs out_features % 64 == 0 (the tiny Llama's 688 is not); it
    # only refines the scales, the format written is the same.
    from gptqmodel.looper import awq_processor

    init = awq_processor.AWQProcessor.__init__

    def without_clip(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.apply_clip = False

    awq_processor.AWQProcessor.__init__ = without_clip


def make(src: Path, out: Path, kind: str) -> None:
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel.quantization import FORMAT, METHOD

    spec = KINDS[kind]
    extra = (dict(quant_method=METHOD.AWQ, format=FORMAT.GEMM) if spec["method"] == "awq"
             # Its group-aware reordering needs groups (per channel has one) and no act-order.
             else dict(desc_act=spec.get("desc_act", False),
                       act_group_aware=spec["group_size"] > 0 and not spec.get("desc_act", False)))
    config = QuantizeConfig(bits=spec["bits"], group_size=spec["group_size"], sym=spec["sym"], **extra)
    model = GPTQModel.load(str(src), config, device="cpu")
    model.quantize(calibration_texts(), batch_size=4)
    model.save(str(out))


def reference(ckpt: Path, prompts: list[list[int]]) -> dict:
    import torch
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    awq = json.loads((ckpt / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"
    model = GPTQModel.load(str(ckpt), device="cpu", dtype=torch.bfloat16,
                           backend=BACKEND.AWQ_TORCH if awq else BACKEND.TORCH)
    out = {}
    for name, module in model.model.named_modules():
        if not hasattr(module, "qweight"):
            continue
        if awq:  # [K, N]
            w = dequantize_gemm(module.qweight, module.qzeros, module.scales.float(), module.bits,
                                module.group_size).t()
        else:
            w = module.dequantize_weight().float().t()  # [K, N] -> [N, K]
        out[f"weight.{name}"] = w.float().contiguous()
    with torch.no_grad():
        for i, ids in enumerate(prompts):
            out[f"logits.{i}"] = model.model(torch.tensor([ids])).logits[0, -1].float().contiguous()
    return out


def main(src: str, out: str, prompts_file: str) -> None:
    from safetensors.torch import save_file

    prompts = json.loads(Path(prompts_file).read_text())
    for kind in KINDS:
        t = time.monotonic()
        make(Path(src), Path(out) / kind, kind)
        save_file(reference(Path(out) / kind, prompts), str(Path(out) / kind / "reference.safetensors"))
        print(f"[gptqmodel] {kind}: {time.monotonic() - t:.0f}s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    _no_awq_clip_search()
    main(*sys.argv[1:])
