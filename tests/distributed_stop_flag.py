"""StopSignals.requested on several processes (used by test_distributed.py): rank 1 "gets" SIGTERM before its
third call; every rank prints what each of five calls answered, at once and a step late.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed_stop_flag.py
"""

from __future__ import annotations

import json
import signal

from accelerate import Accelerator

from rlfactory.engine.shared import StopSignals


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
    print("ANSWERS " + json.dumps({"rank": accelerator.process_index, **answers}), flush=True)


if __name__ == "__main__":
    main()
