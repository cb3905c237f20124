"""netquant.calib: observers that turn calibration data into quantization params.

    obs = make_observer("kl", QuantSpec.int8(), tensor_name="conv1.out")
    for batch in data: obs.observe(batch)
    params = obs.compute_params()          # QParams(scale, zero_point), the exact range
    params = activation_params(obs)        # activations: range rounded outward (calib.ranges)
"""

from netquant.calib.base import Batch, Observer
from netquant.calib.fixed import FixedRangeObserver, NoObserver
from netquant.calib.hist_observers import (
    HistL2Observer,
    HistogramObserverBase,
    KLObserver,
    MSEObserver,
    PercentileObserver,
)
from netquant.calib.histogram import GridMode, Histogram
from netquant.calib.minmax import EmaMinMaxObserver, MinMaxObserver
from netquant.calib.ranges import (
    RANGE_MANTISSA_BITS,
    activation_params,
    clamp_for_observation,
    round_range_outward,
)
from netquant.calib.registry import ALIASES, OBSERVERS, make_observer, observer_class, register_observer

__all__ = [
    "ALIASES", "OBSERVERS", "Batch", "EmaMinMaxObserver", "FixedRangeObserver", "GridMode", "HistL2Observer",
    "Histogram", "HistogramObserverBase", "KLObserver", "MSEObserver", "MinMaxObserver", "NoObserver",
    "Observer", "PercentileObserver", "RANGE_MANTISSA_BITS", "activation_params", "clamp_for_observation",
    "make_observer", "observer_class", "register_observer", "round_range_outward",
]
