"""The emulated `nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader` of a node: the PCI bus
ids of its GPUs, those the CuPy stand-in reports (testing/cupy_standin), in device order."""

import json
import os
import sys

if sys.argv[1:] != ["--query-gpu=pci.bus_id", "--format=csv,noheader"]:
    print("nvidia-smi: only --query-gpu=pci.bus_id --format=csv,noheader is emulated", file=sys.stderr)
    sys.exit(2)
with open(os.path.join(os.environ["EMU_ROOT"], "emu", "node.json")) as f:
    for bus in json.load(f)["gpus"]:
        print("0000" + bus.upper())
