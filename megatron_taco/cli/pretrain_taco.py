"""taco-pretrain / pretrain_taco.py: the TACO recipe (recipes/taco.py) on the generic driver."""

from __future__ import annotations

import sys

from megatron_taco.recipes.taco import SPEC


def main(argv: list[str] | None = None) -> int:
    return SPEC.main(argv)


if __name__ == "__main__":
    sys.exit(main())
