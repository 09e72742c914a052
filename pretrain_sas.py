import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_taco.cli.pretrain_sas import main

if __name__ == "__main__":
    sys.exit(main())
