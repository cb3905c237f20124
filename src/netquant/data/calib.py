"""Calibration data from disk: a folder of images, .npy / .npz files, or random data (smoke tests).

Images: x = (pixel / 255 - mean) / std per channel, resized to the model's H x W, channel order
RGB or BGR, layout NCHW or NHWC.  Arrays: every .npy holds samples (N, ...) or one sample (...);
every .npz holds one array per model input (or one unnamed array for single-input models).
Results are a dict {input name: float32 array (N, ...)} that quantize_onnx accepts.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from netquant.errors import CalibrationError, DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")


class ChannelOrder(enum.Enum):
    RGB = "rgb"
    BGR = "bgr"


class Layout(enum.Enum):
    NCHW = "nchw"
    NHWC = "nhwc"


@dataclass(frozen=True)
class ModelInput:
    """A model input as the loaders need it: name, shape (None / str = dynamic dim) and numpy dtype."""

    name: str
    shape: tuple[int | str | None, ...] | None
    dtype: np.dtype = np.dtype(np.float32)

    def describe(self) -> str:
        dims = "?" if self.shape is None else ", ".join(str(d) if isinstance(d, int) else "?" for d in self.shape)
        return f"'{self.name}' [{dims}] {self.dtype}"


@dataclass(frozen=True)
class ImageOptions:
    """How image files become model input: x = (pixel / 255 - mean) / std."""

    height: int | None = None  # None: from the model's static input shape
    width: int | None = None
    mean: tuple[float, ...] = (0.0,)  # one value per channel, or one value for every channel
    std: tuple[float, ...] = (1.0,)
    channel_order: ChannelOrder = ChannelOrder.RGB
    layout: Layout = Layout.NCHW
    keep_aspect_pad: bool = False  # resize to height, keep aspect ratio, zero-pad on the right (OCR lines)

    def __post_init__(self) -> None:
        if not self.mean or not self.std:
            raise DataError("mean and std (--mean / --std) need at least one value (one value: every channel)")
        if len(self.mean) != len(self.std) and 1 not in (len(self.mean), len(self.std)):
            raise DataError(f"mean (--mean) has {len(self.mean)} values but std (--std) has {len(self.std)}; give "
                            "one per channel, or one value for every channel")
        if not all(np.isfinite(v) for v in (*self.mean, *self.std)):
            raise DataError(f"mean {self.mean} / std {self.std} contain NaN or Inf; give finite numbers")
        if any(s == 0 for s in self.std):
            raise DataError(f"std (--std) {','.join(f'{v:g}' for v in self.std)} contains 0: inputs are "
                            "(pixel/255 - mean) / std, so every channel's std must be non-zero; give the std of the "
                            "pixel/255 values your model was trained with, e.g. 0.229,0.224,0.225 (or 1: no scaling)")
        with np.errstate(over="ignore", divide="ignore"):  # pixel/255 - mean in [-|mean|-1, |mean|+1]
            bound = (np.float32(1) + np.abs(np.float32(self.mean))) / np.abs(np.float32(self.std))
        if not np.isfinite(bound).all():
            raise DataError(f"std {self.std} is too close to 0 for float32 (pixel values would become Inf); "
                            "give std of the pixel/255 values, like 0.229,0.224,0.225")


def model_inputs(model_path: str | Path) -> list[ModelInput]:
    """Non-initializer inputs of an ONNX model file (names, shapes, dtypes)."""
    import onnx
    from onnx import helper

    from netquant.errors import ModelError

    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception as exc:
        raise ModelError(f"cannot read ONNX model '{model_path}': {exc}") from exc
    if not model.HasField("graph"):
        raise ModelError(f"'{model_path}' holds no ONNX graph (an empty or non-ONNX file?); give an .onnx model")
    inits = {t.name for t in model.graph.initializer}
    out = []
    for v in model.graph.input:
        if v.name in inits:
            continue
        if v.type.WhichOneof("value") != "tensor_type":
            raise ModelError(f"'{model_path}': input '{v.name}' is not a tensor "
                             f"({v.type.WhichOneof('value') or 'no type'}); netquant calibrates tensor inputs only")
        tt = v.type.tensor_type
        shape = None
        if tt.HasField("shape"):
            shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)
        try:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)) if tt.elem_type else np.dtype(np.float32)
        except (KeyError, ValueError, TypeError) as exc:
            raise ModelError(f"'{model_path}': input '{v.name}' has element type {tt.elem_type}, which has no "
                             "numpy equivalent; netquant cannot feed it") from exc
        out.append(ModelInput(v.name, shape, dtype))
    if not out:
        raise ModelError(f"'{model_path}' has no graph inputs, so there is nothing to calibrate; give a model "
                         "that takes input")
    return out


def index_limits(model_path: str | Path) -> dict[str, int]:
    """Integer model inputs used as Gather indices into a constant table (token ids into an embedding),
    mapped to the table's size on the gathered axis: random calibration draws ids below it."""
    import onnx

    try:
        graph = onnx.load(str(model_path), load_external_data=False).graph
    except Exception:  # noqa: BLE001 - model_inputs reports unreadable models
        return {}
    tables = {t.name: list(t.dims) for t in graph.initializer}
    for n in graph.node:  # Constant tables too
        if n.op_type == "Constant" and n.output:
            for a in n.attribute:
                if a.name == "value" and a.HasField("t"):
                    tables[n.output[0]] = list(a.t.dims)
    aliases = {i.name: i.name for i in graph.input}
    for n in graph.node:  # an id input is often cast or reshaped first
        if n.op_type in ("Cast", "Reshape", "Unsqueeze", "Squeeze", "Identity", "Flatten") and n.input \
                and n.input[0] in aliases and n.output:
            aliases[n.output[0]] = aliases[n.input[0]]
    limits: dict[str, int] = {}
    for n in graph.node:
        if n.op_type != "Gather" or len(n.input) < 2 or n.input[0] not in tables or n.input[1] not in aliases:
            continue
        dims = tables[n.input[0]]
        axis = next((int(a.i) for a in n.attribute if a.name == "axis"), 0)
        if dims and -len(dims) <= axis < len(dims) and dims[axis] > 0:
            name = aliases[n.input[1]]
            limits[name] = min(limits.get(name, dims[axis]), dims[axis])
    return limits


def sample_count(data: dict[str, np.ndarray]) -> int:
    """Number of samples in stacked calibration data (0 for no inputs)."""
    return min((len(v) for v in data.values()), default=0)


def _static(dim: int | str | None) -> int | None:
    return dim if isinstance(dim, int) and dim > 0 else None


def _image_geometry(inp: ModelInput, opts: ImageOptions) -> tuple[int, int, int]:
    """(channels, height, width) for image loading, from the options or the model's static shape."""
    if inp.shape is None or len(inp.shape) != 4:
        raise DataError(f"image calibration needs a 4-d image input; model input {inp.describe()} is not "
                        "one. Use .npy/.npz calibration files instead")
    if opts.layout is Layout.NCHW:
        c, h, w = (_static(d) for d in inp.shape[1:])
    else:
        h, w, c = (_static(d) for d in inp.shape[1:])
    given = max(len(opts.mean), len(opts.std))
    c = c or (given if given > 1 else 3)  # a dynamic channel dim: RGB unless mean / std say otherwise
    h, w = opts.height or h, opts.width or w
    if h is None or w is None:
        raise DataError(f"model input {inp.describe()} has a dynamic height/width; give the image size "
                        "(--height / --width, or ImageOptions(height=..., width=...))")
    if c not in (1, 3):
        raise DataError(f"model input {inp.describe()} has {c} channels in layout {opts.layout.name}; "
                        "images give 1 or 3 (check --layout)")
    if max(len(opts.mean), len(opts.std)) not in (1, c):
        kind = "grayscale images (1 channel)" if c == 1 else f"{c}-channel images"
        raise DataError(f"mean/std (--mean / --std) give {max(len(opts.mean), len(opts.std))} values but input "
                        f"{inp.describe()} "
                        f"takes {kind}; give {c} value{'s' if c > 1 else ''} (or one value for every channel), "
                        f"e.g. --mean {','.join(['0.5'] * c)} --std {','.join(['0.5'] * c)}")
    return c, h, w


def load_image(path: Path, channels: int, height: int, width: int, opts: ImageOptions) -> np.ndarray:
    """One image file -> (C, H, W) float32 normalized (channel order applied)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im = im.convert("RGB" if channels == 3 else "L")
            if opts.keep_aspect_pad:
                new_w = min(width, max(1, int(np.ceil(height * im.width / im.height))))
                im = im.resize((new_w, height), Image.BILINEAR)
            else:
                im = im.resize((width, height), Image.BILINEAR)
            arr = np.asarray(im, dtype=np.float32)
    except (UnidentifiedImageError, OSError) as exc:
        raise DataError(f"cannot read image '{path}': {exc}") from exc
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if channels == 3 and opts.channel_order is ChannelOrder.BGR:
        arr = arr[:, :, ::-1]
    mean = np.asarray(opts.mean, dtype=np.float32).reshape(1, 1, -1)
    std = np.asarray(opts.std, dtype=np.float32).reshape(1, 1, -1)
    arr = (arr / 255.0 - mean) / std
    out = np.zeros((height, width, channels), dtype=np.float32)
    out[:, : arr.shape[1], :] = arr
    return out.transpose(2, 0, 1)


def image_files(folder: Path) -> list[Path]:
    """Image files directly inside `folder` or below it, sorted by path."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def load_image_folder(folder: str | Path, inputs: Sequence[ModelInput], opts: ImageOptions,
                      limit: int | None = None) -> dict[str, np.ndarray]:
    """Images of `folder` as one stacked batch for the model's single image input."""
    folder = Path(folder)
    if len(inputs) != 1:
        raise DataError(f"an image folder feeds one input, but the model takes {len(inputs)}: "
                        f"{', '.join(i.describe() for i in inputs)}; use .npz files with one array per input")
    files = image_files(folder)[:limit]
    if not files:
        raise CalibrationError(f"no images ({', '.join(IMAGE_SUFFIXES)}) in folder '{folder}'")
    inp = inputs[0]
    c, h, w = _image_geometry(inp, opts)
    batch = np.stack([load_image(f, c, h, w, opts) for f in files])
    if opts.layout is Layout.NHWC:
        batch = batch.transpose(0, 2, 3, 1)
    return {inp.name: np.ascontiguousarray(batch.astype(inp.dtype, copy=False))}


def _check_array(arr: np.ndarray, inp: ModelInput, where: str) -> np.ndarray:
    """A (N, ...) array checked against the input's rank and static dims (a single sample gets N = 1)."""
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.number) and arr.dtype != np.bool_:
        raise DataError(f"{where}: array of dtype {arr.dtype} cannot feed input {inp.describe()}")
    if inp.shape == ():  # a scalar input: one 0-d sample or a 1-d array of samples
        if arr.ndim > 1:
            raise DataError(f"{where}: array of shape {list(arr.shape)} does not fit the scalar (0-d) model input "
                            f"'{inp.name}'; give a 0-d array (one sample) or a 1-d array of samples")
        arr = arr.reshape(-1)
    elif inp.shape is not None:
        if arr.ndim == len(inp.shape) - 1:
            arr = arr[None]
        if arr.ndim != len(inp.shape):
            raise DataError(f"{where}: array of shape {list(arr.shape)} does not fit model input "
                            f"{inp.describe()} (expected {len(inp.shape)}-d)")
        for axis, (want, got) in enumerate(zip(inp.shape, arr.shape)):
            if axis > 0 and _static(want) is not None and want != got:
                raise DataError(f"{where}: array of shape {list(arr.shape)} does not fit model input "
                                f"{inp.describe()} (dim {axis} must be {want})")
    if np.issubdtype(arr.dtype, np.floating) and not np.isfinite(arr).all():
        raise DataError(f"{where}: array for input '{inp.name}' contains NaN or Inf")
    if arr.dtype != inp.dtype:
        if np.issubdtype(arr.dtype, np.floating) != np.issubdtype(inp.dtype, np.floating):
            raise DataError(f"{where}: array of dtype {arr.dtype} cannot feed input {inp.describe()}")
        arr = arr.astype(inp.dtype)
    return arr


def array_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in (".npy", ".npz"))


def calibration_files(source: str | Path) -> list[Path]:
    """Every file load_calibration(source) may read: the .npy / .npz file given, or the array and image files
    of a folder (none for 'random' or a missing path). The output plan treats them as inputs."""
    if str(source) == "random":
        return []
    path = Path(source)
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted({*array_files(path), *image_files(path)})
    return []


def load_arrays(path: str | Path, inputs: Sequence[ModelInput], limit: int | None = None) -> dict[str, np.ndarray]:
    """Samples from .npy / .npz files (a file or a folder of them), stacked per model input."""
    path = Path(path)
    files = array_files(path)
    if not files:
        raise CalibrationError(f"no .npy or .npz files at '{path}'")
    parts: dict[str, list[np.ndarray]] = {i.name: [] for i in inputs}
    for f in files:
        try:
            loaded = np.load(f, allow_pickle=False)
        except Exception as exc:
            raise DataError(f"cannot read calibration array file '{f}': {exc}") from exc
        if isinstance(loaded, np.ndarray):
            if len(inputs) != 1:
                raise DataError(f"'{f}' holds one array but the model takes {len(inputs)} inputs "
                                f"({', '.join(i.describe() for i in inputs)}); use .npz with one array per input")
            parts[inputs[0].name].append(_check_array(loaded, inputs[0], f"'{f}'"))
            continue
        with loaded:
            keys = list(loaded.keys())
            if len(inputs) == 1 and len(keys) == 1:
                mapping = {inputs[0].name: keys[0]}
            else:
                missing = [i.name for i in inputs if i.name not in keys]
                if missing:
                    raise DataError(f"'{f}' has arrays {keys} but lacks model inputs {missing}; name the arrays "
                                    f"after the inputs: {', '.join(i.describe() for i in inputs)}")
                mapping = {i.name: i.name for i in inputs}
            for inp in inputs:
                try:
                    arr = loaded[mapping[inp.name]]
                except (ValueError, OSError, EOFError) as exc:  # object arrays (pickles), corrupt members
                    raise DataError(f"cannot read array '{mapping[inp.name]}' of '{f}': {exc}; save plain numeric "
                                    "arrays (np.savez with float32 / integer arrays)") from exc
                parts[inp.name].append(_check_array(arr, inp, f"'{f}' [{mapping[inp.name]}]"))
    out: dict[str, np.ndarray] = {}
    for inp in inputs:
        try:
            out[inp.name] = np.concatenate(parts[inp.name])[:limit]
        except ValueError as exc:
            shapes = sorted({tuple(a.shape[1:]) for a in parts[inp.name]})
            raise DataError(f"calibration arrays for input '{inp.name}' have different sample shapes {shapes}; "
                            "give samples of one shape") from exc
    counts = {k: len(v) for k, v in out.items()}
    if len(set(counts.values())) > 1:
        raise DataError(f"calibration files give different sample counts per input: {counts}")
    return out


def random_data(inputs: Sequence[ModelInput], count: int = 8, seed: int = 0, dynamic_dim: int = 32,
                image_options: ImageOptions | None = None,
                index_limits: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Standard-normal float (or integer) samples: a smoke test, not a real calibration.

    Integer inputs named in `index_limits` (see index_limits(): token ids) draw uniformly below their
    limit, other integer inputs 0 or 1, booleans False / True.  Dynamic dims other than the batch dim take
    `dynamic_dim`; for 4-d inputs the height / width of `image_options` (when given) fill the spatial
    dims of its layout.
    """
    limits = index_limits or {}
    max_elements = 2**26  # 256 MiB of float32 per input: beyond that random data is a mistake, not a smoke test
    rng = np.random.default_rng(seed)
    out = {}
    for inp in inputs:
        if inp.shape is None:
            raise DataError(f"model input {inp.describe()} has no known rank; random data needs a shape")
        dims = [count] + [_static(d) or dynamic_dim for d in inp.shape[1:]]  # a scalar input: count samples
        if image_options is not None and len(dims) == 4:
            h_axis, w_axis = (2, 3) if image_options.layout is Layout.NCHW else (1, 2)
            if _static(inp.shape[h_axis]) is None and image_options.height:
                dims[h_axis] = image_options.height
            if _static(inp.shape[w_axis]) is None and image_options.width:
                dims[w_axis] = image_options.width
        if any(d < 0 for d in dims) or int(np.prod(dims, dtype=np.float64)) > max_elements:
            raise DataError(f"random data for input {inp.describe()} would be {count} x {dims[1:]} = "
                            f"{int(np.prod(dims, dtype=np.float64)):.3g} values (limit {max_elements}); lower "
                            "--num-calib or give .npy/.npz calibration files")
        if np.issubdtype(inp.dtype, np.floating):
            out[inp.name] = rng.standard_normal(dims).astype(inp.dtype)
        elif np.issubdtype(inp.dtype, np.integer) or inp.dtype == np.bool_:
            high = max(1, limits.get(inp.name, 2)) if inp.dtype != np.bool_ else 2
            out[inp.name] = rng.integers(0, high, dims).astype(inp.dtype)
        else:
            raise DataError(f"random data cannot fill input {inp.describe()}; give .npy/.npz calibration files")
    return out


def load_calibration(source: str | Path, inputs: Sequence[ModelInput], *, image_options: ImageOptions | None = None,
                     limit: int | None = None, seed: int = 0,
                     index_limits: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Calibration samples from `source`: 'random', an image folder, or .npy/.npz file(s).

    index_limits: for 'random', the id range of integer inputs (see index_limits()).
    """
    if limit is not None and limit < 1:
        raise DataError(f"the number of calibration samples must be >= 1, got {limit}")
    if str(source) == "random":
        return random_data(inputs, count=limit or 8, seed=seed, image_options=image_options,
                           index_limits=index_limits)
    path = Path(source)
    if not path.exists():
        raise DataError(f"calibration data '{path}' does not exist; give a folder of images, .npy/.npz "
                        "file(s), or 'random'")
    if path.is_file() and path.suffix.lower() not in (".npy", ".npz"):
        raise DataError(f"calibration file '{path}' is not .npy or .npz; give a folder of images, "
                        ".npy/.npz file(s), or 'random'")
    if path.is_dir():
        arrays, images = array_files(path), image_files(path)
        if arrays and images:
            raise DataError(f"calibration folder '{path}' holds both images ({len(images)}, e.g. '{images[0]}') and "
                            f"arrays ({len(arrays)} .npy/.npz, e.g. '{arrays[0]}'); netquant cannot tell which you "
                            "mean: put them in separate folders and give that one to --calib")
        if not arrays:
            return load_image_folder(path, inputs, image_options or ImageOptions(), limit)
    return load_arrays(path, inputs, limit)


# the keywords of the API that say how files become calibration data (as the CLI's options of the same names)
PATH_OPTION_KEYS = ("height", "width", "mean", "std", "channel_order", "layout", "keep_aspect", "num_calib", "seed")


def graph_inputs(graph: Any) -> list[ModelInput]:
    """The inputs a netquant Graph is fed (names, shapes, numpy dtypes), as model_inputs reads them from a file."""
    import torch

    out = []
    for v in graph.inputs:
        dtype = np.dtype(np.float32) if v.dtype is None else torch.empty(0, dtype=v.dtype).numpy().dtype
        out.append(ModelInput(v.name, v.shape, dtype))
    return out


def load_path_calibration(source: str | Path, inputs: Sequence[ModelInput], batch_size: int, *,
                          height: int | None = None, width: int | None = None,
                          mean: Sequence[float] | float = (0.0,), std: Sequence[float] | float = (1.0,),
                          channel_order: ChannelOrder | str = ChannelOrder.RGB, layout: Layout | str = Layout.NCHW,
                          keep_aspect: bool = False, num_calib: int | None = None,
                          seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Calibration batches from an image folder, .npy / .npz file(s) or 'random', with the CLI's options:
    x = (pixel / 255 - mean) / std (one value per channel, or one for every channel), resized to height x width
    (keep_aspect: to the height, padded right),
    channel_order 'rgb' | 'bgr', layout 'nchw' | 'nhwc'; at most num_calib samples; seed for 'random'."""
    try:
        means = (mean,) if isinstance(mean, (int, float)) else mean
        stds = (std,) if isinstance(std, (int, float)) else std
        opts = ImageOptions(height=height, width=width, mean=tuple(float(m) for m in means),
                            std=tuple(float(v) for v in stds), channel_order=ChannelOrder(str(
                                getattr(channel_order, "value", channel_order)).lower()),
                            layout=Layout(str(getattr(layout, "value", layout)).lower()), keep_aspect_pad=keep_aspect)
    except ValueError as exc:
        raise DataError(f"calibration options for '{source}': {exc} (channel_order: rgb | bgr, layout: nchw | "
                        "nhwc)") from None
    data = load_calibration(source, inputs, image_options=opts, limit=num_calib, seed=seed)
    return split_batches(data, inputs, batch_size)


def split_batches(data: dict[str, np.ndarray], inputs: Sequence[ModelInput],
                  batch_size: int) -> list[dict[str, np.ndarray]]:
    """Stacked samples -> batches of `batch_size` (or of the model's static batch dim when it has one)."""
    scalars = {i.name for i in inputs if i.shape == ()}
    static = {_static(i.shape[0]) for i in inputs if i.shape}
    static.discard(None)
    if scalars:  # a scalar input holds one sample: every batch is one sample, the scalar a 0-d array
        static = {1}
    step = min(static) if static else batch_size
    n = len(next(iter(data.values())))
    if static and n < step:
        raise DataError(f"the model's batch dim is fixed at {step} but only {n} calibration samples were given "
                        f"for {', '.join(i.describe() for i in inputs)}")
    stop = n - n % step if static else n  # a fixed batch dim drops the incomplete last batch
    return [{k: v[s:s + 1].reshape(()) if k in scalars else v[s:s + step] for k, v in data.items()} for s in range(0, stop, step)]
