"""taco-finetune / tools/finetune.py: fine-tune a pretrained checkpoint on a downstream task
(recipes/finetune.py), or run a paper's protocol as a sweep (recipes/sweep.py)."""

from __future__ import annotations

import sys

from megatron_taco.recipes.finetune import SPEC
from megatron_taco.training import driver


def main(argv: list[str] | None = None) -> int:
    return driver.main(SPEC, argv)


if __name__ == "__main__":
    sys.exit(main())
