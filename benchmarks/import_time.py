"""Import time of `fabric` (and, with --peer-python, Lightning Fabric and Accelerate) against `import torch`.

Each measurement is a fresh `python -I` process timing its own import with perf_counter; contenders run
round-robin (rotating the start) so drift in the machine's state hits all alike. Ratios compare each import
with `import torch` run by the same interpreter. Also checks that `import fabric` loads no heavy optional
dependency.

Run:  python benchmarks/import_time.py [-n 15] [--peer-python /path/to/bench-venv/bin/python]
"""

from __future__ import annotations

import argparse
import sys

from _common import (
    MARKER,
    Row,
    machine_line,
    median_iqr,
    peer_python,
    plan_contenders,
    print_table,
    run_json,
)

HEAVY = ("deepspeed", "torch_xla", "tensorboard", "torch._dynamo", "lightning", "lightning_fabric", "accelerate")
TARGET = 1.05

SNIPPET = """\
import sys, time
{pre}
t0 = time.perf_counter()
import {module}
t1 = time.perf_counter()
import json
names = list(sys.modules)
heavy = sorted({{h for h in {heavy!r} if h != {module!r} for m in names if m == h or m.startswith(h + '.')}})
print({marker!r} + json.dumps({{'import_s': t1 - t0, 'heavy': heavy, 'modules': len(sys.modules)}}))
"""


def measure_once(python: str, module: str, pre: str) -> tuple[dict, float]:
    """One fresh process running `pre`, then timing `import module`: its result and the process wall time."""
    # -I keeps the checkout (cwd) and PYTHON* variables out of sys.path, so each interpreter imports its own install.
    return run_json(python, ["-I", "-c", SNIPPET.format(pre=pre, module=module, heavy=HEAVY, marker=MARKER)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--repeats", type=int, default=15, help="fresh processes per contender")
    parser.add_argument("--peer-python", help="interpreter with lightning-fabric and accelerate installed")
    args = parser.parse_args()

    frameworks, versions, skipped = plan_contenders(peer_python(args.peer_python))
    print(machine_line(versions))
    for reason in skipped:
        print(f"skipped: {reason}")

    # (label, python, module, code run before the timed import, label of its baseline). The rows with torch
    # imported first time only what the library adds on top of torch: a small number, far less noisy.
    contenders: list[tuple[str, str, str, str, str | None]] = []
    for interp in dict.fromkeys([sys.executable, *frameworks.values()]):
        tag = "" if interp == sys.executable else " (peer)"
        contenders.append((f"import torch{tag}", interp, "torch", "", None))
        for fw in (fw for fw, py in frameworks.items() if py == interp):
            contenders.append((f"import {fw}{tag}", interp, fw, "", f"import torch{tag}"))
            contenders.append((f"  {fw} on top{tag}", interp, fw, "import torch", None))

    inproc: dict[str, list[float]] = {c[0]: [] for c in contenders}
    wall: dict[str, list[float]] = {c[0]: [] for c in contenders}
    heavy: dict[str, list[str]] = {}
    for _label, py, module, pre, _ in contenders:  # warm the file cache; not recorded
        measure_once(py, module, pre)
    for i in range(args.repeats):
        k = i % len(contenders)
        for label, py, module, pre, _ in contenders[k:] + contenders[:k]:
            data, seconds = measure_once(py, module, pre)
            inproc[label].append(data["import_s"])
            wall[label].append(seconds)
            heavy[label] = data["heavy"]

    rows = []
    for label, _, _, _, base in contenders:
        note = f"process wall {median_iqr(wall[label])[0] * 1e3:.0f} ms (median, incl. start-up)"
        rows.append(Row(label, inproc[label], inproc[base] if base else None, note))
    print_table(f"Import time, in-process perf_counter, {args.repeats} fresh processes each", rows, "ms", 1e3)

    print("\nheavy optional modules loaded by each import (checked in sys.modules):")
    for label, _, module, pre, _ in contenders:
        if module != "torch" and not pre:
            print(f"  {label:<32} {', '.join(heavy[label]) or 'none'}")

    ok = True
    if "fabric" in frameworks:
        # The direct ratio divides two noisy ~seconds-long imports and cannot resolve 5% on a busy machine;
        # fabric's own increment over an imported torch, measured directly, can. The verdict uses it.
        torch_ms, torch_iqr = (v * 1e3 for v in median_iqr(inproc["import torch"]))
        added = 1 + median_iqr(inproc["  fabric on top"])[0] * 1e3 / torch_ms
        direct = median_iqr(inproc["import fabric"])[0] * 1e3 / torch_ms
        verdict = "PASS" if added < TARGET else "FAIL"
        print(f"\ntarget: import fabric < {TARGET:.2f}x import torch -> 1 + on top/torch = {added:.3f}x: {verdict}")
        print(f"        (direct ratio of medians {direct:.3f}x; import torch IQR {torch_iqr:.0f} ms)")
        clean = not heavy["import fabric"]
        print(f"target: import fabric loads none of {', '.join(HEAVY)} -> {'PASS' if clean else 'FAIL'}")
        ok = clean
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
