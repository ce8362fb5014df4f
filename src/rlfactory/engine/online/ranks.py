"""Data-parallel online RL: this process's place among the run's processes, and the collectives a step needs.

A step on W processes (docs/ARCHITECTURE.md, "Online RL on several processes"): rank r generates and scores its
contiguous share of the step's prompts (:meth:`Ranks.share`), then every rank gathers every rank's samples in rank
order (:meth:`Ranks.gather_objects`), so each holds the step's whole sample list in the order one process would
have made it, decides on it (dynamic sampling, metrics, traces) the same way, and trains its equal share of it.
Whatever reads more than one row -- the advantage estimator, a mini-batch's loss aggregation, the metrics -- reads
the rows of every rank (:meth:`Ranks.gather_rows`), so the numbers are those of one process.

The collectives are Accelerate's (``gather_object``, ``gather``, ``pad_across_processes``, ``reduce``). On one
process every method returns its input unchanged and runs no collective: a 1-process run computes exactly what it
computed before data parallelism existed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from accelerate import Accelerator


class Ranks:
    """The run's processes as the online step sees them: ``world`` of them, this one is ``rank``."""

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        self.world = accelerator.num_processes
        self.rank = accelerator.process_index

    @property
    def many(self) -> bool:
        return self.world > 1

    def round_up(self, n: int) -> int:
        """The smallest multiple of the world size >= ``n`` (``n`` itself on one process)."""
        return -(-n // self.world) * self.world

    def share(self, items: list) -> list:
        """This rank's contiguous, equal share of ``items`` (whose length the world size divides)."""
        if len(items) % self.world:
            raise ValueError(f"{len(items)} items do not split evenly over {self.world} processes")
        size = len(items) // self.world
        return items[self.rank * size : (self.rank + 1) * size]

    def gather_objects(self, items: list) -> list:
        """Every rank's list (picklable items), concatenated in rank order; the same list on every rank."""
        if not self.many:
            return items
        from accelerate.utils import gather_object

        return gather_object(items)

    def sum_counts(self, counts: dict[str, int]) -> dict[str, int]:
        """Per-name counts summed over the ranks (e.g. reward failures)."""
        if not self.many:
            return counts
        total: dict[str, int] = {}
        for part in self.gather_objects([counts]):
            for name, n in part.items():
                total[name] = total.get(name, 0) + n
        return total

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """(B_r, ...) numeric rows of every rank -> (sum of B_r, ...) in rank order, the same on every rank; a second
        dimension (the response width, which differs by rank) is right-padded with zeros to the widest."""
        if not self.many:
            return tensor
        if tensor.dim() > 1:
            tensor = self.accelerator.pad_across_processes(tensor, dim=1)
        return self.accelerator.gather(tensor.contiguous())

    def local_rows(self, tensor: torch.Tensor, rows: int, width: int | None = None) -> torch.Tensor:
        """This rank's ``rows`` rows of a :meth:`gather_rows` result (each rank gave ``rows``), cut to ``width``."""
        if not self.many:
            return tensor
        part = tensor[self.rank * rows : (self.rank + 1) * rows]
        return part if width is None else part[:, :width].contiguous()

    def any(self, flags: list[bool]) -> list[bool]:
        """Element-wise: is the flag set on any rank (one collective for the whole list)."""
        if not self.many:
            return flags
        counts = torch.tensor(flags, dtype=torch.float32, device=self.accelerator.device)
        return (self.accelerator.reduce(counts, "sum") > 0).tolist()

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over the ranks."""
        return values if not self.many else self.accelerator.reduce(values, "sum")

    def max(self, value: float) -> float:
        """The largest of every rank's ``value``."""
        if not self.many:
            return value
        return float(self.gather_rows(torch.tensor([value], device=self.accelerator.device)).max())

    def first(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (e.g. what only rank 0 computed)."""
        if not self.many:
            return value
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([value], from_process=0)[0]
