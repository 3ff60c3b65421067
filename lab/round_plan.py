"""The forward's chunk plan against the rounds of its persistent sweep, without a GPU.

    python lab/round_plan.py [--programs 132] [--overhead 0.4]

A persistent sweep of B row blocks x T vocabulary tiles on P multiprocessors takes
ceil(B T / P) rounds of one tile each. For each main head, and for N from 2048 to 70000 rows
with 100%, 90%, 70% and 50% of them having a loss, this plans an evaluation forward (192-row
tiles, chunks of at most 4032 rows) evenly and round-filled (``_chunked._fullest_first`` and
``_fullest_chunk``, what the setting ``fill_rounds`` turns on) and compares their cost in rounds, plus
``--overhead`` rounds a chunk (its other launches): how often the filled plan is cheaper or
dearer, and by how much on average. A model of the sweep, not a timing.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch-ext"))
from fused_linear_ce import _chunked  # noqa: E402

HEADS = {"llama2": 32000, "llama3": 128256, "gemma2": 256000, "qwen25": 151936}
ROW_BLOCK, CHUNK, TILE = 192, 4032, 256


class _Count:
    """Stands for a ``_RowOrder`` whose count of rows with a loss is ``count``."""

    def __init__(self, count: int):
        self.count = count

    def rows_to_compute(self) -> int:
        return self.count


def plan(n_rows: int, count: int, sweep_tiles) -> list[tuple[int, int]]:
    first = _chunked._first_chunk_rows(n_rows, CHUNK, _Count(count), False, ROW_BLOCK, sweep_tiles)
    return list(_chunked._spans(n_rows, CHUNK, _Count(count), first, ROW_BLOCK, sweep_tiles))


def cost(spans, tiles: int, programs: int, overhead: float) -> float:
    """Rounds of the chunks' sweeps, plus ``overhead`` a chunk."""
    blocks = [-(-(end - start) // ROW_BLOCK) for start, end in spans]
    return sum(-(-b * tiles // programs) for b in blocks) + overhead * len(spans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=132)
    parser.add_argument("--overhead", type=float, default=0.4)
    args = parser.parse_args()
    for head, vocab_size in HEADS.items():
        tiles = -(-vocab_size // TILE)
        better, worse, gain, loss, cases = 0, 0, 0.0, 0.0, 0
        for n_rows in range(2048, 70000, 97):
            for share in (1.0, 0.9, 0.7, 0.5):
                count = int(n_rows * share)
                even = cost(plan(n_rows, count, None), tiles, args.programs, args.overhead)
                filled = cost(plan(n_rows, count, (tiles, args.programs)), tiles, args.programs, args.overhead)
                cases += 1
                if filled < even:
                    better, gain = better + 1, gain + (even - filled) / even
                elif filled > even:
                    worse, loss = worse + 1, loss + (filled - even) / even
        print(f"{head}: {cases} plans, filled cheaper in {better} (by {100 * gain / max(better, 1):.2f}% on average), "
              f"dearer in {worse} (by {100 * loss / max(worse, 1):.2f}%)")


if __name__ == "__main__":
    main()
