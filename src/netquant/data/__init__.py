"""netquant.data: calibration data from disk (images, .npy/.npz, random) and OCR text-line data."""

from netquant.data.calib import (
    ChannelOrder,
    ImageOptions,
    Layout,
    ModelInput,
    load_arrays,
    load_calibration,
    load_image_folder,
    model_inputs,
    random_data,
    split_batches,
)

__all__ = [
    "ChannelOrder",
    "ImageOptions",
    "Layout",
    "ModelInput",
    "load_arrays",
    "load_calibration",
    "load_image_folder",
    "model_inputs",
    "random_data",
    "split_batches",
]
