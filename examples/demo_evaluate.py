"""What the demo's pretraining bought: each pretrained encoder beside randomly initialised
twins of the same architecture, on held-out text (megatron_taco/evaluation/random_twins.py
says what is measured and how).

    python examples/demo_evaluate.py --load demo_output/taco/checkpoints \\
        --load demo_output/sas/checkpoints --data-path demo_output/demo_text_sentence \\
        --split 90,5,5 --output demo_output/evaluation.json
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_taco.arguments import add_dataclass_args, dataclass_from_args
from megatron_taco.errors import ConfigError
from megatron_taco.evaluation.random_twins import TwinsConfig, evaluate


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="demo_evaluate.py", description=" ".join(__doc__.split("\n\n")[0].split())
    )
    p.add_argument("--load", action="append", required=True, help="A pretraining checkpoint.")
    add_dataclass_args(p, TwinsConfig, "evaluation")
    args = p.parse_args(argv)
    import torch

    from megatron_taco.checkpoint.errors import CheckpointError
    from megatron_taco.data.indexed_dataset import IndexedDatasetError

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    try:
        evaluate(dataclass_from_args(TwinsConfig, args, load=tuple(args.load)))
    except (ConfigError, CheckpointError, IndexedDatasetError) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
