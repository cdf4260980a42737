"""Weight offloading for `--performance-mode balanced` (components) and `memory` (components + DiT blocks)."""

from k6serve.offload.components import (
    OFFLOAD_MODES,
    RESIDENT,
    ComponentOffload,
    OffloadReport,
    Resident,
    apply_offload,
)

__all__ = ["OFFLOAD_MODES", "RESIDENT", "ComponentOffload", "OffloadReport", "Resident", "apply_offload"]
