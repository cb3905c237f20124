"""Per-tensor quantization config with its state.

CONTRACT (stub to be implemented by the core work):

class QuantState(enum.Enum): INITIAL, PASSIVE_INIT, ACTIVATED, PASSIVE, OVERLAPPED, BAKED, FP32, SOI

@dataclass(eq=False)
class TensorQuantConfig:
    spec: QuantSpec
    state: QuantState = QuantState.INITIAL
    observer: str = "minmax"                         # name in netquant.calib's observer registry
    params: QParams | None = None
    dominated_by: TensorQuantConfig | None = None    # shares params with that config (shared-scale groups, overlaps)
    name: str = ""                                   # tensor name, for messages
    properties: effective_params (follows dominated_by chain), is_active (ACTIVATED/PASSIVE/BAKED/OVERLAPPED use params)
def check_deployable(configs: Iterable[TensorQuantConfig]) -> None   # ExportError naming INITIAL/PASSIVE_INIT configs
"""
