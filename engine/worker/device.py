"""Device and dtype selection for the real (torch) model runner."""

from __future__ import annotations

import torch

from ..config.model import ModelConfig

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is cuda but no CUDA device is available")
    return torch.device(name)


def pick_dtype(name: str, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    dtype = DTYPES[model_cfg.torch_dtype]
    if device.type == "cpu" and dtype == torch.float16:
        return torch.float32  # fp16 matmuls are slow or missing on CPUs
    return dtype
