"""Run all backend node cases through the local harness; print per-op-type counts.

Dev tool, run from the repository root: ``python -m tests.graph.ops.sweep [name filter] [-v]``.
"""
import collections
import sys
import traceback
import warnings

warnings.filterwarnings("ignore")
from onnx.backend.test.case.node import collect_testcases  # noqa: E402

from tests.helpers.node_harness import Skip, check_case  # noqa: E402


def main(filt=None, verbose=False):
    stats = collections.defaultdict(lambda: [0, 0, 0])
    fails = []
    for case in collect_testcases():
        ops = sorted({n.op_type for n in case.model.graph.node})
        key = case.name
        op = ops[0] if len(ops) == 1 else "expanded"
        if filt and not any(f in key for f in filt):
            continue
        try:
            check_case(case)
            stats[op][0] += 1
        except Skip as e:
            stats[op][2] += 1
            if verbose:
                fails.append((key, "SKIP " + str(e)[:150]))
        except Exception:  # noqa: BLE001
            stats[op][1] += 1
            msg = traceback.format_exc().strip().splitlines()
            fails.append((key, " | ".join(m.strip() for m in msg[-3:])[:400]))
    for k in sorted(stats):
        print(f"{k:32s} pass {stats[k][0]:3d} fail {stats[k][1]:3d} skip {stats[k][2]:3d}")
    tot = [sum(s[i] for s in stats.values()) for i in range(3)]
    print("TOTAL", tot)
    for k, m in fails:
        print("FAIL", k, m)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "-v"]
    main(args or None, "-v" in sys.argv)
