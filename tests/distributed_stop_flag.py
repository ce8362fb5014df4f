"""StopSignals.requested on several processes (used by test_distributed.py): rank 1 "gets" SIGTERM before its
third call; every rank writes what each of five calls answered, at once and a step late, to OUT/rank<i>.json
(a file each: the ranks' prints would interleave).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed_stop_flag.py OUT
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from accelerate import Accelerator

from rlfactory.engine.shared import StopSignals
from rlfactory.launch import close_process_group


def main() -> None:
    accelerator = Accelerator(cpu=True)
    answers: dict[str, list[int]] = {}
    for late in (False, True):
        stop = StopSignals()
        answers[str(late)] = []
        for call in range(5):
            if call == 2 and accelerator.process_index == 1:
                stop.signum = int(signal.SIGTERM)  # what its handler records
            answers[str(late)].append(stop.requested(accelerator, a_step_late=late))
    out = Path(sys.argv[1]) / f"rank{accelerator.process_index}.json"
    out.write_text(json.dumps({"rank": accelerator.process_index, **answers}))
    # leave the group before the interpreter ends: a gloo worker thread still holding a tensor otherwise takes the
    # GIL during finalization and aborts the rank (its native stack: ProcessGroupGloo::runLoop, decref_pyobject)
    close_process_group()


if __name__ == "__main__":
    main()
