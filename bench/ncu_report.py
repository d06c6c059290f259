"""Nsight Compute's `--csv --page details` output as compact text: one block per kernel launch,
then `section | metric = value unit` per line. Used by ncu_moe.sh and ncu_tree_attn.sh:

    python3 bench/ncu_report.py details.csv
"""

import csv
import sys


def main(path: str) -> None:
    lines = [ln for ln in open(path) if ln.startswith('"')]
    last = None
    for r in csv.DictReader(lines):
        name = r.get("Kernel Name", "?")[:40]
        key = (r.get("ID"), name)
        if key != last:
            grid, block = r.get("Grid Size"), r.get("Block Size")
            print(f"== {name} (id {r.get('ID')}) grid {grid} block {block}")
            last = key
        sec = r.get("Section Name", "")[:24]
        metric, value = r.get("Metric Name", "")[:44], r.get("Metric Value", "")
        print(f"  {sec:24s} | {metric:44s} = {value} {r.get('Metric Unit', '')}")


if __name__ == "__main__":
    main(sys.argv[1])
