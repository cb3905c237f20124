"""Dev tool: backend node cases through netquant.graph.backend, per op type (optionally a name glob)."""
import sys

from netquant.graph import supported_ops
from netquant.graph.backend_cases import Status, per_op_table, run_all_cases

DOMAINS = ("ai.onnx.ml", "com.microsoft", "ai.onnx.preview.training", "ai.onnx.preview")
supported = set(supported_ops()) | {f"{d}:{t}" for d in DOMAINS for t in supported_ops(d)}
res = run_all_cases(supported, sys.argv[1] if len(sys.argv) > 1 else None)
for op, c in per_op_table(res).items():
    if c["failed"] or "-a" in sys.argv:
        print(f"{op:30s} pass {c['passed']:3d} fail {c['failed']:3d} skip {c['skipped']:3d}")
print("TOTAL", {s.value: sum(r.status is s for r in res) for s in Status})
for r in res:
    if r.status is Status.FAILED:
        print("FAIL", r.name, r.message[:300].replace("\n", " "))
    elif r.status is Status.SKIPPED and "-s" in sys.argv:
        print("SKIP", r.name, r.message[:150])
