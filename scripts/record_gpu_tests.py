"""Summarises a GPU pytest run as JSON (date, GPU, versions, counts) for the repository.

    python scripts/record_gpu_tests.py PYTEST_LOG EXIT_CODE SECONDS [COMMAND] > gpu-tests.json
"""

import datetime
import json
import re
import sys

import torch
import triton


def main() -> None:
    log_path, exit_code, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    text = open(log_path).read()
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|deselected)", text)}
    print(json.dumps({
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": sys.argv[4] if len(sys.argv) > 4 else "scripts/gpu-check tests",
        "exit_code": exit_code,
        "seconds": seconds,
        "counts": counts,
        "summary": text.strip().splitlines()[-1] if text.strip() else "",
    }, indent=1))


if __name__ == "__main__":
    main()
