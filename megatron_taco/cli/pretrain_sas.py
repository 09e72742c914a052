"""taco-pretrain-sas / pretrain_sas.py: the SAS recipe (recipes/sas.py) on the generic driver."""

from __future__ import annotations

import sys

from megatron_taco.recipes.sas import SPEC


def main(argv: list[str] | None = None) -> int:
    return SPEC.main(argv)


if __name__ == "__main__":
    sys.exit(main())
