import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_taco.cli.gpu_wheels import main

sys.exit(main())
