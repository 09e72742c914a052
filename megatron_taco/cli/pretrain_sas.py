"""taco-pretrain-sas / pretrain_sas.py: the SAS recipe (recipes/sas.py) on the generic driver."""

from __future__ import annotations

import sys

from megatron_taco.recipes.sas import SPEC
from megatron_taco.training import driver


def main(argv: list[str] | None = None) -> int:
    return driver.main(SPEC, argv)


if __name__ == "__main__":
    sys.exit(main())
