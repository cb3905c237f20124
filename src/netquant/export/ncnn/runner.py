"""Running an ncnn model from Python (ncnn.Net): one sample per extraction, as ncnn works (no batch axis)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from netquant.errors import ExportError
from netquant.export.ncnn.pnnx_convert import require_engine


def engine_version() -> str:
    ncnn, _ = require_engine()
    return str(getattr(ncnn, "__version__", "?"))


class NcnnRunner:
    """A loaded ncnn net. int8=True: layers with int8 weights run int8 kernels (opt.use_int8_inference);
    fp16 / bf16 storage and arithmetic are off so float layers compute in float32."""

    def __init__(self, param: str | os.PathLike[str], weights: str | os.PathLike[str], *, int8: bool = True,
                 threads: int = 1, where: str = "ncnn model") -> None:
        ncnn, _ = require_engine()
        self.where = where
        net = ncnn.Net()
        opt = net.opt
        opt.num_threads = threads
        opt.use_int8_inference = int8
        for flag in ("use_fp16_storage", "use_fp16_packed", "use_fp16_arithmetic", "use_bf16_storage",
                     "use_bf16_packed"):
            if hasattr(opt, flag):
                setattr(opt, flag, False)
        if net.load_param(str(Path(param))) != 0:
            raise ExportError(f"ncnn cannot load the param file of '{where}' (a layer type ncnn lacks, or a "
                              "malformed line; ncnn's message is on stderr)")
        ret = net.load_model(str(Path(weights)))
        if ret not in (0, None):
            raise ExportError(f"ncnn cannot load the weights of '{where}' (load_model returned {ret})")
        self.net = net
        self.input_names = list(net.input_names())
        self.output_names = list(net.output_names())

    def run_sample(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None) -> list[np.ndarray]:
        """Outputs (float32 arrays as ncnn shapes them) for one sample: inputs without the batch axis."""
        import ncnn

        names = list(outputs or self.output_names)
        with self.net.create_extractor() as ex:
            for name, value in inputs.items():
                ex.input(name, ncnn.Mat(np.ascontiguousarray(value, dtype=np.float32)).clone())
            result = []
            for name in names:
                ret, mat = ex.extract(name)
                if ret != 0:
                    raise ExportError(f"ncnn fails to compute output '{name}' of '{self.where}' (error {ret})")
                result.append(np.array(mat, dtype=np.float32, copy=True))
        return result

    def run_batch(self, feeds: Mapping[str, np.ndarray], input_blobs: Sequence[str],
                  output_blobs: Sequence[str] | None = None) -> list[np.ndarray]:
        """Each output for every sample of the batch, stacked as [N, per-sample values] (flattened)."""
        arrays = list(feeds.values())
        count = int(arrays[0].shape[0])
        outs: list[list[np.ndarray]] = []
        for i in range(count):
            got = self.run_sample({blob: a[i] for blob, a in zip(input_blobs, arrays)}, output_blobs)
            for k, y in enumerate(got):
                if len(outs) <= k:
                    outs.append([])
                outs[k].append(y.reshape(-1))
        return [np.stack(o) for o in outs]


def as_numpy(x: Any) -> np.ndarray:
    try:
        import torch

        if isinstance(x, torch.Tensor):
            return x.detach().cpu().numpy()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return np.asarray(x)
