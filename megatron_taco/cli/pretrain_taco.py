"""taco-pretrain / pretrain_taco.py: the TACO recipe (recipes/taco.py) on the generic driver."""

from __future__ import annotations

import sys

from megatron_taco.recipes.taco import SPEC
from megatron_taco.training import driver


def main(argv: list[str] | None = None) -> int:
    return driver.main(SPEC, argv)


if __name__ == "__main__":
    sys.exit(main())
